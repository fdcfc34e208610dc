"""A trainer shaped like issue 59's, adapted from docs/adapters.md alone, gets the right verdict in
every cell.

tests/stage_trainer.py nests torch's own ``Optimizer.state_dict()`` one level deeper than
tests/checkpointer_trainer.py (``state.optimizer.pp_0_stage_0.state.<id>.<stat>``), beside packed
experts, a shared expert of hidden 32 and a dense MLP of hidden 16, and its save leaves out the LR
scheduler it is handed.  Read by names, digit runs or row counts, layer 1's dense moments
(``state.12`` .. ``state.15``, 32 and 16 rows) shared a key template with its experts'
(``state.10``, ``state.11``) and every model+optimizer cell was red on-disk ("its expert axis has 32
rows, but the model has 4 experts"); experts are now known from the ep=1 truth's evidence alone
(:class:`conformance.inspection.keys.Evidence`).  So in a real matrix run: the model cells pass, and
every model+optimizer cell is red for the one real defect, its first line saying the save left the
scheduler out; the same trainer saving its scheduler is green.  The negative control misfiles its
experts' moments at ep > 1 and is red naming the expert.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from matrix_expectations import run_inline
from stage_adapter import Adapter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from conformance.adapter import Spec
from conformance.checks.truth import optimizer_positions
from conformance.inspection import DEFAULT_PATTERNS, classify_keys, index_state_dict, inspect_index
from conformance.inspection.learn import evidence
from conformance.inspection.positional import resolve

HERE = Path(__file__).parent
E = 4
HEAD = "state.optimizer.pp_0_stage_0.state"
LEFT_OUT = ("[scalars] rank 0: the save left the training state 'lr_scheduler' out: no key of the "
            "checkpoint or of the ep=1 save holds it or any of its ")


def run(pytester: pytest.Pytester, adapter: str, *args: str) -> dict[str, dict[str, Any]]:
    pytester.makepyfile(stage_trainer=(HERE / "stage_trainer.py").read_text(),
                        stage_adapter=(HERE / "stage_adapter.py").read_text())
    run_inline(pytester, f"--moe-ep-adapter=stage_adapter:{adapter}", "--moe-ep-report=out",
               "-p", "no:cacheprovider", *args)
    doc = json.loads((pytester.path / "out" / "moe-ep-conformance.json").read_text())
    return {c["id"].removeprefix("moe-ep-matrix::checkpoint::"): c for c in doc["cells"]
            if c["status"] != "n/a"}


@pytest.mark.usefixtures("shared_fork_server")
def test_every_cell_of_the_default_tier_gets_the_right_verdict(pytester: pytest.Pytester) -> None:
    cells = run(pytester, "Adapter", "--moe-ep-matrix")
    optim = {i: c for i, c in cells.items() if c["state"] == "model+optim"}
    assert optim and any(c["save_ep"] > 1 for c in optim.values())
    model = {i: c for i, c in cells.items() if i not in optim}
    assert all(c["status"] == "pass" for c in model.values()), [
        (i, c["detail"][:300]) for i, c in model.items() if c["status"] != "pass"]
    for cell_id, cell in optim.items():
        lines = cell["detail"].splitlines()
        assert cell["status"] == "fail" and cell["findings"] == ["silent"], (cell_id, lines[:3])
        assert lines[0].startswith(f"silent: {LEFT_OUT}"), (cell_id, lines[0])
        assert "training state 'state.lr_scheduler." in lines[0], (cell_id, lines[0])
        assert not [line for line in lines if line.startswith(("[checkpoint]", "[values]",
                                                               "[missing]"))], (cell_id, lines)


@pytest.mark.usefixtures("shared_fork_server")
def test_the_trainer_that_saves_its_scheduler_is_green_in_every_optimizer_cell(
        pytester: pytest.Pytester) -> None:
    cells = run(pytester, "Correct", "--moe-ep-matrix", "-k", "model+optim")
    assert len(cells) >= 8 and any(c["save_ep"] > 1 for c in cells.values())
    assert all(c["status"] == "pass" for c in cells.values()), [
        (i, c["detail"][:300]) for i, c in cells.items() if c["status"] != "pass"]


@pytest.mark.usefixtures("shared_fork_server")
def test_an_experts_moment_misfiled_at_ep2_is_red_naming_the_expert(
        pytester: pytest.Pytester) -> None:
    cells = run(pytester, "Misfiled", "--moe-ep-matrix", "-k",
                "model+optim and ep-only and save_ep2 and load_ep1")
    assert cells
    for cell_id, cell in cells.items():
        first = cell["detail"].splitlines()[0]
        assert cell["status"] == "fail" and "on-disk" in cell["findings"], (cell_id, first)
        assert ("layer 0, expert 0, tensor 'experts.w_in.exp_avg': holds expert 1's values "
                "instead of expert 0's") in first, (cell_id, first)
        checkpoint = [line for line in cell["detail"].splitlines()
                      if line.startswith("[checkpoint]")]
        assert checkpoint and f"{HEAD}." in checkpoint[0], (cell_id, checkpoint[:2])


def test_optimizer_state_is_placed_through_the_live_optimizer() -> None:
    """No value evidence at all (no owners): the live optimizer alone places every positional
    moment -- layer 1's experts' at ids 10 and 11, its shared expert's and dense MLP's (32 and 16
    rows) at 12 to 15 -- and the checkpoint reads clean."""
    adapter = Adapter()
    model, optimizer, _ = adapter.build(Spec(num_layers=2, num_experts=E, kind="packed",
                                             optimizer_steps=2), None, seed=3)
    flat, _ = flatten_state_dict({"state": {"model": model.state_dict(),
                                            "optimizer": optimizer.state_dict()}})
    index = index_state_dict(flat, "truth")
    positions = optimizer_positions(adapter, model, optimizer)
    placed = {k: (p.fqn, p.kind, p.layer) for k, (p, stat) in resolve(index, positions).items()
              if stat == "exp_avg"}
    want = {1: ("layers.0.router.weight", "dense", 0),
            10: ("layers.1.experts.w_in", "packed", 1),
            11: ("layers.1.experts.w_out", "packed", 1),
            12: ("layers.1.shared.w1.weight", "dense", 1),
            13: ("layers.1.shared.w2.weight", "dense", 1),
            14: ("layers.1.dense.w1.weight", "dense", 1),
            15: ("layers.1.dense.w2.weight", "dense", 1)}
    assert {i: placed[f"{HEAD}.{i}.exp_avg"] for i in want} == want
    assert len(placed) == 16
    known = evidence(index, {}, {}, DEFAULT_PATTERNS, positions)
    infos = classify_keys(flat, known)
    assert sorted(k for k, i in infos.items() if i.role == "expert" and k.startswith(HEAD)) == [
        f"{HEAD}.{i}.{stat}" for i in (10, 11, 2, 3) for stat in ("exp_avg", "exp_avg_sq")]
    assert infos[f"{HEAD}.10.exp_avg"].cls == "layers.#.experts.w_in.exp_avg"
    assert inspect_index(index, num_experts=E, patterns=known).clean

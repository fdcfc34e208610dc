"""The ``deepspeed`` adapter end to end: DeepSpeed's MoE checkpoint through the whole default
matrix.

Skipped unless DeepSpeed is installed (``ci/install_deepspeed.sh`` installs the pinned 0.19.8).  The
matrix runs in a pytester subprocess, and the outcome is asserted *as found*, cell by cell, so a
change in the harness or in DeepSpeed that flips one is noticed:

* model-only cells pass at every EP pair (per-global-expert files re-shard the weights);
* model+optimizer cells pass when saved and loaded at the same EP degree and error otherwise --
  ``load_checkpoint`` reads the optimizer from one ``expp_rank_<r>`` file per EP rank, a positional
  ``torch.optim`` state_dict: a file of another layout (``ValueError``: parameter group size) or no
  file at all (``FileNotFoundError``, for EP ranks the save did not have);
* everything else is n/a: packed kinds, FSDP2, E % ep != 0, legacy saves.

The whole run takes about 30 s on 2 cores once DeepSpeed's CPU communication op is compiled (the
install script compiles it; compiling it inside the first cell would take minutes).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from matrix_expectations import TORCH_EXTENSIONS_DIR, assert_as_expected, expectations_args, pair

# checked without importing DeepSpeed into this process
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (ci/install_deepspeed.sh installs deepspeed==0.19.8)",
                allow_module_level=True)

EPS = (1, 2, 4)
ID = "moe-ep-matrix::checkpoint::unpacked::{state}::ep-only::{pair}"
PASSING = {ID.format(state="model", pair=pair(s, t)) for s in EPS for t in EPS} | {
    ID.format(state="model+optim", pair=pair(ep, ep)) for ep in EPS}
#: model+optimizer at another EP degree: load_checkpoint raises (see the module docstring).
OPTIMIZER_RESHARD = {ID.format(state="model+optim", pair=pair(s, t)): (s, t) for s in EPS
                     for t in EPS if s != t}
NOT_APPLICABLE = {
    "adapter supports layer kinds unpacked, not packed": 62,
    "adapter does not support FSDP2": 18,
    "adapter has no save_legacy (its old, lossy save)": 6,
    "adapter does not support E % ep != 0 (E=5)": 8,
}


@pytest.mark.slow
def test_deepspeed_matrix_as_found(pytester: pytest.Pytester,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # the adapter sets it too; explicit for the rank fork server
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    # the compiled shm op; see matrix_expectations
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", TORCH_EXTENSIONS_DIR)
    out = pytester.path / "out"
    result = pytester.runpytest_subprocess("--moe-ep-matrix=1,2,4", "--moe-ep-adapter=deepspeed",
                                           f"--moe-ep-report={out}", "-p", "no:cacheprovider",
                                           *expectations_args("deepspeed"), timeout=900)
    doc = json.loads((Path(out) / "moe-ep-conformance.json").read_text())
    # the optimizer reshard refusals are in ci/expectations/deepspeed.toml
    cells = assert_as_expected(result, doc)
    assert doc["adapter"] == {"name": "deepspeed", "version": "0.19.8"}
    assert {cells[i]["finding"] for i in OPTIMIZER_RESHARD} == {"refused"}

    by_status: dict[str, set[str]] = {}
    for cell_id, cell in cells.items():
        by_status.setdefault(cell["status"], set()).add(cell_id)
    assert by_status.get("pass", set()) == PASSING, {i: cells[i]["detail"]
                                                     for i in PASSING ^ by_status["pass"]}
    assert by_status.get("stopped", set()) == set(OPTIMIZER_RESHARD)
    assert by_status.get("fail", set()) == set()
    na: dict[str, int] = {}
    for cell_id in by_status.get("n/a", set()):
        na[cells[cell_id]["detail"]] = na.get(cells[cell_id]["detail"], 0) + 1
    assert na == NOT_APPLICABLE
    assert doc["summary"] == {"pass": 9 + 3, "fail": 0, "stopped": 6, "n/a": 94}

    for cell_id in PASSING:
        assert "the ep=1 ground truth bit for bit" in cells[cell_id]["detail"], cells[cell_id]
    for cell_id, (s, t) in OPTIMIZER_RESHARD.items():
        cell = cells[cell_id]
        detail = cell["detail"]
        assert (cell["kind"], cell["state"], cell["fsdp"], cell["save_ep"], cell["load_ep"],
                cell["num_experts"]) == ("unpacked", "model+optim", False, s, t, 4)
        assert (f"load_checkpoint (saved at ep={s}, loading at ep={t} as EP rank 0)"
                in detail), detail
        # EP ranks the save had read a file of another layout; the others find none.
        assert ("raised ValueError: loaded state dict contains a parameter group that doesn't "
                "match the size of optimizer's group" in detail), detail
        assert ("FileNotFoundError" in detail) == (t > s), detail
        if t > s:
            assert f"expp_rank_{s}_mp_rank_00_optim_states.pt" in detail, detail
    result.stdout.fnmatch_lines(["*moe-ep conformance matrix*",
                                 "unpacked · model+optim · ep-only · E=4"])


#: the seeded session's cells (``tests/seeded_deepspeed.py``): model-only, E=4, both MoE paths.
SEEDED_ID = "moe-ep-matrix::checkpoint::{kind}::model::ep-only::{pair}"
SEEDED_SELECTION = ("not optim and not fsdp and not E5 and not legacy and not cross and "
                    "((save_ep2 and load_ep2) or (save_ep4 and load_ep4))")


def test_seeded_deepspeed_bugs_are_caught(pytester: pytest.Pytester,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative controls of the DeepSpeed ``checkpoint`` and ``forward`` checks, as found.

    An expert's file overwritten with another's after an ep=2 save: the ``checkpoint`` check names
    the key against the ep=1 save (native and AutoEP).  Two experts' router rows swapped while the
    forward runs after an ep=4 load (the stored tensors stay right): only ``forward`` fails, on
    every rank, in layer 0's own MoE output -- the model's output moves by ~4e-7 on a residual
    stream of ~3, within its tolerance, so the adapters give each MoE layer's output too
    (``forward_with_layers``), held to that layer's own scale (~1e-6).
    """
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", TORCH_EXTENSIONS_DIR)
    here = Path(__file__).parent
    pytester.makepyfile(seeded_deepspeed=(here / "seeded_deepspeed.py").read_text(),
                        seeded_forward=(here / "seeded_forward.py").read_text())
    out = pytester.path / "out"
    result = pytester.runpytest_subprocess(
        "--moe-ep-matrix=1,2,4", "--moe-ep-adapter=seeded_deepspeed:SeededDeepSpeed", "-k",
        SEEDED_SELECTION, f"--moe-ep-report={out}", "-p", "no:cacheprovider", timeout=900)
    doc = json.loads((Path(out) / "moe-ep-conformance.json").read_text())
    cells = {c["id"]: c for c in doc["cells"]}
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()[-3000:]
    assert doc["summary"] == {"pass": 0, "fail": 4, "stopped": 0,
                              "n/a": 0}, {i: c["detail"] for i, c in cells.items()}
    keys = {"unpacked": "layers.0.moe.deepspeed_moe.experts.deepspeed_experts.{g}.down.weight",
            "packed": "model.layers.0.mlp.experts.{g}.w1"}
    layers = {"unpacked": "layers.0.moe", "packed": "model.layers.0.mlp"}
    for kind in ("unpacked", "packed"):
        overwritten = cells[SEEDED_ID.format(kind=kind, pair="ep2c->ep2c")]
        assert overwritten["skipped_checks"] == {}, overwritten
        key = keys[kind]
        assert (f"[checkpoint] checkpoint: layer 0, key '{key.format(g=0)}', expert 0: holds "
                "expert 1's values instead of expert 0's (the ep=1 checkpoint's "
                f"'{key.format(g=1)}')") in overwritten["detail"], \
            overwritten["detail"]
        swapped = cells[SEEDED_ID.format(kind=kind, pair="ep4->ep4")]
        assert swapped["skipped_checks"] == {}, swapped
        assert swapped["findings"] == ["silent"], swapped  # the forward alone sees it
        *lines, passed = swapped["detail"].removeprefix("silent: ").splitlines()
        assert len(lines) == 4 and passed.startswith("checks that passed: checkpoint, "
                                                     "values"), lines
        # layer 0's output: expected vs got, with the tolerance used
        for rank, line in enumerate(lines):
            assert line.startswith(f"[forward] rank {rank}: the forward after the load differs "
                                   f"from the ground truth's in output '{layers[kind]}': element "
                                   "["), line
            assert (" expected " in line and ", got " in line
                    and " = rtol 1e-05 x |expected| + atol 1e-06 x max|expected| " in line), line

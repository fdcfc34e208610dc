"""A trainer with a real checkpointer's habits, adapted from docs/adapters.md alone, raises no false
alarm.

tests/checkpointer_trainer.py keeps packed experts ``[E, in, out]`` as DTensors ``Shard(0)`` over
``ep``, a shared expert, FSDP2 and HSDP, fused AdamW in its own container with a LambdaLR and an
iteration counter, and saves torch's own ``Optimizer.state_dict()`` (moments keyed by position)
under ``<root>/step-<n>/`` with its own DCP checkpointer; it refuses E=5 at ep > 1.  Its adapter
(tests/checkpointer_adapter.py) is the torch-native base and the trainer's own calls.  Every red
cell of its default tier and of ``--moe-ep-matrix=1,2,4`` is that refusal, with its own file and
line; the same trainer with one module per expert, whose positional ids move with EP, is red
``on-disk`` wherever it saved at ep > 1, naming the parameters whose ids moved (the negative
control).  The base's container rules are checked unit by unit at the end.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from matrix_expectations import run_inline

from conformance.adapters.torch_native import TorchNativeAdapter
from conformance.scalars import optimizers_of, torch_optimizer_scalars

pytestmark = pytest.mark.usefixtures("shared_fork_server")
HERE = Path(__file__).parent
REFUSAL = re.compile(r"ValueError: checkpointer_trainer: 5 experts do not split evenly over "
                     r"ep=[24] \(raised at (?:tests/)?checkpointer_trainer\.py:\d+ "
                     r"in parallelize\)")


def run(pytester: pytest.Pytester, adapter: str, *args: str) -> dict[str, dict[str, Any]]:
    pytester.makepyfile(checkpointer_trainer=(HERE / "checkpointer_trainer.py").read_text(),
                        checkpointer_adapter=(HERE / "checkpointer_adapter.py").read_text())
    run_inline(pytester, f"--moe-ep-adapter=checkpointer_adapter:{adapter}", "--moe-ep-report=out",
               "-p", "no:cacheprovider", *args)
    doc = json.loads((pytester.path / "out" / "moe-ep-conformance.json").read_text())
    return {c["id"].removeprefix("moe-ep-matrix::checkpoint::"): c for c in doc["cells"]}


def no_false_alarm(cells: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every red cell is the trainer's own refusal of E=5 at ep > 1; returns the cells that passed.
    """
    ran = [c for c in cells.values() if c["status"] != "n/a"]
    for cell in ran:
        if cell["status"] != "pass":
            assert cell["findings"] == ["refused"], cell["detail"][:600]
            assert cell["num_experts"] == 5, cell["detail"][:600]
            assert max(cell["save_ep"], cell["load_ep"]) > 1 and REFUSAL.search(cell["detail"]), (
                cell["id"], cell["detail"][:600])
    passed = [c for c in ran if c["status"] == "pass"]
    assert any(c["state"] == "model+optim" and c["save_ep"] != c["load_ep"] for c in passed)
    assert any(c["fsdp"] for c in passed), [c["id"] for c in passed]
    return passed


def test_the_default_tier_raises_no_false_alarm(pytester: pytest.Pytester) -> None:
    passed = no_false_alarm(run(pytester, "Adapter", "--moe-ep-matrix"))
    hsdp = [c for c in passed if "hsdp" in c["save_layout"] + c["load_layout"]]
    assert hsdp, [c["id"] for c in passed]


def test_the_ep_list_tier_raises_no_false_alarm(pytester: pytest.Pytester) -> None:
    cells = run(pytester, "Adapter", "--moe-ep-matrix=1,2,4")
    passed = no_false_alarm(cells)
    even = [c for c in cells.values() if c["num_experts"] == 4 and c["status"] != "n/a"]
    assert len(even) >= 36 and all(c["status"] == "pass" for c in even), [
        (c["id"], c["detail"][:300]) for c in even if c["status"] != "pass"]
    assert {(c["save_ep"], c["load_ep"]) for c in passed if c["state"] == "model+optim"} == {
        (s, t) for s in (1, 2, 4) for t in (1, 2, 4)}


def test_positional_ids_that_move_with_ep_are_on_disk_naming_the_parameters(
        pytester: pytest.Pytester) -> None:
    """One module per expert: a rank's optimizer numbers its own experts only, so every save at ep >
    1 keeps other parameters' moments under the ep=1 save's ids.  The model alone (global names)
    passes."""
    cells = run(pytester, "Unpacked", "--moe-ep-matrix=1,2,4", "-k", "not E5 and ep-only")
    ran = {i: c for i, c in cells.items() if c["status"] != "n/a"}
    assert all(c["status"] == "pass" for c in ran.values() if c["state"] == "model"), ran
    optim = {i: c for i, c in ran.items() if c["state"] == "model+optim"}
    moved = "[checkpoint] checkpoint: key 'optimizer.state.*': positional optimizer ids moved: '"
    for cell_id, cell in optim.items():
        first = cell["detail"].splitlines()[0]
        if cell["save_ep"] == 1:  # the ep=1 save is the truth; a load at ep > 1 asks other ids
            if cell["load_ep"] == 1:
                assert cell["status"] == "pass", (cell_id, first)
            else:
                assert "the load is wrong" in first, (cell_id, first)
            continue
        assert cell["status"] != "pass" and "on-disk" in cell["findings"], (cell_id, first)
        if cell["status"] == "stopped":  # the load raised: the checkpoint's problem leads
            assert ("raised LoadFailed: the checkpoint differs from an EP-invariant one: key "
                    f"{moved.split('key ', 1)[1]}") in first, (cell_id, first)
            assert re.search(r"'experts\.w_(in|out)' \(layer \d, expert \d\) is at id \d+ in the "
                             r"ep=1 checkpoint, \d+ here", first), (cell_id, first)
        else:  # the load succeeded on wrong state (silent): the checkpoint's first line says why
            checkpoint = [line for line in cell["detail"].splitlines()
                          if line.startswith("[checkpoint]")]
            assert checkpoint[0].startswith(moved), (cell_id, checkpoint[:2])
    assert {c["status"] for c in optim.values() if c["save_ep"] > 1} == {"fail", "stopped"}
    to_ep1 = next(c for c in optim.values() if (c["save_ep"], c["load_ep"]) == (2, 1))
    errors = "".join(to_ep1["errors"].values())
    assert re.search(r"it asked for \d+ key\(s\) the checkpoint lacks: 'optimizer\.state\.", errors)


# -- the base's container rules, unit by unit --------------------------------------------------
class Container:
    """A trainer's own optimizer object: AdamW under a name of its own, a schedule it steps itself,
    a zero_grad() without set_to_none."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.adamw = torch.optim.AdamW(params, lr=0.1)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.adamw, lambda it: 0.5 ** it)
        self.iteration = 0

    def step(self) -> None:
        self.adamw.step()
        self.schedule.step()
        self.iteration += 1

    def zero_grad(self) -> None:
        self.adamw.zero_grad()


def test_a_trainers_own_container_is_stepped_as_the_trainer_steps_it() -> None:
    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    container = Container([p])
    assert optimizers_of(container) == [container.adamw]
    plain = torch.optim.SGD([q], lr=1.0)
    apart = torch.optim.lr_scheduler.LambdaLR(plain, lambda it: 1.0)  # one it does not hold
    base = TorchNativeAdapter()
    p.grad = torch.ones(2)
    base.optimizer_step(container, {"schedule": container.schedule, "apart": apart})
    assert container.iteration == 1 and p.grad is None  # its own step and zero_grad, once
    assert (container.schedule.last_epoch, apart.last_epoch) == (1, 1)  # each schedule stepped once
    assert torch_optimizer_scalars(base.torch_optimizers(container))["param_groups.0.lr"] == 0.05
    q.grad = torch.ones(3)
    base.optimizer_step([plain])  # a list of optimizers: each one's step and zero_grad
    assert torch.equal(q.detach(), -torch.ones(3)) and q.grad is None

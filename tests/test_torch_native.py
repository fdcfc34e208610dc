"""The base for torch-native trainers (conformance/adapters/torch_native.py): docs/adapters.md's
first example, as the page prints it, passes every cell that applies on a real torch-native trainer
(tests/tinytrainer.py); the same adapter over a trainer that saves each rank's local experts is
caught (the base's walks hide no framework bug); and the container and placement rules, unit by
unit."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from matrix_expectations import run_inline

from conformance.adapters.torch_native import Param, placed
from conformance.scalars import optimizer_state, optimizers_of, torch_optimizer_scalars

pytestmark = pytest.mark.usefixtures("shared_fork_server")
HERE = Path(__file__).parent
GUIDE = HERE.parent / "docs" / "adapters.md"


def guide_example() -> str:
    """The first python block of docs/adapters.md: the adapter the page shows first."""
    found = re.search(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    assert found is not None, f"{GUIDE} holds no python block"
    return found.group(1)


LOCAL_SAVE = '''
from tinytrainer_adapter import TinyTrainerAdapter


class LocalSave(TinyTrainerAdapter):
    """The trainer's save takes each rank's local experts as plain tensors (what DCP then keeps one
    rank of)."""

    def save(self, model, optimizer, path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        dcp.save({"model": {k: v.to_local() if hasattr(v, "to_local") else v
                            for k, v in get_model_state_dict(model).items()}}, checkpoint_id=path)
'''


def run(pytester: pytest.Pytester, adapter: str, *extra: str) -> dict[str, dict[str, Any]]:
    pytester.makepyfile(tinytrainer=(HERE / "tinytrainer.py").read_text(),
                        tinytrainer_adapter=guide_example(), local_save=LOCAL_SAVE)
    run_inline(pytester, "--moe-ep-matrix", f"--moe-ep-adapter={adapter}", "--moe-ep-report=out",
               "-p", "no:cacheprovider", *extra)
    doc = json.loads((pytester.path / "out" / "moe-ep-conformance.json").read_text())
    return {c["id"].removeprefix("moe-ep-matrix::checkpoint::"): c for c in doc["cells"]}


def test_the_guides_first_example_is_short_and_passes_every_cell_that_applies(
        pytester: pytest.Pytester) -> None:
    assert len(guide_example().splitlines()) <= 60
    cells = run(pytester, "tinytrainer_adapter:TinyTrainerAdapter")
    ran = {i: c for i, c in cells.items() if c["status"] != "n/a"}
    assert {c["status"] for c in ran.values()} == {"pass"}, {i: c["detail"] for i, c in ran.items()
                                                            if c["status"] != "pass"}
    assert any(c["state"] == "model+optim" and c["save_ep"] != c["load_ep"] for c in ran.values())
    # an uneven split ran
    assert any(c["num_experts"] % max(c["save_ep"], c["load_ep"]) for c in ran.values())


def test_the_base_hides_no_framework_bug(pytester: pytest.Pytester) -> None:
    """A trainer whose save keeps each rank's local experts: every model cell saved at ep > 1 is
    red."""
    cells = run(pytester, "local_save:LocalSave", "-k", "model and not optim and not legacy")
    red = {i for i, c in cells.items() if c["status"] in ("fail", "stopped")}
    saved_under_ep = {i for i, c in cells.items() if c["status"] != "n/a" and c["save_ep"] > 1}
    assert saved_under_ep and red == saved_under_ep, {i: cells[i]["detail"][:200]
                                                      for i in red ^ saved_under_ep}
    assert all("on-disk" in cells[i]["findings"] for i in red)


def test_optimizer_containers_and_their_scalars() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    experts, rest = torch.optim.AdamW([a], lr=0.1), torch.optim.SGD([b], lr=0.5)

    class Container:  # torchtitan's OptimizersContainer's shape
        optimizers = [experts, rest]

    for container in ([experts, rest], {"experts": experts, "rest": rest}, Container()):
        assert optimizers_of(container) == [experts, rest]
    assert optimizers_of(None) == [] and optimizers_of(experts) == [experts]
    a.grad = torch.ones(2)
    experts.step()
    assert set(optimizer_state({"experts": experts, "rest": rest})) == {a}
    found = torch_optimizer_scalars([experts, rest])
    assert (found["param_groups.0.lr"] == 0.1 and found["param_groups.1.lr"] == 0.5
            and found["step"] == [1.0])


def test_a_plain_chunk_is_placed_by_its_first_expert_and_a_wrong_one_is_named() -> None:
    chunk = torch.zeros(2, 3, 4)
    local, region, shape = placed(chunk, Param(0, "w", experts="packed", first=4, num_experts=6))
    assert local is chunk and region[0] == slice(4, 6) and shape == (6, 3, 4)
    with pytest.raises(ValueError,
                       match=r"'w' of layer 0: 2 expert rows from global expert 5 run past E=6"):
        placed(chunk, Param(0, "w", experts="packed", first=5, num_experts=6))
    with pytest.raises(ValueError, match="needs num_experts"):
        Param(0, "w", experts="packed")
    with pytest.raises(ValueError, match="expected none, one, packed or flat"):
        Param(0, "w", experts="stacked")


def test_a_plain_chunk_follows_the_layout_rule_and_one_without_room_is_refused() -> None:
    from conformance.adapter import FrameworkRefusal
    from conformance.adapters.torch_native import expert_rows

    # E=5 at ep=4 is chunks of ceil(5/4)=2: ranks hold [0, 2), [2, 4), [4, 5), nothing
    _, region, shape = placed(torch.zeros(1, 3),
                              Param(1, "w", experts="packed", ep_place=(2, 4), num_experts=5))
    assert region[0] == slice(4, 5) and shape == (5, 3)
    rows = expert_rows(torch.arange(6.0).reshape(2, 3),
                       Param(1, "w", "packed", ep_place=(1, 4), num_experts=5))
    assert [g for g, _ in rows] == [2, 3]
    # the whole expert axis (no EP) is placed from expert 0 whatever the place says
    assert placed(torch.zeros(5, 3),
                  Param(1, "w", "packed", ep_place=(0, 1), num_experts=5))[1][0] == slice(0, 5)
    # a framework that gives the last rank ceil(E/ep) rows anyway (a meta shape) is refused, naming
    # the rank
    with pytest.raises(FrameworkRefusal, match=r"'w' of layer 1: ep rank 3 of 4 holds a plain "
                       r"expert tensor of 2 rows where .* gives it experts \[5, 5\) of E=5"):
        placed(torch.zeros(2, 3), Param(1, "w", "packed", ep_place=(3, 4), num_experts=5))


def test_the_adapters_on_the_base_stay_small_and_no_module_is_over_550_lines() -> None:
    """The torch-native base is what makes an adapter short; a module over 550 lines is two."""
    root = Path(__file__).resolve().parents[1]

    def lines(path: Path) -> int:
        return len(path.read_text().splitlines())

    assert lines(root / "conformance/adapters/olmo_core.py") <= 150
    assert lines(root / "conformance/adapters/torchtitan.py") <= 250
    too_long = {str(p.relative_to(root)): lines(p)
                for package in ("conformance", "pytest_moe_ep", "reference_impl")
                for p in (root / package).rglob("*.py") if lines(p) > 550}
    assert not too_long, too_long

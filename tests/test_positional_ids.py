"""A trainer's own checkpoint habits, read by the inspection alone (no world): torch's
``Optimizer.state_dict()`` keyed by position, a kernel choice saved beside the state, a checkpoint
written under a directory the checkpointer names.

The checkpoints are the state dicts tests/checkpointer_trainer.py saves (flattened as DCP flattens
them), built by its adapter's ground truth on this process; the model's tensors by global identity
come from the adapter's own ``expert_tensors``/``other_tensors``, as the matrix learns them.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpointer_adapter import Adapter, Unpacked
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from conformance.adapter import Spec
from conformance.inspection import (
    DEFAULT_PATTERNS,
    CheckpointError,
    classify_keys,
    compare_indexes,
    index_state_dict,
    inspect_index,
    pattern,
    read_checkpoint,
    read_dcp,
)
from conformance.inspection.learn import (
    LearnedKey,
    key_owners,
    learn_expert_keys,
    learned_patterns,
    owners_of,
)
from conformance.inspection.positional import positional
from conformance.members import Built, Members
from conformance.scalars import all_scalars, is_configuration

E = 4


def truth(adapter: Any, kind: str) -> tuple[Any, Any, dict[Any, Any]]:
    """``(model, the trainer's optimizer, the model's tensors by (layer, expert, name))`` at ep=1.
    """
    spec = Spec(num_layers=2, num_experts=E, kind=kind, optimizer_steps=2)
    model, optimizer, _ = adapter.build(spec, None, seed=3)
    state = {(t[0], t[1], t[2]): t[3] for walk in (adapter.expert_tensors, adapter.other_tensors)
             for t in walk(model, optimizer)}
    return model, optimizer, state


def saved(model: Any, adamw: Any) -> dict[str, Any]:
    """What the trainer's checkpointer writes, flattened as DCP flattens it."""
    flat, _ = flatten_state_dict({"model": model.state_dict(), "optimizer": adamw.state_dict()})
    return flat


def learned(flat: dict[str, Any], state: dict[Any, Any]) -> tuple[Any, ...]:
    index = index_state_dict(flat, "truth")
    return (*learned_patterns(learn_expert_keys(index, owners_of(state)[0]), index.entries),
            *DEFAULT_PATTERNS)


def test_positional_optimizer_ids_stay_literal_and_read_no_dense_moment_as_experts() -> None:
    """Packed experts: moments keyed ``optimizer.state.<position>``; the shared expert's 32-row
    moment is no expert axis.  A pattern with every digit run ``\\d+`` (the old rule, given by hand
    here) reads it as 32 experts: the false alarm the literal ids remove."""
    model, optimizer, state = truth(Adapter(), "packed")
    flat = saved(model, optimizer.adamw)
    patterns = learned(flat, state)
    index = index_state_dict(flat, "truth")
    assert inspect_index(index, num_experts=E, patterns=patterns).clean
    infos = classify_keys(flat, patterns)
    expert_ids = sorted({where[1] for k, i in infos.items()
                         if (where := positional(k)) and i.role == "expert"})
    assert expert_ids == [1, 2, 6, 7]  # each layer's w_in, w_out by position: router 0, shared 3, 4
    assert infos["optimizer.state.3.exp_avg"].role == "dense"  # the shared expert's w1: 32 rows
    every_run = (pattern(r"^\d+$"), *patterns)
    alarms = inspect_index(index, num_experts=E, patterns=every_run).findings
    assert ("extent_mismatch", "optimizer.state.3.exp_avg") in [(f.problem, f.key) for f in alarms]
    # the literal ids still read the expert axis: one rank's rows of a packed moment are named
    local = dict(flat, **{"optimizer.state.1.exp_avg": flat["optimizer.state.1.exp_avg"][:2]})
    found = inspect_index(index_state_dict(local, "ep2"), num_experts=E, patterns=patterns).findings
    assert [(f.problem, f.key, f.experts) for f in found] == [
        ("local_extent", "optimizer.state.1.exp_avg", (2, 3))]


def test_a_positional_id_equal_to_its_layer_is_no_layer() -> None:
    """Layer 0's packed weight at position 0: the run equals the layer, but as ``(?P<layer>\\d+)``
    the pattern would match every other parameter's moments; the checkpoint's other keys keep it
    literal."""
    key = LearnedKey("optimizer.state.0.exp_avg", "packed", 0, tuple(range(E)))
    alone = learned_patterns({key.key: key})
    assert [p.regex.pattern for p in alone] == ["^(?P<layer>\\d+)$"]
    guarded = learned_patterns({key.key: key}, [key.key, "optimizer.state.2.exp_avg"])
    assert [(p.regex.pattern, p.template) for p in guarded] == [("^0$", "#")]
    infos = classify_keys(["optimizer.state.0.exp_avg", "optimizer.state.2.exp_avg"], guarded)
    assert (infos["optimizer.state.0.exp_avg"].role, infos["optimizer.state.2.exp_avg"].role) == (
        "expert", "dense")


def _rank_view(model: Any, adamw: Any, keep: set[int]) -> Any:
    """What rank 0 of an ep=2 split of the unpacked trainer saves: its experts ``keep`` only, the
    optimizer numbering the parameters it holds from 0 (their state the truth's own)."""
    names = dict(model.named_parameters())
    held = [(n, p) for n, p in names.items()
            if ".experts." not in n or int(n.split(".")[3]) in keep]
    mine = torch.optim.AdamW([p for _, p in held], lr=0.01)
    for _, p in held:
        mine.state[p] = adamw.state[p]
    return mine


def test_positional_ids_that_move_with_ep_name_the_parameters_that_moved() -> None:
    model, optimizer, state = truth(Unpacked(), "unpacked")
    flat = saved(model, optimizer.adamw)
    index = index_state_dict(flat, "truth")
    patterns = learned(flat, state)
    owners = key_owners(index, owners_of(state)[0], [k for k in flat if positional(k)])
    shifted = index_state_dict(saved(model, _rank_view(model, optimizer.adamw, {0, 1})), "ep2")
    found = compare_indexes(shifted, index, values=True, patterns=patterns, owners=owners,
                            names=("checkpoint", "ep=1 checkpoint"))
    first = str(found[0])
    assert found[0].problem == "ids_moved", found[:3]
    assert first.startswith("key 'optimizer.state.*': positional optimizer ids moved: ")
    # the router of layer 1 is at position 1 + 2 * 4 + 2 = 11 at ep=1, 1 + 2 * 2 + 2 = 7 here
    assert "'router.weight' (layer 1) is at id 11 in the ep=1 checkpoint, 7 here" in first, first
    # the same save with every parameter: nothing moved, nothing found
    assert compare_indexes(index_state_dict(flat, "again"), index, values=True, patterns=patterns,
                           owners=owners) == []


def test_a_kernel_choice_is_configuration_in_every_check() -> None:
    """``fused`` differs by layout (the fused kernel where no parameter is a DTensor): neither the
    checkpoint comparison nor the scalars check reads it as state; a differing lr still is."""
    model, optimizer, _ = truth(Adapter(), "packed")
    flat = saved(model, optimizer.adamw)
    assert flat["optimizer.param_groups.0.fused"] is True
    loop = dict(flat, **{"optimizer.param_groups.0.fused": False,
                         "optimizer.param_groups.0.foreach": False})
    want = index_state_dict(flat, "ep1")
    assert compare_indexes(index_state_dict(loop, "ep2"), want, values=True) == []
    other_lr = dict(loop, **{"optimizer.param_groups.0.lr": 0.5})
    found = compare_indexes(index_state_dict(other_lr, "ep2"), want, values=True)
    assert [f.key for f in found] == ["optimizer.param_groups.0.lr"]
    assert is_configuration("param_groups.layers.0.w1.foreach") and not is_configuration("fused")
    own = {"param_groups.0.lr": 0.1, "param_groups.0.fused": True}
    members = Members("t.Adapter", Adapter.capabilities, frozenset({"scalars"}))
    adapter = SimpleNamespace(members=members, scalars=lambda model, optim: own)
    assert all_scalars(adapter, Built(None, None), None) == {"param_groups.0.lr": 0.1}


def _dcp(path: Path) -> Path:
    dcp.save({"model": {"w": torch.arange(6.0).reshape(2, 3)}}, checkpoint_id=str(path),
             no_dist=True)
    return path


def test_a_checkpointers_root_holding_one_checkpoint_is_read_through_it(tmp_path: Path) -> None:
    root = tmp_path / "run"
    step = _dcp(root / "step-3")
    assert read_dcp(root).path == str(step) == read_checkpoint(root).path
    assert list(read_dcp(root).entries) == ["model.w"]
    _dcp(root / "step-4")
    with pytest.raises(CheckpointError, match=r"holds 2 checkpoints below it \(step-3, step-4\)"):
        read_checkpoint(root)
    (tmp_path / "empty" / "logs").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"holds neither a \.metadata file nor"):
        read_checkpoint(tmp_path / "empty")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "step-1").symlink_to(step)  # a link out of the root is not followed
    with pytest.raises(CheckpointError, match="holds neither"):
        read_checkpoint(linked)

"""Unit tests of the contract's pieces: expert keys learned from content, the layout rule for
reported experts, the blame translation of DCP's load errors, the framework's view of a layout, and
the training state's scalars."""

from __future__ import annotations

import pytest
import torch

from conformance.adapter import AdapterError, state_scalars
from conformance.checks.blame import load_failed, translate
from conformance.checks.layout import formed_groups, problem
from conformance.inspection import (
    DEFAULT_PATTERNS,
    classify_keys,
    compare_indexes,
    index_state_dict,
    inspect_index,
)
from conformance.inspection.learn import LearnedKey, learn_expert_keys, learned_patterns, owners_of
from conformance.layout import LayoutError, ParallelLayout
from conformance.members import built

E, H, D = 4, 3, 2


def _truth() -> dict[tuple[int | None, int | None, str], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state: dict[tuple[int | None, int | None, str], torch.Tensor] = {}
    for layer in range(2):
        for e in range(E):
            for name in ("gate", "up", "down"):
                state[(layer, e, name)] = torch.randn(H, D, generator=g)
        state[(layer, None, "router.weight")] = torch.randn(E, D, generator=g)
    return state


def _packed(state: dict, rows: list[int] | None = None) -> dict[str, torch.Tensor]:
    """A checkpoint in a trainer's own naming: ``blk.N.ffn.<name>_w`` packed, ``blk.N.ffn.route``
    dense."""
    out = {}
    for layer in range(2):
        for name in ("gate", "up", "down"):
            out[f"blk.{layer}.ffn.{name}_w"] = torch.stack([state[(layer, e, name)]
                                                            for e in (rows or range(E))])
        out[f"blk.{layer}.ffn.route"] = state[(layer, None, "router.weight")]
    return out


def test_packed_keys_no_pattern_knows_are_learned_from_their_rows() -> None:
    state = _truth()
    index = index_state_dict(_packed(state), "truth")
    # the names alone: nothing
    assert any(f.problem == "no_expert_keys" for f in inspect_index(index).findings)
    owners, _ = owners_of(state)
    learned = learn_expert_keys(index, owners)
    assert set(learned) == {f"blk.{i}.ffn.{n}_w" for i in range(2) for n in ("gate", "up", "down")}
    assert (learned["blk.1.ffn.up_w"].kind == "packed"
            and learned["blk.1.ffn.up_w"].experts == (0, 1, 2, 3))
    patterns = (*learned_patterns(learned), *DEFAULT_PATTERNS)
    result = inspect_index(index, num_experts=E, patterns=patterns)
    assert result.clean, result.findings
    assert {g.layer for g in result.groups} == {0, 1}
    # A checkpoint with one rank's rows only is then named in expert terms.
    local = index_state_dict(_packed(state, rows=[0, 1]), "ep2")
    found = {f.problem for f in inspect_index(local, num_experts=E, patterns=patterns).findings}
    assert "local_extent" in found
    assert any(f.problem == "shape_differs" and f.experts == (2, 3)
               for f in compare_indexes(local, index, values=True, patterns=patterns))


def test_per_expert_keys_learn_which_digits_are_the_expert_and_the_layer() -> None:
    state = _truth()
    flat = {f"net.{layer}.bank.{e}.{name}": state[(layer, e, name)] for layer in range(2)
            for e in range(E) for name in ("gate", "up", "down")}
    index = index_state_dict(flat, "truth")
    patterns = learned_patterns(learn_expert_keys(index, owners_of(state)[0]))
    assert patterns[0].regex.pattern.startswith("^net\\.(?P<layer>\\d+)\\.bank\\.(?P<expert>\\d+)")
    result = inspect_index(index, num_experts=E, patterns=patterns)
    assert result.clean and {(g.layer, len(g.experts)) for g in result.groups} == {(0, E), (1, E)}


def test_digits_inside_a_name_are_no_layer() -> None:
    """torchtitan's MTP layer 2 (``mtp_layers.0``, global layer ``num_layers + 0``) holds
    ``w2_EDF``: its 2 equals the layer, but a layer's index stands apart (``layers.2``,
    ``block_2``), never inside a word, so the key learns no layer rather than one read from the
    weight's name (which made the checkpoint check call layer 2's experts missing from the main
    layers)."""
    keys = {f"{stack}.moe.routed_experts.inner_experts.w2_EDF": LearnedKey(
        f"{stack}.moe.routed_experts.inner_experts.w2_EDF", "packed", 2, tuple(range(E)))
        for stack in ("mtp_layers.0", "layers.2", "block_2")}
    infos = classify_keys(list(keys), learned_patterns(keys))
    assert [(info.role, info.layer) for info in infos.values()] == [
        ("expert", None), ("expert", 2), ("expert", 2)]


def test_ids_that_disagree_with_the_content_learn_nothing() -> None:
    state = _truth()
    flat = {f"net.{layer}.bank.{(e + 1) % E}.{name}": state[(layer, e, name)] for layer in range(2)
            for e in range(E) for name in ("gate", "up", "down")}
    assert (learned_patterns(learn_expert_keys(index_state_dict(flat, "t"), owners_of(state)[0]))
            == ())


def test_equal_tensors_identify_no_owner() -> None:
    owners, volume = owners_of({(0, 0, "a"): torch.zeros(2, 2), (0, 1, "a"): torch.zeros(2, 2)})
    assert owners == {} and volume == 8


@pytest.mark.parametrize("order", ["strided", "consecutive"])
def test_reported_experts_fit_their_own_layout_and_not_the_other(order: str) -> None:
    layout = ParallelLayout.for_world(4, 2, ep_order=order)
    held = [tuple(range(*layout.experts_of(r, E))) for r in range(4)]
    assert problem(layout, E, held) == ""
    other = ParallelLayout.for_world(4, 2,
                                     ep_order="consecutive" if order == "strided" else "strided")
    assert problem(other, E, held)
    assert formed_groups(other, E, held).startswith(f"the framework formed {order} EP groups")


def test_an_uneven_split_other_than_the_rule_is_left_to_the_other_checks() -> None:
    layout = ParallelLayout.for_world(4, 4)
    balanced = [(0, 1), (2, 3), (4,), (5,)]  # "the first E % k ranks get one more" at E=6
    assert problem(layout, 6, balanced) == ""
    assert "not the contiguous range" in problem(layout, 6, [(0, 1), (4,), (2, 3), (5,)])
    # expert 5 missing: for missing/values to name
    assert problem(layout, 6, [(0, 1), (2, 3), (4,), ()]) == ""
    assert problem(layout, 6, [(), (), (), ()]).startswith("no rank reports any expert")


def test_fsdp_row_shards_of_one_ep_coordinate_count_together() -> None:
    layout = ParallelLayout.for_world(4, 2)  # strided: coordinate 0 is ranks 0, 1
    assert problem(layout, E, [(0,), (1,), (2,), (3,)]) == ""
    assert problem(layout, E, [(0,), (2,), (1,), (3,)])


def test_dcp_size_mismatch_on_a_packed_key_reads_in_expert_terms() -> None:
    layout = ParallelLayout.for_world(4, 2)
    error = RuntimeError("Size mismatch between saved torch.Size([4, 3, 2]) and current: "
                         "torch.Size([2, 3, 2]) for model.layers.0.moe.up_w")
    text = translate(error, layout, E, (), rank=2)
    assert text == (
        "rank 2, layer 0, 'model.layers.0.moe.up_w': the model offers 2 rows for the checkpoint's "
        "4 experts: the load does not map the saved global rows to this rank's experts 2..3")
    blamed = load_failed(error, findings=(), checked="", layout=layout, num_experts=E, patterns=(),
                         rank=2)
    assert blamed.side == "load" and str(blamed).splitlines()[0].endswith("so the load is wrong)")
    assert "Size mismatch between saved" in str(blamed).splitlines()[1]
    saved_wrong = load_failed(error, findings=("layer 0, key 'x': absent",), checked="",
                              layout=layout, num_experts=E, patterns=(), rank=2)
    assert (saved_wrong.side == "checkpoint"
            and str(saved_wrong).startswith("the checkpoint differs"))


def test_framework_dims_keep_the_dims_a_framework_branches_on() -> None:
    layout = ParallelLayout.for_world(8, 2, etp=2)
    assert layout.framework_dims({"dp_shard": "fsdp"}) == (("ep", "fsdp", "etp"), (2, 2, 2),
                                                           [[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    assert ParallelLayout.for_world(4, 4).framework_dims() == (("ep",), (4,), [0, 1, 2, 3])
    with pytest.raises(LayoutError, match="names"):
        layout.framework_dims({"data": "dp"})


def test_training_state_scalars_and_build_results() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    found = state_scalars({"scheduler": sched, "train": {"tokens": 5, "blob": torch.zeros(100)}})
    assert found["state.scheduler.last_epoch"] == 0 and found["state.scheduler.base_lrs"] == [0.1]
    assert found["state.train.tokens"] == 5 and "state.train.blob" not in found
    assert (built((1, None)).training_state is None
            and built((1, None, {"s": 1})).extra == {"state": {"s": 1}})
    with pytest.raises(AdapterError, match="expected \\(model, optimizer\\) or"):
        built([1, 2])
    with pytest.raises(AdapterError, match="mapping"):
        built((1, None, 3))


def test_experts_flattened_into_one_axis_are_read_as_plain_tensors() -> None:
    """OLMo-core's form: ``w1`` of shape ``[E * rows, hidden]``; no false 'expert axis has E*rows
    rows' finding."""
    state = _truth()
    flat = {f"blocks.{layer}.experts.mlp.w1": torch.cat([state[(layer, e, "up")] for e in range(E)])
            for layer in range(2)}
    index = index_state_dict(flat, "truth")
    # by name
    assert any(f.problem == "extent_mismatch" for f in inspect_index(index, num_experts=E).findings)
    learned = learn_expert_keys(index, owners_of(state)[0])
    assert learned["blocks.0.experts.mlp.w1"].kind == "blocks"
    patterns = (*learned_patterns(learned), *DEFAULT_PATTERNS)
    found = {f.problem for f in inspect_index(index, num_experts=E, patterns=patterns).findings}
    # no expert axis to read; the matrix compares these keys by value
    assert found == {"no_expert_keys"}
    swapped = dict(flat, **{"blocks.1.experts.mlp.w1": flat["blocks.0.experts.mlp.w1"]})
    assert compare_indexes(index_state_dict(swapped, "ep2"), index, values=True, patterns=patterns)


def test_check_adapter_resolves_the_optional_members_once_and_refuses_a_bare_value() -> None:
    """``check_adapter`` gives the checks one :class:`Members`; a bare string or class where a
    sequence belongs (``refusal_errors = ValueError``) is refused naming the member, not a crash on
    a rank later."""
    from conformance.adapters.reference import ReferenceAdapter
    from conformance.members import check_adapter

    members = check_adapter(ReferenceAdapter(), "reference")
    assert members.of == "conformance.adapters.reference.ReferenceAdapter"
    assert all(members.has(m) for m in ("step", "scalars", "forward", "check_saved", "save_legacy"))
    assert not members.has("read_checkpoint")
    assert members.value("refusal_errors") == () and members.value("preload") == ()
    assert members.unreadable() == "" and members.capabilities.format == "dcp"

    class BareRefusal(ReferenceAdapter):
        refusal_errors = ValueError

    with pytest.raises(AdapterError, match="refusal_errors must be a sequence, got type"):
        check_adapter(BareRefusal(), "bare")


def test_cell_record_keeps_the_report_schema_and_its_key_order() -> None:
    """The record the README documents, built by one type: the keys (and order) the report always
    had."""
    from conformance.record import CellRecord, environment

    record = CellRecord("moe-ep-matrix::checkpoint::x", "checkpoint", "reference", "0.1.0",
                        {"kind": "packed"})
    record.timings, record.shared_save, record.skipped_checks = {"total": 1.0}, True, {}
    record.finish("pass", "ok", 1.23456)
    record.environment = environment("2.13.0", 4, "gloo")
    assert list(record.to_dict()) == ["id", "suite", "adapter", "adapter_version", "kind",
                                      "timings", "shared_save", "skipped_checks", "status",
                                      "detail", "duration_s", "torch", "world_size", "backend"]
    assert record.to_dict()["duration_s"] == 1.235
    errored = CellRecord("i", "checkpoint", "a", "1", {}, errors={"1": "boom"})
    assert "timings" not in errored.to_dict() and errored.to_dict()["errors"] == {"1": "boom"}


def test_the_guide_names_the_members_the_protocols_declare() -> None:
    """docs/adapters.md's table and the contract's Protocols name the same members, required and
    optional alike, and mark the same framework calls: the contract is written once."""
    import re
    from pathlib import Path

    from conformance.adapter import CheckpointAdapter, OptionalMembers, framework_calls, members

    guide = (Path(__file__).parents[1] / "docs" / "adapters.md").read_text()
    table = guide.split("### The contract at a glance", 1)[1].split("\n\n| member |", 1)[1]
    rows = [line for line in table.split("\n\n", 1)[0].splitlines() if line.startswith("| `")]
    named: dict[str, str] = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for name in re.findall(r"`(\w+)", cells[0]):
            named[name] = cells[1]
    required = {n for group in members(CheckpointAdapter) for n in group}
    optional = {n for group in members(OptionalMembers) for n in group}
    assert set(named) == required | optional, set(named) ^ (required | optional)
    assert {n for n, kind in named.items() if kind.startswith("required")} == required
    assert {n for n, kind in named.items() if "framework call" in kind} == framework_calls()

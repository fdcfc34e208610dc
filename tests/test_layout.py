"""The expert layout rule is DTensor's Shard(0) rule, and refuses what it cannot place."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from reference_impl.layout import (
    balanced_range,
    expert_counts,
    expert_owner,
    expert_range,
    layer_stage,
    stage_layers,
    uneven_classes,
)

GRID = [(e, k) for e in range(1, 17) for k in range(1, 9)]


def test_e6_on_4_ranks_leaves_the_last_rank_empty() -> None:
    # The balanced split would give [(0, 2), (2, 4), (4, 5), (5, 6)]: not what DTensor saves.
    assert [expert_range(6, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 6)]
    assert expert_counts(6, 4) == [2, 2, 2, 0]
    assert [expert_owner(e, 6, 4) for e in range(6)] == [0, 0, 1, 1, 2, 2]


def test_fewer_experts_than_ranks() -> None:
    assert [expert_range(2, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


@pytest.mark.parametrize(("n_experts", "n_ranks"), GRID)
def test_rule_matches_torch_chunk_and_dtensor_shard0(n_experts: int, n_ranks: int) -> None:
    rows = torch.arange(n_experts)
    chunks = list(torch.chunk(rows, n_ranks))
    # torch.chunk omits empty trailing chunks
    chunks += [rows[n_experts:]] * (n_ranks - len(chunks))
    for rank in range(n_ranks):
        start, end = expert_range(n_experts, n_ranks, rank)
        assert rows[start:end].tolist() == chunks[rank].tolist(), (
            f"E={n_experts} k={n_ranks} rank={rank}")
        # DTensor's own placement logic, for this mesh coordinate, without a process group.
        shape, offset = _compute_local_shape_and_global_offset((n_experts, 3), (n_ranks,), [rank],
                                                               [Shard(0)])
        assert shape[0] == end - start, (f"E={n_experts} k={n_ranks} rank={rank}: DTensor says "
                                         f"{shape}")
        if shape[0]:
            assert offset[0] == start, (f"E={n_experts} k={n_ranks} rank={rank}: DTensor offset "
                                        f"{offset}")


@pytest.mark.parametrize(("n_experts", "n_ranks"), GRID)
def test_every_expert_has_exactly_one_owner(n_experts: int, n_ranks: int) -> None:
    held = [e for r in range(n_ranks) for e in range(*expert_range(n_experts, n_ranks, r))]
    assert held == list(range(n_experts))
    assert sum(expert_counts(n_experts, n_ranks)) == n_experts
    for e in range(n_experts):
        start, end = expert_range(n_experts, n_ranks, expert_owner(e, n_experts, n_ranks))
        assert start <= e < end


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: expert_range(0, 2, 0), "num_experts must be an int >= 1"),
        (lambda: expert_range(True, 2, 0), "num_experts must be an int >= 1"),
        (lambda: expert_range(4, 0, 0), "expert-parallel ranks must be an int >= 1"),
        (lambda: expert_range(4, 2, 2), r"rank must be an int in \[0, 2\)"),
        (lambda: expert_range(4, 2, -1), r"rank must be an int in \[0, 2\)"),
        (lambda: expert_owner(4, 4, 2), r"expert id must be an int in \[0, 4\)"),
        (lambda: expert_counts(3, 1.5), "expert-parallel ranks must be an int >= 1"),
    ],
)
def test_bad_arguments_raise_value_error(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# -- the uneven classes a split reaches (the default tier's uneven expert count) -------------------
@pytest.mark.parametrize(("n_experts", "n_ranks", "classes"), [
    # 2,2,1,0 vs 2,1,1,1: rank 2 holds expert 4, named 3
    (5, 4, ("partial", "empty", "miscount", "mislabel")),
    # 2,2,2,0 vs 2,2,1,1: no rank with agreeing counts differs
    (6, 4, ("empty", "miscount")),
    (5, 2, ("partial",)),                                 # 3,2 under both splits
    (7, 4, ("partial",)),                                 # 2,2,2,1 under both
    (9, 8, ("partial", "empty", "miscount", "mislabel")),
    (4, 4, ()), (8, 2, ()),
])
def test_uneven_classes(n_experts: int, n_ranks: int, classes: tuple[str, ...]) -> None:
    assert uneven_classes(n_experts, n_ranks) == classes


@pytest.mark.parametrize(("n_experts", "n_ranks"),
                         [(e, k) for e in range(1, 13) for k in (1, 2, 3, 4, 8)])
def test_the_balanced_split_covers_every_expert_once_and_agrees_when_k_divides_e(
        n_experts: int, n_ranks: int) -> None:
    ranges = [balanced_range(n_experts, n_ranks, r) for r in range(n_ranks)]
    assert [i for a, b in ranges for i in range(a, b)] == list(range(n_experts))
    if n_experts % n_ranks == 0:
        assert ranges == [expert_range(n_experts, n_ranks, r) for r in range(n_ranks)]
        assert uneven_classes(n_experts, n_ranks) == ()


# -- the stage rule: which global layers a pipeline stage holds ------------------------------------
def test_stages_are_contiguous_and_the_first_stages_take_the_extra_layers() -> None:
    assert [stage_layers(4, 2, s) for s in range(2)] == [(0, 2), (2, 4)]
    # torchtitan's split: first stages longer
    assert [stage_layers(5, 2, s) for s in range(2)] == [(0, 3), (3, 5)]
    assert [stage_layers(7, 3, s) for s in range(3)] == [(0, 3), (3, 5), (5, 7)]


@pytest.mark.parametrize(("num_layers", "pp"),
                         [(n, p) for n in range(1, 9) for p in range(1, n + 1)])
def test_every_layer_has_exactly_one_stage_and_no_stage_is_empty(num_layers: int, pp: int) -> None:
    blocks = [stage_layers(num_layers, pp, s) for s in range(pp)]
    assert [i for a, b in blocks for i in range(a, b)] == list(range(num_layers))
    assert all(b > a for a, b in blocks)
    assert [layer_stage(i, num_layers, pp) for i in range(num_layers)] == [
        s for s, (a, b) in enumerate(blocks) for _ in range(a, b)]


@pytest.mark.parametrize(("call", "match"), [
    (lambda: stage_layers(2, 3, 0), r"pp=3 stages need at least 3 layers"),
    (lambda: stage_layers(4, 0, 0), r"pp must be an int >= 1, got 0"),
    (lambda: stage_layers(4, 2, 2), r"stage must be an int in \[0, 2\), got 2"),
    (lambda: layer_stage(4, 4, 2), r"layer must be an int in \[0, 4\), got 4"),
])
def test_bad_stage_arguments_raise_value_error(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()

"""The expert layout rule: which global experts an expert-parallel rank holds.

Everything in this project that needs to know where an expert lives asks :func:`expert_range`.
The rule is DTensor's own ``Shard(0)`` rule (``torch.chunk`` semantics), because that is the
layout torch.distributed.checkpoint records: with ``chunk = ceil(E / k)`` rank ``i`` holds rows
``[min(i * chunk, E), min((i + 1) * chunk, E))``, and trailing ranks may hold none.

The tempting "first ``E % k`` ranks get one extra expert" split disagrees with it whenever
``E % k != 0``: with E=6 on k=4 it puts experts 4:5 on rank 2 and 5:6 on rank 3, while DTensor
records rows 4:6 for rank 2 and none for rank 3, so a checkpoint saved from it loses expert 5.
"""

from __future__ import annotations

__all__ = ["expert_counts", "expert_owner", "expert_range"]


def _check(num_experts: int, num_ranks: int) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"the number of expert-parallel ranks must be an int >= 1, got {num_ranks!r}")


def expert_range(num_experts: int, num_ranks: int, rank: int) -> tuple[int, int]:
    """``(start, end)`` of the global experts ``rank`` holds among ``num_ranks`` (end exclusive)."""
    _check(num_experts, num_ranks)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be an int in [0, {num_ranks}), got {rank!r}")
    chunk = -(-num_experts // num_ranks)
    start = min(rank * chunk, num_experts)
    return start, min(start + chunk, num_experts)


def expert_counts(num_experts: int, num_ranks: int) -> list[int]:
    """How many experts each of ``num_ranks`` ranks holds, in rank order."""
    _check(num_experts, num_ranks)
    return [end - start for start, end in (expert_range(num_experts, num_ranks, r) for r in range(num_ranks))]


def expert_owner(expert_id: int, num_experts: int, num_ranks: int) -> int:
    """The rank that holds global expert ``expert_id``."""
    _check(num_experts, num_ranks)
    if isinstance(expert_id, bool) or not isinstance(expert_id, int) or not 0 <= expert_id < num_experts:
        raise ValueError(f"expert id must be an int in [0, {num_experts}), got {expert_id!r}")
    return expert_id // -(-num_experts // num_ranks)

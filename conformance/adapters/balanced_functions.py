"""Negative control for the functions suite: the reference, except for the tempting expert split.

Many frameworks split E experts over k ranks as "the first ``E % k`` ranks get one more" (E=6 on
k=4: ``2, 2, 1, 1``).  DTensor's ``Shard(0)``, and so every checkpoint, uses ``torch.chunk``
(``2, 2, 2, 0``).  The two agree when k divides E and for some uneven E (E=7 on k=4), and disagree
for the rest.  This module is :mod:`reference_impl.state_dict_utils` with that one change wherever
the layout rule matters -- expert ranges, ``should_load``, slice start/end, split ids, validation
and ``create_dtensor_from_local``'s count check -- so the suite must fail it on exactly those uneven
cases and pass it everywhere else.  A suite that passes it, or fails it on an even case, is broken.

To stay identical to the reference everywhere else, the reference's own functions are re-bound to a
copy of its globals in which ``expert_range``, ``expert_counts`` and ``_local_expert_rows`` are the
balanced versions below; nothing else is rewritten.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import reference_impl.state_dict_utils as _reference
from reference_impl.layout import _check, balanced_range
from reference_impl.state_dict_utils import (
    EXPERT_MESH_DIMS,
    _get_expert_mesh_dim_index,
    _is_expert_shard,
    get_submesh,
    is_dtensor,
)

__all__ = [
    "EXPERT_MESH_DIMS",
    "_get_expert_mesh_dim_index",
    "create_dtensor_from_local",
    "expert_counts",
    "expert_range",
    "get_expert_range_for_rank_from_mesh",
    "get_expert_slice_for_rank",
    "get_submesh",
    "is_dtensor",
    "should_load_expert_for_rank",
    "split_experts_weights_dtensor_aware",
    "validate_dtensor_expert_sharding",
]


def expert_range(num_experts: int, num_ranks: int, rank: int) -> tuple[int, int]:
    """The bug: the first ``num_experts % num_ranks`` ranks hold one extra expert."""
    return balanced_range(num_experts, num_ranks, rank)


def expert_counts(num_experts: int, num_ranks: int) -> list[int]:
    _check(num_experts, num_ranks)
    return [end - start
            for start, end in (expert_range(num_experts, num_ranks, r) for r in range(num_ranks))]


def _local_expert_rows(dtensor: Any, n_experts: int, what: str) -> tuple[int, int]:
    """The rows a framework with the bug believes this rank holds: the balanced split per Shard(0)
    dim.

    Keeps the reference's refusals (Partial, strided expert shards, ranks outside the mesh, a local
    row count that contradicts the split) so that only the split differs.
    """
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh, placements = dtensor.device_mesh, dtensor.placements
    for placement in placements:
        if isinstance(placement, Partial) or (isinstance(placement, _StridedShard)
                                              and placement.dim == 0):
            raise ValueError(f"{what} has unsupported DTensor placement: {placement!r}")
    if not mesh._is_current_rank_part_of_mesh():
        raise ValueError(f"{what}: this rank is not part of the DTensor's device mesh {mesh}")
    coord = mesh.get_coordinate()
    start, end = 0, n_experts
    for dim, placement in enumerate(placements):
        if _is_expert_shard(placement) and end > start:
            lo, hi = expert_range(end - start, mesh.size(dim), coord[dim])
            start, end = start + lo, start + hi
    if end == start:
        start = end = n_experts
    rows = dtensor.to_local().shape[0]
    if rows != end - start:
        raise ValueError(f"{what}: the local tensor holds {rows} expert rows, expected "
                         f"{end - start}")
    return start, end


_GLOBALS: dict[str, Any] = {
    **vars(_reference),
    "expert_range": expert_range,
    "expert_counts": expert_counts,
    "_local_expert_rows": _local_expert_rows,
}


def _rebound(fn: Callable[..., Any]) -> Any:
    """The reference function ``fn``, looking up its helpers (and its siblings) in ``_GLOBALS``."""
    new = types.FunctionType(fn.__code__, _GLOBALS, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__doc__ = fn.__doc__
    new.__module__ = __name__
    _GLOBALS[fn.__name__] = new
    return new


get_expert_slice_for_rank = _rebound(_reference.get_expert_slice_for_rank)
split_experts_weights_dtensor_aware = _rebound(_reference.split_experts_weights_dtensor_aware)
validate_dtensor_expert_sharding = _rebound(_reference.validate_dtensor_expert_sharding)
create_dtensor_from_local = _rebound(_reference.create_dtensor_from_local)
get_expert_range_for_rank_from_mesh = _rebound(_reference.get_expert_range_for_rank_from_mesh)
should_load_expert_for_rank = _rebound(_reference.should_load_expert_for_rank)

"""The one translation of :mod:`reference_impl.expert_layout` that copies: staging tensors.

Where a checkpoint holds one tensor that the model keeps as several -- the packed form's
``[E, ...]`` for an unpacked layer's experts, the fused form's ``gate_up_w`` for a packed layer's
``gate_w`` and ``up_w`` or an unpacked layer's experts -- no DTensor can present the several as
one (a DTensor's local data is one tensor).  :func:`stack` copies this rank's tensors into one
staging tensor, placed as the checkpoint's tensor is over the same mesh, for a load to fill;
:func:`copy_back` writes what the load put there back into each of them.  One copy of this rank's
tensors each way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from reference_impl.regions import contiguous_stride, local_region

__all__ = ["STACKINGS", "Staged", "StagedKey", "copy_back", "stack"]

#: how tensors are stacked: each an expert's row (``[n, ...]``); each two an expert's gate and up
#: halves (``[n, 2, ...]``, members gate 0, up 0, gate 1, ...); two packed weights as the halves
#: of every row (``[n, 2, ...]``: a packed layer's ``gate_w`` and ``up_w``).
STACKINGS = ("experts", "expert-halves", "halves")
#: a staging tensor and each tensor copied into it, with its index there.
Staged = tuple[torch.Tensor, list[tuple[torch.Tensor, tuple[Any, ...]]]]


@dataclass(frozen=True)
class StagedKey:
    """A staging copy presented under one key: this rank's ``members`` (FQNs) of MoE layer ``moe``
    stacked as ``how`` says (:data:`STACKINGS`)."""

    moe: Any
    members: tuple[str, ...]
    how: str


def stack(values: list[torch.Tensor], how: str) -> Staged:
    """This rank's ``values`` (plain tensors, or DTensors placed alike) stacked as ``how``
    (:data:`STACKINGS`) says: a copy, each DTensor placement ``Shard(d)`` moved past the new axes,
    so every rank's part sits where the stacked tensor's own shard of it would."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if how not in STACKINGS:
        raise ValueError(f"how must be one of {STACKINGS}, got {how!r}")
    first = values[0]
    locals_ = [local_region(v)[0] for v in values]
    if how == "halves":  # [n, 2, ...]: the halves' axis after the rows, which FSDP2 may split
        local, after = torch.stack(locals_, dim=1), 1
        index: list[tuple[Any, ...]] = [(slice(None), half) for half in (0, 1)]
        shape = (first.shape[0], 2, *first.shape[1:])
    else:
        grid = (len(values),) if how == "experts" else (len(values) // 2, 2)
        local, after = torch.stack(locals_).view(*grid, *locals_[0].shape), 0
        index = [(i,) if how == "experts" else divmod(i, 2) for i in range(len(values))]
        shape = (*grid, *first.shape)
    added = len(shape) - first.dim()

    def moved(p: Any) -> Any:  # _StridedShard (FSDP's over etp's) is no Shard in torch 2.13
        if isinstance(p, _StridedShard) and p.dim >= after:
            return _StridedShard(p.dim + added, split_factor=p.split_factor)
        return Shard(p.dim + added) if isinstance(p, Shard) and p.dim >= after else p

    with torch.no_grad():
        stacked: torch.Tensor = local
        if isinstance(first, DTensor):
            placements = [moved(p) for p in first.placements]
            stacked = DTensor.from_local(local, first.device_mesh, placements, run_check=False,
                                         shape=torch.Size(shape), stride=contiguous_stride(shape))
    return stacked, list(zip(values, index, strict=True))


def copy_back(staged: list[Staged]) -> None:
    """Each staging tensor's loaded part into the tensor (weight or moment) it was copied from."""
    with torch.no_grad():
        for stacked, values in staged:
            rows = local_region(stacked)[0]
            for value, index in values:
                local_region(value)[0].copy_(rows[index])

"""A fused gate/up weight under its global identity: its canonical view and its gate and up halves.

A fused layer's ``gate_up_w`` holds each expert's gate and up rows in one of two orders
(:data:`~reference_impl.model.FUSED_ORDERS`), and is a plain ``[n, 2h, dim]`` tensor, an FSDP2
DTensor of it, or, under expert tensor parallelism, a DTensor of its frame (``[n, 2, h, dim]`` or
``[n, h, 2, dim]``, :func:`~reference_impl.model.fused_frame`).  :mod:`reference_impl.expert_layout`
presents it through two views, made here for any of those (its optimizer moments too), each a view
of the rank's own data (a DTensor over the same mesh on that view where the weight is one), so a
load into them writes the weight:

- :func:`canonical_fused`, ``[n, 2, h, dim]`` whatever the order, gate at ``[:, 0]`` and up at ``[:,
  1]``: the **fused checkpoint form** (``gate_up_w``).  One form for both orders, so a checkpoint
  does not depend on how a model lays the rows out in memory and either order loads the other's
  checkpoint; its bytes are those of ``[gate; up]`` per expert, the concatenated layout transformers
  5, Megatron-Core and NeMo keep.  It keeps the half axis apart from the hidden axis so each etp (or
  FSDP) rank's shard is one region of it: its rows of gate and the same rows of up.  The 3-D ``[E,
  2h, dim]`` would need two regions per rank under expert tensor parallelism, which a DTensor, and
  so a DCP item, cannot describe.
- :func:`fused_halves`, ``gate`` and ``up`` ``[n, h, dim]`` each, exactly what a packed layer's
  ``gate_w`` and ``up_w`` are on the same rank (placements included): the packed form and the
  per-expert form of a fused layer are then a packed layer's, so those checkpoints load across the
  three kinds with no copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from reference_impl.model import fused_frame
from reference_impl.regions import contiguous_stride

__all__ = ["canonical_fused", "fused_halves"]


def _moved(placements: Sequence[Any], to: Callable[[int], int | None], where: str) -> list[Any]:
    """``placements`` with each ``Shard(d)`` (and ``_StridedShard``) moved to dim ``to(d)``; ``to(d)
    is None``: that dim may not be split."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for p in placements:
        if not isinstance(p, Shard | _StridedShard):  # _StridedShard is no Shard in torch 2.13
            out.append(p)
            continue
        dim = to(p.dim)
        if dim is None:
            raise ValueError(f"{where}: placed {tuple(placements)}, its dim {p.dim} is split; a "
                             f"split of the fused gate/up axis would hold some rows of gate on one "
                             f"rank and some of up on another, so it has no one region among all "
                             f"the experts' rows of gate and of up")
        if isinstance(p, _StridedShard):
            out.append(_StridedShard(dim, split_factor=p.split_factor))
        else:
            out.append(Shard(dim))
    return out


def _view(t: torch.Tensor, local: torch.Tensor, placements: list[Any] | None,
          shape: tuple[int, ...]) -> torch.Tensor:
    """``local`` as ``t`` is held: a DTensor of global ``shape`` on ``t``'s mesh, or itself for a
    plain ``t``."""
    from torch.distributed.tensor import DTensor

    if placements is None or not isinstance(t, DTensor):
        return local
    with torch.no_grad():
        return DTensor.from_local(local, t.device_mesh, placements, run_check=False,
                                  shape=torch.Size(shape), stride=contiguous_stride(shape))


def canonical_fused(t: torch.Tensor, order: str,
                    where: str = "a fused gate/up weight") -> torch.Tensor:
    """``t`` (a fused weight or one of its moments, in any of the module docstring's shapes) as
    ``[n, 2, h, dim]``, gate then up: a view of the rank's data (transposed for ``"interleaved"``),
    a DTensor where ``t`` is one."""
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    shape = tuple(t.shape)
    placements = list(t.placements) if isinstance(t, DTensor) else None
    if len(shape) == 3:  # FSDP2 may split the expert and model axes, never the fused one
        if placements is not None:
            placements = _moved(placements, {0: 0, 2: 3}.get, where)
        shape = tuple(fused_frame(torch.empty(shape, device="meta"), order).shape)
    framed = fused_frame(local, order)
    if order == "interleaved":
        framed = framed.transpose(1, 2)
        shape = (shape[0], shape[2], shape[1], shape[3])
        if placements is not None:
            placements = _moved(placements, {0: 0, 1: 2, 2: 1, 3: 3}.get, where)
    return _view(t, framed, placements, shape)


def fused_halves(t: torch.Tensor, order: str, where: str = "a fused gate/up weight"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate, up)`` of ``t`` (as :func:`canonical_fused` reads it), ``[n, h, dim]`` each: views
    of the rank's data, DTensors placed as a packed layer's ``gate_w`` and ``up_w`` where ``t``
    is one."""
    from torch.distributed.tensor import DTensor

    canon = canonical_fused(t, order, where)
    shape = (canon.shape[0], *canon.shape[2:])
    if not isinstance(canon, DTensor):
        return canon[:, 0], canon[:, 1]
    placements = _moved(canon.placements, {0: 0, 2: 1, 3: 2}.get, where)
    local = canon.to_local()
    gate, up = (_view(canon, local[:, half], placements, shape) for half in (0, 1))
    return gate, up

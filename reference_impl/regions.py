"""Where a rank's tensors sit in the global ones, and the ep=1 oracle built on it.

:func:`local_region` is the one place that turns a DTensor into "this rank's data and the region
of the global tensor it is" (DTensor's own ``compute_local_shape_and_global_offset``); the
implementation (:mod:`reference_impl.expert_layout`, :mod:`reference_impl.state_dict_utils`), the
conformance checks and the adapters all ask it.

:func:`global_regions` and :func:`set_deterministic_grads` are not part of the implementation:
they are an independent oracle that says where each parameter of a split, sharded model sits in
the ep=1 model, so tests (and the reference adapter's synthetic gradients) compare any rank with
an ep=1 model built on that rank alone, with no communication.  They rely only on the model's own
bookkeeping (``local_expert_start``) and DTensor's placement logic, never on ExpertLayout.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from reference_impl.memo import Memo
from reference_impl.meshes import sliced
from reference_impl.model import (
    FUSED_WEIGHT,
    HALF_AXIS,
    PACKED_WEIGHTS,
    MoEMLP,
    fused_frame,
    moe_layers,
    moe_modules,
    named_parameters,
)
from reference_impl.weights import normal, stable_seed

__all__ = ["GlobalRegion", "RegionError", "block_region", "global_regions", "local_region",
           "packed_rows", "set_deterministic_grads", "set_deterministic_loads"]


class RegionError(ValueError):
    """A DTensor whose local tensor is not the shard its placements give this rank.

    ``local_shape`` is what the rank holds; ``placed_shape`` and ``offset`` are where DTensor (and
    so DCP) would put it.
    """

    def __init__(self, local_shape: tuple[int, ...], placed_shape: tuple[int, ...],
                 offset: tuple[int, ...], placements: tuple[object, ...], mesh: object) -> None:
        super().__init__(f"the DTensor's local tensor has shape {local_shape}, but its placements "
                         f"{placements} on {mesh} give this rank shape {placed_shape} at offset "
                         f"{offset}; DCP would place the data wrongly")
        self.local_shape, self.placed_shape, self.offset = local_shape, placed_shape, offset
        self.placements, self.mesh = placements, mesh


#: ``compute_local_shape_and_global_offset`` by (global shape, mesh, placements): its Python walk
#: over the placements cost more than the rest of a walk of the model, which the checks take several
#: times a cell.
_PLACED = Memo("placements", 4096)


def local_region(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
    """``(local data, region of the global tensor it is)``; a plain tensor is whole (region
    ``None``).

    The region comes from the DTensor's placements, so FSDP2's uneven and empty shards, nested
    ``Shard`` placements and ``Replicate`` dims all resolve as DCP resolves them.  Raises ValueError
    for ``Partial`` (its local values are summands, not a region of anything) and
    :class:`RegionError` for a local tensor whose shape is not the one its placements give this rank
    (a DTensor made by ``from_local(..., shape=...)`` from another split), which DCP would silently
    misplace.
    """
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(t, DTensor):
        return t, None
    if any(isinstance(p, Partial) for p in t.placements):
        raise ValueError(f"a DTensor placed {tuple(t.placements)} holds partial sums, not a region "
                         f"of its global tensor; redistribute it to Replicate() first")
    local = t.to_local()
    key = (t.shape, t.device_mesh, tuple(t.placements))
    placed = _PLACED.get(key)
    # a pure function of the key on this rank (its coordinates are fixed): taken once
    if placed is None:
        placed = _PLACED.put(key, compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                                        t.placements))
    shape, offset = placed
    if tuple(shape) != tuple(local.shape):
        raise RegionError(tuple(local.shape), tuple(shape), tuple(offset), tuple(t.placements),
                          t.device_mesh)
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (a DTensor made ``from_local`` of a row needs
    its own)."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def _row_split(tensor: torch.Tensor, where: str) -> dict[int, Any]:
    """The mesh dims (index -> placement) of a packed DTensor that split each row itself (an inner
    axis), not the expert axis: expert tensor parallelism, FSDP2 sharding an inner dim.  Empty for a
    plain tensor."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(tensor, DTensor):
        return {}
    mesh, placements = tensor.device_mesh, tensor.placements
    keep = {i: p for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim > 0
            and mesh.size(i) > 1}
    if any(isinstance(p, _StridedShard) for p in keep.values()):
        raise ValueError(f"{where}: placed {tuple(placements)}, it has a strided shard of an inner "
                         f"axis; its rows are not contiguous shards of one expert")
    return keep


def block_region(tensor: torch.Tensor, first: int = 0, *, where: str = "a packed weight"
                 ) -> tuple[torch.Tensor, int, tuple[slice, ...] | None]:
    """A packed weight's (or moment's) rows on this rank: ``(local data, global id of its row 0, row
    region)``.

    Row ``i`` of the local data is expert ``first + i``; ``region`` is where each row sits in the
    expert's whole tensor (``None`` when the rows are whole here), what :func:`local_region` gives
    for the same row of :func:`packed_rows`.  No DTensor is made per row, so a harness walks
    thousands of rows for one :func:`local_region`.
    """
    local, region = local_region(tensor)
    first = first + (region[0].start if region is not None else 0)
    return local, first, region[1:] if region is not None and _row_split(tensor, where) else None


def packed_rows(tensor: torch.Tensor, first: int = 0, *, where: str = "a packed weight"
                ) -> list[tuple[int, torch.Tensor]]:
    """The rows of a packed weight (or moment) this rank holds, each with its global expert id.

    ``first`` is the global id of the tensor's row 0: 0 for a DTensor over all experts, the rank's
    first expert for a plain tensor holding its chunk.  Each row is what the same expert's unpacked
    weight is on this rank: a view of the row when the row is whole here (mesh dims that split the
    expert axis, FSDP's, and replicating dims drop out), else a DTensor on that view over the mesh
    dims that split the row itself (expert tensor parallelism, FSDP2 sharding an inner dim),
    ``Shard(d)`` becoming ``Shard(d - 1)``.  Nothing is copied.
    """
    from torch.distributed.tensor import DTensor, Shard

    local, first, _ = block_region(tensor, first, where=where)
    rows = [(first + i, local[i]) for i in range(local.shape[0])]
    keep = _row_split(tensor, where)
    if keep:
        assert isinstance(tensor, DTensor)
        mesh, names = tensor.device_mesh, tensor.device_mesh.mesh_dim_names
        if len(keep) == mesh.ndim:
            sub = mesh
        elif names is None:
            raise ValueError(f"{where}: placed {tuple(tensor.placements)} on a mesh without dim "
                             "names; its rows need the submesh of the dims that split them, so "
                             "create the mesh with mesh_dim_names")
        else:
            sub = sliced(mesh, tuple(names[i] for i in keep))
        shards = [Shard(p.dim - 1) for p in keep.values()]
        shape = tuple(tensor.shape[1:])
        rows = [(g, DTensor.from_local(row, sub, shards, run_check=False, shape=torch.Size(shape),
                                       stride=contiguous_stride(shape))) for g, row in rows]
    return rows


@dataclass(frozen=True)
class GlobalRegion:
    """Where one parameter of a (split, sharded) model sits in the ep=1 model.

    ``name`` and ``global_shape`` are the parameter's name and shape at ep=1 without FSDP, and
    ``region`` the slices of that tensor this rank's ``local`` holds.  ``experts`` is the layer
    name (``"layers.0.moe"``) when the parameter is a packed expert weight, whose dim 0 is the
    expert axis and whose row ``g`` is ``{experts}.experts.{g}.{linear}.weight`` unpacked.

    A fused ``gate_up_w`` (``fused_order`` set) is read in its frame, ``[E, 2, h, dim]`` or ``[E, h,
    2, dim]`` (:func:`~reference_impl.model.fused_frame`): ``global_shape`` and ``region`` are the
    frame's, where each half's shard is one region (in ``[E, 2h, dim]`` an etp rank's rows are two),
    and :meth:`mine` and :meth:`of` read a tensor in that frame.
    """

    name: str
    global_shape: tuple[int, ...]
    region: tuple[slice, ...]
    param: nn.Parameter
    experts: str | None = None
    fused_order: str | None = None

    @property
    def local(self) -> torch.Tensor:
        """The rank's own data of ``param`` (FSDP's shard without padding, or the tensor itself), in
        its frame."""
        return self.mine(self.param)

    def mine(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's data of ``t``, ``param`` or a tensor held as it is (an optimizer moment), in
        the frame of ``region`` (a view)."""
        local = local_region(t)[0]
        return local if self.fused_order is None else fused_frame(local, self.fused_order)

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's region of ``full``, the ep=1 tensor named ``name`` (or one held as it is)."""
        framed = full if self.fused_order is None else fused_frame(full, self.fused_order)
        return framed[self.region]


def global_regions(model: nn.Module) -> Iterator[GlobalRegion]:
    """Every parameter of ``model`` with its ep=1 name, ep=1 shape and the region this rank
    holds."""
    owners: dict[int, MoEMLP] = {}
    for _, layer in moe_layers(model):
        for p in layer.parameters():
            owners[id(p)] = layer
    prefixes = {id(layer): name for name, layer in moe_layers(model)}
    for fqn, p in named_parameters(model):
        local, found = local_region(p)
        shape = list(p.shape)
        region = list(found) if found is not None else [slice(0, n) for n in local.shape]
        moe, experts, fused = owners.get(id(p)), None, None
        if moe is not None:
            prefix = prefixes[id(moe)]
            head = f"{prefix}." if prefix else ""
            rest = fqn[len(head):].split(".")
            if rest[0] == "experts":  # unpacked: experts.{i}.{linear}.weight -> global expert id
                rest[1] = str(moe.local_expert_start + int(rest[1]))
                fqn = head + ".".join(rest)
            elif rest[0] in PACKED_WEIGHTS or rest[0] == FUSED_WEIGHT or (
                    rest[0] in moe.packed_weights()):  # packed adapters are expert rows too
                experts = prefix
                if rest[0] == FUSED_WEIGHT:
                    fused = moe.fused_order
                    shape, region = _in_frame(fqn, fused, shape, region)
                shape[0] = moe.num_experts
                start = moe.local_expert_start + region[0].start
                region[0] = slice(start, start + local.shape[0])
        yield GlobalRegion(fqn, tuple(shape), tuple(region), p, experts, fused)


def _in_frame(name: str, order: str, shape: list[int],
              region: list[slice]) -> tuple[list[int], list[slice]]:
    """A fused weight's shape and region ``[E, 2h, dim]`` in its frame; a frame's (4-D) as they
    are."""
    if len(shape) == 4:
        return shape, region
    if (region[1].start, region[1].stop) != (0, shape[1]):
        raise ValueError(f"{name}: this rank holds rows {region[1].start}:{region[1].stop} of "
                         f"the fused gate/up axis of {shape[1]}; a shard of it mixes gate and up "
                         f"(shard the weight in its frame)")
    framed = list(fused_frame(torch.empty(shape, device="meta"), order).shape)
    return framed, [region[0], *(slice(0, n) for n in framed[1:3]), region[2]]


def set_deterministic_grads(model: nn.Module, seed: int, step: int) -> None:
    """Set every gradient to a pure function of ``(seed, step, ep=1 unpacked name)``, sliced to this
    rank.

    A model at any layout (ep, etp, FSDP/HSDP) and of any kind then takes the same optimizer step as
    an ep=1 model -- a packed row, and each half of a fused row, gets the gradient its unpacked
    expert's weight gets -- and every expert's moments differ from every other's.
    """
    from torch.distributed.tensor import DTensor

    for piece in global_regions(model):
        if piece.experts is not None:  # packed: one draw per expert, under its unpacked name
            head, linear = (f"{piece.experts}." if piece.experts else "",
                            piece.name.rsplit(".", 1)[-1][:-2])
            order, shape = piece.fused_order, piece.global_shape
            linears = (linear,) if order is None else ("gate", "up")  # a fused row: gate, up
            halves = 0 if order is None else HALF_AXIS[order]
            row = tuple(n for i, n in enumerate(shape) if i not in (0, halves))  # one expert's
            draws = torch.stack([torch.stack([normal(row, 1.0, piece.param.dtype, seed, step,
                                                     f"{head}experts.{g}.{name}.weight", "grad")
                                              for name in linears])
                                 for g in range(shape[0])])  # [E, linears, *row]
            full = (draws[:, 0] if order is None else draws if order == "concatenated"
                    else draws.transpose(1, 2))
        else:
            full = normal(piece.global_shape, 1.0, piece.param.dtype, seed, step, piece.name,
                          "grad")
        p = piece.param
        grad = full[piece.region].reshape(local_region(p)[0].shape)
        grad = grad.clone(memory_format=torch.contiguous_format)
        if isinstance(p, DTensor):
            grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False,
                                      shape=p.shape, stride=p.stride())
        p.grad = grad


@torch.no_grad()
def set_deterministic_loads(model: nn.Module, seed: int, step: int) -> int:
    """Write into every expert-bias router's ``tokens_per_expert`` a load that is a pure function of
    ``(seed, step, layer name)``, whole on every rank (the routers are replicated); how many
    routers.  Loads are whole numbers in ``[0, 64)``: some experts over the mean, some under, so
    :func:`~reference_impl.router.update_expert_bias` moves every bias.  The synthetic loads a
    training step on synthetic gradients sets, as the matrix sets its own."""
    routers = 0
    for moe in moe_modules(model):
        router = moe.router
        if router.has_expert_bias:
            key = stable_seed(seed, step, moe.name, "tokens_per_expert")
            generator = torch.Generator().manual_seed(key)
            load = torch.randint(0, 64, (moe.num_experts,), generator=generator)
            router.tokens_per_expert.copy_(load)
            routers += 1
    return routers

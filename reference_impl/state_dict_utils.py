"""Where grouped expert weights live on each rank, and how to take them apart without copies.

A grouped expert weight has global shape ``[E, ...]``: row ``e`` is expert ``e``.  Expert
parallelism (EP) shards those rows across the ``ep`` mesh dim with ``Shard(0)``; FSDP may shard
them again (``(ep, dp_shard)`` with ``(Shard(0), Shard(0))``), or shard them alone on an EP-free
mesh such as ``dp_shard_cp``.  Inner-axis shards (``Shard(1)``, ``Shard(2)``) and ``Replicate()``
leave every expert's row on the rank.

Which rows a rank holds is decided by one rule, :func:`reference_impl.layout.expert_range`, which
is DTensor's own ``Shard(0)`` rule (``torch.chunk``): with E=6 experts on k=4 ranks the ranks hold
``0:2, 2:4, 4:6`` and nothing.  Every function here follows it, because it is the layout that
``torch.distributed.checkpoint`` records; any other split (say ``2, 2, 1, 1``) saves rows under the
wrong global ids and silently drops experts.  Where several mesh dims shard the expert axis the
rows come from DTensor's own shape-and-offset logic, so nested sharding needs no arithmetic here.

Nothing here copies weights: every tensor returned views the input's local storage.  Bad input
raises ``ValueError`` or ``TypeError`` saying what was wrong and what was expected.
"""

from __future__ import annotations

from typing import TypeGuard

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from reference_impl.layout import expert_counts, expert_range
from reference_impl.meshes import sliced
from reference_impl.regions import RegionError, contiguous_stride, local_region

__all__ = [
    "create_dtensor_from_local",
    "get_expert_range_for_rank_from_mesh",
    "get_expert_slice_for_rank",
    "get_submesh",
    "is_dtensor",
    "should_load_expert_for_rank",
    "split_experts_weights_dtensor_aware",
    "validate_dtensor_expert_sharding",
]

#: mesh dim names create_dtensor_from_local understands, and the placement each one means.
EXPERT_MESH_DIMS = ("ep", "ep_shard", "ep_replicate")
#: the dims of a full parallel-layout mesh (conformance.layout.ParallelLayout): data-parallel dims
#: replicate a rank's experts, ``etp`` splits each expert's hidden axis.
LAYOUT_MESH_DIMS = ("dp_replicate", "ep", "dp_shard", "etp")


# ----------------------------------------------------------------------------- argument checks


def _check_tensor(tensor: object, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor or DTensor, got {type(tensor).__name__}")
    if tensor.ndim < 1:
        raise ValueError(f"{what} must have an expert axis (dim 0), got a 0-dim tensor")
    return tensor


def _check_n_experts(n_experts: object, what: str = "n_experts") -> int:
    if isinstance(n_experts, bool) or not isinstance(n_experts, int) or n_experts < 1:
        raise ValueError(f"{what} must be an int >= 1, got {n_experts!r}")
    return n_experts


def _check_global_experts(tensor: torch.Tensor, n_experts: int, what: str) -> None:
    if tensor.shape[0] != n_experts:
        kind = "global " if is_dtensor(tensor) else ""
        raise ValueError(
            f"{what} has {kind}shape {tuple(tensor.shape)}: dim 0 holds {tensor.shape[0]} experts, "
            f"expected n_experts={n_experts}"
        )


def _check_mesh(device_mesh: object) -> DeviceMesh:
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError("device_mesh must be a DeviceMesh or None, got "
                        f"{type(device_mesh).__name__}")
    return device_mesh


def _is_expert_shard(placement: Placement) -> bool:
    return isinstance(placement, Shard) and placement.dim == 0


# ------------------------------------------------------------------------------- small helpers


def is_dtensor(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a DTensor, i.e. its local tensor may hold only part of the experts."""
    return isinstance(tensor, DTensor)


def get_submesh(device_mesh: DeviceMesh, dims: tuple[str, ...]) -> DeviceMesh:
    """The submesh over the named ``dims``, with a readable error for a name the mesh lacks."""
    _check_mesh(device_mesh)
    if isinstance(dims, str):
        dims = (dims,)
    if not isinstance(dims, tuple) or not dims or not all(isinstance(d, str) for d in dims):
        raise TypeError(f"dims must be a non-empty tuple of mesh dim names, got {dims!r}")
    names = device_mesh.mesh_dim_names
    if names is None:
        raise ValueError(f"cannot select mesh dims {dims}: the mesh has no dim names (pass "
                         "mesh_dim_names)")
    missing = [d for d in dims if d not in names]
    if missing:
        raise ValueError(f"mesh has no dim named {', '.join(map(repr, missing))}; its dims are "
                         f"{names}")
    if len(set(dims)) != len(dims):
        raise ValueError(f"mesh dim names must not repeat, got {dims}")
    if dims == names:
        return device_mesh
    return sliced(device_mesh, dims)



def _get_expert_mesh_dim_index(dtensor: DTensor) -> int | None:
    """The mesh dim that partitions experts: a named ``ep`` dim, else the first ``Shard(0)``, else
    None.

    ``ep`` wins when present because it is the dim EP loading reasons about, even where FSDP shards
    the same rows again; without it an EP-free FSDP dim (``dp_shard_cp``) is the partition.
    """
    if not is_dtensor(dtensor):
        raise TypeError(f"expected a DTensor, got {type(dtensor).__name__}")
    names = dtensor.device_mesh.mesh_dim_names
    if names is not None and "ep" in names:
        return names.index("ep")
    for i, placement in enumerate(dtensor.placements):
        if _is_expert_shard(placement):
            return i
    return None


# ------------------------------------------------------------------------- the rows a rank holds


def _local_expert_rows(dtensor: DTensor, n_experts: int, what: str) -> tuple[int, int]:
    """``(start, end)`` of the global expert rows this rank's local tensor holds.

    Asks DTensor itself (through :func:`reference_impl.regions.local_region`) so that nested
    ``Shard(0)`` placements are resolved exactly as DTensor and DCP resolve them, then checks the
    local tensor really has that many rows: a DTensor built by ``from_local(..., shape=...)`` from
    another split describes rows its ranks do not hold, and trusting it would save experts under
    wrong ids.
    """
    mesh, placements = dtensor.device_mesh, dtensor.placements
    for placement in placements:
        if isinstance(placement, Partial):
            raise ValueError(
                f"{what} has unsupported DTensor placement: {placement!r}. Its local values are "
                "partial sums, not expert weights; redistribute to Replicate() first"
            )
        if isinstance(placement, _StridedShard) and placement.dim == 0:
            raise ValueError(
                f"{what} has unsupported DTensor placement: {placement!r}. A strided shard of the "
                "expert axis need not hold a contiguous range of experts; use the DTensor before "
                "FSDP wrapped it or its full_tensor()"
            )
    if not mesh._is_current_rank_part_of_mesh():
        raise ValueError(f"{what}: this rank is not part of the DTensor's device mesh {mesh}")
    try:
        _, region = local_region(dtensor)
    except RegionError as exc:
        if exc.local_shape[0] == exc.placed_shape[0]:
            raise ValueError(f"{what}: {exc}") from None
        rows, at = exc.placed_shape[0], min(exc.offset[0],
                                            n_experts) if exc.placed_shape[0] else n_experts
        raise ValueError(
            f"{what}: the local tensor holds {exc.local_shape[0]} expert rows but its placements "
            f"{tuple(placements)} give this rank {rows} (rows {at}:{at + rows} of {n_experts}). "
            "Was it built with DTensor.from_local(..., shape=...) from a split other than "
            "torch.chunk's? See reference_impl.layout.expert_range"
        ) from None
    assert region is not None
    rows = region[0].stop - region[0].start
    start = min(region[0].start, n_experts) if rows else n_experts
    expert_dims = [i for i, p in enumerate(placements) if _is_expert_shard(p)]
    if len(expert_dims) == 1 and rows:
        (dim,) = expert_dims
        rule = expert_range(n_experts, mesh.size(dim), mesh.get_local_rank(dim))
        if rule != (start, start + rows):
            raise RuntimeError(
                f"DTensor places rows {start}:{start + rows} of {n_experts} on this rank but the "
                f"layout rule says {rule[0]}:{rule[1]}; this torch version changed Shard(0), "
                "update reference_impl.layout"
            )
    return start, start + rows


def get_expert_slice_for_rank(
    experts_tensor: torch.Tensor, n_experts: int
) -> tuple[torch.Tensor, int, int]:
    """The experts this rank holds: ``(local_tensor, start_expert, end_expert)``, end exclusive.

    A plain tensor holds all of them.  For a DTensor the range is the rows DTensor assigns this rank
    under every ``Shard(0)`` placement together (EP, EP then FSDP, or FSDP alone), so it names the
    experts by the global ids DCP saves them under.  A rank holding none gets ``(E, E)``, which is
    also where DTensor places an empty shard.  The local tensor is the DTensor's own local tensor,
    not a copy; for inner-axis shards it holds all experts but part of each.
    """
    _check_tensor(experts_tensor, "experts_tensor")
    n_experts = _check_n_experts(n_experts)
    _check_global_experts(experts_tensor, n_experts, "experts_tensor")
    if not is_dtensor(experts_tensor):
        return experts_tensor, 0, n_experts
    start, end = _local_expert_rows(experts_tensor, n_experts, "experts_tensor")
    return experts_tensor.to_local(), start, end


def split_experts_weights_dtensor_aware(
    weight: torch.Tensor, n_experts: int
) -> tuple[list[torch.Tensor], list[int]]:
    """This rank's experts one by one, with their global ids in order; each output views ``weight``.

    The mesh dims that partition experts have nothing left to shard once a tensor holds a single
    expert, so they are dropped; the other placements shift down one tensor dim (``Shard(d)``
    becomes ``Shard(d-1)``) and the per-expert tensors are DTensors over the remaining mesh dims of
    size > 1, or plain tensors when none remain.  That keeps an inner-axis shard sharded, with no
    copy.
    """
    local, start, end = get_expert_slice_for_rank(weight, n_experts)
    ids = list(range(start, end))
    if not is_dtensor(weight):
        return [local[i] for i in range(len(ids))], ids

    mesh, placements = weight.device_mesh, weight.placements
    keep = [i for i, p in enumerate(placements) if not _is_expert_shard(p) and mesh.size(i) > 1]
    if not keep:
        return [local[i] for i in range(len(ids))], ids

    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "split_experts_weights_dtensor_aware needs mesh dim names to build the per-expert "
            "submesh; create the mesh with mesh_dim_names"
        )
    submesh = get_submesh(mesh, tuple(names[i] for i in keep))
    new_placements: list[Placement] = []
    for i in keep:
        placement = placements[i]
        if isinstance(placement, _StridedShard):
            placement = _StridedShard(placement.dim - 1, split_factor=placement.split_factor)
        elif isinstance(placement, Shard):
            placement = Shard(placement.dim - 1)
        new_placements.append(placement)
    shape, stride = weight.shape[1:], weight.stride()[1:]
    experts: list[torch.Tensor] = [
        DTensor.from_local(local[i], submesh, new_placements, shape=shape, stride=stride)
        for i in range(len(ids))
    ]
    return experts, ids


def validate_dtensor_expert_sharding(
    tensor: torch.Tensor, expected_experts: int, tensor_name: str = "tensor"
) -> bool:
    """True when ``tensor`` holds ``expected_experts`` experts in a layout EP loading can use.

    Checks the placement on the expert-partitioning mesh dim (``Shard(0)`` or ``Replicate()``), not
    whichever placement comes last, so an ``(ep, ep_shard)`` DTensor with ``(Shard(0), Shard(1))``
    is valid.  ``Partial`` anywhere, or a shard of another dim on the expert dim, is not: such a
    local tensor does not hold whole experts.  Raises ``ValueError`` instead of returning False.
    """
    _check_tensor(tensor, tensor_name)
    expected_experts = _check_n_experts(expected_experts, "expected_experts")
    if not is_dtensor(tensor):
        if tensor.shape[0] != expected_experts:
            raise ValueError(f"{tensor_name} has shape {tensor.shape[0]} experts, expected "
                             f"{expected_experts}")
        return True
    if tensor.shape[0] != expected_experts:
        raise ValueError(
            f"{tensor_name} global shape has {tensor.shape[0]} experts, expected {expected_experts}"
        )
    expert_dim = _get_expert_mesh_dim_index(tensor)
    if expert_dim is not None:
        placement = tensor.placements[expert_dim]
        if not (_is_expert_shard(placement) or isinstance(placement, Replicate)):
            raise ValueError(
                f"{tensor_name} has unsupported DTensor placement: {placement!r}. The expert mesh "
                f"dim {expert_dim} must use Shard(0) or Replicate()"
            )
    _local_expert_rows(tensor, expected_experts, tensor_name)
    return True


# --------------------------------------------------------------------- building and loading


def _gather_local_shapes(
    local_shape: tuple[int, ...], mesh: DeviceMesh, dim: int
) -> tuple[list[tuple[int, ...]], list[int]]:
    """Every rank's local shape along mesh ``dim``, and those ranks' global ids (collective)."""
    group = mesh.get_group(dim)
    shapes: list[tuple[int, ...]] = [()] * mesh.size(dim)
    dist.all_gather_object(shapes, local_shape, group=group)
    return shapes, dist.get_process_group_ranks(group)


def create_dtensor_from_local(
    local_tensor: torch.Tensor, device_mesh: DeviceMesh | None, rank: int | None = None, *,
    etp_dim: int | None = None,
) -> torch.Tensor:
    """Wrap this rank's experts as a DTensor with the right global shape; None mesh returns them as
    is.

    Collective: every rank of ``device_mesh`` must call it, because the global shape comes from the
    local expert counts gathered over the ``ep`` group (ranks may hold different numbers of
    experts). Those counts must follow :func:`reference_impl.layout.expert_range`, or the DTensor
    would describe rows its ranks do not hold and a checkpoint would lose experts; a mismatch raises
    ``ValueError``.

    Mesh dims: ``ep`` shards experts (``Shard(0)``); ``ep_shard`` (``Shard(1)``) and
    ``ep_replicate`` (``Replicate()``) are used only when one of them has size > 1, else the ep
    submesh alone is used. A parallel-layout mesh (:data:`LAYOUT_MESH_DIMS`, EP groups strided or
    consecutive) is read the same way: ``dp_replicate`` and ``dp_shard`` replicate the rank's
    experts, and ``etp`` (expert tensor parallelism) shards axis ``etp_dim`` of them, the hidden
    axis, which only the caller knows (``[E, hidden, dim]`` -> 1, ``[E, dim, hidden]`` -> 2); the
    DTensor uses ``ep`` and the dims of size > 1. The tensor moves to the mesh's device type
    (``rank`` picks the CUDA device, else the current one); when it is already there nothing is
    copied.
    """
    if device_mesh is None:
        return local_tensor
    _check_tensor(local_tensor, "local_tensor")
    if is_dtensor(local_tensor):
        raise TypeError("local_tensor is already a DTensor; pass this rank's local torch.Tensor")
    _check_mesh(device_mesh)
    names = device_mesh.mesh_dim_names
    if names is None:
        raise ValueError("create_dtensor_from_local needs a mesh with dim names among "
                         f"{EXPERT_MESH_DIMS}")
    unknown = [n for n in names if n not in EXPERT_MESH_DIMS + LAYOUT_MESH_DIMS]
    if unknown:
        raise ValueError(
            f"create_dtensor_from_local got mesh dim {', '.join(map(repr, unknown))} (mesh dims "
            f"{names}); allowed names are {EXPERT_MESH_DIMS} or {LAYOUT_MESH_DIMS}"
        )
    placement_of: dict[str, Placement] = {"ep": Shard(0), "ep_shard": Shard(1),
                                          "ep_replicate": Replicate(),
                                          "dp_replicate": Replicate(), "dp_shard": Replicate()}
    size = {n: device_mesh.size(i) for i, n in enumerate(names)}
    if size.get("etp", 1) > 1:
        if isinstance(etp_dim, bool) or not isinstance(etp_dim,
                                                       int) or not 1 <= etp_dim < local_tensor.ndim:
            raise ValueError(
                f"the mesh's etp dim (size {size['etp']}) splits each expert's hidden axis; pass "
                f"etp_dim, that axis of local_tensor (shape {tuple(local_tensor.shape)}): an int "
                f"in [1, {local_tensor.ndim}), got {etp_dim!r}")
        placement_of["etp"] = Shard(etp_dim)
    if any(n in ("dp_replicate", "dp_shard", "etp") for n in names):
        kept = tuple(n for n in names if n == "ep" or size[n] > 1)
    else:
        inner = any(size[n] > 1 for n in ("ep_shard", "ep_replicate") if n in names)
        kept = names if inner or "ep" not in names else ("ep",)
    mesh = device_mesh if kept == names else get_submesh(device_mesh, kept)
    mesh_names = mesh.mesh_dim_names or ()
    placements = [placement_of[n] for n in mesh_names]
    if "ep_shard" in mesh_names and local_tensor.ndim < 2:
        raise ValueError("ep_shard shards dim 1, but local_tensor has shape "
                         f"{tuple(local_tensor.shape)}")

    if local_tensor.device.type != mesh.device_type:
        if mesh.device_type == "cuda":
            index = (rank % torch.cuda.device_count() if rank is not None
                     else torch.cuda.current_device())
            local_tensor = local_tensor.to(torch.device("cuda", index))
        else:
            local_tensor = local_tensor.to(mesh.device_type)

    global_shape = list(local_tensor.shape)
    local_shape = tuple(local_tensor.shape)
    for dim, name in enumerate(mesh_names):
        shapes, ranks = _gather_local_shapes(local_shape, mesh, dim)
        placement = placement_of[name]
        if not isinstance(placement, Shard):
            if len(set(shapes)) > 1:
                raise ValueError(
                    f"local shapes over the {name} group (global ranks {ranks}) are {shapes}: "
                    f"{name} replicates, so they must all be equal"
                )
            continue
        axis = placement.dim
        counts = [s[axis] for s in shapes]
        if any(s[:axis] + s[axis + 1 :] != local_shape[:axis] + local_shape[axis + 1 :]
               for s in shapes):
            raise ValueError(
                f"local shapes over the {name} group (global ranks {ranks}) are {shapes}: they may "
                f"differ only in dim {axis}"
            )
        total = sum(counts)
        if total < 1:
            raise ValueError(f"the {name} group (global ranks {ranks}) holds no rows in dim {axis} "
                             "at all")
        expected = expert_counts(total, len(counts))
        wrong = [r for r, c, e in zip(ranks, counts, expected, strict=True) if c != e]
        if wrong:
            what = "expert counts" if axis == 0 else f"dim-{axis} sizes"
            raise ValueError(
                f"local {what} {counts} over the {name} group (global ranks {ranks}) do not follow "
                f"the layout rule for {total} rows on {len(counts)} ranks, which expects "
                f"{expected} (reference_impl.layout.expert_range); ranks {wrong} disagree"
            )
        global_shape[axis] = total

    return DTensor.from_local(
        local_tensor, mesh, placements, shape=torch.Size(global_shape),
        stride=contiguous_stride(global_shape)
    )


def get_expert_range_for_rank_from_mesh(device_mesh: DeviceMesh | None,
                                        n_experts: int) -> tuple[int, int]:
    """``(start, end)`` of the experts this rank loads: its ``ep`` coordinate under the layout rule.

    No mesh means one rank holding everything.  A mesh with an ``ep`` dim uses that dim; a 1-D mesh
    without one is itself the expert partition; a larger mesh without ``ep`` is ambiguous and
    refused.
    """
    n_experts = _check_n_experts(n_experts)
    if device_mesh is None:
        return 0, n_experts
    _check_mesh(device_mesh)
    names = device_mesh.mesh_dim_names
    if names is not None and "ep" in names:
        dim = names.index("ep")
    elif device_mesh.ndim == 1:
        dim = 0
    else:
        raise ValueError(
            f"device_mesh has dims {names} of shape {tuple(device_mesh.shape)} and no 'ep' dim: "
            "cannot tell which dim partitions the experts; pass a mesh with an 'ep' dim or a 1-D "
            "mesh"
        )
    return expert_range(n_experts, device_mesh.size(dim), device_mesh.get_local_rank(dim))


def should_load_expert_for_rank(expert_id: int, device_mesh: DeviceMesh | None,
                                n_experts: int) -> bool:
    """Whether global expert ``expert_id`` lives on this rank, so a loader reads only its own
    experts."""
    n_experts = _check_n_experts(n_experts)
    if isinstance(expert_id, bool) or not isinstance(expert_id,
                                                     int) or not 0 <= expert_id < n_experts:
        raise ValueError(f"expert_id must be an int in [0, {n_experts}), got {expert_id!r}")
    start, end = get_expert_range_for_rank_from_mesh(device_mesh, n_experts)
    return start <= expert_id < end

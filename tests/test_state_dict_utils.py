"""reference_impl.state_dict_utils on real gloo worlds: every function follows the one layout rule.

Each world test runs on every rank.  The expected rows come from an oracle written here from the
rule itself (``expert_range`` applied mesh dim by mesh dim, which is ``torch.chunk``), never from
the code under test; DTensors under test are made by ``distribute_tensor``, i.e. by DTensor itself.
Coverage across ranks is checked with one ``all_gather_object`` per test.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from pytest_moe_ep.world.meshes import device_mesh
from reference_impl.layout import expert_range
from reference_impl.state_dict_utils import (
    _get_expert_mesh_dim_index,
    create_dtensor_from_local,
    get_expert_range_for_rank_from_mesh,
    get_expert_slice_for_rank,
    get_submesh,
    is_dtensor,
    should_load_expert_for_rank,
    split_experts_weights_dtensor_aware,
    validate_dtensor_expert_sharding,
)

EXPERTS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16)
INNER = (4, 6)  # trailing dims: Shard(1) over 4 ranks is even, Shard(2) over 4 ranks is 2, 2, 2, 0


def full(n_experts: int) -> torch.Tensor:
    """A grouped weight whose every element names its position, so a misplaced row cannot pass."""
    return torch.arange(n_experts * math.prod(INNER),
                        dtype=torch.float32).reshape(n_experts, *INNER)


def storage(t: torch.Tensor) -> int:
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()


def parse(placement: str) -> Placement:
    return Replicate() if placement == "R" else Shard(int(placement[1:]))


@dataclass(frozen=True)
class Kind:
    """A mesh and the placements of a grouped weight on it.  Placements: "S<d>" or "R"."""

    name: str
    shape: tuple[int, ...]
    names: tuple[str, ...]
    placements: tuple[str, ...]

    @property
    def world(self) -> int:
        return math.prod(self.shape)

    def mesh(self) -> DeviceMesh:
        return device_mesh(self.shape, self.names)

    def is_ep_mesh(self) -> bool:
        """Whether the mesh-only functions (range, should_load) apply: it names ep, or is 1-D and
        shards experts."""
        return "ep" in self.names or (len(self.shape) == 1 and self.placements == ("S0",))

    def param(self) -> object:
        return pytest.param(self, marks=pytest.mark.moe_ep_world(self.world, backend="gloo"),
                            id=self.name)


def oracle_rows(kind: Kind, coord: list[int], n_experts: int) -> tuple[int, int]:
    """The rows a rank holds: the layout rule applied to every Shard(0) mesh dim in order."""
    start, end = 0, n_experts
    for dim, placement in enumerate(kind.placements):
        if placement == "S0" and end > start:
            lo, hi = expert_range(end - start, kind.shape[dim], coord[dim])
            start, end = start + lo, start + hi
    return (start, end) if end > start else (n_experts, n_experts)


def oracle_local(kind: Kind, coord: list[int], n_experts: int) -> torch.Tensor:
    """This rank's local tensor by the rule: expert rows, then each inner-axis shard."""
    start, end = oracle_rows(kind, coord, n_experts)
    local = full(n_experts)[start:end]
    for dim, placement in enumerate(kind.placements):
        if placement not in ("S0", "R"):
            axis = int(placement[1:])
            lo, hi = expert_range(local.shape[axis], kind.shape[dim], coord[dim])
            local = local.narrow(axis, lo, hi - lo)
    return local


def oracle_mesh_range(kind: Kind, coord: list[int], n_experts: int) -> tuple[int, int]:
    dim = kind.names.index("ep") if "ep" in kind.names else 0
    return expert_range(n_experts, kind.shape[dim], coord[dim])


def check_coverage(kind: Kind, held: dict[int, tuple[int, int]]) -> None:
    """Over all ranks, every expert is held once per copy the non-expert mesh dims make."""
    everyone: list[dict[int, tuple[int, int]]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, held)
    copies = math.prod(size for size, p in zip(kind.shape, kind.placements, strict=True)
                       if p != "S0")
    for n_experts in held:
        count = Counter(e for ranges in everyone for e in range(*ranges[n_experts]))
        assert count == dict.fromkeys(range(n_experts), copies), (
            f"{kind.name} E={n_experts}: ranges per rank {[r[n_experts] for r in everyone]} do not "
            f"hold every expert {copies} time(s)"
        )


# ------------------------------------------------------------------ DTensors made by DTensor

SLICE_KINDS = [
    Kind("ep1", (1,), ("ep",), ("S0",)),
    Kind("ep2", (2,), ("ep",), ("S0",)),
    Kind("ep3", (3,), ("ep",), ("S0",)),
    Kind("ep4", (4,), ("ep",), ("S0",)),
    Kind("dp2-ep2", (2, 2), ("dp", "ep"), ("R", "S0")),
    Kind("ep2-dp_shard2-nested", (2, 2), ("ep", "dp_shard"), ("S0", "S0")),
    Kind("dp_shard_cp3", (3,), ("dp_shard_cp",), ("S0",)),
    Kind("dp_shard_cp4", (4,), ("dp_shard_cp",), ("S0",)),
    Kind("dp2-dp_shard2", (2, 2), ("dp", "dp_shard"), ("R", "S0")),
    Kind("ep2-ep_shard2-inner", (2, 2), ("ep", "ep_shard"), ("S0", "S1")),
    Kind("tp4-shard1", (4,), ("tp",), ("S1",)),
    Kind("tp4-shard2", (4,), ("tp",), ("S2",)),
    Kind("dp_shard_cp4-replicate", (4,), ("dp_shard_cp",), ("R",)),
]


@pytest.mark.parametrize("kind", [k.param() for k in SLICE_KINDS])
def test_slice_split_and_mesh_functions_follow_the_rule(kind: Kind) -> None:
    mesh = kind.mesh()
    coord = mesh.get_coordinate()
    placements = [parse(p) for p in kind.placements]
    remaining = [i for i, p in enumerate(kind.placements) if p != "S0" and kind.shape[i] > 1]
    held = {}
    for n_experts in EXPERTS:
        where = f"{kind.name} E={n_experts} rank={dist.get_rank()} coord={coord}"
        weight = distribute_tensor(full(n_experts), mesh, placements, src_data_rank=None)
        start, end = oracle_rows(kind, coord, n_experts)
        expected_local = oracle_local(kind, coord, n_experts)

        local, got_start, got_end = get_expert_slice_for_rank(weight, n_experts)
        assert (got_start, got_end) == (start, end), f"{where}: slice {got_start}:{got_end}"
        assert torch.equal(local,
                           expected_local), f"{where}: local rows differ from full[{start}:{end}]"
        assert storage(local) == storage(weight), f"{where}: the local tensor is a copy"
        assert validate_dtensor_expert_sharding(weight, n_experts, "w") is True

        experts, ids = split_experts_weights_dtensor_aware(weight, n_experts)
        assert ids == list(range(start, end)), f"{where}: split ids {ids}"
        for expert, local_row in zip(experts, expected_local, strict=True):
            assert storage(expert) == storage(weight), f"{where}: a per-expert tensor is a copy"
            if remaining:
                assert isinstance(expert, DTensor), f"{where}: expected a DTensor per expert"
                assert expert.device_mesh.mesh_dim_names == tuple(kind.names[i] for i in remaining)
                assert expert.placements == tuple(
                    Replicate() if kind.placements[i] == "R"
                    else Shard(int(kind.placements[i][1:]) - 1) for i in remaining
                ), f"{where}: per-expert placements {expert.placements}"
                assert expert.shape == INNER
                assert torch.equal(expert.to_local(), local_row)
            else:
                assert not is_dtensor(expert), f"{where}: expected a plain tensor per expert"
                assert torch.equal(expert, local_row)
        # the per-expert DTensors describe the right global tensors
        if n_experts == 5 and remaining:
            for expert, expert_id in zip(experts, ids, strict=True):
                assert torch.equal(expert.full_tensor(),
                                   full(n_experts)[expert_id]), f"{where}: {expert_id}"

        if kind.is_ep_mesh():
            mesh_range = oracle_mesh_range(kind, coord, n_experts)
            assert get_expert_range_for_rank_from_mesh(mesh, n_experts) == mesh_range, where
            loads = [e for e in range(n_experts) if should_load_expert_for_rank(e, mesh, n_experts)]
            assert loads == list(range(*mesh_range)), f"{where}: should_load picks {loads}"
            # nested FSDP splits the ep range further; without it the slice is the ep range itself
            if kind.placements.count("S0") == 1:
                assert (start, end) == mesh_range, where
            else:
                assert set(range(start, end)) <= set(range(*mesh_range)), where
        held[n_experts] = (start, end)
    check_coverage(kind, held)


@pytest.mark.moe_ep_world(4, backend="gloo")
def test_expert_mesh_dim_index_rule() -> None:
    cases = [
        ((2, 2), ("dp", "ep"), [Replicate(), Shard(0)], 1),
        ((2, 2), ("ep", "dp_shard"), [Shard(0), Shard(0)], 0),
        # a named ep dim wins even if not sharding
        ((2, 2), ("ep", "ep_shard"), [Replicate(), Shard(1)], 0),
        ((2, 2), ("dp", "dp_shard"), [Replicate(), Shard(0)], 1),
        ((4,), ("dp_shard_cp",), [Shard(0)], 0),
        ((4,), ("tp",), [Shard(1)], None),
        ((4,), ("dp_shard_cp",), [Replicate()], None),
    ]
    for shape, names, placements, expected in cases:
        weight = distribute_tensor(full(4), device_mesh(shape, names), placements,
                                   src_data_rank=None)
        assert _get_expert_mesh_dim_index(weight) == expected, f"{names} {placements}"


# ------------------------------------------------------------ create_dtensor_from_local

CREATE_KINDS = [
    Kind("ep1", (1,), ("ep",), ("S0",)),
    Kind("ep2", (2,), ("ep",), ("S0",)),
    Kind("ep3", (3,), ("ep",), ("S0",)),
    Kind("ep4", (4,), ("ep",), ("S0",)),
    Kind("ep_replicate2-ep2", (2, 2), ("ep_replicate", "ep"), ("R", "S0")),
    Kind("ep2-ep_shard2", (2, 2), ("ep", "ep_shard"), ("S0", "S1")),
    # size-1 ep_shard: ep submesh only
    Kind("ep4-ep_shard1", (4, 1), ("ep", "ep_shard"), ("S0", "S1")),
]


@pytest.mark.parametrize("kind", [k.param() for k in CREATE_KINDS])
def test_create_dtensor_from_local_agrees_with_everything(kind: Kind) -> None:
    mesh = kind.mesh()
    coord = mesh.get_coordinate()
    used = [i for i, size in enumerate(kind.shape) if size > 1 or kind.names[i] == "ep"]
    if not any(kind.names[i] in ("ep_shard", "ep_replicate") for i in used):
        used = [kind.names.index("ep")]
    held = {}
    for n_experts in EXPERTS:
        where = f"{kind.name} E={n_experts} rank={dist.get_rank()} coord={coord}"
        start, end = oracle_mesh_range(kind, coord, n_experts)
        local = oracle_local(kind, coord, n_experts)
        weight = create_dtensor_from_local(local, mesh)

        assert isinstance(weight, DTensor), where
        assert weight.device_mesh.mesh_dim_names == tuple(kind.names[i] for i in used), where
        assert weight.placements == tuple(parse(kind.placements[i]) for i in used), where
        assert weight.shape == full(n_experts).shape, f"{where}: global shape {tuple(weight.shape)}"
        assert weight.stride() == full(n_experts).stride(), where
        assert storage(weight) == storage(local), f"{where}: create_dtensor_from_local copied"
        assert torch.equal(weight.full_tensor(),
                           full(n_experts)), f"{where}: rows land in the wrong place"

        assert validate_dtensor_expert_sharding(weight, n_experts, "w") is True
        sliced, got_start, got_end = get_expert_slice_for_rank(weight, n_experts)
        assert (got_start, got_end) == (start, end), f"{where}: slice {got_start}:{got_end}"
        assert storage(sliced) == storage(local)
        assert get_expert_range_for_rank_from_mesh(mesh, n_experts) == (start, end), where
        assert [e for e in range(n_experts)
                if should_load_expert_for_rank(e, mesh, n_experts)] == list(range(start, end)
        ), where
        assert split_experts_weights_dtensor_aware(weight,
                                                   n_experts)[1] == list(range(start, end)), where
        held[n_experts] = (start, end)
    check_coverage(kind, held)


@pytest.mark.moe_ep_world(4, backend="gloo")
def test_dcp_checkpoint_of_six_experts_on_four_ranks_holds_every_expert(
        moe_ep_shared_dir: Path) -> None:
    n_experts, path = 6, str(moe_ep_shared_dir / "e6-k4")
    mesh = device_mesh((4,), ("ep",))
    start, end = get_expert_range_for_rank_from_mesh(mesh, n_experts)
    assert (start, end) == [(0, 2), (2, 4), (4, 6), (6, 6)][dist.get_rank()]
    dcp.save({"w": create_dtensor_from_local(full(n_experts)[start:end].clone(), mesh)},
             checkpoint_id=path)
    dist.barrier()

    if dist.get_rank() == 0:  # load at EP=1: a plain tensor, no process group involved
        loaded = {"w": torch.zeros(n_experts, *INNER)}
        dcp.load(loaded, checkpoint_id=path, no_dist=True)
        assert torch.equal(loaded["w"], full(n_experts)), "an expert was lost between EP=4 and EP=1"

    # and at EP=2 (replicated twice): each rank gets exactly its new experts back
    mesh2 = device_mesh((2, 2), ("ep_replicate", "ep"))
    start2, end2 = get_expert_range_for_rank_from_mesh(mesh2, n_experts)
    target = create_dtensor_from_local(torch.zeros(end2 - start2, *INNER), mesh2)
    dcp.load({"w": target}, checkpoint_id=path)
    assert torch.equal(target.to_local(), full(n_experts)[start2:end2])


# ------------------------------------------------------------------------- errors on worlds


@pytest.mark.moe_ep_world(4, backend="gloo")
def test_balanced_split_is_refused_everywhere() -> None:
    """The "first E % k ranks get one more" split is what loses expert 5; every entry point says
    so."""
    n_experts, rank = 6, dist.get_rank()
    balanced = [(0, 2), (2, 4), (4, 5), (5, 6)][rank]
    local = full(n_experts)[balanced[0] : balanced[1]]
    mesh = device_mesh((4,), ("ep",))
    with pytest.raises(ValueError, match=r"expects \[2, 2, 2, 0\].*ranks \[2, 3\] disagree"):
        create_dtensor_from_local(local, mesh)

    wrong = DTensor.from_local(local, mesh, [Shard(0)], shape=full(n_experts).shape,
                               stride=(24, 6, 1))
    if rank in (2, 3):
        rows = {2: "1 expert rows but its placements .* give this rank 2",
                3: "1 expert rows .* give this rank 0"}
        with pytest.raises(ValueError, match=rows[rank]):
            get_expert_slice_for_rank(wrong, n_experts)
        with pytest.raises(ValueError, match=r"split other than torch\.chunk's"):
            validate_dtensor_expert_sharding(wrong, n_experts, "w")
        with pytest.raises(ValueError, match=r"split other than torch\.chunk's"):
            split_experts_weights_dtensor_aware(wrong, n_experts)
    else:
        assert get_expert_slice_for_rank(wrong, n_experts)[1:] == balanced


@pytest.mark.moe_ep_world(4, backend="gloo")
def test_create_dtensor_from_local_errors() -> None:
    rank = dist.get_rank()
    with pytest.raises(ValueError,
                       match=r"mesh dim 'dp' \(mesh dims \('dp', 'ep'\)\); allowed names are "
                                         r"\('ep', 'ep_shard', 'ep_replicate'\)"):
        create_dtensor_from_local(full(4), device_mesh((2, 2), ("dp", "ep")))
    with pytest.raises(ValueError, match="needs a mesh with dim names"):
        create_dtensor_from_local(full(4), DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    ep_shard = device_mesh((2, 2), ("ep", "ep_shard"))
    with pytest.raises(ValueError,
                       match=r"ep_shard shards dim 1, but local_tensor has shape \(2,\)"):
        create_dtensor_from_local(torch.zeros(2), ep_shard)
    # ep_shard splits dim 1 of 4 as 3, 1: not torch.chunk's 2, 2
    with pytest.raises(ValueError,
                       match=r"dim-1 sizes \[3, 1\] over the ep_shard group .* expects \[2, 2\]"):
        create_dtensor_from_local(torch.zeros(2, 3 if rank % 2 == 0 else 1, 6), ep_shard)
    ep = device_mesh((4,), ("ep",))
    with pytest.raises(ValueError,
                       match=r"local shapes over the ep group .* may differ only in dim 0"):
        create_dtensor_from_local(torch.zeros(1, 4, 6 + (rank == 1)), ep)
    with pytest.raises(ValueError,
                       match=r"the ep group \(global ranks \[0, 1, 2, 3\]\) holds no rows"):
        create_dtensor_from_local(torch.zeros(0, 4, 6), ep)
    replicated = device_mesh((2, 2), ("ep_replicate", "ep"))
    shapes = r"\[\(1, 4, 6\), \(2, 4, 6\)\]"
    with pytest.raises(ValueError,
                       match=rf"ep_replicate group \(global ranks \[(0, 2|1, 3)\]\) are {shapes}: "
                                         "ep_replicate replicates, so they must all be equal"):
        create_dtensor_from_local(torch.zeros(1 + (rank >= 2), 4, 6), replicated)
    with pytest.raises(TypeError, match="already a DTensor"):
        create_dtensor_from_local(create_dtensor_from_local(torch.zeros(1, 4, 6), ep), ep)


@pytest.mark.moe_ep_world(4, backend="gloo")
def test_mesh_and_placement_errors() -> None:
    dp_ep = device_mesh((2, 2), ("dp", "ep"))
    with pytest.raises(ValueError, match=r"no dim named 'tp'; its dims are \('dp', 'ep'\)"):
        get_submesh(dp_ep, ("tp",))
    with pytest.raises(ValueError, match="must not repeat"):
        get_submesh(dp_ep, ("ep", "ep"))
    with pytest.raises(TypeError, match="non-empty tuple of mesh dim names"):
        get_submesh(dp_ep, ())
    assert get_submesh(dp_ep, ("ep",)).mesh_dim_names == ("ep",)
    assert get_submesh(dp_ep, "ep").size() == 2
    unnamed = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    with pytest.raises(ValueError, match="the mesh has no dim names"):
        get_submesh(unnamed, ("ep",))
    with pytest.raises(ValueError,
                       match=r"dims \('dp', 'dp_shard'\) of shape \(2, 2\) and no 'ep' dim"):
        get_expert_range_for_rank_from_mesh(device_mesh((2, 2), ("dp", "dp_shard")), 4)
    with pytest.raises(ValueError, match="cannot tell which dim partitions"):
        should_load_expert_for_rank(0, device_mesh((2, 2), ("dp", "dp_shard")), 4)
    assert get_expert_range_for_rank_from_mesh(unnamed, 6) == expert_range(6, 4, dist.get_rank())
    with pytest.raises(ValueError, match="needs mesh dim names"):
        split_experts_weights_dtensor_aware(distribute_tensor(full(4), unnamed, [Replicate()]), 4)

    ep_shard = device_mesh((2, 2), ("ep", "ep_shard"))
    weight = create_dtensor_from_local(torch.zeros(2, 2, 6), ep_shard)
    assert validate_dtensor_expert_sharding(weight, 4, "w") is True  # (Shard(0), Shard(1)): valid
    with pytest.raises(ValueError, match=r"w global shape has 4 experts, expected 5"):
        validate_dtensor_expert_sharding(weight, 5, "w")
    with pytest.raises(ValueError,
                       match=r"experts_tensor has global shape \(4, 4, 6\): dim 0 holds 4"):
        get_expert_slice_for_rank(weight, 5)
    sharded_inner_on_ep = DTensor.from_local(torch.zeros(4, 2, 6), ep_shard,
                                             [Shard(1), Replicate()],
                                             shape=(4, 4, 6), stride=(24, 6, 1))
    with pytest.raises(ValueError,
                       match=r"w has unsupported DTensor placement: Shard\(dim=1\)\. The expert "
                                         r"mesh dim 0 must use Shard\(0\) or Replicate\(\)"):
        validate_dtensor_expert_sharding(sharded_inner_on_ep, 4, "w")
    partial = DTensor.from_local(torch.zeros(4, 4, 6), device_mesh((4,), ("tp",)), [Partial()])
    for call in (validate_dtensor_expert_sharding, get_expert_slice_for_rank,
                 split_experts_weights_dtensor_aware):
        with pytest.raises(ValueError,
                           match=r"has unsupported DTensor placement: Partial\(sum\)\. .*partial"):
            call(partial, 4)
    strided = DTensor.from_local(torch.zeros(2, 4, 6), device_mesh((2, 2), ("dp_shard", "ep")),
                                 [_StridedShard(0, split_factor=2), Shard(0)], shape=(8, 4, 6),
                                 stride=(24, 6, 1))
    with pytest.raises(ValueError,
                       match=r"unsupported DTensor placement: _StridedShard.*contiguous range"):
        get_expert_slice_for_rank(strided, 8)


@pytest.mark.moe_ep_world(2, backend="gloo")
def test_rank_outside_the_mesh_is_refused() -> None:
    mesh = DeviceMesh("cpu", torch.tensor([0]), mesh_dim_names=("ep",))
    weight = DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)], shape=(2, 3), stride=(3, 1))
    if dist.get_rank() == 1:
        with pytest.raises(ValueError, match="this rank is not part of the DTensor's device mesh"):
            get_expert_slice_for_rank(weight, 2)


@pytest.mark.moe_ep_world(1, backend="nccl")
def test_create_dtensor_from_local_moves_to_the_mesh_device() -> None:
    """Skipped without a GPU: the tensor follows the mesh's device type, not a guess."""
    mesh = device_mesh((1,), ("ep",))
    weight = create_dtensor_from_local(full(3), mesh)
    assert weight.to_local().device.type == "cuda"
    assert torch.equal(weight.full_tensor().cpu(), full(3))


# ---------------------------------------------------------------------- plain unit tests


def test_plain_tensors_hold_every_expert_without_copies() -> None:
    weight = full(5)
    local, start, end = get_expert_slice_for_rank(weight, 5)
    assert local is weight and (start, end) == (0, 5)
    experts, ids = split_experts_weights_dtensor_aware(weight, 5)
    assert ids == [0, 1, 2, 3, 4]
    for i, expert in enumerate(experts):
        assert storage(expert) == storage(weight) and torch.equal(expert, weight[i])
    assert validate_dtensor_expert_sharding(weight, 5) is True
    assert not is_dtensor(weight)


def test_no_mesh_means_one_rank_with_everything() -> None:
    weight = full(3)
    assert create_dtensor_from_local(weight, None) is weight
    assert get_expert_range_for_rank_from_mesh(None, 7) == (0, 7)
    assert all(should_load_expert_for_rank(e, None, 7) for e in range(7))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: get_expert_slice_for_rank(full(2), 0), ValueError,
         "n_experts must be an int >= 1, got 0"),
        (lambda: get_expert_slice_for_rank(full(2), 2.0), ValueError,
         "n_experts must be an int >= 1"),
        (lambda: get_expert_slice_for_rank(full(2), 3), ValueError,
         r"experts_tensor has shape \(2, 4, 6\): dim 0 holds 2 experts, expected n_experts=3"),
        (lambda: get_expert_slice_for_rank([1, 2], 2), TypeError,
         "must be a torch.Tensor or DTensor, got list"),
        (lambda: get_expert_slice_for_rank(torch.tensor(1.0), 1), ValueError, "0-dim tensor"),
        (lambda: split_experts_weights_dtensor_aware(full(2), -1), ValueError,
         "n_experts must be an int >= 1"),
        (lambda: split_experts_weights_dtensor_aware(full(2), 4), ValueError,
         "expected n_experts=4"),
        (lambda: split_experts_weights_dtensor_aware(None, 4), TypeError, "got NoneType"),
        (lambda: validate_dtensor_expert_sharding(full(2), 3, "moe.w1"), ValueError,
         "moe.w1 has shape 2 experts, expected 3"),
        (lambda: validate_dtensor_expert_sharding(full(2), 0), ValueError,
         "expected_experts must be an int >= 1"),
        (lambda: validate_dtensor_expert_sharding("w", 2), TypeError, "got str"),
        (lambda: create_dtensor_from_local(full(2), "ep"), TypeError,
         "DeviceMesh or None, got str"),
        (lambda: create_dtensor_from_local(3, None), None, None),
        (lambda: get_expert_range_for_rank_from_mesh(None, 0), ValueError,
         "n_experts must be an int >= 1"),
        (lambda: get_expert_range_for_rank_from_mesh(4, 4), TypeError,
         "DeviceMesh or None, got int"),
        (lambda: should_load_expert_for_rank(7, None, 7), ValueError,
         r"expert_id must be an int in \[0, 7\)"),
        (lambda: should_load_expert_for_rank(-1, None, 7), ValueError,
         r"expert_id must be an int in \[0, 7\)"),
        (lambda: should_load_expert_for_rank(0, None, 0), ValueError,
         "n_experts must be an int >= 1"),
        (lambda: get_submesh(None, ("ep",)), TypeError, "DeviceMesh or None, got NoneType"),
        (lambda: _get_expert_mesh_dim_index(full(2)), TypeError, "expected a DTensor, got Tensor"),
    ],
)
def test_bad_input_says_what_was_expected(call, error: type[Exception] | None,
                                          match: str | None) -> None:
    if error is None:  # a None mesh hands back whatever it was given, untouched
        assert call() == 3
        return
    with pytest.raises(error, match=match):
        call()

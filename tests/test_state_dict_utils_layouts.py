"""reference_impl.state_dict_utils on the parallel-layout meshes: 3-D/4-D, EP groups strided and
consecutive, etp.

The mesh is :meth:`conformance.layout.ParallelLayout.build_mesh`'s (dims dp_replicate, ep, dp_shard,
etp, every one present).  DTensors under test are made by ``distribute_tensor``; the expected rows
come from the layout rule applied to the rank's coordinates, which the layout gives, never from the
code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from conformance.layout import ParallelLayout
from reference_impl.layout import expert_range
from reference_impl.state_dict_utils import (
    _get_expert_mesh_dim_index,
    create_dtensor_from_local,
    get_expert_range_for_rank_from_mesh,
    get_expert_slice_for_rank,
    get_submesh,
    should_load_expert_for_rank,
    split_experts_weights_dtensor_aware,
    validate_dtensor_expert_sharding,
)

INNER = (4, 6)  # the etp shard is axis 2: 6 over 2 ranks
EXPERTS = (1, 2, 3, 5, 6, 8)

LAYOUTS = [
    pytest.param(layout, marks=pytest.mark.moe_ep_world(layout.world_size), id=name)
    for name, layout in {
        "ep2": ParallelLayout.for_world(4, 2),
        "ep2c": ParallelLayout.for_world(4, 2, ep_order="consecutive"),
        "ep4": ParallelLayout.for_world(4, 4),
        "ep2.hsdp2": ParallelLayout.for_world(4, 2, dp_replicate=2),
        "ep1.etp2": ParallelLayout.for_world(4, 1, etp=2),
        "ep2.etp2": ParallelLayout.for_world(4, 2, etp=2),
            "ep2c.etp2.8": ParallelLayout.for_world(8, 2, etp=2, ep_order="consecutive"),
    }.items()
]


def full(n_experts: int) -> torch.Tensor:
    return torch.arange(n_experts * math.prod(INNER),
                        dtype=torch.float32).reshape(n_experts, *INNER)


def _placements(layout: ParallelLayout, nested: bool) -> list:
    """(dp_replicate, ep, dp_shard, etp): EP rows, FSDP nesting them over dp_shard, etp on the
    hidden axis."""
    return [Replicate(), Shard(0), Shard(0) if nested else Replicate(),
            Shard(2) if layout.etp > 1 else Replicate()]


@pytest.mark.parametrize("nested", [False, True], ids=["ep-only", "fsdp-nested"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_nine_functions_on_layout_meshes(layout: ParallelLayout, nested: bool) -> None:
    mesh = layout.build_mesh()
    rank = dist.get_rank()
    coords = layout.coordinates(rank)
    held = {}
    for n_experts in EXPERTS:
        where = f"{layout.fragment} nested={nested} E={n_experts} rank {rank} coords {coords}"
        ep_range = expert_range(n_experts, layout.ep, coords["ep"])
        start, end = ep_range
        if nested and end > start:
            lo, hi = expert_range(end - start, layout.dp_shard, coords["dp_shard"])
            start, end = start + lo, start + hi
        if end == start:
            start = end = n_experts
        lo, hi = expert_range(INNER[1], layout.etp, coords["etp"])
        expected_local = full(n_experts)[start:end, :, lo:hi]

        weight = distribute_tensor(full(n_experts), mesh, _placements(layout, nested),
                                   src_data_rank=None)
        assert _get_expert_mesh_dim_index(weight) == 1, where
        local, got_start, got_end = get_expert_slice_for_rank(weight, n_experts)
        assert (got_start, got_end) == (start, end), f"{where}: slice {got_start}:{got_end}"
        assert torch.equal(local, expected_local), f"{where}: local tensor"
        assert validate_dtensor_expert_sharding(weight, n_experts, "w") is True
        experts, ids = split_experts_weights_dtensor_aware(weight, n_experts)
        assert ids == list(range(start, end)), f"{where}: split ids {ids}"
        # The dims that do not split the expert axis stay (size > 1 only), Shard(d) becoming
        # Shard(d - 1).
        placements = _placements(layout, nested)
        remaining = [i for i, p in enumerate(placements) if p != Shard(0)
                     and layout.mesh_shape[i] > 1]
        for expert, g in zip(experts, ids, strict=True):
            if remaining:
                assert isinstance(expert, DTensor), f"{where}: expert {g} is not a DTensor"
                assert (expert.device_mesh.mesh_dim_names
                        == tuple(mesh.mesh_dim_names[i] for i in remaining)), where
                assert (expert.placements
                        == tuple(Shard(1) if placements[i] == Shard(2) else Replicate()
                                 for i in remaining)), f"{where}: {expert.placements}"
                assert torch.equal(expert.full_tensor(), full(n_experts)[g]), f"{where}: expert {g}"
            else:
                assert torch.equal(expert, full(n_experts)[g]), f"{where}: expert {g}"

        assert get_expert_range_for_rank_from_mesh(mesh, n_experts) == ep_range, where
        loads = [e for e in range(n_experts) if should_load_expert_for_rank(e, mesh, n_experts)]
        assert loads == list(range(*ep_range)), f"{where}: should_load picks {loads}"
        held[n_experts] = (start, end)

    group = sorted(dist.get_process_group_ranks(get_submesh(mesh, ("ep",)).get_group()))
    assert group in layout.ep_groups() and rank in group, f"rank {rank}: ep submesh {group}"
    everyone: list[dict[int, tuple[int, int]]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, held)
    copies = layout.world_size // layout.ep // (layout.dp_shard if nested else 1)
    for n_experts in EXPERTS:  # every expert held once per replica (and per etp shard)
        count = [sum(start <= e < end for start, end in (r[n_experts] for r in everyone))
                 for e in range(n_experts)]
        assert count == [copies] * n_experts, f"{layout.fragment} E={n_experts}: {count}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_create_dtensor_from_local_on_layout_meshes(layout: ParallelLayout) -> None:
    mesh = layout.build_mesh()
    coords = layout.coordinates(dist.get_rank())
    for n_experts in EXPERTS:
        start, end = expert_range(n_experts, layout.ep, coords["ep"])
        lo, hi = expert_range(INNER[1], layout.etp, coords["etp"])
        local = full(n_experts)[start:end, :, lo:hi].clone()
        weight = create_dtensor_from_local(local, mesh, etp_dim=2)
        where = f"{layout.fragment} E={n_experts} coords {coords}"
        kept = tuple(n for n, size in zip(mesh.mesh_dim_names, layout.mesh_shape, strict=True)
                     if n == "ep" or size > 1)
        assert weight.device_mesh.mesh_dim_names == kept, f"{where}: mesh {weight.device_mesh}"
        assert weight.shape == full(n_experts).shape, f"{where}: global shape {tuple(weight.shape)}"
        assert weight.to_local().data_ptr() == local.data_ptr(), f"{where}: copied"
        assert torch.equal(weight.full_tensor(),
                           full(n_experts)), f"{where}: rows land in the wrong place"
        assert get_expert_slice_for_rank(weight, n_experts)[1:] == (start, end), where
    if layout.etp > 1:
        with pytest.raises(ValueError, match=r"etp dim \(size 2\) splits each expert's hidden "
                           r"axis; pass etp_dim"):
            create_dtensor_from_local(full(2), mesh)

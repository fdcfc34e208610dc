"""ParallelLayout, the one owner of a cell's rank layout: degrees, EP order, names, groups, and its
real mesh."""

from __future__ import annotations

import pytest

from conformance.layout import LayoutError, ParallelLayout

LAYOUTS = [ParallelLayout.for_world(4, 2), ParallelLayout.for_world(4, 2, ep_order="consecutive"),
           ParallelLayout.for_world(4, 4), ParallelLayout.for_world(4, 2, dp_replicate=2),
           ParallelLayout.for_world(4, 2, etp=2), ParallelLayout.for_world(4, 1)]


def test_ep_groups_strided_and_consecutive() -> None:
    assert ParallelLayout.for_world(4, 2).ep_groups() == [[0, 2], [1, 3]]
    assert ParallelLayout.for_world(4, 2, ep_order="consecutive").ep_groups() == [[0, 1], [2, 3]]
    assert ParallelLayout.for_world(8, 2, etp=2).groups("etp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert (ParallelLayout.for_world(8, 4, ep_order="consecutive").ep_groups()
            == [[0, 1, 2, 3], [4, 5, 6, 7]])


def test_replica_groups_hold_one_copy_each() -> None:
    layout = ParallelLayout.for_world(4, 2)
    assert layout.replica_groups(fsdp=False) == [[0, 2], [1, 3]]
    assert layout.replica_groups(fsdp=True) == [[0, 1, 2, 3]]
    hsdp = ParallelLayout.for_world(4, 2, dp_replicate=2)
    assert hsdp.replica_groups(fsdp=True) == [[0, 1], [2, 3]]


def test_names_and_keywords() -> None:
    assert [lay.fragment for lay in LAYOUTS] == ["ep2", "ep2c", "ep4", "ep2.hsdp2", "ep2.etp2",
                                                 "ep1"]
    consecutive = ParallelLayout.for_world(4, 2, ep_order="consecutive")
    assert {"ep2", "consecutive", "dp_shard2", "etp1"} <= consecutive.keywords()
    assert "hsdp" in ParallelLayout.for_world(4, 2, dp_replicate=2).keywords()
    assert (ParallelLayout.for_world(4, 2).describe()
            == "ep=2 (strided EP groups), etp=1, dp_shard=2, dp_replicate=1")


def test_one_name_for_one_layout() -> None:
    # ep=1 and dp_shard=1 leave no choice of ranks: both orders are one layout, named once.
    assert ParallelLayout.for_world(4, 4, ep_order="consecutive") == ParallelLayout.for_world(4, 4)
    assert ParallelLayout.for_world(4, 1, ep_order="consecutive").fragment == "ep1"
    assert not ParallelLayout.for_world(4, 2, dp_replicate=2).order_matters


@pytest.mark.parametrize(("call", "field"), [
    (lambda: ParallelLayout.for_world(4, 3), "ep"),
    (lambda: ParallelLayout.for_world(4, 2, etp=4), "ep"),
    (lambda: ParallelLayout(ep=0), "ep"),
    (lambda: ParallelLayout(ep=True), "ep"),
    (lambda: ParallelLayout(ep=2, ep_order="diagonal"), "ep_order"),
    (lambda: ParallelLayout.for_world(0, 1), "world_size"),
    (lambda: ParallelLayout.for_world(4, 2).coordinates(9), "rank"),
])
def test_bad_layouts_are_refused_with_the_field(call: object, field: str) -> None:
    with pytest.raises(LayoutError) as info:
        call()  # type: ignore[operator]
    assert info.value.field == field and "expected" in str(info.value)


@pytest.mark.moe_ep_world(4)
def test_the_mesh_has_the_layouts_groups() -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    for layout in LAYOUTS:
        mesh = layout.build_mesh()
        assert mesh.mesh_dim_names == ("dp_replicate", "ep", "dp_shard", "etp")
        coords = layout.coordinates(rank)
        for dim in ("ep", "dp_shard", "etp", "dp_replicate"):
            group = sorted(dist.get_process_group_ranks(mesh[dim].get_group()))
            assert group in layout.groups(dim), (layout, dim, group)
            assert mesh[dim].get_local_rank() == coords[dim], (layout, dim)


def test_pipeline_stages_are_the_outermost_dim() -> None:
    layout = ParallelLayout.for_world(4, 2, pp=2)
    assert (layout.fragment, layout.dp_shard, layout.stage_size) == ("pp2.ep2", 1, 2)
    assert [layout.stage_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert (layout.stage_ranks() == [[0, 1], [2, 3]]
            and ParallelLayout.for_world(4, 2).stage_ranks() == [[0, 1, 2, 3]])
    assert layout.ep_groups() == [[0, 1], [2, 3]]  # EP groups within a stage
    assert layout.replica_groups(fsdp=False) == [[0, 1, 2, 3]]  # one copy spans both stages
    assert [layout.layers_of(r, 3) for r in range(4)] == [(0, 2), (0, 2), (2, 3), (2, 3)]
    assert ParallelLayout.for_world(4, 1, pp=2).replica_groups(fsdp=False) == [[0, 2], [1, 3]]
    assert {"pp2", "save_pp2"} - ParallelLayout.for_world(4, 1, pp=2).keywords() == {"save_pp2"}
    assert "pp=2, ep=2" in layout.describe() and layout.mesh_dims[0] == "pp"
    assert ParallelLayout.for_world(4, 2).mesh_dims == ("dp_replicate", "ep", "dp_shard", "etp")
    with pytest.raises(LayoutError) as info:
        ParallelLayout.for_world(4, 4, pp=2)
    assert info.value.field == "ep"


@pytest.mark.moe_ep_world(4)
def test_a_pipeline_mesh_has_the_stage_groups() -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    for layout in (ParallelLayout.for_world(4, 2, pp=2), ParallelLayout.for_world(4, 1, pp=2)):
        mesh = layout.build_mesh()
        assert mesh.mesh_dim_names == ("pp", "dp_replicate", "ep", "dp_shard", "etp")
        for dim in ("pp", "ep", "dp_shard"):
            group = sorted(dist.get_process_group_ranks(mesh[dim].get_group()))
            assert group in layout.groups(dim), (layout, dim, group)
            assert mesh[dim].get_local_rank() == layout.coordinates(rank)[dim], (layout, dim)

"""An :class:`~conformance.adapter.ExpertBlock` reads as exactly the rows it stands for.

The reference yields each packed weight and moment as one block (at 256 experts a DTensor per row
was most of a cell's checks).  The harness expands a block in one place
(:func:`conformance.checks.held.held_tensors`, on :func:`reference_impl.regions.block_region`);
these tests hold it to the per-row path it replaced (:func:`reference_impl.regions.packed_rows` and
:func:`~reference_impl.regions.local_region` of each row) in real 4-rank worlds: plain rows,
expert-TP rows (a region of each expert), FSDP2 and HSDP shards of the expert axis, an empty rank at
E=6, ep=4.  The build-side block fills (weights, gradients) are held to their per-expert draws.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conformance.adapter import ExpertBlock, Spec
from conformance.adapters.reference import ReferenceAdapter
from conformance.checks.held import held_tensors
from conformance.checks.layout import reported
from conformance.layout import ParallelLayout
from conformance.synthetic import synthetic_grad, synthetic_grad_rows
from reference_impl.moe import MoEConfig, build_model, moe_layers
from reference_impl.regions import block_region, local_region, packed_rows

WORLD = 4

LAYOUTS = {
    "ep2": (ParallelLayout.for_world(WORLD, 2), False, 4),
    "ep4-E6": (ParallelLayout.for_world(WORLD, 4), False, 6),
    "ep2.etp2": (ParallelLayout.for_world(WORLD, 2, etp=2), False, 4),
    "ep2.hsdp2-fsdp": (ParallelLayout.for_world(WORLD, 2, dp_replicate=2), True, 4),
    "ep2.etp2-fsdp": (ParallelLayout.for_world(WORLD, 2, etp=2), True, 6),
    "ep1-fsdp": (ParallelLayout.for_world(WORLD, 1), True, 4),
}


def _per_row(adapter: ReferenceAdapter, model: object, optimizer: object) -> dict[tuple, tuple]:
    """What the per-row path gave before blocks: a tensor per expert through packed_rows, read by
    local_region."""
    out = {}
    for entry in adapter.expert_tensors(model, optimizer):
        if not isinstance(entry, ExpertBlock):
            local, region = local_region(entry[3])
            out[(entry[0], entry[1], entry[2])] = (local, region)
            continue
        for g, row in packed_rows(entry.tensor, entry.first):
            local, region = local_region(row)
            out[(entry.layer, g, entry.name)] = (local, region)
    return out


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_a_block_reads_as_its_rows_did_at_every_layout(case: str) -> None:
    layout, fsdp, num_experts = LAYOUTS[case]
    adapter = ReferenceAdapter()
    spec = Spec(num_experts=num_experts, kind="packed", optimizer_steps=1, fsdp=fsdp, layout=layout)
    model, optimizer = adapter.build(spec, layout.build_mesh(), seed=3)
    blocks = [e for e in adapter.expert_tensors(model, optimizer) if isinstance(e, ExpertBlock)]
    assert blocks, "the reference yields its packed weights as blocks"
    want = _per_row(adapter, model, optimizer)
    got = {(h.layer, h.expert, h.name): (h.local, h.region)
           for h in held_tensors(adapter.expert_tensors(model,
                                                        optimizer))}
    assert got.keys() == want.keys(), f"{case}: keys {sorted(got.keys() ^ want.keys())[:4]} differ"
    for key, (local, region) in got.items():
        assert region == want[key][1], f"{case}: {key} region {region}, per row {want[key][1]}"
        assert torch.equal(local, want[key][0]), f"{case}: {key} values differ from its row's"
    copies = {(h.layer, h.expert, h.name): h.local
              for h in held_tensors(adapter.expert_tensors(model, optimizer),
                                    copy=True)}
    assert all(torch.equal(copies[k], v[0]) and copies[k].data_ptr() != v[0].data_ptr()
               for k, v in got.items())
    ids = {k[1] for k in want if k[1] is not None}
    assert reported(adapter, model, optimizer)[1] == tuple(sorted(ids))


@pytest.mark.moe_ep_world(WORLD)
def test_a_block_on_a_rank_with_no_experts_holds_no_rows() -> None:
    layout = ParallelLayout.for_world(WORLD, 4)
    adapter = ReferenceAdapter()
    spec = Spec(num_experts=3, kind="packed", layout=layout)
    model, _ = adapter.build(spec, layout.build_mesh(), seed=3)
    held = list(held_tensors(adapter.expert_tensors(model, None)))
    ep_rank = layout.coordinates(torch.distributed.get_rank())["ep"]
    assert {h.expert for h in held} == ({ep_rank} if ep_rank < 3 else set())


def test_block_region_of_a_plain_chunk_starts_at_its_first_expert() -> None:
    chunk = torch.arange(24.0).reshape(3, 2, 4)
    local, first, region = block_region(chunk, 5)
    assert local is chunk and first == 5 and region is None
    rows = list(held_tensors([ExpertBlock(0, 5, "up", chunk)]))
    assert [(h.expert, h.region) for h in rows] == [(5, None), (6, None), (7, None)]
    assert all(torch.equal(h.local, chunk[i]) for i, h in enumerate(rows))


@pytest.mark.parametrize("num_experts", [4, 6])
def test_a_packed_build_fills_each_row_as_its_unpacked_expert(num_experts: int) -> None:
    config = MoEConfig(num_experts=num_experts, kind="packed")
    packed = dict(moe_layers(build_model(config, 2, seed=11)))
    unpacked = dict(moe_layers(build_model(replace(config, kind="unpacked"), 2, seed=11)))
    for name, moe in packed.items():
        for g in range(num_experts):
            for linear in ("gate", "up", "down"):
                assert torch.equal(moe.expert_weight(g, linear),
                                   unpacked[name].expert_weight(g, linear)), (name, g, linear)


def test_gradient_rows_are_each_experts_own_gradient() -> None:
    block = synthetic_grad_rows(7, 1, 0, range(2, 6), "up", (3, 5))
    assert block.shape == (4, 3, 5)
    for i, g in enumerate(range(2, 6)):
        assert torch.equal(block[i], synthetic_grad(7, 1, 0, g, "up", (3, 5)))
    block.zero_()  # a copy: the kept block is not changed through it
    assert torch.equal(synthetic_grad_rows(7, 1, 0, range(2, 6), "up", (3, 5))[0],
                       synthetic_grad(7, 1, 0, 2, "up",
                                      (3, 5)))
    assert synthetic_grad_rows(7, 1, 0, range(4, 4), "up", (3, 5)).shape == (0, 3, 5)


def test_gradient_rows_under_any_ranges_are_the_experts_own_draws() -> None:
    """Rows are kept per expert whatever range asked first (a quarter, then all, then a half across
    both): each is the draw of its own seed, as ``synthetic_tensor`` makes it, and a single expert's
    gradient is its row."""
    from conformance.synthetic import synthetic_tensor

    for experts in (range(8, 12), range(0, 16), range(6, 14), range(15, 16)):
        block = synthetic_grad_rows(9, 2, 1, experts, "down", (4, 3))
        for i, g in enumerate(experts):
            assert torch.equal(block[i],
                               synthetic_tensor((4, 3), "grad", 9, 2, 1, g, "down")), (experts, g)
    synthetic_grad(9, 2, 1, 3, "down", (4, 3)).fill_(1.0)  # a copy too
    assert torch.equal(synthetic_grad_rows(9, 2, 1, range(3, 4), "down", (4, 3))[0],
                       synthetic_tensor((4, 3), "grad", 9, 2, 1, 3, "down"))
    # not a step-1 range
    assert synthetic_grad_rows(9, 2, 1, range(3, 0, -1), "down", (4, 3)).shape == (3, 4, 3)
    # layer None: the seed's repr
    outside = synthetic_grad_rows(9, 2, None, range(0, 3), "shared.up", (4, 3))
    assert all(torch.equal(outside[g], synthetic_tensor((4, 3), "grad", 9, 2, None, g, "shared.up"))
               for g in range(3))

"""The reference MoE: both expert forms agree, weights depend only on global identity, EP and FSDP2
split it right.

The single-process tests pin the model itself; the 4-rank tests show that after
``apply_expert_parallel`` (and FSDP2 over dp_shard) a rank holds exactly its experts under the
layout rule, and that forward and backward still give the ep=1 model's output and gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from conformance.layout import ParallelLayout
from pytest_moe_ep.world.meshes import device_mesh
from reference_impl.layout import expert_range
from reference_impl.moe import (
    HIDDEN_AXIS,
    MoEConfig,
    MoEMLP,
    apply_expert_parallel,
    apply_fsdp,
    build_model,
    stable_seed,
)
from reference_impl.regions import global_regions, local_region

WORLD = 4


class _NamedOnly:
    """Stands in for a DeviceMesh where only the dimension names are read."""

    def __init__(self, *names: str) -> None:
        self.mesh_dim_names = names


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("shared_expert", [True, False])
def test_packed_and_unpacked_give_the_same_output(activation: str, shared_expert: bool) -> None:
    kw: dict[str, Any] = {"activation": activation, "shared_expert": shared_expert, "top_k": 3}
    unpacked = build_model(MoEConfig(kind="unpacked", **kw), 2, seed=5)
    packed = build_model(MoEConfig(kind="packed", **kw), 2, seed=5)
    x = torch.randn(4, 9, 32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpacked(x), packed(x))
    for layer in range(2):
        u, p = unpacked.layers[layer].moe, packed.layers[layer].moe
        for g in range(6):
            for linear in ("gate", "up", "down") if activation == "swiglu" else ("up", "down"):
                assert torch.equal(u.expert_weight(g, linear),
                                   p.expert_weight(g, linear)), (layer, g, linear)


def test_state_dict_names() -> None:
    unpacked = build_model(MoEConfig(kind="unpacked", activation="gelu"), 1).state_dict()
    packed = build_model(MoEConfig(kind="packed"), 1).state_dict()
    assert ("layers.0.moe.experts.5.up.weight" in unpacked
            and "layers.0.moe.experts.0.gate.weight" not in unpacked)
    assert {k: tuple(v.shape) for k, v in packed.items() if k.endswith("_w")} == {
        "layers.0.moe.gate_w": (6, 64, 32), "layers.0.moe.up_w": (6, 64, 32),
        "layers.0.moe.down_w": (6, 32, 64)}


def test_init_is_a_function_of_seed_layer_and_expert_only() -> None:
    a = build_model(MoEConfig(num_experts=6), 2, seed=1)
    again = build_model(MoEConfig(num_experts=6), 2, seed=1).state_dict()
    assert all(torch.equal(v, again[k]) for k, v in a.state_dict().items())
    # Another E, top_k or number of layers leaves expert g of layer i as it is.
    b = build_model(MoEConfig(num_experts=9, top_k=1), 3, seed=1)
    for g in range(6):
        assert torch.equal(a.layers[1].moe.experts[g].up.weight,
                           b.layers[1].moe.experts[g].up.weight), g
    assert torch.equal(a.layers[0].moe.shared.up.weight, b.layers[0].moe.shared.up.weight)
    # ... while another seed, layer or expert changes it.
    c = build_model(MoEConfig(num_experts=6), 2, seed=2)
    assert not torch.equal(a.layers[1].moe.experts[0].up.weight,
                           c.layers[1].moe.experts[0].up.weight)
    assert not torch.equal(a.layers[0].moe.experts[0].up.weight,
                           a.layers[1].moe.experts[0].up.weight)
    assert not torch.equal(a.layers[0].moe.experts[0].up.weight,
                           a.layers[0].moe.experts[1].up.weight)


def test_stable_seed_does_not_use_python_hash() -> None:
    assert stable_seed(0, "layers.0.moe", "expert", 3,
                       "up") == stable_seed(0, "layers.0.moe", "expert", 3, "up")
    assert stable_seed(0, "a") != stable_seed(0, "b")
    # pinned: the same in every process, forever
    assert stable_seed(0, "layers.0.moe") == 4989160234143381662
    assert 0 <= stable_seed("x") < 2**63


def test_bf16_and_meta_builds() -> None:
    model = build_model(MoEConfig(kind="packed", dtype=torch.bfloat16), 1)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.device("meta"):
        meta = build_model(MoEConfig(num_experts=16, dim=7168, hidden=2048), 1)
    assert meta.layers[0].moe.experts[15].down.weight.is_meta


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="kind"):
        MoEConfig(kind="grouped")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="activation"):
        MoEConfig(activation="relu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(num_experts=2, top_k=3)


def test_without_an_ep_dimension_nothing_is_split() -> None:
    model = build_model(MoEConfig(), 1)
    assert apply_expert_parallel(model, _NamedOnly("dp_shard")) is model
    moe = model.layers[0].moe
    assert (moe.ep_world_size, moe.num_local_experts, len(moe.experts)) == (1, 6, 6)
    with pytest.raises(ValueError, match="dp_shard"):
        apply_fsdp(model, _NamedOnly("ep"))


# ---------------------------------------------------------------- 4-rank worlds


def _mesh(ep: int) -> Any:
    return device_mesh((ep, WORLD // ep), ("ep", "dp_shard"))


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("kind", ["unpacked", "packed"])
def test_a_rank_keeps_exactly_its_experts(kind: str, ep: int) -> None:
    config = MoEConfig(num_experts=6, kind=kind)  # type: ignore[arg-type]
    full = build_model(config, 2, seed=7)
    model = apply_expert_parallel(build_model(config, 2, seed=7), _mesh(ep))
    ep_rank = dist.get_rank() // (WORLD // ep)
    start, end = expert_range(6, ep, ep_rank)
    for i in range(2):
        moe, ref = model.layers[i].moe, full.layers[i].moe
        where = f"{kind} ep={ep} rank {dist.get_rank()} layer {i}"
        assert (moe.num_experts, moe.ep_world_size, moe.ep_rank) == (6, ep, ep_rank), where
        assert (moe.local_expert_start, moe.num_local_experts) == (start, end - start), where
        assert (moe.ep_mesh is None) == (ep == 1), where
        if ep > 1:
            assert moe.ep_mesh.size() == ep and moe.ep_mesh.get_local_rank() == ep_rank, where
        held = len(moe.experts) if kind == "unpacked" else moe.up_w.shape[0]
        assert held == end - start, f"{where}: holds {held} experts, expected {end - start}"
        for j in range(end - start):
            for linear in ("gate", "up", "down"):
                assert torch.equal(
                    moe.expert_weight(j, linear),
                    ref.expert_weight(start + j, linear)), (f"{where}: local expert {j} {linear} "
                                                            f"is not global expert {start + j}")
        assert torch.equal(moe.router.weight, ref.router.weight), where
    if ep == 4 and dist.get_rank() == 3:
        assert model.layers[0].moe.num_local_experts == 0


def ep1_reference(config: MoEConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                              dict[str, Any]]:
    """The batch, the loss weights, and the ep=1 model's output and gradients every split must
    reproduce."""
    gen = torch.Generator().manual_seed(11)
    x, weight = torch.randn(3, 8, 32, generator=gen), torch.randn(3, 8, 32, generator=gen)
    ref = build_model(config, 2, seed=4)
    ref_out = ref(x)
    (ref_out * weight).sum().backward()
    return x, weight, ref_out, {name: p.grad for name, p in ref.named_parameters()}


FORWARD_CASES = [(fsdp, e, ep) for fsdp in (False, True)
                 for e, ep in [(6, 1), (6, 2), (6, 4), (3, 2), (2, 2)]
                 if fsdp or ep > 1]  # ep=1 without FSDP is the reference itself


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize(("fsdp", "num_experts", "ep"), FORWARD_CASES)
@pytest.mark.parametrize("kind", ["unpacked", "packed"])
def test_forward_and_backward_match_ep1(kind: str, fsdp: bool, num_experts: int, ep: int) -> None:
    """EP (and FSDP2, including ranks with zero rows) gives ep=1's output and gradients."""
    config = MoEConfig(num_experts=num_experts, kind=kind, top_k=2)  # type: ignore[arg-type]
    x, weight, ref_out, ref_grads = ep1_reference(config)

    model = apply_expert_parallel(build_model(config, 2, seed=4), _mesh(ep))
    if fsdp:
        apply_fsdp(model, _mesh(ep))
    out = model(x)
    (out * weight).sum().backward()
    where = f"{kind} E={num_experts} ep={ep} fsdp={fsdp} rank {dist.get_rank()}"
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{where} output: {m}")
    for piece in global_regions(model):
        grad = piece.param.grad
        if grad is None:  # an expert no token reached (or none held) has no gradient at ep=1 either
            assert ref_grads[piece.name] is None or not ref_grads[piece.name][piece.region].any(), (
                f"{where}: {piece.name} got no gradient")
            continue
        got = grad.to_local() if fsdp else grad
        torch.testing.assert_close(got, ref_grads[piece.name][piece.region], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=piece.name: f"{where}: gradient of {n}: {m}")


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize(("num_experts", "ep", "rows"), [
    (6, 4, [2, 2, 2, 0]),   # E=6 at ep=4: the last EP rank holds nothing (dp_shard=1)
    (6, 1, [2, 2, 2, 0]),   # FSDP2 over 4 ranks of 6 rows: torch.chunk gives 2, 2, 2 and padding
    (3, 2, [1, 1, 1, 0]),   # ep rank 1 holds 1 row for 2 dp_shard ranks
    (2, 2, [1, 0, 1, 0]),   # every ep rank holds fewer rows than dp_shard ranks
])
def test_fsdp2_shards_packed_rows_with_torch_chunk(num_experts: int, ep: int,
                                                   rows: list[int]) -> None:
    config = MoEConfig(num_experts=num_experts, kind="packed")
    model = apply_fsdp(apply_expert_parallel(build_model(config, 1), _mesh(ep)), _mesh(ep))
    moe = model.layers[0].moe
    assert isinstance(moe, MoEMLP)
    local = moe.up_w.to_local()
    assert local.shape[0] == rows[dist.get_rank()], (f"rank {dist.get_rank()} holds "
                                                     f"{local.shape[0]} rows")
    piece = next(p for p in global_regions(model) if p.name == "layers.0.moe.up_w")
    ref = build_model(config, 1).layers[0].moe.up_w
    assert torch.equal(local, ref[piece.region]), f"rank {dist.get_rank()}: rows {piece.region[0]}"


# ---------------------------------------------------------------- every ParallelLayout on 4 ranks

#: the rank layouts of the matrix on 4 ranks: EP groups strided and consecutive, HSDP, expert TP.
LAYOUTS = {
    "ep1": ParallelLayout.for_world(WORLD, 1),
    "ep2": ParallelLayout.for_world(WORLD, 2),
    "ep2c": ParallelLayout.for_world(WORLD, 2, ep_order="consecutive"),
    "ep4": ParallelLayout.for_world(WORLD, 4),
    "ep2.hsdp2": ParallelLayout.for_world(WORLD, 2, dp_replicate=2),
    "ep1.hsdp2": ParallelLayout.for_world(WORLD, 1, dp_replicate=2),
    "ep1.etp2": ParallelLayout.for_world(WORLD, 1, etp=2),
    "ep2.etp2": ParallelLayout.for_world(WORLD, 2, etp=2),
    "ep2c.etp2": ParallelLayout.for_world(WORLD, 2, etp=2, ep_order="consecutive"),
}


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", ["unpacked", "packed"])
def test_every_layout_keeps_its_experts_and_hidden_shard(kind: str, layout: str) -> None:
    """The EP rank is the ``ep`` coordinate (not the global rank); etp splits each expert's hidden
    axis."""
    spec = LAYOUTS[layout]
    rank = dist.get_rank()
    coords = spec.coordinates(rank)
    config = MoEConfig(num_experts=6, kind=kind, hidden=10)  # type: ignore[arg-type]  # 10 % 4 != 0
    full = build_model(config, 1, seed=7).layers[0].moe
    moe = apply_expert_parallel(build_model(config, 1, seed=7), spec.build_mesh()).layers[0].moe
    start, end = expert_range(6, spec.ep, coords["ep"])
    where = f"{kind} {layout} rank {rank} coords {coords}"
    assert (moe.ep_rank, moe.local_expert_start,
            moe.num_local_experts) == (coords["ep"], start, end - start), where
    assert moe.etp_world_size == spec.etp, where
    for j in range(end - start):
        for linear, axis in HIDDEN_AXIS.items():
            ref = full.expert_weight(start + j, linear)
            lo, hi = expert_range(ref.shape[axis], spec.etp, coords["etp"])  # DTensor's Shard rule
            expected = ref.narrow(axis, lo, hi - lo)
            assert torch.equal(moe.expert_weight(j, linear),
                               expected), f"{where}: expert {start + j} {linear}"
    if spec.etp > 1:
        weight = moe.experts[0].up.weight if kind == "unpacked" else moe.up_w
        assert isinstance(weight, DTensor) and weight.device_mesh.mesh_dim_names == ("etp",), where


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", ["unpacked", "packed"])
def test_every_layout_forward_and_backward_match_ep1(kind: str, layout: str, fsdp: bool) -> None:
    spec = LAYOUTS[layout]
    config = MoEConfig(num_experts=6, kind=kind, top_k=2)  # type: ignore[arg-type]
    x, weight, ref_out, ref_grads = ep1_reference(config)

    mesh = spec.build_mesh()
    model = apply_expert_parallel(build_model(config, 2, seed=4), mesh)
    where = f"{kind} {layout} fsdp={fsdp} rank {dist.get_rank()}"
    if fsdp:
        apply_fsdp(model, mesh)
        router = model.layers[0].moe.router.weight
        dims = ("dp_replicate", "dp_shard") if spec.hsdp else ("dp_shard",)
        assert router.device_mesh.mesh_dim_names == dims, (f"{where}: FSDP2 mesh "
                                                           f"{router.device_mesh}")
        assert router.placements == ((Replicate(), Shard(0)) if spec.hsdp else (Shard(0),)), where
    out = model(x)
    (out * weight).sum().backward()
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{where} output: {m}")
    checked = 0
    for piece in global_regions(model):
        grad = piece.param.grad
        if grad is None:
            assert ref_grads[piece.name] is None or not ref_grads[piece.name][piece.region].any(), (
                f"{where}: {piece.name} got no gradient")
            continue
        got, _ = local_region(grad)
        torch.testing.assert_close(got, ref_grads[piece.name][piece.region], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=piece.name: f"{where}: gradient of {n}: {m}")
        checked += 1
    assert checked, where


# -- pipeline stages: the reference keeps a stage's blocks under their global names ----------------
@pytest.mark.parametrize(("num_layers", "pp"), [(2, 2), (3, 2), (5, 3)])
@pytest.mark.parametrize("kind", ["packed", "unpacked"])
def test_pipeline_stages_partition_the_state_dict_and_chain_to_the_whole_forward(
        num_layers: int, pp: int, kind: str) -> None:
    from reference_impl.layout import stage_layers
    from reference_impl.moe import apply_pipeline

    config = MoEConfig(num_experts=4, dim=8, hidden=16, kind=kind, top_k=2)
    whole = build_model(config, num_layers, seed=3)
    stages = [apply_pipeline(build_model(config, num_layers, seed=3), pp, s) for s in range(pp)]
    want = whole.state_dict()
    held = [m.state_dict() for m in stages]
    keys = [k for sd in held for k in sd]
    # every key once, under its global name
    assert sorted(keys) == sorted(want) and len(keys) == len(set(keys))
    for stage, sd in enumerate(held):
        start, end = stage_layers(num_layers, pp, stage)
        assert {int(k.split(".")[1]) for k in sd
                if k.startswith("layers.")} == set(range(start, end))
        assert ("norm.weight" in sd) == (stage == pp - 1)
        assert all(torch.equal(t, want[k]) for k, t in sd.items())
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))
    y = x
    with torch.no_grad():
        for model in stages:
            y = model(y)
        assert torch.equal(y, whole(x))


def test_a_stage_that_renumbers_its_layers_files_them_where_other_layers_belong() -> None:
    """The negative control for the names: stage 1 of 2 renumbered 0..k-1 (a ``ModuleList`` rebuilt
    from the stage's blocks) saves layer 2's weights under ``layers.0``, the key stage 0's layer 0
    also writes."""
    from torch import nn

    from reference_impl.moe import apply_pipeline

    config = MoEConfig(num_experts=4, dim=8, hidden=16, kind="packed", top_k=2)
    stage = apply_pipeline(build_model(config, 4, seed=3), 2, 1)
    stage.layers = nn.ModuleList(list(stage.layers))  # type: ignore[assignment]
    renumbered, whole = stage.state_dict(), build_model(config, 4, seed=3).state_dict()
    assert "layers.0.moe.up_w" in renumbered and "layers.2.moe.up_w" not in renumbered
    assert torch.equal(renumbered["layers.0.moe.up_w"], whole["layers.2.moe.up_w"])
    assert not torch.equal(renumbered["layers.0.moe.up_w"], whole["layers.0.moe.up_w"])

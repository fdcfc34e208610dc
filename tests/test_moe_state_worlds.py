"""Today's MoE state across ranks: fused gate/up shards, the expert bias, MTP layers under pipeline
stages.

Real 4-rank gloo worlds, as ``tests/test_checkpoint_layouts.py``: each rank compares itself with the
ep=1 run it makes alone (:func:`test_checkpoint.assert_matches_reference`, every weight and AdamW
moment bit for bit, read through :class:`~reference_impl.regions.GlobalRegion`), never with another
rank.  The layouts are :class:`conformance.layout.ParallelLayout`'s.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_checkpoint import (
    LAYERS,
    LOAD_SEED,
    OTHER_HP,
    SAVE_SEED,
    SAVED_HP,
    assert_matches_reference,
)
from torch import nn

from conformance.layout import ParallelLayout
from reference_impl import checkpoint
from reference_impl.expert_layout import expert_layout
from reference_impl.layout import expert_range, stage_mtp_layers
from reference_impl.meshes import sliced
from reference_impl.moe import (
    MoEConfig,
    apply_expert_parallel,
    apply_fsdp,
    apply_pipeline,
    build_model,
    moe_layers,
    pipeline_outputs,
    update_expert_bias,
)
from reference_impl.regions import (
    global_regions,
    local_region,
    set_deterministic_grads,
    set_deterministic_loads,
)
from reference_impl.weights import expert_bias_values

WORLD = 4
ORDERS = ("concatenated", "interleaved")
GRAD_SEED, BIAS_RATE = 3, 2.0 ** -7
#: every dimension distinct (model 16, expert hidden 10 -- fused rows 20 -- shared hidden 20, 6
#: experts), and hidden 10 split by 4 etp ranks unevenly (3, 3, 3, 1): a plain Shard of the fused
#: axis would split a pair.
FUSED = MoEConfig(num_experts=6, dim=16, hidden=10, shared_hidden=20, kind="fused", top_k=2)
LAYOUTS = {name: ParallelLayout.for_world(WORLD, ep, etp=etp, pp=pp, ep_order=order)
           for name, ep, etp, pp, order in [
               ("ep1", 1, 1, 1, "strided"), ("ep2", 2, 1, 1, "strided"),
               ("ep2c", 2, 1, 1, "consecutive"), ("ep4", 4, 1, 1, "strided"),
               ("ep1.etp2", 1, 2, 1, "strided"), ("ep2.etp2", 2, 2, 1, "strided"),
               ("ep1.etp4", 1, 4, 1, "strided"), ("pp2.ep1", 1, 1, 2, "strided"),
               ("pp2.ep2", 2, 1, 2, "strided")]}


def build(config: MoEConfig, layout: str, fsdp: bool, seed: int, hp: dict[str, Any]
          ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``config``'s model at ``layout``: its pipeline stage first, then EP/ETP, then FSDP2 if
    ``fsdp``."""
    spec = LAYOUTS[layout]
    model = build_model(config, LAYERS, seed)
    mesh = spec.build_mesh()
    if spec.pp > 1:
        apply_pipeline(model, spec.pp, sliced(mesh, ("pp",)).get_local_rank())
    apply_expert_parallel(model, mesh)
    if fsdp:
        apply_fsdp(model, mesh)
    return model, torch.optim.AdamW(model.parameters(), foreach=False, **hp)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    """Steps on synthetic gradients and synthetic loads: the expert bias moves as the weights do."""
    for step in range(steps):
        set_deterministic_grads(model, GRAD_SEED, step)
        set_deterministic_loads(model, GRAD_SEED, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_expert_bias(model, BIAS_RATE)


def biases(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every router's expert bias by state-dict key, copied (the state dict's are the buffers)."""
    return {k: v.clone() for k, v in model.state_dict().items() if k.endswith("expert_bias")}


def roundtrip(path: Path, config: MoEConfig, save: str, fsdp: bool,
              loads: list[tuple[str, MoEConfig, bool]], per_expert: bool = False) -> None:
    """Train and save ``config`` at ``save``, load at each of ``loads`` (layout, config, fsdp),
    compare with ep=1: weights, moments, steps, settings and (where there is one) the expert bias,
    exactly."""
    model, optimizer = build(config, save, fsdp, SAVE_SEED, SAVED_HP)
    train(model, optimizer)
    form = " per expert" if per_expert else ""
    case = f"{config.kind}/{config.fused_order} saved at {save} fsdp={fsdp}{form}"
    assert_matches_reference(model, optimizer, config, f"{case} (before saving)")
    checkpoint.save(model, optimizer, path, per_expert=per_expert)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    counters = [k for k in saved if "tokens_per_expert" in k]
    assert not counters, f"{case}: the counter reached the checkpoint: {counters}"
    truth = build_model(config, LAYERS, SAVE_SEED)
    initial = biases(truth)
    train(truth, torch.optim.AdamW(truth.parameters(), foreach=False, **SAVED_HP))
    expected = biases(truth)
    moved = all(not torch.equal(expected[k], v) for k, v in initial.items())
    assert moved, f"{case}: the bias never moved"
    for layout, into, load_fsdp in loads:
        model, optimizer = build(into, layout, load_fsdp, LOAD_SEED, OTHER_HP)
        before = biases(model)
        checkpoint.load(model, optimizer, path)
        where = f"{case}, loaded at {layout} into {into.kind}/{into.fused_order} fsdp={load_fsdp}"
        assert assert_matches_reference(model, optimizer, into, where), f"{where}: nothing held"
        for key, bias in biases(model).items():  # where no load would pass, exactly
            assert not torch.equal(before[key], expected[key]), f"{where}: {key} was already right"
            assert torch.equal(bias, expected[key]), (
                f"{where} rank {dist.get_rank()}: {key} {bias.tolist()} != "
                f"{expected[key].tolist()}")


def concatenated(**kw: Any) -> MoEConfig:
    return replace(FUSED, fused_order="concatenated", **kw)


def interleaved(**kw: Any) -> MoEConfig:
    return replace(FUSED, fused_order="interleaved", **kw)


def packed(**kw: Any) -> MoEConfig:
    return replace(FUSED, kind="packed", **kw)


def unpacked(**kw: Any) -> MoEConfig:
    return replace(FUSED, kind="unpacked", **kw)


# ---------------------------------------------------------------- fused shards


def halves_match(local: torch.Tensor, order: str, gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether ``local`` (a rank's rows of a fused weight, ``[n, 2k, dim]``) holds the same rows of
    ``gate`` and of ``up`` (``[n, k, dim]``, the expected rows of each), read in ``order``."""
    rows = local.reshape(local.shape[0], -1, local.shape[-1])
    if rows.shape[1] != gate.shape[1] + up.shape[1]:
        return False
    if order == "concatenated":
        rows = rows.unflatten(1, (2, -1))
        return torch.equal(rows[:, 0], gate) and torch.equal(rows[:, 1], up)
    return torch.equal(rows[:, 0::2], gate) and torch.equal(rows[:, 1::2], up)


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize(("layout", "fsdp"),
                         [("ep1.etp4", False), ("ep2.etp2", False), ("ep1.etp2", True)])
@pytest.mark.parametrize("order", ORDERS)
def test_each_etp_and_fsdp_shard_of_a_fused_weight_holds_the_same_rows_of_gate_and_up(
        order: str, layout: str, fsdp: bool) -> None:
    config = replace(FUSED, fused_order=order)  # type: ignore[arg-type]
    spec, rank = LAYOUTS[layout], dist.get_rank()
    model, _ = build(config, layout, fsdp, SAVE_SEED, SAVED_HP)
    whole = build_model(replace(config, kind="packed"), LAYERS, SAVE_SEED)
    lo, hi = expert_range(config.hidden, spec.etp, spec.coordinates(rank)["etp"])  # Shard's rule
    for name, moe in moe_layers(model):
        where = f"{order} {layout} fsdp={fsdp} rank {rank}: {name}"
        piece = next(p for p in global_regions(model) if p.name == f"{name}.gate_up_w")
        rows = piece.region[0]
        ref = whole.get_submodule(name)
        gate, up = ref.gate_w[rows, lo:hi].detach(), ref.up_w[rows, lo:hi].detach()
        held = local_region(moe.gate_up_w)[0]
        assert halves_match(held, order, gate, up), f"{where}: rows {lo}:{hi}"
        frame = (slice(0, 2), slice(lo, hi))
        frame = frame if order == "concatenated" else frame[::-1]
        assert piece.region[1:3] == frame, f"{where}: region {piece.region}"
        # the negative control: Shard(1) of [E, 2h, dim] (transformers PR #48823), wrong but where
        # etp divides h under the interleaved order (each etp rank's rows are whole pairs then)
        if spec.etp > 1 and not fsdp and (order == "concatenated" or config.hidden % spec.etp):
            from torch.distributed.tensor import Shard, distribute_tensor

            fused = build_model(config, LAYERS, SAVE_SEED).get_submodule(name).gate_up_w.detach()
            naive = distribute_tensor(fused[rows], sliced(spec.build_mesh(), ("etp",)), [Shard(1)],
                                      src_data_rank=None).to_local()
            assert not halves_match(naive, order, gate, up), f"{where}: the naive shard passed"

    # and the fused model computes the ep=1 forward and gradients at this layout
    gen = torch.Generator().manual_seed(11)
    x, weight = torch.randn(3, 8, 16, generator=gen), torch.randn(3, 8, 16, generator=gen)
    ref_model = build_model(config, LAYERS, seed=4)
    ref_out = ref_model(x)
    (ref_out * weight).sum().backward()
    ref_grads = {n: p.grad for n, p in ref_model.named_parameters()}
    model, _ = build(config, layout, fsdp, 4, SAVED_HP)
    out = model(x)
    (out * weight).sum().backward()
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    for piece in global_regions(model):
        if piece.param.grad is not None:
            torch.testing.assert_close(
                piece.mine(piece.param.grad), piece.of(ref_grads[piece.name]), rtol=1e-5, atol=1e-6,
                msg=lambda m, n=piece.name: f"{layout} rank {rank}: {n}: {m}")


# ---------------------------------------------------------------- fused checkpoints

#: (save config, save layout, fsdp, per_expert, loads): each fused order saved under expert TP and
#: FSDP2 and loaded at other layouts into the other order and the other kinds; a fused model saved
#: per expert; a packed checkpoint loaded into fused layers.
FUSED_ROUNDTRIPS = {
    "concatenated-ep2.etp2": (concatenated(), "ep2.etp2", False, False, [
        ("ep4", concatenated(), True), ("ep1.etp2", interleaved(), True), ("ep2c", packed(), False),
        ("ep1.etp4", unpacked(), False)]),
    "interleaved-ep1.etp2-fsdp": (interleaved(), "ep1.etp2", True, False, [
        ("ep2.etp2", interleaved(), False), ("ep4", concatenated(), False),
        ("ep2c", unpacked(), True), ("ep2.etp2", packed(), True)]),
    "interleaved-ep2-fsdp-per-expert": (interleaved(), "ep2", True, True, [
        ("ep4", packed(), False), ("ep1.etp2", unpacked(), True),
        ("ep2.etp2", concatenated(), False)]),
    "packed-ep2.etp2-into-fused": (packed(), "ep2.etp2", False, False, [
        ("ep4", concatenated(), True), ("ep1.etp4", interleaved(), False)]),
}


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize("case", list(FUSED_ROUNDTRIPS))
def test_fused_checkpoints_round_trip_across_layouts_orders_and_kinds(
        case: str, moe_ep_shared_dir: Path) -> None:
    config, save, fsdp, per_expert, loads = FUSED_ROUNDTRIPS[case]
    roundtrip(moe_ep_shared_dir / "ckpt", config, save, fsdp, loads, per_expert=per_expert)


@pytest.mark.moe_ep_world(WORLD)
def test_both_orders_save_one_fused_form_and_per_expert_the_unpacked_form(
        moe_ep_shared_dir: Path) -> None:
    """``gate_up_w`` ``[E, 2, h, dim]`` (gate, then up) and its moments, whatever the order and
    layout: the two orders' checkpoints hold the same tensors, the packed gate and up stacked; per
    expert, a fused save indexes what an unpacked save does."""
    read: dict[str, dict[str, torch.Tensor]] = {}
    indexes = {}
    for name, config, layout, fsdp, per_expert in (
            ("concatenated", concatenated(), "ep2.etp2", False, False),
            ("interleaved", interleaved(), "ep1.etp2", True, False),
            ("fused-per-expert", interleaved(), "ep2", False, True),
            ("unpacked", unpacked(), "ep2c", True, False)):
        model, optimizer = build(config, layout, fsdp, SAVE_SEED, SAVED_HP)
        train(model, optimizer)
        path = moe_ep_shared_dir / name
        checkpoint.save(model, optimizer, path, per_expert=per_expert)
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        indexes[name] = {k: tuple(v.size) for k, v in saved.items() if hasattr(v, "size")}
        if name in ORDERS:
            keys = ("model.layers.1.moe.gate_up_w",
                    "optimizer.state.layers.1.moe.gate_up_w.exp_avg")
            read[name] = {k: torch.empty(indexes[name][k]) for k in keys}
            dcp.load(read[name], checkpoint_id=str(path), no_dist=True)
    assert indexes["concatenated"]["model.layers.1.moe.gate_up_w"] == (6, 2, 10, 16)
    assert indexes["concatenated"] == indexes["interleaved"]
    assert not [k for k in indexes["concatenated"]
                if ".experts." in k or k.endswith((".gate_w", ".up_w"))]
    assert all(torch.equal(v, read["interleaved"][k]) for k, v in read["concatenated"].items())
    truth = build_model(packed(), LAYERS, SAVE_SEED)
    train(truth, torch.optim.AdamW(truth.parameters(), foreach=False, **SAVED_HP))
    moe = truth.layers[1].moe
    stacked = torch.stack([moe.gate_w, moe.up_w], 1)
    assert torch.equal(read["concatenated"]["model.layers.1.moe.gate_up_w"], stacked)
    assert indexes["fused-per-expert"] == indexes["unpacked"]


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize(("layout", "fsdp"), [("ep2.etp2", False), ("ep2", True)])
@pytest.mark.parametrize("order", ORDERS)
def test_to_global_presents_fused_weights_and_moments_as_views(order: str, layout: str,
                                                               fsdp: bool) -> None:
    """Both the fused and the per-expert form of a fused layer are views of its weight and moments,
    and to_local gives back the very tensors it was given."""
    config = replace(FUSED, fused_order=order)  # type: ignore[arg-type]
    model, optimizer = build(config, layout, fsdp, SAVE_SEED, SAVED_HP)
    train(model, optimizer)
    state = checkpoint.state_dict(model, optimizer)
    weight = model.layers[0].moe.gate_up_w
    storages = {local_region(t)[0].untyped_storage().data_ptr()
                for t in (weight, *(optimizer.state[weight][m] for m in ("exp_avg", "exp_avg_sq")))}
    for packed_form in ({"layers.0.moe", "layers.1.moe"}, set()):
        layout_ = expert_layout(model, packed_form=packed_form)
        assert layout_ is not None
        out = layout_.to_global(state)
        shown = {k: v for k, v in out["model"].items() if k.startswith("layers.0.moe.") and (
            k.endswith("gate_up_w")
            or (k.endswith((".gate.weight", ".up.weight")) and ".experts." in k))}
        moments = [t for k, e in out["optimizer"]["state"].items() if k in shown
                   for t in e.values() if t.dim()]
        assert shown and moments, f"{order} {layout}: nothing presented"
        for t in (*shown.values(), *moments):
            storage = local_region(t)[0].untyped_storage().data_ptr()
            assert storage in storages, f"{order} {layout}: a copy"
        back = layout_.to_local(out)
        assert all(back["model"][k] is v for k, v in state["model"].items())
        for key, entry in state["optimizer"]["state"].items():
            assert all(back["optimizer"]["state"][key][n] is t for n, t in entry.items()), key


# ---------------------------------------------------------------- the expert bias


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize("save", ["ep1", "ep2", "ep4"])
def test_the_expert_bias_round_trips_at_every_ep_and_the_counter_never_reaches_a_checkpoint(
        save: str, moe_ep_shared_dir: Path) -> None:
    config = packed(expert_bias=True)
    loads = [(layout, config, fsdp)
             for layout, fsdp in (("ep1", True), ("ep2", False), ("ep4", True))]
    roundtrip(moe_ep_shared_dir / "ckpt", config, save, True, loads)
    # a model-only checkpoint of an untrained model holds its initial, non-zero bias
    model, _ = build(config, save, False, SAVE_SEED, SAVED_HP)
    checkpoint.save(model, None, moe_ep_shared_dir / "model-only")
    held = {"model.layers.1.moe.router.expert_bias": torch.empty(6)}
    dcp.load(held, checkpoint_id=str(moe_ep_shared_dir / "model-only"), no_dist=True)
    initial = expert_bias_values(config.init_std, 6, SAVE_SEED, "layers.1.moe",
                                 "router.expert_bias")
    assert torch.equal(held["model.layers.1.moe.router.expert_bias"], initial)
    assert bool(initial.all())


# ---------------------------------------------------------------- MTP layers and pipeline stages


MTP = concatenated(mtp_layers=1, expert_bias=True)


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize(("save", "fsdp", "loads"), [
    ("pp2.ep2", False, [("ep4", MTP, True), ("pp2.ep1", MTP, True),
                        ("ep2.etp2", replace(MTP, kind="packed"), False)]),
    ("ep2c", True, [("pp2.ep2", MTP, False),
                    ("pp2.ep1", replace(MTP, fused_order="interleaved"), True)]),
], ids=["saved-pp2.ep2", "saved-ep2c-fsdp"])
def test_mtp_layers_round_trip_with_pipeline_stages(save: str, fsdp: bool, loads: list[Any],
                                                   moe_ep_shared_dir: Path) -> None:
    roundtrip(moe_ep_shared_dir / "ckpt", MTP, save, fsdp, loads)


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize("layout", ["pp2.ep2", "pp2.ep1"])
def test_the_last_stage_holds_the_mtp_layers_split_like_any_layer_and_the_stages_forward_the_whole(
        layout: str) -> None:
    spec, rank = LAYOUTS[layout], dist.get_rank()
    stage = spec.stage_of(rank)
    model, _ = build(MTP, layout, True, 4, SAVED_HP)
    start, end = stage_mtp_layers(LAYERS, 1, spec.pp, stage)
    mtp = {moe.layer: (name, moe) for name, moe in moe_layers(model) if name.startswith("mtp.")}
    assert sorted(mtp) == list(range(start, end)), (
        f"{layout} rank {rank} stage {stage}: MTP layers {sorted(mtp)}")
    for layer, (name, moe) in mtp.items():
        assert name == f"mtp.{layer - LAYERS}.moe"
        first, last = expert_range(6, spec.ep, spec.coordinates(rank)["ep"])
        held = (moe.local_expert_start, moe.num_local_experts)
        assert held == (first, last - first), f"rank {rank}: {name}"
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = build_model(MTP, LAYERS, 4)(x, with_mtp=True)
        pp_mesh = sliced(spec.build_mesh(), ("pp",))
        got = pipeline_outputs(lambda h: model(h, x, with_mtp=True), x, pp_mesh.get_group(), stage,
                               2)
    for depth, (a, b) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, d=depth: f"rank {rank} output {d}: {m}")

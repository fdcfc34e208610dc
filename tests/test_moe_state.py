"""The state today's MoE models carry, in the reference (single process): the router's expert bias
and its token counter, fused gate/up weights in both row orders, multi-token-prediction layers --
and today's forms unchanged.

The multi-rank halves of the same promises (shards of fused weights, round trips at every layout,
pipeline stages) are ``tests/test_moe_state_worlds.py``.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from reference_impl.expert_layout import check_saved_experts, expert_layout
from reference_impl.fused import canonical_fused, fused_halves
from reference_impl.layout import layer_stage, mtp_stage, stage_layers, stage_mtp_layers
from reference_impl.model import fused_frame, mtp_inputs
from reference_impl.moe import MoEConfig, apply_pipeline, build_model, update_expert_bias
from reference_impl.regions import set_deterministic_loads

#: every dimension distinct: model dim 16, expert hidden 12 (fused rows 24), shared expert hidden
#: 20, 5 experts.
DISTINCT = MoEConfig(num_experts=5, dim=16, hidden=12, shared_hidden=20, top_k=2)
ORDERS = ("concatenated", "interleaved")


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- today's forms, value for value

#: (kind, activation) -> (state-dict digest, entries, forward's sum and absolute sum) of
#: build_model(MoEConfig(...), 2, seed=0) and its forward on randn(3, 8, 32) of seed 0, taken from
#: the reference before the expert bias, fused and MTP fields existed (5ab9d28).  The state is
#: pinned to the byte; the forward to what every CPU's kernels agree on: an AVX2 and an AVX-512
#: matmul round the same sums differently, so the forward's own bytes are the machine's, not the
#: model's.
PINS = {
    ("packed", "swiglu"): ("201dc6bbff807684", 17, 43.2767272, 613.701536),
    ("packed", "gelu"): ("1f7647524a1c763c", 13, 43.6317979, 613.559593),
    ("unpacked", "swiglu"): ("85eb043f6922c509", 47, 43.2767272, 613.701536),
    ("unpacked", "gelu"): ("c1278e57e6b79eff", 33, 43.6317979, 613.559593),
}


@pytest.mark.parametrize(("kind", "activation"), list(PINS))
def test_the_default_fields_leave_todays_models_value_for_value(kind: str, activation: str) -> None:
    config = MoEConfig(kind=kind, activation=activation)  # type: ignore[arg-type]
    model = build_model(config, 2, seed=0)
    state = model.state_dict()
    x = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(0))
    out = model(x).double()
    digest, entries, total, magnitude = PINS[(kind, activation)]
    assert (_digest(state), len(state)) == (digest, entries)
    assert (out.sum().item(), out.abs().sum().item()) == pytest.approx((total, magnitude),
                                                                       rel=1e-7)
    grown = [k for k in state if "expert_bias" in k or k.startswith("mtp.")]
    assert not grown, f"a default model grew state: {grown}"
    assert not list(model.buffers()), "a default model holds buffers"


def test_new_fields_are_checked() -> None:
    with pytest.raises(ValueError, match=r"kind='fused' fuses the gate and up.*activation='gelu'"):
        MoEConfig(kind="fused", activation="gelu")
    with pytest.raises(ValueError, match="fused_order must be one of"):
        MoEConfig(kind="fused", fused_order="halves")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mtp_layers must be an int >= 0, got -1"):
        MoEConfig(mtp_layers=-1)
    defaults = MoEConfig()
    new = (defaults.expert_bias, defaults.fused_order, defaults.mtp_layers, defaults.shared_hidden)
    assert new == (False, "concatenated", 0, None)


# ---------------------------------------------------------------- fused gate/up weights


@pytest.mark.parametrize("order", ORDERS)
def test_fused_rows_hold_the_packed_gate_and_up_in_their_order(order: str) -> None:
    """Row ``r`` of ``gate_up_w[g]``: gate row ``r`` then up row ``r - h`` (concatenated), or gate
    row ``r // 2`` for even ``r`` and up row ``r // 2`` for odd (interleaved); the same values as
    packed and unpacked expert g."""
    config = replace(DISTINCT, kind="fused", fused_order=order)  # type: ignore[arg-type]
    fused = build_model(config, 2, seed=4)
    packed = build_model(replace(DISTINCT, kind="packed"), 2, seed=4)
    unpacked = build_model(replace(DISTINCT, kind="unpacked"), 2, seed=4)
    assert tuple(fused.state_dict()["layers.1.moe.gate_up_w"].shape) == (5, 24, 16)
    assert tuple(fused.state_dict()["layers.1.moe.shared.up.weight"].shape) == (20, 16)
    for layer in range(2):
        f, p, u = (m.layers[layer].moe for m in (fused, packed, unpacked))
        for g in range(5):
            rows = f.gate_up_w[g]
            if order == "concatenated":
                gate, up = rows[:12], rows[12:]
            else:
                gate, up = rows[0::2], rows[1::2]
            assert torch.equal(gate, p.gate_w[g]) and torch.equal(up, p.up_w[g]), (layer, g)
            for linear in ("gate", "up", "down"):
                got, want = f.expert_weight(g, linear), u.expert_weight(g, linear)
                assert torch.equal(got, want), (layer, g, linear)
        canon = canonical_fused(f.gate_up_w, order)
        assert canon.shape == (5, 2, 12, 16)
        assert torch.equal(canon[:, 0], p.gate_w) and torch.equal(canon[:, 1], p.up_w)
        storage = f.gate_up_w.untyped_storage().data_ptr()
        halves = fused_halves(f.gate_up_w, order)
        assert all(h.untyped_storage().data_ptr() == storage for h in halves)


@pytest.mark.parametrize("order", ORDERS)
def test_the_fused_forward_and_backward_are_the_packed_ones_bit_for_bit(order: str) -> None:
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(2))
    configs = {kind: replace(DISTINCT, kind=kind, fused_order=order, expert_bias=True)
               for kind in ("packed", "fused")}  # type: ignore[arg-type]
    models = {kind: build_model(config, 2, seed=6) for kind, config in configs.items()}
    outs = {kind: model(x) for kind, model in models.items()}
    assert torch.equal(outs["fused"], outs["packed"]), f"{order}: the fused forward differs"
    for out in outs.values():
        (out * weight).sum().backward()
    for layer in range(2):
        f, p = models["fused"].layers[layer].moe, models["packed"].layers[layer].moe
        grad = fused_frame(f.gate_up_w.grad, order)
        half = 1 if order == "concatenated" else 2
        gate, up = grad.select(half, 0), grad.select(half, 1)
        assert torch.equal(gate, p.gate_w.grad) and torch.equal(up, p.up_w.grad), (order, layer)
        assert torch.equal(f.down_w.grad, p.down_w.grad)
        assert torch.equal(f.router.weight.grad, p.router.weight.grad)


def test_a_fused_weight_split_on_its_fused_axis_has_no_canonical_region() -> None:
    """The negative control for the half axis: a tensor held as ``Shard(1)`` of ``[E, 2h, dim]`` is
    refused."""
    from torch.distributed.tensor import Shard

    from reference_impl.fused import _moved

    with pytest.raises(ValueError, match=r"its dim 1 is split; a split of the fused gate/up axis"):
        _moved([Shard(1)], {0: 0, 2: 3}.get, "layers.0.moe.gate_up_w")


# ---------------------------------------------------------------- the expert bias


def test_the_expert_bias_is_a_persistent_fp32_function_of_seed_layer_and_expert() -> None:
    config = replace(DISTINCT, expert_bias=True, dtype=torch.bfloat16)
    model = build_model(config, 2, seed=1)
    state = model.state_dict()
    bias = state["layers.0.moe.router.expert_bias"]
    assert bias.dtype == torch.float32 and bias.shape == (5,) and bool((bias != 0).all()), bias
    assert not [k for k in state if "tokens_per_expert" in k], "the counter is in the state dict"
    router = model.layers[0].moe.router
    assert router.tokens_per_expert.dtype == torch.float32 and not router.tokens_per_expert.any()
    more = build_model(replace(config, num_experts=9, dtype=torch.float32), 3, seed=1).state_dict()
    assert torch.equal(more["layers.0.moe.router.expert_bias"][:5], bias), "E changed expert g's"
    assert not torch.equal(state["layers.1.moe.router.expert_bias"], bias), "two layers share one"
    other = build_model(config, 2, seed=2).state_dict()["layers.0.moe.router.expert_bias"]
    assert not torch.equal(other, bias), "another seed kept the bias"


def test_the_expert_bias_selects_experts_and_never_weighs_them() -> None:
    """A zero bias routes as no bias; a bias makes an expert chosen, weighed by its unbiased
    score."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    plain = build_model(DISTINCT, 1, seed=2)
    biased = build_model(replace(DISTINCT, expert_bias=True), 1, seed=2)
    router = biased.layers[0].moe.router
    assert not torch.equal(biased(x), plain(x)), "the initial bias changed no choice: shows nothing"
    router.expert_bias.zero_()
    assert torch.equal(biased(x), plain(x))
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0, 0.0]))
    weights, experts = router.route(x, 2)
    probs = F.linear(x, router.weight).float().softmax(dim=-1)
    assert bool((experts == 3).any(dim=-1).all()), experts
    unbiased = probs.gather(-1, experts)
    assert torch.equal(weights, unbiased / unbiased.sum(dim=-1, keepdim=True))


def test_the_update_steps_against_the_sign_of_the_imbalance_and_zeroes_the_counter() -> None:
    model = build_model(replace(DISTINCT, expert_bias=True, mtp_layers=1), 2, seed=1)
    routers = [moe.router for moe in (model.layers[0].moe, model.layers[1].moe, model.mtp[0].moe)]
    model(torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(0)), with_mtp=True)
    counted = [float(r.tokens_per_expert.sum()) for r in routers]
    assert counted == [3 * 7 * 2] * 3, f"the forward counted {counted}"
    before = [r.expert_bias.clone() for r in routers]
    assert set_deterministic_loads(model, seed=5, step=0) == 3  # loads set from outside count
    loads = [r.tokens_per_expert.clone() for r in routers]
    routers[1].tokens_per_expert.copy_(torch.tensor([4.0, 4.0, 4.0, 4.0, 4.0]))  # balanced: no step
    loads[1] = routers[1].tokens_per_expert.clone()
    assert update_expert_bias(model, rate=0.125) == 3
    for router, bias, load in zip(routers, before, loads, strict=True):
        assert torch.equal(router.expert_bias, bias + 0.125 * torch.sign(load.mean() - load))
        assert not router.tokens_per_expert.any()
    assert torch.equal(routers[1].expert_bias, before[1])
    assert not torch.equal(routers[0].expert_bias, before[0])


def test_check_saved_experts_refuses_a_bias_of_fewer_experts() -> None:
    """A bias split by EP rank and saved under one name holds one rank's entries: refused, as lossy
    experts are."""
    model = build_model(replace(DISTINCT, kind="fused", expert_bias=True), 1)

    def md(*size: int) -> TensorStorageMetadata:
        chunk = ChunkStorageMetadata(torch.Size([0] * len(size)), torch.Size(size))
        properties = TensorProperties(dtype=torch.float32)
        return TensorStorageMetadata(properties, torch.Size(size), [chunk])

    head = "model.layers.0.moe."
    saved = {f"{head}gate_up_w": md(5, 2, 12, 16), f"{head}down_w": md(5, 16, 12),
             f"{head}router.expert_bias": md(5)}
    check_saved_experts(model, saved, where="ok")
    with pytest.raises(ValueError, match=r"^x: the checkpoint's router\.expert_bias of MoE layer "
                                         r"'layers\.0\.moe' holds 3 entries, but the model has 5 "
                                         r"experts"):
        check_saved_experts(model, {**saved, f"{head}router.expert_bias": md(3)}, where="x")
    with pytest.raises(ValueError, match=r"holds 2 experts of MoE layer 'layers\.0\.moe'"):
        check_saved_experts(model, {**saved, f"{head}gate_up_w": md(2, 2, 12, 16)}, where="x")


def test_to_global_refuses_a_state_that_holds_the_counter() -> None:
    model = build_model(replace(DISTINCT, kind="packed", expert_bias=True), 1)
    layout = expert_layout(model)
    assert layout is not None
    state = model.state_dict()
    state["layers.0.moe.router.tokens_per_expert"] = model.layers[0].moe.router.tokens_per_expert
    with pytest.raises(ValueError, match=r"non-persistent buffer\(s\) "
                                         r"\['layers.0.moe.router.tokens_per_expert'\]"):
        layout.to_global({"model": state})


# ---------------------------------------------------------------- multi-token prediction


def test_mtp_layers_are_named_and_numbered_after_the_main_stack() -> None:
    config = replace(DISTINCT, mtp_layers=2, kind="packed")
    model = build_model(config, 3, seed=2)
    state = model.state_dict()
    names = [name for name, _ in model.named_modules() if name.endswith(".moe")]
    assert names[-2:] == ["mtp.0.moe", "mtp.1.moe"]
    assert [m.moe.layer for m in model.mtp] == [3, 4]
    for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "norm.weight", "mtp_norm.weight",
                 "moe.router.weight", "moe.gate_w", "moe.shared.down.weight"):
        assert f"mtp.1.{part}" in state, part
    assert tuple(state["mtp.0.eh_proj.weight"].shape) == (16, 32)
    plain = build_model(replace(config, mtp_layers=0), 3, seed=2).state_dict()
    assert all(torch.equal(state[k], v) for k, v in plain.items()), "MTP changed the main stack"
    assert not torch.equal(state["mtp.0.moe.gate_w"], state["mtp.1.moe.gate_w"])


def test_the_mtp_forward_is_deepseek_v3s_small() -> None:
    """Depth ``i`` reads the last hidden state (before the final norm) or depth ``i - 1``'s output,
    and the inputs ``i + 1`` tokens ahead; the main output is the one without MTP layers."""
    config = replace(DISTINCT, mtp_layers=2)
    model = build_model(config, 2, seed=3)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out, *mtp = model(x, with_mtp=True)
        assert torch.equal(out, build_model(replace(config, mtp_layers=0), 2, seed=3)(x))
        assert torch.equal(out, model(x))
        hidden = model.layers[1](model.layers[0](x))
        for depth, layer in enumerate(model.mtp):
            ahead = torch.cat([x[:, depth + 1:], torch.zeros(2, depth + 1, 16)], dim=1)
            assert torch.equal(mtp_inputs(x, depth + 1), ahead)
            h = layer.eh_proj(torch.cat([layer.enorm(ahead), layer.hnorm(hidden)], dim=-1))
            hidden = layer.mtp_norm(h + layer.moe(layer.norm(h)))
            assert torch.equal(mtp[depth], hidden), depth
        assert not torch.equal(mtp[0], mtp[1])


def test_the_stage_rules_put_the_mtp_layers_on_the_last_stage() -> None:
    assert [mtp_stage(pp) for pp in (1, 2, 3)] == [0, 1, 2]
    assert [stage_mtp_layers(4, 2, 2, s) for s in (0, 1)] == [(4, 4), (4, 6)]
    assert [layer_stage(layer, 4, 2, mtp_layers=2) for layer in range(6)] == [0, 0, 1, 1, 1, 1]
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 4\), got 4"):
        layer_stage(4, 4, 2)
    with pytest.raises(ValueError, match="pp must be an int >= 1"):
        mtp_stage(0)


@pytest.mark.parametrize(("num_layers", "pp"), [(2, 2), (3, 2), (3, 3)])
def test_pipeline_stages_hold_the_mtp_layers_on_the_last_and_chain_to_the_whole(num_layers: int,
                                                                                pp: int) -> None:
    config = replace(DISTINCT, mtp_layers=2, kind="fused", expert_bias=True)
    whole = build_model(config, num_layers, seed=5)
    stages = [apply_pipeline(build_model(config, num_layers, seed=5), pp, s) for s in range(pp)]
    want, held = whole.state_dict(), [m.state_dict() for m in stages]
    keys = [k for sd in held for k in sd]
    assert sorted(keys) == sorted(want) and len(keys) == len(set(keys))
    for stage, sd in enumerate(held):
        assert any(k.startswith("mtp.") for k in sd) == (stage == pp - 1), stage
        assert {int(k.split(".")[1]) for k in sd if k.startswith("layers.")} == set(range(
            *stage_layers(num_layers, pp, stage)))
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = whole(x, with_mtp=True)
        h: Any = x
        for stage, model in enumerate(stages):
            got = model(h, x if stage else None, with_mtp=True)
            h = got[0]
        assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        if pp > 1:
            with pytest.raises(ValueError, match=f"pipeline stage {pp - 1} holds the MTP layers"):
                stages[-1](x, with_mtp=True)

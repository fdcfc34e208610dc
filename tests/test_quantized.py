"""The quantized expert base (reference_impl.quantized, reference_impl.lora.quantize_experts):
exact round trips on representable values, one-line errors for grids that disagree, the one rule
a hidden-axis shard cuts blocks by, and blocks and scales following their expert at every layout.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from conformance.layout import ParallelLayout
from reference_impl.layout import expert_range
from reference_impl.lora import keep_expert_rows, quantize_experts, quantized_names
from reference_impl.moe import MoEConfig, apply_expert_parallel, build_model
from reference_impl.quantized import (
    FP8,
    FP8_MAX,
    MXFP4,
    BlockCutError,
    QuantizedShapeError,
    block_span,
    dequantize,
    hidden_shards,
    quantize,
    scales_shape,
    shard_quantized,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _representable_mxfp4(lead: tuple[int, ...], blocks: int, block: int = 32
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes and scales whose every block reaches a magnitude of 4 or 6 (so the OCP rule
    picks the same exponent back)."""
    codes = torch.randint(0, 16, (*lead, blocks, block), generator=_gen(1))
    codes[..., 0] = torch.randint(6, 8, (*lead, blocks), generator=_gen(2)) | (
        torch.randint(0, 2, (*lead, blocks), generator=_gen(3)) << 3)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    scales = torch.randint(110, 140, (*lead, blocks), generator=_gen(4)).to(torch.uint8)
    return packed, scales


def test_mxfp4_round_trip_is_exact_on_representable_values() -> None:
    blocks, scales = _representable_mxfp4((3, 5), 2)
    weight = dequantize(MXFP4, blocks, scales)
    assert weight.shape == (3, 5, 64)
    again_blocks, again_scales = quantize(MXFP4, weight)
    assert torch.equal(again_blocks, blocks) and torch.equal(again_scales, scales)
    assert torch.equal(dequantize(MXFP4, again_blocks, again_scales), weight)


def test_mxfp4_packs_as_gpt_oss_does() -> None:
    """Element 2j in the low nibble, 2j+1 in the high one, code bit 3 the sign, scale 2**(s-127):
    transformers' convert_moe_packed_tensors' reading."""
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x9 | (0x7 << 4)  # -0.5 then 6.0
    weight = dequantize(MXFP4, blocks, torch.tensor([[128]], dtype=torch.uint8))
    assert weight[0, :2].tolist() == [-1.0, 12.0] and not weight[0, 2:].any()


def test_mxfp4_rounds_to_nearest_ties_to_even_and_is_idempotent() -> None:
    # block amax 4 -> exponent 0: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 2.5 -> 2, 5 -> 4, -3.5 -> -4
    row = torch.tensor([4.0, 0.25, 0.75, 1.25, 2.5, 5.0, -3.5] + [0.0] * 25)
    got = dequantize(MXFP4, *quantize(MXFP4, row[None]))[0, :7].tolist()
    assert got == [4.0, 0.0, 1.0, 1.0, 2.0, 4.0, -4.0]
    w = torch.randn(4, 6, 96, generator=_gen(5))
    once = dequantize(MXFP4, *quantize(MXFP4, w))
    assert torch.equal(dequantize(MXFP4, *quantize(MXFP4, once)), once)
    assert ((once - w).abs() <= w.abs().amax(-1, keepdim=True) / 4).all()


@pytest.mark.parametrize(("shape", "block"), [((2, 10, 12), 4), ((3, 5, 7), 2), ((1, 9, 9), 128)])
def test_fp8_round_trip_is_exact_on_representable_values(shape: tuple[int, ...],
                                                         block: int) -> None:
    """fp8 codes times power-of-two tile scales, each tile holding +-448: quantize gives them back
    (partial tiles at the edges included)."""
    raw = torch.randint(0, 256, shape, generator=_gen(6)).to(torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x10  # no NaN codes
    codes = raw.view(torch.float8_e4m3fn).clone()
    grid = scales_shape(FP8, shape, block)
    for r in range(grid[-2]):
        for c in range(grid[-1]):
            codes[..., r * block, c * block] = FP8_MAX
    scale_inv = torch.ldexp(torch.ones(grid), torch.randint(-8, 4, grid, generator=_gen(7)).float())
    weight = dequantize(FP8, codes, scale_inv, block)
    again, again_scale = quantize(FP8, weight, block)
    assert torch.equal(again.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(again_scale, scale_inv)


def test_fp8_error_is_within_the_format_and_zero_tiles_get_scale_one() -> None:
    w = torch.randn(2, 20, 24, generator=_gen(8))
    w[:, :8, :8] = 0
    q, s = quantize(FP8, w, 8)
    assert s.shape == (2, 3, 3) and torch.equal(s[:, 0, 0], torch.ones(2))
    back = dequantize(FP8, q, s, 8)
    assert ((back - w).abs() <= w.abs().max() / 16).all()  # e4m3: 3 mantissa bits


def test_grids_that_disagree_are_one_line_errors_naming_key_and_shapes() -> None:
    q, s = quantize(FP8, torch.randn(4, 20, 24, generator=_gen(9)), 8)
    with pytest.raises(QuantizedShapeError) as found:
        dequantize(FP8, q, s[:, :2], 8, key="layers.0.moe.up_w")
    e = found.value
    assert (e.key, e.blocks_shape, e.scales_shape, e.expected) == (
        "layers.0.moe.up_w", (4, 20, 24), (4, 2, 3), (4, 3, 3))
    assert "\n" not in str(e) and "layers.0.moe.up_w" in str(e)
    assert "[4, 20, 24]" in str(e) and "[4, 2, 3]" in str(e)
    # a singleton grid dim squeezed (Megatron-Bridge #5731): refused, not broadcast
    q1, s1 = quantize(FP8, torch.randn(3, 8, 24, generator=_gen(10)), 8)
    with pytest.raises(QuantizedShapeError, match="expected scales"):
        dequantize(FP8, q1, s1.squeeze(1), 8, key="k")
    blocks, scales = quantize(MXFP4, torch.randn(2, 3, 64, generator=_gen(11)))
    with pytest.raises(QuantizedShapeError) as found:
        dequantize(MXFP4, blocks, scales[:, :, :1], key="layers.1.moe.down_w_scales")
    assert found.value.expected == (2, 3, 2) and found.value.scales_shape == (2, 3, 1)
    with pytest.raises(QuantizedShapeError, match="whole number of MXFP4 blocks"):
        quantize(MXFP4, torch.randn(3, 40), key="w")
    with pytest.raises(QuantizedShapeError, match=r"uint8"):
        dequantize(MXFP4, blocks.to(torch.int32), scales, key="w")


def test_the_block_cut_rule() -> None:
    assert block_span(0, 32, 64, 32) == (0, 1) and block_span(32, 64, 64, 32) == (1, 2)
    # a shard smaller than a block that ends the axis keeps its partial block's scale
    assert block_span(5, 9, 9, 5) == (1, 2) and block_span(9, 10, 10, 3) == (3, 4)
    assert block_span(4, 4, 8, 4) == (1, 1)
    with pytest.raises(BlockCutError) as found:
        block_span(5, 10, 10, 4, key="layers.0.moe.down_w_scales", shard="etp rank 1 of 2")
    e = found.value
    assert (e.shard, e.start, e.stop, e.size, e.block) == ("etp rank 1 of 2", 5, 10, 10, 4)
    assert "etp rank 1 of 2" in str(e) and "block of 4" in str(e) and "\n" not in str(e)
    with pytest.raises(BlockCutError, match="etp rank 0 of 4"):
        hidden_shards(10, 4, 4)


@pytest.mark.parametrize(("size", "parts", "block"),
                         [(s, k, b) for s in range(1, 20) for k in (1, 2, 3, 4) for b in (1, 2, 3,
                                                                                         5, 8)])
def test_a_block_aligned_split_is_torch_chunk_of_the_grid(size: int, parts: int,
                                                          block: int) -> None:
    """Where no shard cuts a block, DTensor's Shard of the scales' grid is the blocks' own rule."""
    try:
        shards = hidden_shards(size, parts, block)
    except BlockCutError:
        return
    grid = -(-size // block)
    assert [(first, end) for _, _, first, end in shards] == [
        expert_range(grid, parts, p) for p in range(parts)]


@pytest.mark.parametrize("fmt", [MXFP4, FP8])
def test_a_hidden_shard_takes_the_blocks_and_scales_of_its_slice(fmt: str) -> None:
    w = torch.randn(3, 12, 16, generator=_gen(12))
    blocks, scales = quantize(fmt, w, 4)
    whole = dequantize(fmt, blocks, scales, 4)
    for axis, (lo, hi) in [("out", (8, 12)), ("in", (4, 12)), ("in", (12, 16)), ("out", (5, 7))]:
        if fmt == FP8 and axis == "out" and lo % 4:
            with pytest.raises(BlockCutError):
                shard_quantized(fmt, blocks, scales, axis, lo, hi, 4)
            continue
        b, s = shard_quantized(fmt, blocks, scales, axis, lo, hi, 4, key="k")
        part = dequantize(fmt, b, s, 4)
        expected = whole[:, lo:hi] if axis == "out" else whole[..., lo:hi]
        assert torch.equal(part, expected), (axis, lo, hi)
    with pytest.raises(BlockCutError, match="block of 4"):
        shard_quantized(fmt, blocks, scales, "in", 2, 10, 4, shard="etp rank 0 of 2")


@pytest.mark.parametrize("fmt", [MXFP4, FP8])
@pytest.mark.parametrize("kind", ["packed", "unpacked", "fused"])
def test_quantized_experts_follow_their_expert(kind: str, fmt: str) -> None:
    """Expert g's blocks and scales are the same at any EP slice (keep_expert_rows), and hold the
    quantization of its weight; the forward runs on the dequantized base."""
    if kind == "fused" and fmt == FP8:
        with pytest.raises(ValueError, match="not a released layout"):
            quantize_experts(build_model(MoEConfig(kind="fused"), 1), FP8, 8)
        return
    config = MoEConfig(kind=kind, num_experts=5, dim=16, hidden=24)  # type: ignore[arg-type]
    plain = build_model(config, 1, seed=2)
    model = quantize_experts(build_model(config, 1, seed=2), fmt, 8)
    moe, ref = model.layers[0].moe, plain.layers[0].moe
    x = torch.randn(6, 16, generator=_gen(13))
    out = model(x)
    assert (out - plain(x)).abs().max() < 0.01 and not torch.equal(out, plain(x))
    assert not any(p.dtype in (torch.uint8, torch.float8_e4m3fn) for p in model.parameters())
    names = (list(quantized_names(fmt, w)) for w in ref.packed_weights())
    if kind == "unpacked":
        for g in range(5):
            for linear in ("gate", "up", "down"):
                b, s = (getattr(getattr(moe.experts[g], linear), n)
                        for n in quantized_names(fmt, "weight"))
                want = quantize(fmt, ref.expert_weight(g, linear), 8)
                assert torch.equal(b.view(torch.uint8), want[0].view(torch.uint8))
                assert torch.equal(s, want[1])
        return
    whole = {n: getattr(moe, n).clone() for pair in names for n in pair}
    start, end = 2, 5  # what ep rank 1 of 2 keeps of 5 experts
    keep_expert_rows(moe, start, end)
    for name, full in whole.items():
        assert torch.equal(getattr(moe, name).view(torch.uint8) if full.dtype != torch.float32
                           else getattr(moe, name),
                           (full.view(torch.uint8) if full.dtype != torch.float32
                            else full)[start:end]), name
        assert name in moe._buffers, name


# ---------------------------------------------------------------- a 4-rank world

WORLD = 4


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize("fmt", [MXFP4, FP8])
def test_expert_tp_splits_blocks_and_scales_on_the_hidden_blocks(fmt: str) -> None:
    """ep2.etp2: each rank holds its experts' blocks and scales of its hidden shard, as the cut
    rule gives them, and the forward is the ep=1 quantized model's.  FP8: hidden 18 in tiles of 9
    (each etp shard one tile; tiles of 6 cut: refused, naming the rank); MXFP4: hidden 24 in
    blocks of 6 (down's input axis cut at 12)."""
    spec = ParallelLayout.for_world(WORLD, 2, etp=2)
    coords = spec.coordinates(dist.get_rank())
    hidden, block = (18, 9) if fmt == FP8 else (24, 6)  # MXFP4's blocks are of an even size
    config = MoEConfig(kind="packed", num_experts=5, dim=18, hidden=hidden)
    whole = quantize_experts(build_model(config, 1, seed=3), fmt, block)
    x = torch.randn(7, 18, generator=_gen(14))
    model = apply_expert_parallel(quantize_experts(build_model(config, 1, seed=3), fmt, block),
                                  spec.build_mesh())
    moe, ref = model.layers[0].moe, whole.layers[0].moe
    start, end = expert_range(5, 2, coords["ep"])
    where = f"{fmt} rank {dist.get_rank()} {coords}"
    for weight, axis in (("up_w", "out"), ("down_w", "in")):
        b_name, s_name = quantized_names(fmt, weight)
        lo, hi = expert_range(hidden, 2, coords["etp"])
        want_b, want_s = shard_quantized(fmt, getattr(ref, b_name)[start:end],
                                         getattr(ref, s_name)[start:end], axis, lo, hi, block)
        got_b: Any = getattr(moe, b_name).to_local()
        got_s: Any = getattr(moe, s_name).to_local()
        assert torch.equal(got_b.view(torch.uint8), want_b.view(torch.uint8)), f"{where} {b_name}"
        assert torch.equal(got_s, want_s), f"{where} {s_name}"
    torch.testing.assert_close(model(x), whole(x), rtol=1e-5, atol=1e-6)
    if fmt == FP8:  # shards of 9 rows cut FP8 tiles of 6: refused before any split
        with pytest.raises(BlockCutError, match="etp rank 0 of 2"):
            apply_expert_parallel(quantize_experts(build_model(config, 1), fmt, 6),
                                  spec.build_mesh())

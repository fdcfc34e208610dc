"""A frozen expert base held quantized, as released checkpoints ship it: MXFP4 and block FP8.

Fine-tuning a released MoE keeps its experts frozen and, to fit, quantized; the checkpoint a
fine-tuning run writes and reads then holds the experts' *blocks* and *scales*, which are one
expert's state and must move together at every layout.  This module is the arithmetic of the two
formats and the one rule of how a shard of the hidden axis cuts them (:func:`block_span`);
:mod:`reference_impl.lora` holds them on a model.

- **MXFP4** (:data:`MXFP4`), the layout gpt-oss ships (``*_blocks`` / ``*_scales``, read by
  transformers' ``integrations/mxfp4.py`` ``convert_moe_packed_tensors``): a weight ``[..., out,
  in]`` is cut along its input axis into blocks of 32; each element is an fp4 e2m1 code (bit 3 the
  sign, bits 0-2 index the magnitudes :data:`E2M1`), two codes a ``uint8`` byte, element ``2j`` in
  the low nibble and ``2j + 1`` in the high one: ``blocks`` ``[..., out, in/32, 16]``.  Each block
  has one e8m0 scale, a ``uint8`` exponent with bias 127 (``2 ** (s - 127)``): ``scales`` ``[...,
  out, in/32]``.  We follow gpt-oss's 4-D blocks rather than NeMo Automodel's ``[..., out, in/2]``
  int8 + ``float8_e8m0fnu`` (the same bytes, another view) because it is what the hub holds, and
  its block axis makes the grid explicit: ``blocks.shape[:-1] == scales.shape``.
- **block FP8** (:data:`FP8`), DeepSeek-V3's: the weight itself in ``torch.float8_e4m3fn`` ``[...,
  out, in]`` and an fp32 ``weight_scale_inv`` per ``block x block`` tile (128 in the release; a
  smaller ``block`` lets small test dims hold several), grid ``[..., ceil(out/b), ceil(in/b)]``
  with partial tiles at the edges.  Dequantized: ``weight * scale_inv`` tile by tile.

Leading axes are carried through, so a packed ``[E, out, in]`` expert weight quantizes per expert:
``blocks[g]`` and ``scales[g]`` are expert ``g``'s, and slicing experts slices both alike.
Both quantizers are deterministic (no randomness, round to nearest, ties to even) and exact on
values the format represents (see the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["E2M1", "FORMATS", "FP8", "FP8_MAX", "MXFP4", "BlockCutError", "QuantizedAxes",
           "QuantizedShapeError",
           "block_span", "check_grid", "default_block", "dequantize", "hidden_shards", "quantize",
           "quantized_axes", "scales_shape", "shard_quantized"]

#: the two formats, by the names node ids and configs use.
MXFP4, FP8 = "mxfp4", "fp8"
FORMATS = (MXFP4, FP8)
#: the positive fp4 e2m1 magnitudes, by code (bits 0-2); bit 3 is the sign.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: the largest ``float8_e4m3fn`` magnitude (DeepSeek-V3's quantizer divides the tile's by it).
FP8_MAX = 448.0
_BLOCK = {MXFP4: 32, FP8: 128}
#: midpoints between neighbouring magnitudes: where rounding to nearest changes code.
_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def default_block(fmt: str) -> int:
    """The block size the format's releases use: 32 elements (MXFP4), 128 x 128 (FP8)."""
    _check_format(fmt)
    return _BLOCK[fmt]


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"quantized format must be one of {FORMATS}, got {fmt!r}")


class QuantizedShapeError(ValueError):
    """Blocks and scales that do not fit each other (or a weight the blocks cannot cut whole).

    A one-line message names the key and both shapes; the fields let a check report them without
    parsing it.  ``expected`` is the scales' shape the blocks call for (``None`` where the blocks
    themselves are wrong); ``scales_shape`` is ``None`` for a weight refused before quantizing.
    """

    def __init__(self, key: str, blocks_shape: tuple[int, ...],
                 scales_shape: tuple[int, ...] | None, expected: tuple[int, ...] | None,
                 reason: str) -> None:
        self.key, self.blocks_shape, self.scales_shape = key, blocks_shape, scales_shape
        self.expected, self.reason = expected, reason
        scales = "" if scales_shape is None else f", scales {list(scales_shape)}"
        want = "" if expected is None else f" (expected scales {list(expected)})"
        super().__init__(f"{key}: {reason}: blocks {list(blocks_shape)}{scales}{want}")


class BlockCutError(ValueError):
    """A shard of an axis that would cut a quantization block: its scale cannot be split.

    ``shard`` names the shard (``"etp rank 1 of 2"``), ``start``/``stop`` its cut of an axis of
    ``size`` elements, ``block`` the block size.
    """

    def __init__(self, key: str, shard: str, start: int, stop: int, size: int,
                 block: int) -> None:
        self.key, self.shard, self.start, self.stop = key, shard, start, stop
        self.size, self.block = size, block
        super().__init__(f"{key}: {shard} holds elements {start}:{stop} of {size}, which cuts a "
                         f"quantization block of {block} (a shard must start on a multiple of "
                         f"{block} and end on one or at {size}); choose a block size that divides "
                         f"the shard, or another degree")


# ------------------------------------------------------------------------------- the cut rule
def block_span(start: int, stop: int, size: int, block: int, *, key: str = "weight",
               shard: str = "a shard") -> tuple[int, int]:
    """The blocks ``[first, end)`` that elements ``[start, stop)`` of an axis of ``size`` hold:
    THE rule every split of quantized state asks (expert tensor parallelism, a converter).

    A shard keeps whole blocks or it cannot carry its scales: it must start on a block boundary and
    end on one or at the axis' end, where the last block may be partial.  Then ``first = start //
    block`` and ``end = ceil(stop / block)``: a shard smaller than a block that ends the axis holds
    that partial block's one scale (``floor(stop / block)`` would drop it: the scale offset bug of
    vLLM #52997); a cut mid-block is refused (:class:`BlockCutError`) rather than given a
    neighbour's scale.  An empty shard holds no block, at ``ceil(start / block)``.
    """
    if not 0 <= start <= stop <= size or block < 1:
        raise ValueError(f"{key}: {shard}: {start}:{stop} is no slice of an axis of {size} (block "
                         f"{block})")
    if start == stop:  # no block, placed after those before it (as torch.chunk places it)
        return -(-start // block), -(-start // block)
    if start % block or (stop % block and stop != size):
        raise BlockCutError(key, shard, start, stop, size, block)
    return start // block, -(-stop // block)


def hidden_shards(size: int, parts: int, block: int, *, key: str = "weight",
                  name: str = "etp") -> list[tuple[int, int, int, int]]:
    """Each of ``parts`` shards of an axis of ``size`` as DTensor's ``Shard`` cuts it (the
    layout rule, ``torch.chunk``): ``(start, stop, first_block, end_block)``, refusing the split
    where any shard cuts a block (:func:`block_span`).

    Where no shard cuts a block, ``torch.chunk`` of the block grid over ``parts`` gives exactly
    these block ranges (``ceil(ceil(n/b)/k) == ceil(ceil(n/k)/b)``), so a DTensor ``Shard`` of the
    scales on their grid axis records the regions the blocks' shards need.
    """
    from reference_impl.layout import expert_range  # the one Shard rule, for any axis

    found = []
    for part in range(parts):
        lo, hi = expert_range(size, parts, part)
        found.append((lo, hi, *block_span(lo, hi, size, block, key=key,
                                          shard=f"{name} rank {part} of {parts}")))
    return found


# ------------------------------------------------------------------------------- shapes
def scales_shape(fmt: str, weight_shape: tuple[int, ...], block: int | None = None
                 ) -> tuple[int, ...]:
    """The scales' shape of a weight of ``weight_shape`` ``[..., out, in]`` in ``fmt``."""
    b = block or default_block(fmt)
    *lead, out, inn = weight_shape
    if fmt == MXFP4:
        return (*lead, out, inn // b)
    _check_format(fmt)
    return (*lead, -(-out // b), -(-inn // b))


def _check_grid(fmt: str, blocks: torch.Tensor, scales: torch.Tensor, block: int,
                key: str) -> None:
    """Refuse blocks and scales whose grids disagree, naming the key and both shapes."""
    shape, got = tuple(blocks.shape), tuple(scales.shape)
    if fmt == MXFP4:
        if blocks.dim() < 3 or shape[-1] != block // 2:
            raise QuantizedShapeError(key, shape, got, None,
                                      f"MXFP4 blocks are [..., out, in/{block}, {block // 2}]")
        expected = shape[:-1]
    else:
        if blocks.dim() < 2:
            raise QuantizedShapeError(key, shape, got, None, "FP8 blocks are [..., out, in]")
        expected = scales_shape(FP8, shape, block)
    if got != expected:
        raise QuantizedShapeError(key, shape, got, expected,
                                  f"the {fmt} scales do not match the blocks' grid")


def check_grid(fmt: str, blocks_shape: tuple[int, ...], scales_shape: tuple[int, ...],
               block: int | None = None, *, key: str = "weight") -> None:
    """Refuse blocks and scales of these shapes whose grids disagree (:class:`QuantizedShapeError`,
    one line naming ``key`` and both shapes): what a load asks of a checkpoint's index before it
    reads a byte."""
    _check_format(fmt)
    blocks = torch.empty(blocks_shape, device="meta", dtype=torch.uint8)
    scales = torch.empty(scales_shape, device="meta", dtype=torch.uint8)
    _check_grid(fmt, blocks, scales, block or default_block(fmt), key)


# ------------------------------------------------------------------------------- MXFP4
def _quantize_mxfp4(weight: torch.Tensor, block: int, key: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, out, inn = weight.shape
    if weight.dim() < 2 or inn % block or block % 2:
        raise QuantizedShapeError(key, tuple(weight.shape), None, None,
                                  f"the input axis is not a whole number of MXFP4 blocks of "
                                  f"{block}")
    x = weight.detach().float().reshape(*lead, out, inn // block, block)
    amax = x.abs().amax(dim=-1)
    # The OCP MX rule: the block's exponent is floor(log2(amax)) - 2 (e2m1's largest magnitude is
    # 6 = 1.5 * 2**2); frexp's exponent is floor(log2) + 1 exactly, with no log2 round-off.
    exponent = torch.frexp(amax).exponent - 3
    scales = (exponent + 127).clamp(0, 254)
    scaled = torch.ldexp(x, -(scales - 127).unsqueeze(-1).float()).abs()
    mids = torch.tensor(_MIDS)
    code = torch.bucketize(scaled, mids)  # a value on a midpoint goes to the lower code ...
    tie = (code < len(_MIDS)) & (scaled == mids[code.clamp(max=len(_MIDS) - 1)])
    code = code + (tie & (code % 2 == 1)).long()  # ... unless that code is odd: ties to even
    code = code | (torch.signbit(x).long() << 3)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.to(torch.uint8), scales.to(torch.uint8)


def _dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, block: int,
                      dtype: torch.dtype) -> torch.Tensor:
    lut = torch.tensor(E2M1 + tuple(-v for v in E2M1))
    b = blocks.long()
    values = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).flatten(-2)  # low nibble first
    values = torch.ldexp(values, (scales.long() - 127).unsqueeze(-1).float())
    return values.flatten(-2).to(dtype)


# ------------------------------------------------------------------------------- block FP8
def _tiles(t: torch.Tensor, block: int) -> torch.Tensor:
    """``t`` ``[..., out, in]`` zero-padded to whole tiles, as ``[..., rows, b, cols, b]``."""
    *lead, out, inn = t.shape
    rows, cols = -(-out // block), -(-inn // block)
    padded = F.pad(t, (0, cols * block - inn, 0, rows * block - out))
    return padded.reshape(*lead, rows, block, cols, block)


def _quantize_fp8(weight: torch.Tensor, block: int, key: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    if weight.dim() < 2:
        raise QuantizedShapeError(key, tuple(weight.shape), None, None,
                                  "block FP8 quantizes a weight [..., out, in]")
    out, inn = weight.shape[-2:]
    tiles = _tiles(weight.detach().float(), block)
    amax = tiles.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # zero tile: 1
    q = (tiles / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.to(torch.float8_e4m3fn).flatten(-4, -3).flatten(-2)[..., :out, :inn]
    return q.contiguous(), scale_inv


def _dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: int,
                    dtype: torch.dtype) -> torch.Tensor:
    out, inn = weight.shape[-2:]
    tiles = _tiles(weight.float(), block) * scale_inv[..., :, None, :, None]
    return tiles.flatten(-4, -3).flatten(-2)[..., :out, :inn].to(dtype)


# ------------------------------------------------------------------------------- the API
def quantize(fmt: str, weight: torch.Tensor, block: int | None = None, *,
             key: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[..., out, in]`` as ``(blocks, scales)`` in ``fmt`` (the module docstring's
    layouts); deterministic.  :class:`QuantizedShapeError` where the input axis is not a whole
    number of MXFP4 blocks."""
    _check_format(fmt)
    b = block or default_block(fmt)
    return _quantize_mxfp4(weight, b, key) if fmt == MXFP4 else _quantize_fp8(weight, b, key)


def dequantize(fmt: str, blocks: torch.Tensor, scales: torch.Tensor, block: int | None = None,
               *, dtype: torch.dtype = torch.float32, key: str = "weight") -> torch.Tensor:
    """The weight ``[..., out, in]`` that ``(blocks, scales)`` hold, in ``dtype``.

    Scales whose grid does not match the blocks' are refused (:class:`QuantizedShapeError`, naming
    ``key`` and both shapes) rather than broadcast: a squeezed singleton grid dim (Megatron-Bridge
    #5731) or scales cut at another block would otherwise scale the wrong elements, silently.
    """
    _check_format(fmt)
    b = block or default_block(fmt)
    _check_grid(fmt, blocks, scales, b, key)
    want = torch.uint8 if fmt == MXFP4 else torch.float8_e4m3fn
    if blocks.dtype != want:
        raise QuantizedShapeError(key, tuple(blocks.shape), tuple(scales.shape), None,
                                  f"{fmt} blocks are {want}, got {blocks.dtype}")
    if fmt == MXFP4:
        return _dequantize_mxfp4(blocks, scales, b, dtype)
    return _dequantize_fp8(blocks, scales, b, dtype)


@dataclass(frozen=True)
class QuantizedAxes:
    """Where one axis of the weight ``[..., out, in]`` lies in its blocks and its scales, and
    whether the format blocks it (a cut must then keep whole blocks)."""

    blocks: int
    scales: int
    blocked: bool


def quantized_axes(fmt: str, axis: str) -> QuantizedAxes:
    """The blocks' and scales' axes (negative, from the end) of the weight's ``"out"`` or
    ``"in"`` axis in ``fmt``: MXFP4 blocks only the input axis (its blocks' ``in/32`` axis and the
    scales' last), block FP8 both (the scales' grid rows and columns)."""
    _check_format(fmt)
    if axis not in ("out", "in"):
        raise ValueError(f"axis must be 'out' or 'in', got {axis!r}")
    if fmt == MXFP4:
        return QuantizedAxes(-3, -2, False) if axis == "out" else QuantizedAxes(-2, -1, True)
    return QuantizedAxes(-2, -2, True) if axis == "out" else QuantizedAxes(-1, -1, True)


def shard_quantized(fmt: str, blocks: torch.Tensor, scales: torch.Tensor, axis: str, start: int,
                    stop: int, block: int | None = None, *, key: str = "weight",
                    shard: str = "a shard") -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks and scales of elements ``[start, stop)`` of the weight's ``axis`` (``"out"``:
    its rows, ``"in"``: its columns) -- views, the one way a shard of the hidden axis takes its
    quantized state.

    Rows of MXFP4 are cut anywhere (each row has its own scales); a blocked axis is cut by
    :func:`block_span`: whole blocks, the axis' partial last block kept with its scale, a cut
    mid-block refused (:class:`BlockCutError` naming ``shard`` and the block size).
    """
    b = block or default_block(fmt)
    _check_grid(fmt, blocks, scales, b, key)
    where = quantized_axes(fmt, axis)
    size = (blocks.shape[-3] if fmt == MXFP4 else blocks.shape[-2]) if axis == "out" else (
        blocks.shape[-2] * b if fmt == MXFP4 else blocks.shape[-1])
    if not where.blocked:
        first, end = start, stop
        if not 0 <= start <= stop <= size:
            raise ValueError(f"{key}: {shard}: {start}:{stop} is no slice of an axis of {size}")
    else:
        first, end = block_span(start, stop, size, b, key=key, shard=shard)
    if fmt == MXFP4:
        kept = blocks.narrow(where.blocks, first, end - first)
    else:
        kept = blocks.narrow(where.blocks, start, stop - start)
    return kept, scales.narrow(where.scales, first, end - first)


"""Fine-tuning state on the reference MoE: LoRA adapters on every expert, over a base that may be
held quantized (:mod:`reference_impl.quantized`), frozen.

Most MoE checkpoints written today come from fine-tuning a released model, and they hold what this
module adds to a :class:`~reference_impl.model.MoEMLP` -- state that is one expert's and must move
with it at every layout:

- **adapters** (:func:`apply_lora`): ``delta = alpha / r * B @ A`` on each expert's ``gate``,
  ``up``, ``down`` and on the shared expert's.  Packed and fused layers hold them packed as NeMo
  Automodel's ``GroupedExpertsLoRA`` does (``nemo_automodel/components/_peft/lora_experts.py``),
  in its orientation, A ``[E, in, r]`` and B ``[E, r, out]`` (``x @ A @ B``): ``lora_gate_A``,
  ``lora_gate_B``, ``lora_up_*``, ``lora_down_*``; a fused layer one ``lora_gate_and_up_A`` ``[E,
  dim, r]`` shared by both halves and ``lora_gate_and_up_B`` ``[E, r, 2h]`` whose columns are the
  fused weight's rows in its ``fused_order`` (NeMo's and PEFT's fused adapter).  Unpacked experts
  and the shared expert hold PEFT's per-module ``lora_A.weight`` ``[r, in]`` and ``lora_B.weight``
  ``[out, r]`` as children of each linear (``experts.3.up.lora_A.weight``), so the base keeps its
  key.  B starts at zero as PEFT's does; ``b_init="synthetic"`` gives it values, a function of
  ``(seed, layer, global expert, linear)`` as every weight here, so a save and load can be checked.
- **a quantized base** (:func:`quantize_experts`): each routed expert weight replaced by its
  blocks and scales, persistent buffers (no gradient, and FSDP2 leaves buffers whole): packed
  ``{w}_blocks``/``{w}_scales`` (MXFP4, gpt-oss's names) or ``{w}``/``{w}_scale_inv`` (block FP8,
  DeepSeek-V3's: the weight itself in fp8); unpacked ``experts.G.up.weight_blocks`` ... alike.

The forward multiplies by the *merged* weight (:func:`effective_weight`: base, dequantized where
quantized, plus the delta), as NeMo's ``materialize_effective_weights`` does, through the layer's
``weight_hook``; so :func:`merge` is the forward's own weights, bit for bit.

Expert parallelism: :func:`keep_expert_rows` (called by
:func:`~reference_impl.parallelize.apply_expert_parallel`) keeps a packed layer's rows of every
tensor together, so one expert's base, blocks, scales and adapters move as one; unpacked experts
carry theirs as children.  Expert tensor parallelism (:func:`split_hidden`) splits the hidden axis
as the base's: **B follows it on gate and up** (column-parallel: ``B`` ``[h, r]``'s rows are the
hidden rows, ``A`` is read whole), **A follows it on down** (row-parallel: ``A`` ``[r, h]``'s
columns, ``B`` whole) -- Megatron's rule for LoRA under tensor parallelism, the one that keeps
every product local and the down's partial sums the ones the layer already reduces.  The factor
read whole is replicated over etp and its gradient summed there.  Blocks and scales split on the
hidden axis' blocks, by :func:`reference_impl.quantized.hidden_shards` (whole blocks or refused).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from reference_impl.collectives import CopyToGroup
from reference_impl.model import FUSED_WEIGHT, MoEMLP, _local, fused_half, moe_layers, moe_modules
from reference_impl.quantized import FP8, MXFP4, default_block, dequantize, hidden_shards, quantize
from reference_impl.weights import fill, fill_rows

__all__ = ["LoRASpec", "QuantSpec", "adapter_factors", "apply_lora", "effective_weight",
           "expert_state_plan", "has_tuning_state", "is_adapter", "keep_expert_rows", "lora_names",
           "merge", "merged_experts", "quantize_experts", "quantized_names", "split_hidden"]

#: the factor expert tensor parallelism splits, per adapter (the other is read whole): B's rows on
#: the column-parallel gate and up, A's columns on the row-parallel down.
ETP_FACTOR = {"gate": "B", "up": "B", "gate_and_up": "B", "down": "A"}
#: the hidden axis of a linear's ``[out, in]`` weight (``up``/``gate``: rows; ``down``: columns).
_HIDDEN = {"gate": "out", "up": "out", "gate_and_up": "out", "down": "in"}


@dataclass(frozen=True)
class LoRASpec:
    """A layer's adapters: rank ``r``, ``alpha`` (the delta is ``alpha / r * B @ A``), and how
    they were initialised."""

    r: int
    alpha: float
    seed: int
    b_init: str
    shared: bool

    @property
    def scale(self) -> float:
        return self.alpha / self.r


@dataclass(frozen=True)
class QuantSpec:
    """A layer's quantized base: its format and block size."""

    fmt: str
    block: int


def _linears(moe: MoEMLP) -> tuple[str, ...]:
    return ("gate", "up", "down") if moe.activation == "swiglu" else ("up", "down")


def _adapted(moe: MoEMLP) -> tuple[str, ...]:
    """The adapters a packed layer holds: per linear, a fused layer's gate and up as one."""
    return ("gate_and_up", "down") if moe.kind == "fused" else _linears(moe)


def lora_names(moe: MoEMLP) -> dict[str, tuple[str, str]]:
    """A packed or fused layer's adapter Parameters, ``{adapter: (A name, B name)}`` (NeMo's
    names); empty for an unpacked layer, whose experts hold theirs."""
    if moe.kind == "unpacked":
        return {}
    return {a: (f"lora_{a}_A", f"lora_{a}_B") for a in _adapted(moe)}


def quantized_names(fmt: str, weight: str) -> tuple[str, str]:
    """The (blocks, scales) names that stand for a weight named ``weight`` (``up_w``; ``weight``
    in an unpacked expert's linear): gpt-oss's ``_blocks``/``_scales``, DeepSeek-V3's fp8 weight
    under its own name and ``_scale_inv``."""
    return (f"{weight}_blocks", f"{weight}_scales") if fmt == MXFP4 else (
        weight, f"{weight}_scale_inv")


def _dims(moe: MoEMLP, adapter: str, shared: bool = False) -> tuple[int, int]:
    """``(in, out)`` of an expert's (or the shared expert's) ``adapter`` on the whole hidden
    axis."""
    c = moe.config
    hidden = (c.shared_hidden or c.hidden) if shared else c.hidden
    if adapter == "down":
        return hidden, c.dim
    return c.dim, 2 * hidden if adapter == "gate_and_up" else hidden


def _refuse_split(moe: MoEMLP, what: str) -> None:
    if moe.etp_world_size != 1:
        raise ValueError(f"MoE layer {moe.name!r} is already split over {moe.etp_world_size} "
                         f"expert-TP ranks: {what} before apply_expert_parallel's etp split")


def _module_lora(linear: nn.Module, dims: tuple[int, int], r: int, dtype: torch.dtype) -> None:
    linear.add_module("lora_A", nn.Linear(dims[0], r, bias=False, dtype=dtype))
    linear.add_module("lora_B", nn.Linear(r, dims[1], bias=False, dtype=dtype))


@torch.no_grad()
def apply_lora(model: nn.Module, r: int, alpha: float, *, seed: int = 0,
               b_init: Literal["zeros", "synthetic"] = "zeros", shared: bool = True,
               init_std: float = 0.02) -> nn.Module:
    """Attach adapters of rank ``r`` to every routed expert (and, with ``shared``, the shared
    expert) of every MoE layer of ``model``, freeze every other parameter, in place.

    A is drawn per ``(seed, layer, "lora", adapter, global expert, "A")`` in PEFT's ``[r, in]``
    orientation, whatever the kind holds, so the same expert gets the same adapter in every kind
    and at every EP degree (apply it before or after the EP split, not after expert TP's).  B is
    zeros (PEFT's start: the forward is the base's), or drawn alike with ``"synthetic"``.
    """
    if r < 1 or b_init not in ("zeros", "synthetic"):
        raise ValueError(f"apply_lora needs r >= 1 and b_init 'zeros' or 'synthetic', got r={r}, "
                         f"b_init={b_init!r}")
    layers = list(moe_modules(model))
    for moe in layers:
        _refuse_split(moe, "apply LoRA")
        if getattr(moe, "lora", None) is not None:
            raise ValueError(f"MoE layer {moe.name!r} already holds LoRA adapters")
    for moe in layers:
        spec = LoRASpec(r, alpha, seed, b_init, shared and moe.shared is not None)
        dtype, first, n = moe.config.dtype, moe.local_expert_start, moe.num_local_experts

        def draw(t: torch.Tensor, factor: str, *key: object, rows: bool = False,
                 name: str = moe.name, first: int = first) -> None:
            if factor == "B" and b_init == "zeros":
                t.zero_()
            elif rows:
                fill_rows(t, init_std, first, seed, name, "lora", *key, factor)
            else:
                fill(t, init_std, seed, name, "lora", *key, factor)

        for adapter, (a_name, b_name) in lora_names(moe).items():
            fan_in, fan_out = _dims(moe, adapter)
            a = nn.Parameter(torch.empty(n, fan_in, r, dtype=dtype))
            b = nn.Parameter(torch.empty(n, r, fan_out, dtype=dtype))
            draw(a.transpose(1, 2), "A", adapter, rows=True)  # drawn as [r, in], held as NeMo's
            draw(b.transpose(1, 2), "B", adapter, rows=True)
            moe.register_parameter(a_name, a)
            moe.register_parameter(b_name, b)
        if moe.kind == "unpacked":
            for i, expert in enumerate(moe.experts):
                for linear in _linears(moe):
                    module = getattr(expert, linear)
                    _module_lora(module, _dims(moe, linear), r, dtype)
                    draw(module.lora_A.weight, "A", linear, first + i)
                    draw(module.lora_B.weight, "B", linear, first + i)
        if spec.shared:
            for linear in _linears(moe):
                module = getattr(moe.shared, linear)
                _module_lora(module, _dims(moe, linear, shared=True), r, dtype)
                draw(module.lora_A.weight, "A", "shared", linear)
                draw(module.lora_B.weight, "B", "shared", linear)
        moe.lora = spec  # type: ignore[assignment]
        moe.weight_hook = effective_weight
        _record_state(moe)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return model


@torch.no_grad()
def quantize_experts(model: nn.Module, fmt: str, block: int | None = None) -> nn.Module:
    """Hold every routed expert weight of ``model`` quantized in ``fmt`` (blocks of ``block``),
    in place: each becomes its blocks and scales, persistent buffers (:func:`quantized_names`).

    Routed experts only: the shared expert stays as it is, as NeMo's ``GroupedExpertsMXFP4``
    keeps it.  A fused layer in block FP8 is refused: DeepSeek-V3 ships gate and up apart, and a
    128-row tile of a fused weight would straddle its two halves.  Apply it before expert TP.
    """
    b = block or default_block(fmt)
    layers = list(moe_modules(model))
    for moe in layers:
        _refuse_split(moe, "quantize the experts")
        if getattr(moe, "quant", None) is not None:
            raise ValueError(f"MoE layer {moe.name!r} is already held quantized")
        if moe.kind == "fused" and fmt == FP8:
            raise ValueError(f"MoE layer {moe.name!r}: block FP8 on a fused gate/up weight is "
                             "not a released layout (DeepSeek-V3 ships gate and up apart)")
    for moe in layers:
        holders: list[tuple[nn.Module, str]] = (
            [(getattr(e, linear), "weight") for e in moe.experts for linear in _linears(moe)]
            if moe.kind == "unpacked" else [(moe, w) for w in moe.base_weights()])
        for holder, weight in holders:
            full = getattr(holder, weight)
            blocks, scales = quantize(fmt, full, b, key=f"{moe.name}.{weight}")
            del holder._parameters[weight]
            for name, t in zip(quantized_names(fmt, weight), (blocks, scales), strict=True):
                holder.register_buffer(name, t)
        moe.quant = QuantSpec(fmt, b)  # type: ignore[assignment]
        if moe.weight_hook is None:
            moe.weight_hook = effective_weight
        _record_state(moe)
    return model


# ------------------------------------------------------------------------------- the forward
def _held(moe: MoEMLP, adapter: str, i: int) -> torch.Tensor:
    """Local expert ``i``'s weight for ``adapter`` in a packed layer (a fused layer's gate and up
    as its fused rows, in their frame under expert TP), dequantized where held quantized."""
    weight = FUSED_WEIGHT if adapter == "gate_and_up" else f"{adapter}_w"
    quant: QuantSpec | None = getattr(moe, "quant", None)
    if quant is None:
        return _local(getattr(moe, weight))[i]
    blocks, scales = (_local(getattr(moe, n))[i] for n in quantized_names(quant.fmt, weight))
    return dequantize(quant.fmt, blocks, scales, quant.block, dtype=moe.config.dtype,
                      key=f"{moe.name}.{weight}")


def _factor(moe: MoEMLP, t: torch.Tensor, adapter: str, factor: str) -> torch.Tensor:
    """An adapter factor's local data; the one expert TP reads whole passes through
    :class:`~reference_impl.collectives.CopyToGroup`, so its gradient is summed over etp."""
    local = _local(t)
    if moe.etp_world_size > 1 and ETP_FACTOR[adapter] != factor:
        return CopyToGroup.apply(local, moe.etp_mesh.get_group())
    return local


def _delta(moe: MoEMLP, i: int | None, adapter: str, module: nn.Module | None) -> torch.Tensor:
    """``alpha / r * B @ A`` ``[out, in]`` of local expert ``i``'s ``adapter`` (the etp shard)."""
    spec: LoRASpec = moe.lora  # type: ignore[assignment]
    if module is not None:  # PEFT's per-module adapter: A [r, in], B [out, r]
        lora_a, lora_b = cast(nn.Linear, module.lora_A), cast(nn.Linear, module.lora_B)
        a = _factor(moe, lora_a.weight, adapter, "A")
        b = _factor(moe, lora_b.weight, adapter, "B")
        return spec.scale * (b @ a)
    a_name, b_name = lora_names(moe)[adapter]
    a = _factor(moe, getattr(moe, a_name), adapter, "A")[i]  # [in, r]
    b = _factor(moe, getattr(moe, b_name), adapter, "B")[i]  # [r, out] (a fused one in its frame)
    return spec.scale * (b.reshape(b.shape[0], -1).mT @ a.mT)


def effective_weight(moe: MoEMLP, i: int | None, linear: str) -> torch.Tensor:
    """The weight the forward multiplies by: local expert ``i``'s (``None``: the shared expert's)
    ``linear`` ``[out, in]`` -- the base, dequantized where held quantized, plus the LoRA delta
    where adapters are attached.  Under expert TP, this rank's hidden shard.  The layer's
    ``weight_hook``."""
    lora: LoRASpec | None = getattr(moe, "lora", None)
    if i is None or moe.kind == "unpacked":
        module = getattr(moe.shared if i is None else moe.experts[i], linear)
        quant: QuantSpec | None = getattr(moe, "quant", None)
        if quant is None or i is None:
            base = _local(module.weight)
        else:
            blocks, scales = (_local(getattr(module, n)) for n in quantized_names(quant.fmt,
                                                                                  "weight"))
            base = dequantize(quant.fmt, blocks, scales, quant.block, dtype=moe.config.dtype,
                              key=f"{moe.name}.experts.{i}.{linear}.weight")
        has = lora is not None and (i is not None or lora.shared)
        return base + _delta(moe, i, linear, module) if has else base
    adapter = "gate_and_up" if moe.kind == "fused" and linear != "down" else linear
    w = _held(moe, adapter, i)
    if lora is not None:
        w = w.reshape(-1, w.shape[-1]) + _delta(moe, i, adapter, None)
    if adapter == "gate_and_up":  # the half, as a view of the expert's fused rows
        return fused_half(w.reshape(1, -1, w.shape[-1]), moe.fused_order,
                          ("gate", "up").index(linear))[0]
    return w


# ------------------------------------------------------------------------------- merged weights
def merged_experts(model: nn.Module) -> Iterator[tuple[str, int | None, str, torch.Tensor]]:
    """Every merged expert weight this rank holds: ``(layer name, global expert or None for the
    shared expert, linear, weight [out, in])`` -- the base (dequantized) plus ``alpha / r * B @
    A``, the etp shard under expert TP.  A merged export gathers these from every rank: the rows of
    one rank are not the layer (a merge over the local experts only, ms-swift #9030)."""
    with torch.no_grad():
        for name, moe in moe_layers(model):
            for i in range(moe.num_local_experts):
                for linear in _linears(moe):
                    yield name, moe.local_expert_start + i, linear, _weight(moe, i, linear)
            if moe.shared is not None:
                for linear in _linears(moe):
                    yield name, None, linear, _weight(moe, None, linear)


def _weight(moe: MoEMLP, i: int | None, linear: str) -> torch.Tensor:
    hook = moe.weight_hook
    return hook(moe, i, linear) if hook is not None else (
        _local(getattr(moe.shared, linear).weight) if i is None else moe.expert_weight(i, linear))


def merge(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the plain model this one merges to: same keys as a model of its config
    and layout built without fine-tuning state, the expert weights (packed ones stacked) merged,
    everything else as it is -- ``plain.load_state_dict(merge(model))`` gives a model whose forward
    is this one's, bit for bit.  Needs no expert-TP split (its shards are DTensors)."""
    out: dict[str, torch.Tensor] = {}
    merged = {(n, g, linear): w for n, g, linear, w in merged_experts(model)}
    for key, value in model.state_dict().items():
        parts = key.split(".")
        if is_adapter(key) or parts[-1].endswith(("_blocks", "_scales", "_scale_inv")):
            continue
        out[key] = value
    for name, moe in moe_layers(model):
        if moe.etp_world_size != 1:
            raise ValueError(f"merge: MoE layer {name!r} is split over expert-TP ranks; gather "
                             f"merged_experts() instead")
        head = f"{name}." if name else ""
        for (layer, g, linear), w in merged.items():
            if layer != name:
                continue
            if g is None:
                out[f"{head}shared.{linear}.weight"] = w
            elif moe.kind == "unpacked":
                out[f"{head}experts.{g - moe.local_expert_start}.{linear}.weight"] = w
        if moe.kind != "unpacked":
            starts = range(moe.local_expert_start, moe.local_expert_start + moe.num_local_experts)
            for linear in _linears(moe):
                out[f"{head}{linear}_w"] = torch.stack([merged[(name, g, linear)] for g in starts])
            if moe.kind == "fused":
                gate, up = out.pop(f"{head}gate_w"), out.pop(f"{head}up_w")
                fused = torch.empty((gate.shape[0], 2 * gate.shape[1], gate.shape[2]),
                                    dtype=gate.dtype)
                fused_half(fused, moe.fused_order, 0).copy_(gate)
                fused_half(fused, moe.fused_order, 1).copy_(up)
                out[f"{head}{FUSED_WEIGHT}"] = fused
    return out


def adapter_factors(model: nn.Module) -> Iterator[tuple[int, int | None, str, torch.Tensor,
                                                        torch.Tensor]]:
    """Every adapter this rank holds in PEFT's orientation: ``(layer index, global expert or None
    for the shared expert, adapter, A [r, in], B [out, r])`` (a fused layer's ``gate_and_up``: B's
    rows in its ``fused_order``).  What an adapter export writes, whatever the kind holds."""
    for _, moe in moe_layers(model):
        spec: LoRASpec | None = getattr(moe, "lora", None)
        if spec is None:
            continue
        for adapter, (a_name, b_name) in lora_names(moe).items():
            a, b = _local(getattr(moe, a_name)).detach(), _local(getattr(moe, b_name)).detach()
            for i in range(moe.num_local_experts):
                yield (moe.layer, moe.local_expert_start + i, adapter, a[i].mT,
                       b[i].reshape(spec.r, -1).mT)
        modules = [(moe.local_expert_start + i, e) for i, e in enumerate(moe.experts)] if (
            moe.kind == "unpacked") else []
        for g, holder in [*modules, *([(None, moe.shared)] if spec.shared else [])]:
            for linear in _linears(moe):
                m = getattr(holder, linear)
                yield (moe.layer, g, linear, _local(m.lora_A.weight).detach(),
                       _local(m.lora_B.weight).detach())


# ------------------------------------------------------------------------------- EP and ETP
def _packed_plan(moe: MoEMLP) -> list[tuple[str, int | None, bool, int | None]]:
    """Every packed tensor of expert state of ``moe``: ``(name, hidden axis, framed, block)``.

    The hidden axis is the one expert TP splits (``None``: read whole, replicated over etp), in
    the fused frame where ``framed`` (a fused tensor's ``2h`` axis viewed as its halves and ``h``,
    the axis after it); ``block``: the hidden axis is cut in blocks of it (quantized).
    """
    quant: QuantSpec | None = getattr(moe, "quant", None)
    plan: list[tuple[str, int | None, bool, int | None]] = []
    for weight in moe.base_weights():
        linear = "gate_and_up" if weight == FUSED_WEIGHT else weight[:-2]
        rows = _HIDDEN[linear] == "out"
        fused = weight == FUSED_WEIGHT
        if quant is None:
            plan.append((weight, 1 if rows else 2, fused, None))
            continue
        blocks, scales = quantized_names(quant.fmt, weight)
        if quant.fmt == MXFP4:  # rows hold their own scales; down's hidden is the blocked input
            plan += [(blocks, 1 if rows else 2, fused, None if rows else quant.block),
                     (scales, 1 if rows else 2, fused, None if rows else quant.block)]
        else:
            plan += [(blocks, 1 if rows else 2, False, quant.block),
                     (scales, 1 if rows else 2, False, quant.block)]
    adapters = lora_names(moe) if getattr(moe, "lora", None) is not None else {}
    for adapter, (a_name, b_name) in adapters.items():
        hidden_b = ETP_FACTOR[adapter] == "B"
        plan += [(a_name, None if hidden_b else 1, False, None),
                 (b_name, 2 if hidden_b else None, adapter == "gate_and_up", None)]
    return plan


def expert_state_plan(moe: MoEMLP) -> list[tuple[str, int | None, bool, int | None]]:
    """Every packed tensor of expert state of a layer with fine-tuning state: ``(name, hidden axis
    or None, framed, block)``, the plan the EP and ETP splits follow (a checkpoint presents them by
    it: reference_impl.tuned_checkpoint).  ``framed``: its axis ``hidden axis`` is a fused gate/up
    axis, held in the fused frame (``[2, h]`` or ``[h, 2]`` there) under expert TP."""
    return _packed_plan(moe)


def is_adapter(name: str) -> bool:
    """Whether the state-dict entry ``name`` is a LoRA adapter's (packed ``lora_up_A``, or PEFT's
    ``...up.lora_A.weight``): what an adapter-only checkpoint holds."""
    return ".lora_" in f".{name}"


def has_tuning_state(moe: MoEMLP) -> bool:
    """Whether ``moe`` holds LoRA adapters or a quantized base."""
    return getattr(moe, "lora", None) is not None or getattr(moe, "quant", None) is not None


def _record_state(moe: MoEMLP) -> None:
    """Tell the layer which packed tensors of expert state it now holds
    (:meth:`~reference_impl.model.MoEMLP.packed_weights` answers with them)."""
    if moe.kind != "unpacked":
        moe.expert_state = tuple(name for name, *_ in _packed_plan(moe))


def keep_expert_rows(moe: MoEMLP, start: int, end: int) -> None:
    """Keep global experts ``[start, end)`` of a packed layer's every tensor of expert state --
    base, blocks, scales and adapters alike (copies, so the whole can be freed); a Parameter stays
    a Parameter (its ``requires_grad`` kept), a buffer a buffer."""
    for name, *_ in _packed_plan(moe):
        full = getattr(moe, name)
        kept = full.detach()[start:end].clone()
        if name in moe._parameters:
            setattr(moe, name, nn.Parameter(kept, requires_grad=full.requires_grad))
        else:
            moe.register_buffer(name, kept)


def _frame(t: torch.Tensor, axis: int, order: str) -> tuple[torch.Tensor, int]:
    """``t`` with its fused ``2h`` axis ``axis`` viewed as the frame's two (``[2, h]``
    concatenated, ``[h, 2]`` interleaved), and the frame's hidden axis."""
    shape = list(t.shape)
    two, h = 2, shape[axis] // 2
    pair = [two, h] if order == "concatenated" else [h, two]
    framed = t.reshape(*shape[:axis], *pair, *shape[axis + 1:])
    return framed, axis + 1 if order == "concatenated" else axis


def split_hidden(moe: MoEMLP, etp_mesh: Any) -> None:
    """Expert tensor parallelism for a layer with fine-tuning state: every tensor of expert state
    a DTensor over ``etp_mesh``, ``Shard`` on its hidden axis or ``Replicate`` (the factor read
    whole), quantized blocks and scales on the hidden axis' blocks only where no shard cuts one
    (:func:`~reference_impl.quantized.hidden_shards` refuses it, naming the tensor)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    etp = etp_mesh.size()
    hidden = moe.config.hidden

    def place(holder: nn.Module, name: str, axis: int | None, block: int | None,
              t: torch.Tensor) -> None:
        if block is not None:
            hidden_shards(hidden, etp, block, key=f"{moe.name}.{name}")
        placement = Replicate() if axis is None else Shard(axis)
        dt = distribute_tensor(t.detach(), etp_mesh, [placement], src_data_rank=None)
        if name in holder._parameters:
            setattr(holder, name, nn.Parameter(dt, requires_grad=holder._parameters[name]
                                               .requires_grad))  # type: ignore[union-attr]
        else:
            holder.register_buffer(name, dt)

    if moe.kind != "unpacked":
        for name, axis, framed, block in _packed_plan(moe):
            t = getattr(moe, name)
            if framed and axis is not None:  # rows (base, blocks, scales) or B's columns
                t, axis = _frame(t, 2 if name.startswith("lora_") else 1, moe.fused_order)
            place(moe, name, axis, block, t)
    else:
        quant: QuantSpec | None = getattr(moe, "quant", None)
        for expert in moe.experts:
            for linear in _linears(moe):
                module = getattr(expert, linear)
                axis = 0 if _HIDDEN[linear] == "out" else 1
                if quant is None:
                    place(module, "weight", axis, None, module.weight)
                else:
                    blocked = quant.fmt == FP8 or axis == 1
                    for name in quantized_names(quant.fmt, "weight"):
                        place(module, name, axis, quant.block if blocked else None,
                              getattr(module, name))
                if getattr(moe, "lora", None) is not None:
                    hidden_b = ETP_FACTOR[linear] == "B"
                    place(module.lora_A, "weight", None if hidden_b else 1, None,
                          module.lora_A.weight)
                    place(module.lora_B, "weight", 0 if hidden_b else None, None,
                          module.lora_B.weight)
    moe.etp_world_size, moe.etp_mesh = etp, etp_mesh

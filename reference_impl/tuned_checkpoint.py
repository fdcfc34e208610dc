"""Fine-tuning state in a DCP checkpoint: adapters, quantized blocks and scales under their global
expert ids, the same at every (ep, etp, FSDP/HSDP) layout, and the adapter-only checkpoint.

A layer holding LoRA adapters or a quantized base (:mod:`reference_impl.lora`) is saved in its own
kind's form, which :class:`~reference_impl.expert_layout.ExpertLayout` presents through the views
made here:

- **packed and fused layers**: every packed tensor of expert state the EP and ETP splits move
  together (:func:`~reference_impl.lora.expert_state_plan`: ``lora_{lin}_{A,B}``, ``{w}_blocks``
  / ``{w}_scales`` (MXFP4), ``{w}`` in fp8 / ``{w}_scale_inv`` (FP8), a frozen unquantized base)
  is one ``[E, ...]`` tensor among all experts, ``Shard(0)`` over ep nested with its etp (and
  FSDP) placement: one DCP item per tensor and moment per rank's chunk, blocks and scales of one
  expert in the same rows of their two keys.  A fused gate/up axis (the fused base, its blocks and
  scales on their row axis, ``lora_gate_and_up_B`` on its columns) is presented as ``[..., 2, h,
  ...]``, gate then up, whatever the row order and whether expert TP holds it in its frame
  (:func:`canonical_pairs`, :func:`~reference_impl.fused.canonical_fused`'s rule on any axis): the
  ``2h`` axis itself would be two regions per etp rank, which no DCP item describes.
- **unpacked layers**: each expert's tensors under its global id (``experts.G.up.lora_A.weight``,
  ``experts.G.up.weight_blocks``, ``...weight_scales``, fp8 ``experts.G.up.weight`` and
  ``...weight_scale_inv``), whole or an etp DTensor.
- the shared expert's ``shared.{lin}.lora_{A,B}.weight``: whole tensors, as any dense one.

Why its own form only: a packed adapter pair has no per-expert twin in a fused layer (one A shared
by gate and up), PEFT's per-module orientation is the transpose of NeMo's packed one, and the
quantized base of one kind is another kind's only after a re-quantization; a translation between
them would be a converter's job (:mod:`reference_impl.peft_export` writes PEFT's), not a load's.  A
load of another form is refused naming the first key the checkpoint lacks.

:func:`check_saved_tuning` reads the checkpoint's index before anything is loaded: scales whose
grid does not match their blocks' are the one-line
:class:`~reference_impl.quantized.QuantizedShapeError` (DCP would assert on a shape, or worse,
load the scales of another block size), and a key the model presents that the checkpoint lacks
or holds in another shape is a one-line ValueError.  :func:`adapters_only` keeps what an
adapter-only save holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from reference_impl.fused import _moved, _view
from reference_impl.lora import (
    QuantSpec,
    _linears,
    expert_state_plan,
    has_tuning_state,
    is_adapter,
    quantized_names,
)
from reference_impl.model import MoEMLP, moe_layers
from reference_impl.quantized import check_grid

__all__ = ["adapters_only", "canonical_pairs", "check_saved_tuning", "own_forms", "tuned_parts"]


def canonical_pairs(t: torch.Tensor, axis: int, order: str, framed: bool,
                    where: str = "a fused tensor") -> torch.Tensor:
    """``t`` with its fused gate/up axis ``axis`` (``2h``, or the frame's two axes where
    ``framed``) as ``[2, h]`` at ``axis, axis + 1``, gate then up: a view of the rank's data, a
    DTensor placed on the same mesh where ``t`` is one (a ``Shard`` of the ``2h`` axis itself is
    refused: no region holds it)."""
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    shape = list(t.shape)
    placements = list(t.placements) if isinstance(t, DTensor) else None
    if not framed:
        pair = [2, shape[axis] // 2] if order == "concatenated" else [shape[axis] // 2, 2]
        local = local.unflatten(axis, pair)
        shape[axis:axis + 1] = pair
        if placements is not None:
            placements = _moved(placements,
                                lambda d: d if d < axis else None if d == axis else d + 1, where)
    if order == "interleaved":  # [h, 2] -> [2, h]
        local = local.transpose(axis, axis + 1)
        shape[axis], shape[axis + 1] = shape[axis + 1], shape[axis]
        if placements is not None:
            swap = {axis: axis + 1, axis + 1: axis}
            placements = _moved(placements, lambda d: swap.get(d, d), where)
    return _view(t, local, placements, tuple(shape))


def _same(t: torch.Tensor) -> torch.Tensor:
    """A tensor presented as it is (shared with reference_impl.expert_layout)."""
    return t


def _own_form(moe: MoEMLP) -> str:
    return {"unpacked": "per-expert", "fused": "fused"}.get(moe.kind, "packed")


def tuned_parts(name: str, moe: MoEMLP, form: str
                ) -> dict[str, tuple[tuple[str, Callable[[torch.Tensor], torch.Tensor]], ...]]:
    """How a layer with fine-tuning state presents its packed tensors: ``{key: ((key, view),)}``
    (each under its own key, among all experts), nothing for an unpacked layer (its experts are
    renamed to their global ids).  ``form`` must be the layer's own kind's (module docstring)."""
    own = _own_form(moe)
    if form != own:
        raise ValueError(f"MoE layer {name!r} holds fine-tuning state (LoRA adapters or a "
                         f"quantized base), which is saved and loaded in its own kind's form "
                         f"({own}) only, not the {form} form")
    pre = f"{name}." if name else ""
    framed = moe.etp_world_size > 1  # expert TP holds a fused axis in its frame
    parts: dict[str, tuple[tuple[str, Callable[[torch.Tensor], torch.Tensor]], ...]] = {}
    for tensor, axis, fused, _ in expert_state_plan(moe):
        key, view = f"{pre}{tensor}", _same
        if fused and axis is not None:
            view = partial(canonical_pairs, axis=axis, order=moe.fused_order, framed=framed,
                           where=f"MoE layer {moe.name!r}: {tensor}")
        parts[key] = ((key, view),)
    return parts


def own_forms(model: nn.Module) -> dict[str, str]:
    """The form each layer of ``model`` with fine-tuning state loads: its own kind's."""
    return {name: _own_form(moe) for name, moe in moe_layers(model) if has_tuning_state(moe)}


def adapters_only(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` (a translated ``{"model", "optimizer"}`` dict) restricted to the LoRA adapters
    (:func:`~reference_impl.lora.is_adapter`): their tensors, their optimizer state, and param
    groups listing them only -- what PEFT's fine-tuning writes, no base.  The base is frozen, so
    the optimizer holds state for adapters alone; a group's settings (lr, betas ...) stay."""
    out = dict(state)
    out["model"] = {k: v for k, v in state["model"].items() if is_adapter(k)}
    optimizer = state.get("optimizer")
    if optimizer is not None:
        out["optimizer"] = {
            **optimizer,
            "state": {k: v for k, v in optimizer.get("state", {}).items() if is_adapter(k)},
            "param_groups": [{**g, "params": [p for p in g["params"] if is_adapter(p)]}
                             for g in optimizer.get("param_groups", [])]}
    return out


def _pairs(name: str, moe: MoEMLP, quant: QuantSpec) -> Iterator[tuple[str, str]]:
    """The (blocks, scales) keys of a quantized layer, under global ids."""
    pre = f"{name}." if name else ""
    if moe.kind != "unpacked":
        for weight in moe.base_weights():
            blocks, scales = quantized_names(quant.fmt, weight)
            yield f"{pre}{blocks}", f"{pre}{scales}"
        return
    blocks, scales = quantized_names(quant.fmt, "weight")
    for g in range(moe.num_experts):
        for linear in _linears(moe):
            yield (f"{pre}experts.{g}.{linear}.{blocks}", f"{pre}experts.{g}.{linear}.{scales}")


def _size(entry: Any) -> tuple[int, ...] | None:
    size = getattr(entry, "size", None)
    return None if size is None or callable(size) else tuple(size)


def check_saved_tuning(model: nn.Module, saved: Mapping[str, Any], where: str,
                       presented: Mapping[str, Any] | None = None) -> None:
    """Refuse, before anything is loaded, a checkpoint (its DCP index ``saved``, keys
    ``model.<name>``) whose quantized scales do not match their blocks' grid
    (:class:`~reference_impl.quantized.QuantizedShapeError`, one line: the scales' key and both
    shapes); and, given the ``presented`` model state the load will ask for, a tensor of a layer
    with fine-tuning state that the checkpoint lacks or holds in another global shape (a
    ValueError naming the key: another form, kind, block size, or an adapter-only save)."""
    tuned = [(name, moe) for name, moe in moe_layers(model) if has_tuning_state(moe)]
    for name, moe in tuned:
        quant: QuantSpec | None = getattr(moe, "quant", None)
        if quant is None:
            continue
        for blocks, scales in _pairs(name, moe, quant):
            b, s = (_size(saved.get(f"model.{k}")) for k in (blocks, scales))
            if b is not None and s is not None:
                check_grid(quant.fmt, b, s, quant.block, key=f"model.{scales}")
    if presented is None:
        return
    heads = tuple(f"{name}." if name else "" for name, _ in tuned)
    for key, value in presented.items():
        if not (isinstance(value, torch.Tensor) and key.startswith(heads)):
            continue
        got = _size(saved.get(f"model.{key}"))
        if got is None:
            adapters = any(is_adapter(k) for k in saved) and not any(
                k.startswith("model.") and not is_adapter(k) for k in saved)
            hint = ("; it is an adapter-only checkpoint: load it with adapters_only=True"
                    if adapters else "")
            raise ValueError(f"{where}: the checkpoint holds no 'model.{key}', which the model's "
                             f"fine-tuning state needs (saved in another form or kind?){hint}")
        if got != tuple(value.shape):
            raise ValueError(f"{where}: 'model.{key}' is {list(got)} in the checkpoint, but "
                             f"{list(value.shape)} in the model (another block size, rank or "
                             f"expert count?)")

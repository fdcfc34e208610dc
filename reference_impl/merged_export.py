"""A fine-tuned model's merged release: every expert's base (dequantized where held quantized) plus
``alpha / r * B @ A``, in the plain model's per-expert form, gathered from every rank.

After LoRA fine-tuning the release most users load is the merged model: the checkpoint a plain
model of the same config holds, whose forward is the fine-tuned one's.  Reported trainers get this
wrong in two ways the reference must not: a merge over the experts one rank holds, the others'
written as they were or not at all (ms-swift #9030, unsloth-zoo #885: the expert count taken from
one shard), and a merged save that writes the base with the delta dropped (unsloth-zoo #647, #812).
So the merge here is per global expert, from the forward's own weights
(:func:`~reference_impl.lora.merged_experts`), and gathered:

- FSDP2's shards are unsharded for the merge (the forward's view of each weight) and resharded
  after;
- under expert TP each rank's merged weight is its hidden shard, and the shards of one expert are
  put together over the layer's expert-TP group (rows of ``gate``/``up``, columns of ``down``: the
  hidden axis of each);
- every rank offers the experts it holds, each under its global id, as whole tensors; replicas
  offer equal tensors under equal keys, and DCP keeps one.

The result has the keys a plain model's per-expert save has (``layers.N.moe.experts.G.up.weight``,
``layers.N.moe.shared.up.weight``), so the Hugging Face export (:mod:`reference_impl.hf`) writes it
as it writes a model that was never fine-tuned.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from reference_impl.lora import has_tuning_state, is_adapter, merged_experts
from reference_impl.model import MoEMLP, moe_layers

__all__ = ["merged_state"]

#: the hidden axis of each linear's ``[out, in]`` weight: what expert TP splits.
_HIDDEN_AXIS = {"gate": 0, "up": 0, "down": 1}
#: the suffixes of a quantized base's tensors (MXFP4's blocks and scales, block FP8's scale_inv).
_QUANTIZED = ("_blocks", "_scales", "_scale_inv")


def _fsdp_modules(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _whole_hidden(moe: MoEMLP, linear: str, weight: torch.Tensor) -> torch.Tensor:
    """``weight``, this rank's hidden shard of one expert's merged ``linear``, put together over the
    layer's expert-TP group (in its ranks' order); as it is without expert TP."""
    import torch.distributed as dist

    if moe.etp_world_size == 1:
        return weight
    group = moe.etp_mesh.get_group()
    shard = weight.contiguous()
    parts = [torch.empty_like(shard) for _ in range(moe.etp_world_size)]
    dist.all_gather(parts, shard, group=group)
    return torch.cat(parts, dim=_HIDDEN_AXIS[linear])


def _tuned_expert_state(key: str, layers: dict[str, MoEMLP]) -> bool:
    """Whether state-dict ``key`` is expert state of a fine-tuned layer (adapters, a quantized
    base, expert and shared weights): what the merged weights replace."""
    for name, moe in layers.items():
        head = f"{name}." if name else ""
        if not key.startswith(head) or not has_tuning_state(moe):
            continue
        rest = key[len(head):]
        return (is_adapter(rest) or rest.endswith(_QUANTIZED) or rest.startswith("experts.")
                or (rest.startswith("shared.") and rest.endswith(".weight"))
                or rest.split(".")[0].endswith("_w"))
    return False


def merged_state(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (this rank's model state dict, as get_model_state_dict names it) with every
    fine-tuned layer's expert state replaced by its merged weights, whole, under the plain model's
    per-expert keys.  A collective on every rank (the unshard, the expert-TP gather)."""
    layers = dict(moe_layers(model))
    out = {k: v for k, v in state.items() if not _tuned_expert_state(k, layers)}
    fsdp = _fsdp_modules(model)
    for module in fsdp:
        module.unshard()
    try:
        with torch.no_grad():
            for name, expert, linear, weight in merged_experts(model):
                head = f"{name}." if name else ""
                key = (f"{head}shared.{linear}.weight" if expert is None
                       else f"{head}experts.{expert}.{linear}.weight")
                whole = weight if expert is None else _whole_hidden(layers[name], linear, weight)
                out[key] = whole.detach().clone()
    finally:
        for module in fsdp:
            module.reshard()
    return out

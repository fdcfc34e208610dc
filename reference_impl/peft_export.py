"""The adapter export in PEFT's own format: ``adapter_model.safetensors`` + ``adapter_config.json``,
for the reference's Hugging Face family (:mod:`reference_impl.hf`, ``Ernie4_5_MoeForCausalLM``).

A LoRA fine-tune reaches its users as an adapter that PEFT's loader (``PeftModel.from_pretrained``
on the transformers class) reads, so the reference writes one, the truth an export at any layout is
held to.  Two forms, as PEFT 0.21 writes them (read in ``peft/tuners/lora/layer.py`` and
``peft/tuners/tuners_utils.py``, and checked by saving PEFT's own adapters):

- ``"param_wrapper"``, the form for transformers 5's packed experts (``mlp.experts.gate_up_proj``
  ``[E, 2h, dim]``, ``down_proj`` ``[E, dim, h]``, what Ernie 4.5 MoE holds): LoRA on the
  parameters themselves, ``target_parameters``, each wrapped by ``lora.ParamWrapper``.  Its A is
  ``lora_A.weight`` ``[r * E, in]`` read as ``[E, r, in]`` (**expert-major**), its B
  ``lora_B.weight`` ``[out, r * E]`` read as ``[out, r, E]`` (**rank-major**) -- the two orders
  one tool reshaping B expert-major scrambles (unsloth #6930).  Two targets on one module nest:
  PEFT matches ``target_parameters`` sorted and walks each module's parameters in registration
  order, so ``gate_up_proj`` is wrapped first (inner: ``experts.base_layer.lora_A.weight``) and
  ``down_proj`` around it (``experts.lora_A.weight``).  A layer with separate gate and up adapters
  (packed, unpacked) has no one rank-``r`` adapter on ``gate_up_proj``: it is written exactly as
  rank ``2r`` (A the two A's stacked, B block-diagonal) with ``rank_pattern``/``alpha_pattern``
  doubling both, so ``alpha / r`` is the same.
- ``"per_expert"``: PEFT's ``lora.Linear`` on per-expert modules,
  ``mlp.experts.G.{gate,up,down}_proj.lora_A.weight`` ``[r, in]`` / ``lora_B.weight`` ``[out, r]``
  (``target_modules``), the form of models whose experts are modules; a fused adapter is written as
  gate and up sharing A.

The shared expert is ``mlp.shared_experts.{gate,up,down}_proj`` (``lora.Linear``) in both.
Every expert of every layer is needed: the export refuses a model split over EP or expert-TP ranks
(gather the adapters, :func:`~reference_impl.lora.adapter_factors` on every rank, and call
:func:`peft_state` with all of them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from reference_impl.hf import write_safetensors_file
from reference_impl.lora import LoRASpec, adapter_factors
from reference_impl.model import moe_layers

__all__ = ["ADAPTER_CONFIG", "ADAPTER_FILE", "FORMS", "export_peft", "peft_config", "peft_state"]

ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
FORMS = ("param_wrapper", "per_expert")
_PREFIX = "base_model.model.model.layers"
_HF = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
#: the ParamWrapper nesting on ``mlp.experts``: what precedes ``lora_A`` per parameter.
_NESTED = {"gate_up_proj": "experts.base_layer", "down_proj": "experts"}

Factor = tuple[int, int | None, str, torch.Tensor, torch.Tensor]


def _halves(b: torch.Tensor, order: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused adapter's B ``[2h, r]`` (rows in ``order``) as its gate and up rows."""
    h = b.shape[0] // 2
    return (b[:h], b[h:]) if order == "concatenated" else (b[0::2], b[1::2])


def peft_state(factors: Iterable[Factor], num_experts: int, form: str = "param_wrapper", *,
               fused_order: str = "concatenated") -> dict[str, torch.Tensor]:
    """PEFT's ``adapter_model.safetensors`` tensors from every adapter of a model
    (:func:`~reference_impl.lora.adapter_factors`' tuples, from all ranks); ValueError names an
    expert missing from a layer (a merge of one rank's experts must not pass as the layer's)."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    out: dict[str, torch.Tensor] = {}
    routed: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for layer, g, adapter, a, b in factors:
        pairs = [(adapter, a, b)]
        if adapter == "gate_and_up" and (form == "per_expert" or g is None):
            gate, up = _halves(b, fused_order)
            pairs = [("gate", a, gate), ("up", a, up)]
        for name, fa, fb in pairs:
            if g is None or form == "per_expert":
                where = "shared_experts" if g is None else f"experts.{g}"
                key = f"{_PREFIX}.{layer}.mlp.{where}.{_HF[name]}"
                out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = fa, fb
            else:
                routed.setdefault((layer, name), {})[g] = (fa, fb)
    for (layer, name), experts in sorted(routed.items()):
        if sorted(experts) != list(range(num_experts)):
            missing = sorted(set(range(num_experts)) - set(experts))
            raise ValueError(f"layer {layer} {name}: adapters of experts {missing} of "
                             f"{num_experts} are missing; the export needs every expert")
    layers = sorted({layer for layer, _ in routed})
    for layer in layers:
        gate_up = _gate_up(routed, layer, num_experts, fused_order)
        down = [routed[(layer, "down")][g] for g in range(num_experts)]
        for param, per_expert in (("gate_up_proj", gate_up), ("down_proj", down)):
            key = f"{_PREFIX}.{layer}.mlp.{_NESTED[param]}"
            out[f"{key}.lora_A.weight"] = torch.cat([a for a, _ in per_expert])  # expert-major
            out[f"{key}.lora_B.weight"] = torch.stack([b for _, b in per_expert],
                                                      dim=-1).flatten(-2)  # rank-major
    return {k: v.detach().contiguous() for k, v in out.items()}


def _gate_up(routed: Mapping[tuple[int, str], Mapping[int, tuple[torch.Tensor, torch.Tensor]]],
             layer: int, num_experts: int, order: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each expert's adapter on HF's ``gate_up_proj`` (gate rows, then up rows): a fused one with
    its B's rows put in that order, separate gate and up ones as one of rank ``2r``."""
    if (layer, "gate_and_up") in routed:
        fused = routed[(layer, "gate_and_up")]
        return [(fused[g][0], torch.cat(_halves(fused[g][1], order))) for g in range(num_experts)]
    found = []
    for g in range(num_experts):
        (a_gate, b_gate), (a_up, b_up) = routed[(layer, "gate")][g], routed[(layer, "up")][g]
        b = torch.block_diag(b_gate, b_up)
        found.append((torch.cat([a_gate, a_up]), b))
    return found


def peft_config(spec: LoRASpec, form: str, fused: bool, shared: bool) -> dict[str, Any]:
    """``adapter_config.json`` for adapters of ``spec`` in ``form`` (``fused``: one rank-``r``
    adapter on gate and up)."""
    # The shared expert by its parameters: PEFT 0.21 rewrites a target_modules name ending in
    # gate_proj/up_proj/down_proj into the fused experts' gate_up_proj for transformers 5 MoE
    # families (utils/transformers_weight_conversion.py), so naming the shared expert's modules
    # would drop its adapters and double the routed rank; a 2-D ParamWrapper is lora.Linear's.
    shared_targets = [f"mlp.shared_experts.{p}.weight" for p in _HF.values()] if shared else []
    config: dict[str, Any] = {
        "peft_type": "LORA", "r": spec.r, "lora_alpha": spec.alpha, "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True,
        "inference_mode": True, "use_rslora": False, "use_dora": False, "task_type": None,
        "base_model_name_or_path": None, "rank_pattern": {}, "alpha_pattern": {}}
    if form == "per_expert":
        return {**config, "target_modules": [f"experts.{p}" for p in _HF.values()],
                "target_parameters": shared_targets}
    config.update(target_modules=[], target_parameters=[
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj", *shared_targets])
    if not fused:
        config["rank_pattern"] = {"mlp.experts.gate_up_proj": 2 * spec.r}
        config["alpha_pattern"] = {"mlp.experts.gate_up_proj": 2 * spec.alpha}
    return config


def export_peft(model: nn.Module, directory: str | os.PathLike[str],
                form: str = "param_wrapper") -> None:
    """Write ``model``'s adapters in PEFT's format to ``directory``: a whole model (every expert
    on this rank); a split one is refused, naming the layer and the experts it holds."""
    layers = list(moe_layers(model))
    specs = [getattr(moe, "lora", None) for _, moe in layers]
    if not layers or any(s is None for s in specs):
        raise ValueError("export_peft: the model has MoE layers without LoRA adapters")
    for name, moe in layers:
        if moe.num_local_experts != moe.num_experts or moe.etp_world_size != 1:
            raise ValueError(f"export_peft: {name} holds experts {moe.local_expert_start}:"
                             f"{moe.local_expert_start + moe.num_local_experts} of "
                             f"{moe.num_experts} (etp {moe.etp_world_size}); gather every "
                             f"rank's adapter_factors and call peft_state")
    moe = layers[0][1]
    spec: LoRASpec = specs[0]  # type: ignore[assignment]
    if moe.activation != "swiglu":
        raise ValueError("export_peft: the family's experts are SwiGLU (gate_up_proj)")
    tensors = peft_state(adapter_factors(model), moe.num_experts, form,
                         fused_order=moe.fused_order)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors_file(tensors, directory / ADAPTER_FILE)
    config = peft_config(spec, form, moe.kind == "fused", spec.shared)
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))

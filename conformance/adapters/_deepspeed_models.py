"""The models the ``deepspeed-autoep`` adapters hand to AutoEP, and their names in AutoEP's form.

* :func:`mixtral_model`: plain torch modules with the structure AutoEP's ``mixtral`` preset finds
  (fused ``gate_up_proj`` / ``down_proj``, a linear router, a LayerNorm per layer).
* :func:`deepseek_v3_model`: transformers' own ``DeepseekV3ForCausalLM`` (the installed
  transformers: the environment's 5.18.0, or 5.24.0 under ci/conformance.sh's overlay) at the
  suite's sizes (:func:`conformance.adapters.transformers_deepseek.deepseek_v3_config`), for
  AutoEP's ``deepseek_v3`` preset: multi-head latent attention, a shared expert, and the sigmoid
  router's ``mlp.gate.e_score_correction_bias``, a persistent fp32 ``[E]`` buffer AutoEP moves onto
  its own router.

Every value is a function of the seed and global identities: an expert's ``gate_up_proj`` row
is ``[w1; w3]`` (AutoEP splits it so, gate first), ``down_proj``'s is ``w2``, by global expert id;
every other parameter and the expert bias by the name it has after AutoEP's conversion
(:func:`canonical_name`), within its layer, so the ground truth (converted at ep=1) and every
engine agree on them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from typing import Any

from conformance.adapter import Spec
from conformance.synthetic import synthetic_weight

__all__ = ["canonical_name", "deepseek_v3_model", "dense_params", "mixtral_model"]

#: a name within layer N (``model.layers.N.<name>``), in the source model and AutoEP's alike.
IN_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
EXPERTS = "mlp.experts."
#: the persistent buffers the source models give synthetic values (the last part of the name).
SYNTHETIC_BUFFERS = ("e_score_correction_bias",)


@cache
def _classes() -> type:
    """The Mixtral-shaped model: plain torch modules with the structure AutoEP's mixtral preset
    finds."""
    import torch
    from torch import nn

    class MixtralExperts(nn.Module):
        """Transformers >= 5 storage: gate and up fused on one 3-D parameter."""

        def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * hidden, dim))
            self.down_proj = nn.Parameter(torch.zeros(num_experts, dim, hidden))
            self.act_fn = nn.SiLU()  # AutoEP checks it against the preset's SwiGLU

    class MixtralSparseMoeBlock(nn.Module):
        def __init__(self, spec: Spec) -> None:
            super().__init__()
            self.gate = nn.Linear(spec.dim, spec.num_experts, bias=False)
            self.experts = MixtralExperts(spec.num_experts, spec.dim, spec.hidden)

    class MixtralDecoderLayer(nn.Module):
        def __init__(self, spec: Spec) -> None:
            super().__init__()
            self.input_layernorm = nn.LayerNorm(spec.dim)
            self.mlp = MixtralSparseMoeBlock(spec)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # AutoEP's layer gives [B, S, H], or that and the router logits
            out = self.mlp(self.input_layernorm(x))
            return x + (out[0] if isinstance(out, tuple) else out)

    class MixtralModel(nn.Module):
        def __init__(self, spec: Spec) -> None:
            super().__init__()
            self.layers = nn.ModuleList(MixtralDecoderLayer(spec) for _ in range(spec.num_layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    class MixtralConfig:
        model_type = "mixtral"

        def __init__(self, spec: Spec) -> None:
            self.num_local_experts = spec.num_experts
            self.num_experts_per_tok = min(spec.top_k, spec.num_experts)
            self.hidden_size = spec.dim
            self.intermediate_size = spec.hidden

    class MixtralForCausalLM(nn.Module):
        def __init__(self, spec: Spec) -> None:
            super().__init__()
            self.config = MixtralConfig(spec)
            self.model = MixtralModel(spec)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

    return MixtralForCausalLM


def mixtral_model(spec: Spec, seed: int) -> Any:
    """The global Mixtral-shaped model, filled (:func:`_fill`)."""
    return _fill(_classes()(spec), spec, seed)


def deepseek_v3_model(spec: Spec, seed: int) -> Any:
    """transformers' ``DeepseekV3ForCausalLM`` in fp32, filled (:func:`_fill`), its expert bias
    :func:`conformance.synthetic_weight` at the transformers adapter's scale
    (:data:`~conformance.adapters.transformers_deepseek.BIAS_SCALE`)."""
    from transformers import DeepseekV3ForCausalLM
    from transformers.utils import logging

    from conformance.adapters.transformers_deepseek import BIAS_SCALE, deepseek_v3_config

    logging.set_verbosity_error()
    model = DeepseekV3ForCausalLM(deepseek_v3_config(spec)).float()
    return _fill(model, spec, seed, bias_scale=BIAS_SCALE)


def canonical_name(name: str) -> str:
    """A source model's name within its layer as AutoEP's model names it: AutoEP replaces the MoE
    block's router ``mlp.gate`` by ``mlp.router`` holding it as ``mlp.router.gate`` and the expert
    bias as ``mlp.router.e_score_correction_bias``."""
    name = name.replace("mlp.gate.e_score_correction_bias", "mlp.router.e_score_correction_bias")
    return name.replace("mlp.gate.", "mlp.router.gate.")


def dense_params(module: Any) -> Iterator[tuple[int | None, str, Any]]:
    """``(layer, name, parameter)`` for every non-expert parameter of ``module`` (the source model
    or AutoEP's): a layer's by its name within the layer, the rest (embeddings, the final norm, the
    head) by their full name with no layer."""
    for fqn, p in module.named_parameters():
        match = IN_LAYER.match(fqn)
        if match is None:
            yield None, fqn, p
        elif not match.group(2).startswith(EXPERTS):
            yield int(match.group(1)), match.group(2), p


def _fill(model: Any, spec: Spec, seed: int, bias_scale: float = 0.02) -> Any:
    """Every expert by global id, every other parameter and each expert bias (scale
    ``bias_scale``) by its canonical name (the module docstring)."""
    import torch

    from conformance.adapters.torch_native import persistent_buffers

    with torch.no_grad():
        for layer, block in enumerate(model.model.layers):
            experts = block.mlp.experts
            shape = (spec.hidden, spec.dim)
            for g in range(spec.num_experts):
                halves = [synthetic_weight(seed, layer, g, name, shape) for name in ("w1", "w3")]
                experts.gate_up_proj[g].copy_(torch.cat(halves))
                experts.down_proj[g].copy_(synthetic_weight(seed, layer, g, "w2", shape[::-1]))
        for where, name, p in dense_params(model):
            p.copy_(synthetic_weight(seed, where, None, canonical_name(name), p.shape))
        for fqn, buffer in persistent_buffers(model):
            match = IN_LAYER.match(fqn)
            if match and fqn.rsplit(".", 1)[-1] in SYNTHETIC_BUFFERS:
                layer, name = int(match.group(1)), canonical_name(match.group(2))
                shape = tuple(buffer.shape)
                value = synthetic_weight(seed, layer, None, name, shape, scale=bias_scale)
                buffer.copy_(value.to(buffer.dtype))
    return model

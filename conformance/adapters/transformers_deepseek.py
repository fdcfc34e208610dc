"""The ``transformers-deepseek_v3`` adapter: transformers 5.24.0's DeepSeek-V3 on its own EP.

The machinery of :mod:`conformance.adapters.transformers_ep` (``from_pretrained(None,
config=..., distributed_config=DistributedConfig(ep_size=...))``, FSDP2, the distributed
``save_pretrained`` and load, AdamW), on a tiny ``DeepseekV3ForCausalLM``: multi-head latent
attention, a shared expert, packed SwiGLU experts (``gate_up_proj [E, 2I, H]``, gate and up
concatenated; ``down_proj [E, H, I]``) and the sigmoid router with its auxiliary-loss-free
balancing bias ``mlp.gate.e_score_correction_bias``: an fp32 ``[E]`` buffer, persistent (a
checkpoint holds it), added to the scores only to choose the experts.

transformers has no update rule for the bias (its users load a trained one, or step it in their own
code), so the matrix checks that it is kept: every build gives it synthetic, seed-dependent values
(:data:`BIAS_SCALE`), and a load that leaves the load side's values, or zeroes it, is red in
``values``, ``resume`` and ``forward``.

The expert views name the fused weight's halves ``gate`` and ``up`` (each expert's rows ``[:I]``
and ``[I:]`` of ``gate_up_proj``), and ``down``:
:data:`~conformance.adapters.transformers_ep.EXPERT_VIEWS`.

What the matrix finds: docs/frameworks/transformers.md.
"""

from __future__ import annotations

from typing import Any

from conformance.adapter import Spec
from conformance.adapters.transformers_ep import VOCAB, TransformersAdapter

#: the synthetic bias's scale (:func:`conformance.synthetic_weight`'s).  The router's sigmoid scores
#: of the forward check's batch spread ~3e-4 between experts.  Measured at E=4 and 5, after 0 and 2
#: steps, seed 1234's bias chooses other experts than a zero bias (or seed 5678's) for 6-75% of the
#: batch's tokens in each layer, and every expert is still chosen; ten times this scale leaves two
#: experts for every token of a layer.
BIAS_SCALE = 1e-4


class TransformersDeepseekV3Adapter(TransformersAdapter):
    """transformers 5.24.0's ``DeepseekV3ForCausalLM`` under ``DistributedConfig`` EP + FSDP2."""

    name = "transformers-deepseek_v3"
    preload = ("transformers.models.deepseek_v3.modeling_deepseek_v3",
               "transformers.distributed.checkpoint", "transformers.distributed.expert_parallel")
    model_class = "DeepseekV3ForCausalLM"
    synthetic_buffers = ("e_score_correction_bias",)
    buffer_scale = BIAS_SCALE

    def config(self, spec: Spec) -> Any:
        return deepseek_v3_config(spec)


def deepseek_v3_config(spec: Spec) -> Any:
    """A tiny DeepSeek-V3 at the suite's sizes: every layer sparse
    (``first_k_dense_replace=0``), one expert group (``n_group`` must cut E into groups of two
    or more, and E=5 has no other cut), one shared expert when the spec has one, 2 attention
    heads without query LoRA, no multi-token-prediction layer, an untied head.  The
    ``deepspeed-autoep-deepseek_v3`` adapter hands the same model to AutoEP."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=spec.dim, intermediate_size=spec.hidden,
        moe_intermediate_size=spec.hidden, num_hidden_layers=spec.num_layers,
        first_k_dense_replace=0, n_routed_experts=spec.num_experts,
        num_experts_per_tok=min(spec.top_k, spec.num_experts), n_group=1, topk_group=1,
        n_shared_experts=1 if spec.shared_expert else 0, routed_scaling_factor=1.0,
        norm_topk_prob=True, num_mtp_layers=0, num_attention_heads=2,
        num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_interleave=True, tie_word_embeddings=False, attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, hidden_act="silu")

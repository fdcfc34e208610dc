"""The built-in ``torchtitan-deepseek`` adapter: torchtitan 0.3.0's DeepSeek-V3 with one MTP layer.

A whole ``DeepSeekV3Model`` (token embedding, MLA attention and MoE in every block, the output
head) with one multi-token-prediction layer (``mtp_layers.0``: its own attention and MoE, which
torchtitan's Hugging Face export files as layer ``num_layers``), built as ``Trainer`` builds it:
meta, the parallelize function, ``to_empty``, ``init_states``; ``spmd_backend="partial_dtensor"``.
Everything else is :class:`~conformance.adapters.torchtitan.TorchtitanAdapter`'s: the optimizers
with torchtitan's load-balancing hook, the synthetic expert bias and loads, ``dcp_save`` /
``dcp_load``.

What DeepSeek-V3 is: a sigmoid router with the bias DeepSeek-V3 balances by and its top-k
renormalised (``route_norm``, as Hugging Face's DeepSeek-V3 routes), one shared expert, every
block MoE (``n_dense_layers=0``), the matrix's sizes (dim, expert hidden, E, top-k); the attention
is torchtitan's MLA at a size to match (2 heads, ``kv_lora_rank`` 8, no ``q_lora``), vocabulary 32.

For CPU, besides the base's: ``DeepSeekV3Model.Config.update_from_config`` imports
``torchtitan.trainer``, which needs ``torchdata`` (not installed): the adapter calls what it does
for the model, ``set_deepseek_v3_sharding_config`` (main and MTP layers alike).  torchtitan
refuses pipeline parallelism with MTP ("MTP does not support pipeline parallelism yet",
``MTPDecoder.Config.update_from_config``): pp=1 only.  The Hugging Face export is the checkpointer's
``last_save_in_hf`` through ``DeepSeekV3StateDictAdapter`` (the MTP layer filed as layer
``num_layers``), the import ``dcp_load(..., from_hf=True)``, checked against transformers'
``DeepseekV3ForCausalLM``.  Findings: docs/frameworks/torchtitan.md.
"""

from __future__ import annotations

from typing import Any

from conformance.adapter import (
    Capabilities,
    HFModel,
    NotApplicable,
    Spec,
    forward_with_layers,
    world_device,
)
from conformance.adapters import _torchtitan_objects as objects
from conformance.adapters.torch_native import Param, reshard
from conformance.adapters.torchtitan import TorchtitanAdapter
from conformance.saves import export_root

_EXPERTS = "routed_experts.inner_experts."
_VOCAB = 32
_MAX_SEQ = 64
#: torchtitan's RMSNorm eps (``RMSNorm.Config.eps``), every norm's.
_NORM_EPS = 1e-5
#: the attribute a built model keeps its spec under (the Hugging Face path converts by it).
_SPEC = "_moe_ep_spec"
#: transformers' DeepSeek-V3 on torchtitan's export computes torchtitan's forward only roughly:
#: measured on the suite's model (E=4 and 5, fp32), the logits need 74x the forward check's
#: tolerance and each MoE layer's own output 2,300x (3e-3 of its scale; sdpa against flex attention
#: accounts for the logits, not for all of that).  Widened to 5,000x: rtol 5e-2, atol 5e-3 of the
#: output's scale -- a swapped or transposed expert still moves a layer's output by its whole size.
HF_TOLERANCE_SCALE = 5000.0


class TorchtitanDeepSeekAdapter(TorchtitanAdapter):
    """torchtitan 0.3.0's DeepSeek-V3 with one MTP layer, experts DTensors over ``ep``."""

    name = "torchtitan-deepseek"
    capabilities = Capabilities(kinds=("packed",), optimizer=True, fsdp=True, uneven=True,
                                max_ep=64, format="dcp", ep_orders=("consecutive",), pp=(1,))
    preload = ("torchtitan.models.deepseek_v3", "torchtitan.components.checkpoint",
               "torchtitan.components.optimizer")

    def build_model(self, spec: Spec, mesh: Any) -> Any:
        import torch
        from torchtitan.config import ParallelismConfig
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config
        from torchtitan.tools.utils import set_default_dtype

        if (spec.kind, spec.activation, spec.shared_expert) != ("packed", "swiglu", True):
            raise ValueError("torchtitan's DeepSeek-V3 has packed SwiGLU experts and a shared "
                             f"expert, not {spec.kind} {spec.activation}, "
                             f"shared_expert={spec.shared_expert}")
        dist_utils.set_spmd_backend(self.spmd_backend)
        ep = 1 if mesh is None else mesh["ep"].size()
        parallelism = ParallelismConfig(expert_parallel_degree=ep, spmd_backend=self.spmd_backend)
        config = deepseek_config(spec)
        set_deepseek_v3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel,
                                        enable_ep=ep > 1)
        with torch.device("meta"), set_default_dtype(getattr(torch, spec.dtype)):
            model = config.build()
        parallel_dims = None
        if mesh is not None:
            parallel_dims = objects.parallel_dims(self.spmd_backend, ep, world_device(mesh).type)
            parallelize(model, parallel_dims, parallelism, fsdp=spec.fsdp, dtype=spec.dtype)
        object.__setattr__(model, objects.PARALLEL_DIMS, parallel_dims)
        object.__setattr__(model, _SPEC, spec)  # what the Hugging Face path converts by
        model.to_empty(device=world_device(mesh))
        with torch.no_grad():
            model.init_states(buffer_device=None)
        return model

    # -- Hugging Face export: the checkpointer's last_save_in_hf and initial_load_in_hf ------------
    def hf_model(self, spec: Spec) -> HFModel:
        """``DeepseekV3ForCausalLM`` at torchtitan's sizes and norms (RMSNorm eps 1e-5): its
        MTP layer is one more layer in the export, which the class does not load."""
        return HFModel("DeepseekV3ForCausalLM", hf_config(spec),
                       extra_keys=(rf"^model\.layers\.{spec.num_layers}\.",),
                       tolerance_scale=HF_TOLERANCE_SCALE)

    def export_hf(self, model: Any, path: str) -> None:
        """``CheckpointManager._save_last_step`` with ``last_save_in_hf``: the consolidated
        safetensors under ``path/step-0/``, as a training run's last save writes them."""
        from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

        spec: Spec = getattr(model, _SPEC)
        self._even_or_not_applicable(model, "export")
        manager = objects.manager(model, None, path)
        manager.sd_adapter = DeepSeekV3StateDictAdapter(deepseek_config(spec), None)
        manager.last_save_in_hf = manager.last_save_model_only = True
        manager._save_last_step(curr_step=0)

    def import_hf(self, model: Any, path: str) -> None:
        """``dcp_load(..., from_hf=True)``: what ``initial_load_in_hf`` runs (``to_hf`` of this
        model's state as the read targets, the HF storage reader, ``from_hf``)."""
        from torchtitan.components.checkpoint import MODEL
        from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

        spec: Spec = getattr(model, _SPEC)
        self._even_or_not_applicable(model, "import")
        manager = objects.manager(model, None, path)
        manager.sd_adapter = DeepSeekV3StateDictAdapter(deepseek_config(spec), None)
        manager.dcp_load(manager.states[MODEL].state_dict(), checkpoint_id=export_root(path),
                         from_hf=True, from_quantized=False)

    def hf_forward(self, hf_model: Any, batch: Any) -> Any:
        """transformers' forward on the same tokens, its norms at torchtitan's eps (the export
        carries no config, and ``kv_a_layernorm`` takes no eps from one): the logits and each MoE
        layer's own output under ``forward``'s names."""
        import torch

        for module in hf_model.modules():
            if hasattr(module, "variance_epsilon"):
                module.variance_epsilon = _NORM_EPS
        tokens = tokens_of(batch)[None]
        moes = {f"moe.{i}": layer.mlp for i, layer in enumerate(hf_model.model.layers)}
        with torch.no_grad():
            return forward_with_layers(lambda: hf_model(input_ids=tokens).logits[0], moes)

    @staticmethod
    def _even_or_not_applicable(model: Any, what: str) -> None:
        """torchtitan's ``to_hf`` splits each expert weight into E even chunks of the EP shard:
        E % ep != 0 stops it on every rank alike (``ValueError: Dim 0 size (5) cannot be evenly
        divided by shard degree (2)``)."""
        parallel_dims = getattr(model, objects.PARALLEL_DIMS)
        experts = model.layers["0"].moe.routed_experts.inner_experts.num_experts
        ep = 1 if parallel_dims is None else parallel_dims.ep
        if experts % ep:
            raise NotApplicable(f"torchtitan's Hugging Face {what} (MoEStateDictAdapter.to_hf) "
                                f"cannot split E={experts} experts over ep={ep}")

    def fill(self, model: Any, make: Any) -> None:
        """The base's fill, with every RMSNorm's weight about 1 (1 + a synthetic weight), as
        torchtitan's init gives it: activations keep their scale through the blocks, so the router
        scores tokens as differently as the expert bias steers them."""
        def centred(layer: Any, expert: Any, name: str, shape: Any) -> Any:
            value = make(layer, expert, name, shape)
            return value + 1.0 if name.endswith("norm.weight") else value

        super().fill(model, centred)

    def identify(self, model: Any, fqn: str, param: Any) -> Param:
        """A block's tensors by their global layer (MTP layer ``j``: ``num_layers + j``) and their
        name in the block, its MoE's without ``moe.``; the embedding, norm and head by their FQN."""
        from torchtitan.components.checkpointer.utils import canonical_fqn

        parts = canonical_fqn(fqn).split(".")
        if parts[0] not in ("layers", "mtp_layers") or len(parts) < 3:
            return Param(None, ".".join(parts))
        layer = int(parts[1]) + (len(model.layers) if parts[0] == "mtp_layers" else 0)
        rest = ".".join(parts[3:] if parts[2] == "moe" else parts[2:])
        if rest.startswith(_EXPERTS):
            experts = model.layers["0"].moe.routed_experts.inner_experts.num_experts
            return Param(layer, rest[len(_EXPERTS):], "packed", num_experts=experts)
        return Param(layer, rest)

    def forward(self, model: Any, batch: Any) -> Any:
        """torchtitan's forward of the whole model on tokens drawn from ``batch`` (the same on every
        rank), in its training context: the main head's logits, the MTP head's, and each MoE
        layer's own output; n/a where its dispatcher cannot split E over ep (as the base's)."""
        import contextlib

        import torch
        from torchtitan.distributed import utils as dist_utils

        parallel_dims = getattr(model, objects.PARALLEL_DIMS)
        experts = model.layers["0"].moe.routed_experts.inner_experts.num_experts
        ep = 1 if parallel_dims is None else parallel_dims.ep
        if experts % ep:  # decided before any exchange, on every rank alike
            raise NotApplicable(objects.UNEVEN_DISPATCH.format(num_experts=experts, ep=ep))
        device = next(model.parameters()).device
        tokens = tokens_of(batch).to(device)[None]
        positions = torch.arange(tokens.shape[1], device=device)[None]
        context = (dist_utils.get_spmd_context(parallel_dims=parallel_dims)()
                   if parallel_dims is not None else contextlib.nullcontext())
        moes = {f"moe.{layer}": moe for layer, moe in objects.moe_layers(model)}
        try:
            with torch.no_grad(), context:
                masks = model.get_attention_masks(positions)
                found = forward_with_layers(lambda: model(tokens, positions, masks), moes)
        finally:
            reshard(model)
        main, *mtp = found.pop("output")
        heads = {"output": main[0], **{f"mtp.{j}": out[0] for j, out in enumerate(mtp)}}
        return {name: objects.plain(out) for name, out in {**heads, **found}.items()}


def tokens_of(batch: Any) -> Any:
    """``[tokens]`` ids in the vocabulary from the suite's ``[tokens, dim]`` batch: a pure
    function of its values, so every rank and the truth read the same sequence."""
    import torch

    return (batch.float().abs().sum(dim=-1) * 64).to(torch.int64) % _VOCAB


def deepseek_config(spec: Spec) -> Any:
    """A tiny ``DeepSeekV3Model.Config`` at the cell's sizes with one MTP layer (the module
    docstring says what is DeepSeek-V3's)."""
    from torchtitan.models import deepseek_v3 as ds
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    layers = ds._build_dsv3_layers(
        n_layers=spec.num_layers, n_dense_layers=0, dim=spec.dim, n_heads=2, q_lora_rank=0,
        kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, mscale=1.0,
        dense_hidden_dim=spec.hidden, moe_hidden_dim=spec.hidden, num_experts=spec.num_experts,
        num_shared_experts=1, router_top_k=min(spec.top_k, spec.num_experts),
        router_score_func="sigmoid", router_route_norm=True, attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=4, max_seq_len=_MAX_SEQ, theta=10000.0))
    return DeepSeekV3Model.Config(
        vocab_size=_VOCAB, dim=spec.dim,
        tok_embeddings=Embedding.Config(num_embeddings=_VOCAB, embedding_dim=spec.dim,
                                        param_init=ds._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=spec.dim, param_init=ds._NORM_INIT),
        lm_head=Linear.Config(in_features=spec.dim, out_features=_VOCAB,
                              param_init=ds._output_linear_init(spec.dim)),
        layers=layers,
        mtp_layers=ds._build_mtp_layers(layers[-1], dim=spec.dim, num_mtp_layers=1))


def parallelize(model: Any, parallel_dims: Any, parallelism: Any, *, fsdp: bool,
                dtype: str) -> None:
    """The trainer's ``parallelize_deepseekv3`` with FSDP2 (main and MTP layers); EP-only, what it
    does before FSDP, which it always applies (it has no ``skip_dp``): ``model.parallelize``."""
    import tempfile

    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

    try:
        if not fsdp:
            if parallel_dims.ep_enabled:
                model.parallelize(parallel_dims)
            return
        with tempfile.TemporaryDirectory(prefix="torchtitan-dump-") as dump_folder:
            precision = "bfloat16" if dtype == "bfloat16" else "float32"
            parallelize_deepseekv3(model, parallel_dims=parallel_dims, parallelism=parallelism,
                                   training=TrainingConfig(mixed_precision_param=precision),
                                   compile_config=CompileConfig(), ac_config=None,
                                   dump_folder=dump_folder)
    except Exception as exc:  # the framework's own failure, named with its configuration
        raise RuntimeError(f"torchtitan parallelize_deepseekv3 failed (ep={parallel_dims.ep}, "
                           f"{'FSDP' if fsdp else 'EP-only'}): {type(exc).__name__}: {exc}"
                           ) from exc


def hf_config(spec: Spec) -> dict[str, Any]:
    """``DeepseekV3Config``'s fields for :func:`deepseek_config`'s model: the same sizes, a sigmoid
    router with its top-k renormalised and one expert group, torchtitan's norm eps, interleaved
    (complex) RoPE at theta 1e4, no query LoRA, an untied head."""
    return {"model_type": "deepseek_v3", "vocab_size": _VOCAB, "hidden_size": spec.dim,
            "intermediate_size": spec.hidden, "moe_intermediate_size": spec.hidden,
            "num_hidden_layers": spec.num_layers, "first_k_dense_replace": 0,
            "n_routed_experts": spec.num_experts,
            "num_experts_per_tok": min(spec.top_k, spec.num_experts), "n_group": 1,
            "topk_group": 1, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
            "norm_topk_prob": True, "num_nextn_predict_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2, "q_lora_rank": None, "kv_lora_rank": 8,
            "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8,
            "max_position_embeddings": _MAX_SEQ, "rms_norm_eps": _NORM_EPS,
            "rope_interleave": True, "tie_word_embeddings": False, "attention_dropout": 0.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "hidden_act": "silu"}

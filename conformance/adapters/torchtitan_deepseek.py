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
``MTPDecoder.Config.update_from_config``): pp=1 only.  Findings: docs/frameworks/torchtitan.md.
"""

from __future__ import annotations

from typing import Any

from conformance.adapter import Capabilities, NotApplicable, Spec, forward_with_layers, world_device
from conformance.adapters import _torchtitan_objects as objects
from conformance.adapters.torch_native import Param, reshard
from conformance.adapters.torchtitan import TorchtitanAdapter

_EXPERTS = "routed_experts.inner_experts."
_VOCAB = 32
_MAX_SEQ = 64


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
        model.to_empty(device=world_device(mesh))
        with torch.no_grad():
            model.init_states(buffer_device=None)
        return model

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

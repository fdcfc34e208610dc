"""torchtitan's objects for the ``torchtitan`` adapters, built inside rank processes only: its
ParallelDims and mesh, the MoE decoder from its config builders, its pipeline split, its parallelize
function and CheckpointManager -- each as torchtitan's ``Trainer`` makes it
(:mod:`conformance.adapters.torchtitan` says what is changed for CPU)."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

from conformance.adapter import Spec

EXPERT_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")
#: attribute set on the built model: its torchtitan ParallelDims (None for the ground truth), for
#: the forward, the load-balancing hook and the loads.
PARALLEL_DIMS = "_conformance_parallel_dims"
#: why torchtitan's forward cannot run at E % ep != 0 (its dispatcher's token-count exchange).
UNEVEN_DISPATCH = ("torchtitan's AllToAllTokenDispatcher cannot split the token counts of "
                   "E={num_experts} experts over ep={ep} (_token_count_exchange: "
                   "num_local_tokens_per_expert_E.view(ep, -1))")
#: attribute set on a pipeline stage's model part: its stage index, for the forward stage by stage.
STAGE = "_conformance_stage"


@functools.cache
def parallel_dims(backend: str, ep: int, device_type: str, pp: int = 1) -> Any:
    """torchtitan's ParallelDims over the whole world at EP degree ``ep`` (and ``pp`` stages), its
    mesh built once."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    parallel_dims_module.device_type = device_type  # workaround: torchtitan picked "cuda" at import
    parallelism = ParallelismConfig(expert_parallel_degree=ep, pipeline_parallel_degree=pp,
                                    spmd_backend=backend)
    parallel_dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    parallel_dims.build_mesh()
    return parallel_dims


def stage(model: Any, parallel_dims: Any, num_layers: int, device: Any) -> Any:
    """This rank's model part, as ``pipeline_llm`` makes it: torchtitan's default module names per
    stage (``_generate_llm_fqn_per_model_part``, embeddings and output weighed as one layer each, as
    its ``pipeline_parallel_first/last_stage_less_layers`` defaults do) and its
    ``_pipeline_module_split`` (a ``PipelineStage`` per part, schedule 1F1B: one stage per pp
    rank)."""
    from torchtitan.distributed import pipeline_parallel as pipelining

    pp_mesh = parallel_dims.get_mesh("pp")
    names = pipelining._generate_llm_fqn_per_model_part(pp_mesh.size(), num_layers, 1, 1)
    _, parts = pipelining._pipeline_module_split(model, pp_mesh, "1F1B", device, names,
                                                 get_mesh=pipelining._build_get_mesh_callback(
                                                     parallel_dims))
    (part,) = parts
    object.__setattr__(part, STAGE, pp_mesh.get_local_rank())
    return part


def build_model(spec: Spec, parallelism: Any, *, enable_ep: bool) -> Any:
    """``num_layers`` torchtitan MoE layers in a decoder-shaped container (``layers.<i>.moe``)."""
    from torch import nn
    from torchtitan.models.common import config_utils as make
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config
    from torchtitan.models.qwen3.sharding import _GROUPED_EXPERTS_PARAM_LAYOUT
    from torchtitan.protocols.module import ModuleDict

    linear_init = {"weight": functools.partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
    experts_init = {w: functools.partial(nn.init.normal_, std=0.02) for w in EXPERT_WEIGHTS}
    top_k = min(spec.top_k, spec.num_experts)
    config = make.make_moe_config(
        num_experts=spec.num_experts,
        router=make.make_router_config(dim=spec.dim, num_experts=spec.num_experts,
                                       gate_param_init=linear_init,
                                       top_k=top_k, score_func="softmax", route_norm=True),
        routed_experts=make.make_routed_experts_config(dim=spec.dim, hidden_dim=spec.hidden,
                                                       num_experts=spec.num_experts, top_k=top_k,
                                                       param_init=experts_init,
                                                       comm_backend="standard"),
        shared_experts=(
            make.make_ffn_config(dim=spec.dim, hidden_dim=spec.hidden, w1_param_init=linear_init,
                                 w2w3_param_init=linear_init) if spec.shared_expert else None),
    )
    set_moe_sharding_config(config, enable_ep=enable_ep,
                            enable_sp=parallelism.enable_sequence_parallel,
                            expert_param_layout=_GROUPED_EXPERTS_PARAM_LAYOUT)
    block_class, stack_class = model_classes()
    layers = ModuleDict({str(i): block_class(config.build()) for i in range(spec.num_layers)})
    return stack_class(layers)


@functools.cache
def model_classes() -> tuple[type, type]:
    """A block reduced to ``x + moe(x)`` and a decoder to its layers: what ``apply_fsdp_to_decoder``
    reads of them."""
    from torchtitan.protocols.module import Module

    class MoEBlock(Module):
        moe_enabled = True

        def __init__(self, moe: Any) -> None:
            super().__init__()
            self.moe = moe

        def forward(self, x: Any) -> Any:
            return x + self.moe(x)

    class MoEStack(Module):
        tok_embeddings = norm = lm_head = None
        enable_weight_tying = False

        def __init__(self, layers: Any) -> None:
            super().__init__()
            self.layers = layers

        def forward(self, x: Any) -> Any:
            for layer in self.layers.values():
                x = layer(x)
            return x

    return MoEBlock, MoEStack


def parallelize(model: Any, parallel_dims: Any, parallelism: Any, *, fsdp: bool,
                dtype: str) -> None:
    """The trainer's parallelize_fn (Qwen3's, shared by torchtitan's MoE decoders)."""
    import tempfile

    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.qwen3 import parallelize_qwen3

    with tempfile.TemporaryDirectory(prefix="torchtitan-dump-") as dump_folder:
        try:
            # FSDP computes in the cell's dtype (the default bf16 is a compute cast), as the truth
            # does
            training = TrainingConfig(mixed_precision_param="bfloat16" if dtype == "bfloat16"
                                      else "float32")
            parallelize_qwen3(model, parallel_dims=parallel_dims, training=training,
                              parallelism=parallelism, compile_config=CompileConfig(),
                              ac_config=None, dump_folder=dump_folder, skip_dp=not fsdp)
        # the framework's own failure, named with the configuration it failed in
        except Exception as exc:
            raise RuntimeError("torchtitan parallelize_qwen3 failed "
                               f"(spmd_backend={parallelism.spmd_backend!r}, ep="
                               f"{parallel_dims.ep}, {'FSDP' if fsdp else 'skip_dp=True'}): "
                               f"{type(exc).__name__}: {exc}"
                               ) from exc


def manager(model: Any, optimizer: Any, path: str) -> Any:
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(enable=True, folder=path, keep_latest_k=0)
    return CheckpointManager(config, dataloader=None, model_parts=[model], optimizers=optimizer,
                             lr_schedulers=None, states={}, sd_adapter=None)


#: the last part of the name of torchtitan's expert bias (``MoE.expert_bias_E``: persistent, fp32
#: ``[E]``).
EXPERT_BIAS = "expert_bias_E"


def _no_dp_mesh(*_: Any, **__: Any) -> None:
    return None


#: what ``register_moe_load_balancing_hook`` reads of ParallelDims, for the ground truth (one
#: process, no ParallelDims): no loss mesh to all-reduce the counts over, no expert TP.
NO_DP = SimpleNamespace(get_optional_mesh=_no_dp_mesh, ep_enabled=False, tp=1)


def moe_layers(model: Any) -> list[tuple[int, Any]]:
    """``(global layer index, MoE module)`` of every MoE layer of ``model`` (a pipeline stage's part
    keeps its layers' global keys); a DeepSeek-V3 MTP layer ``j`` (whole models only: torchtitan
    pipelines no MTP) is layer ``len(layers) + j``, as its Hugging Face export numbers it."""
    found = [(int(key), block.moe) for key, block in model.layers.items()
             if getattr(block, "moe_enabled", False)]
    mtp = getattr(model, "mtp_layers", None) or ()
    return found + [(len(model.layers) + j, block.moe) for j, block in enumerate(mtp)]


def register_load_balancing(optimizer: Any, model: Any, parallel_dims: Any) -> None:
    """torchtitan's auxiliary-loss-free balancing as ``Trainer`` registers it for every MoE model
    (``post_optimizer_build_fn``): a pre-hook of the optimizers' step that all-reduces every
    layer's ``tokens_per_expert_E`` over the loss mesh, steps ``expert_bias_E`` on them and zeroes
    them."""
    from torchtitan.components.optimizer import register_moe_load_balancing_hook

    dims = parallel_dims if parallel_dims is not None else NO_DP
    register_moe_load_balancing_hook(optimizer, [model], dims)


def write_loads(model: Any, parallel_dims: Any, seed: int, step: int) -> None:
    """Every MoE layer's ``tokens_per_expert_E`` := this rank's share of ``step``'s synthetic load
    (:func:`conformance.synthetic_load`), for torchtitan's own hook to consume at the optimizer
    step.

    Each rank of the hook's all-reduce (the loss mesh) counted the tokens of the experts ``g`` with
    ``g % size == its rank`` there, and none of the others, so the sum over the mesh is the whole
    load (the ground truth's) exactly, and a hook that skipped the all-reduce would step each rank's
    bias on a different vector."""
    import torch

    from conformance import synthetic_load

    mesh = parallel_dims.get_optional_mesh("loss") if parallel_dims is not None else None
    rank, size = (0, 1) if mesh is None else (mesh.get_local_rank(), mesh.size())
    for layer, moe in moe_layers(model):
        load = synthetic_load(seed, step, layer, moe.tokens_per_expert_E.shape[0])
        mine = torch.arange(load.shape[0]) % size == rank
        counter = moe.tokens_per_expert_E
        counter = counter.to_local() if hasattr(counter, "to_local") else counter
        counter.copy_(torch.where(mine, load, torch.zeros_like(load)).to(counter.device))


def plain(out: Any) -> Any:
    """A forward's output as a plain tensor (a DTensor's whole value)."""
    return out.full_tensor() if hasattr(out, "full_tensor") else out

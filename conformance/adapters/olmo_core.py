"""The built-in ``olmo_core`` and ``olmo_core-dropless`` adapters: OLMo-core 3.0.0 end to end.

OLMo-core's own code throughout: ``MoEConfig.build`` layers (router, ``ParallelMLP`` over ``MoEMLP``
or ``ParallelDroplessMLP`` over ``DroplessMoEMLP``, the shared ``FeedForward``) as ``blocks.<i>``,
experts packed, *flattened* (expert ``g``: rows ``[g * rows, (g + 1) * rows)`` of
``w1``/``w2``/``w3``); ``build_world_mesh`` with HSDP and ``ExpertParallelConfig(degree=ep)`` (EP on
``dp_shard``: consecutive groups, checked against the cell's ``mesh["ep"]``), ``get_ep_mesh`` and
``apply_ep``; FSDP as ``parallelize_model`` applies it to MoE (``prepare_experts_for_fsdp``,
``fully_shard`` per block and root, fp32); ``AdamWConfig(lr).build``; DCP through
``save_model_and_optim_state`` / ``load_model_and_optim_state``.  On
:mod:`conformance.adapters.torch_native`: ``identify`` names the flattened expert weights, the base
derives the rest.  On CPU: ``parallel._WORLD_MESH`` is reset before each ``build_world_mesh`` (each
is cached), and there is no ``forward`` (its Triton kernels need a GPU).  ``uneven=True``: OLMo-core
refuses ``E % ep != 0``, a ``refused`` cell.  What the matrix finds: docs/frameworks/olmo_core.md.
"""

from __future__ import annotations

import functools
from typing import Any

from conformance.adapter import Capabilities, Spec, world_device
from conformance.adapters.torch_native import Param, TorchNativeAdapter

_EXPERTS = "experts.mlp."  # blocks.<i>.experts.mlp.w1: layer i's flattened expert weight w1


class OlmoCoreAdapter(TorchNativeAdapter):
    """OLMo-core 3.0.0's default ``MoE`` (``ParallelMLP`` over ``MoEMLP``)."""

    name = "olmo_core"
    moe_type = "default"
    capabilities = Capabilities(kinds=("packed",), optimizer=True, fsdp=True, uneven=True,
                                max_ep=64, format="dcp", ep_orders=("consecutive",))
    preload = ("olmo_core.nn.moe", "olmo_core.distributed.checkpoint", "olmo_core.optim")
    distribution = "olmo_core"

    def build_model(self, spec: Spec, mesh: Any) -> Any:
        if (spec.kind, spec.activation) != ("packed", "swiglu"):
            raise ValueError(f"OLMo-core's MoE experts are packed SwiGLU; cannot build {spec.kind} "
                             f"{spec.activation}")
        device = world_device(mesh)
        model = _build_model(spec, self.moe_type, device)
        if mesh is not None:
            _parallelize(model, mesh, fsdp=spec.fsdp, device_type=device.type)
        return model

    def build_optimizer(self, spec: Spec, model: Any) -> Any:
        from olmo_core.optim import AdamWConfig

        return AdamWConfig(lr=spec.lr).build(model)

    def identify(self, model: Any, fqn: str, param: Any) -> Param:
        """``blocks.<i>.experts.mlp.<w>``: layer i's flat expert weight ``w``; the rest: dense."""
        parts = fqn.split(".")
        if parts[:1] != ["blocks"]:
            return Param(None, fqn)
        rest = ".".join(parts[2:])
        if rest.startswith(_EXPERTS):
            return Param(int(parts[1]), rest[len(_EXPERTS):], experts="flat",
                         num_experts=next(iter(model.blocks.values())).num_experts)
        return Param(int(parts[1]), rest)

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        from olmo_core.distributed.checkpoint import save_model_and_optim_state

        save_model_and_optim_state(path, model, optimizer)

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        from olmo_core.distributed.checkpoint import load_model_and_optim_state

        load_model_and_optim_state(path, model, optimizer)


class OlmoCoreDroplessAdapter(OlmoCoreAdapter):
    """OLMo-core 3.0.0's ``DroplessMoE`` (``ParallelDroplessMLP`` over ``DroplessMoEMLP``)."""

    name = "olmo_core-dropless"
    moe_type = "dropless"


# -- OLMo-core objects (built inside rank processes only) ----------------------------------------
def _build_model(spec: Spec, moe_type: str, device: Any) -> Any:
    """``blocks.<i>``: ``spec.num_layers`` OLMo-core MoE layers from ``MoEConfig.build``."""
    import torch
    from olmo_core.config import DType
    from olmo_core.nn.feed_forward import FeedForwardConfig
    from olmo_core.nn.moe import MoEConfig, MoERouterConfig, MoEType
    from torch import nn

    shared = FeedForwardConfig(hidden_size=spec.hidden, bias=False) if spec.shared_expert else None
    router = MoERouterConfig(top_k=min(spec.top_k, spec.num_experts))
    config = MoEConfig(name=MoEType(moe_type), num_experts=spec.num_experts, router=router,
                       hidden_size=spec.hidden, shared_mlp=shared, dtype=DType(spec.dtype))
    if getattr(torch, spec.dtype) != config.dtype.as_pt():
        raise ValueError(f"OLMo-core's DType has no {spec.dtype!r}")

    model = nn.Module()
    model.blocks = nn.ModuleDict({str(i): config.build(spec.dim, n_layers=spec.num_layers,
                                                       init_device=device.type)
                                  for i in range(spec.num_layers)})
    return model.to(device)


@functools.cache
def _world_mesh(ep: int, fsdp: bool, device_type: str) -> Any:
    """OLMo-core's world mesh at EP degree ``ep``: HSDP with EP on ``dp_shard`` (FSDP at ep=1)."""
    import torch.distributed as dist
    from olmo_core.distributed import parallel

    parallel._WORLD_MESH = None  # OLMo-core allows one world mesh per process; ours are cached
    if ep == 1:
        dp = parallel.DataParallelConfig(name=parallel.DataParallelType.fsdp)
        return parallel.build_world_mesh(dp=dp, device_type=device_type)
    dp = parallel.DataParallelConfig(name=parallel.DataParallelType.hsdp,
                                     num_replicas=dist.get_world_size() // ep, shard_degree=ep)
    return parallel.build_world_mesh(dp=dp, ep=parallel.ExpertParallelConfig(degree=ep),
                                     device_type=device_type)


def _parallelize(model: Any, mesh: Any, *, fsdp: bool, device_type: str) -> None:
    """EP (ep > 1) and FSDP as OLMo-core's ``parallelize_model`` applies them to an MoE model."""
    import torch.distributed as dist
    from olmo_core.distributed.parallel import get_dp_model_mesh, get_ep_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    ep = mesh["ep"].size()
    if ep == 1 and not fsdp:
        return
    world_mesh = _world_mesh(ep, fsdp, device_type)
    if ep > 1:
        ep_mesh = get_ep_mesh(world_mesh)
        framework = sorted(dist.get_process_group_ranks(ep_mesh.get_group()))
        suite = sorted(dist.get_process_group_ranks(mesh["ep"].get_group()))
        if framework != suite:
            raise RuntimeError(
                f"OLMo-core's EP group for rank {dist.get_rank()} is ranks {framework} (its "
                f"dp_shard dim: consecutive ranks), but this cell's layout gives {suite}")
        for moe in model.blocks.values():
            moe.apply_ep(ep_mesh)
    if not fsdp:
        return
    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None)
    for moe in model.blocks.values():
        moe.prepare_experts_for_fsdp(world_mesh=world_mesh, mp_policy=policy,
                                     reshard_after_forward=ep == 1)
    dp_mesh = get_dp_model_mesh(world_mesh)
    for moe in model.blocks.values():
        fully_shard(moe, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)

"""The built-in ``olmo_core`` and ``olmo_core-dropless`` adapters: OLMo-core 3.0.0 end to end.

They drive OLMo-core's own code (nothing of the EP split or the checkpoint is re-implemented): MoE layers
from ``olmo_core.nn.moe.MoEConfig.build`` (router, ``ParallelMLP`` around ``MoEMLP`` -- or
``ParallelDroplessMLP`` around ``DroplessMoEMLP`` for ``olmo_core-dropless`` -- and the shared
``FeedForward``) in a container reduced to them (``blocks.<i>``), with packed, *flattened* expert weights
(``w1``/``w3`` ``(E * d_model, hidden)``, ``w2`` ``(E * hidden, d_model)`` for ``MoEMLP``; ``(E * hidden,
d_model)`` all three for the dropless one; expert ``g`` is rows ``[g * rows, (g + 1) * rows)``), filled by
global expert id; ``build_world_mesh`` with HSDP and ``ExpertParallelConfig(degree=ep)`` (EP only with
HSDP, on the ``dp_shard`` dim: consecutive EP groups, checked against the suite's ``mesh["ep"]``; ep=1
without EP, as OLMo-core's train module builds it), ``get_ep_mesh`` and ``MoEBase.apply_ep``; FSDP as
``parallelize_model`` does it for an MoE model (``prepare_experts_for_fsdp``, then ``fully_shard`` of each
block and the root over ``get_dp_model_mesh``, mixed precision at fp32); ``AdamWConfig(lr=spec.lr).build``;
and ``save_model_and_optim_state`` / ``load_model_and_optim_state`` (DCP).

Workarounds for a CPU/gloo world (none changes what is checked):

* ``olmo_core.distributed.parallel._WORLD_MESH`` is reset before each ``build_world_mesh``: OLMo-core
  allows one world mesh per process, and a rank process serves cells at several EP degrees.  Each
  mesh is built once per (ep, fsdp, device) and cached, like the suite's meshes.
* Gradients are set directly (:func:`conformance.synthetic_grad` on ``.grad``) and ``forward`` is left out:
  the MoE layers route tokens through Triton kernels (``olmo_core.ops.moe``), which find no driver on CPU.
* Where FSDP2's dim-0 chunks of a flattened expert weight cut through an expert (E=6 on 4 ranks), the canonical
  views gather that tensor (``DTensor.full_tensor``) and each rank reports the experts it holds rows of, whole:
  the adapter contract names whole experts only.  The checkpoint is still OLMo-core's own save of its shards.

``uneven=True`` ("run it"): OLMo-core refuses ``E % ep != 0`` loudly (``MoEMLPBase._shard_experts`` raises
``OLMoConfigurationError``), so those cells are ``error`` cells carrying its message.

What the matrix finds: docs/frameworks/olmo_core.md.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from conformance.adapter import (
    ADAM_MOMENTS,
    Capabilities,
    Spec,
    local_region,
    run_steps,
    torch_optimizer_scalars,
    world_device,
)
from conformance.synthetic import synthetic_grad, synthetic_weight

EXPERT_WEIGHTS = ("w1", "w2", "w3")
_EXPERTS = "experts.mlp."


class OlmoCoreAdapter:
    """OLMo-core 3.0.0's default ``MoE`` (``ParallelMLP`` over ``MoEMLP``)."""

    name = "olmo_core"
    moe_type = "default"
    capabilities = Capabilities(kinds=("packed",), optimizer=True, fsdp=True, uneven=True, max_ep=64,
                                format="dcp", ep_orders=("consecutive",))
    preload = ("olmo_core.nn.moe", "olmo_core.distributed.checkpoint", "olmo_core.optim")

    @property
    def version(self) -> str:
        """The installed OLMo-core's version (read from its metadata, without importing it)."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("ai2-olmo-core")
        except PackageNotFoundError:
            return "not installed"

    # -- building ----------------------------------------------------------------------------------
    def build(self, spec: Spec, mesh: Any, seed: int) -> tuple[Any, Any]:
        import torch

        if spec.kind != "packed":
            raise ValueError(f"OLMo-core's MoE experts are packed; cannot build kind {spec.kind!r}")
        if spec.activation != "swiglu":
            raise ValueError(f"OLMo-core's MoE experts are SwiGLU; cannot build activation {spec.activation!r}")
        device = world_device(mesh)
        model = _build_model(spec, self.moe_type, device)
        if mesh is not None:
            _parallelize(model, mesh, fsdp=spec.fsdp, device_type=device.type)
        with torch.no_grad():
            _overwrite(model, lambda layer, expert, name, shape: synthetic_weight(seed, layer, expert, name, shape))
        if spec.optimizer_steps <= 0:
            return model, None
        from olmo_core.optim import AdamWConfig

        optimizer = AdamWConfig(lr=spec.lr).build(model)
        run_steps(lambda index: self.step(model, optimizer, seed, index), 0, spec.optimizer_steps)
        return model, optimizer

    def step(self, model: Any, optimizer: Any, seed: int, step: int) -> None:
        _set_grads(model, seed, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def scalars(self, model: Any, optimizer: Any) -> dict[str, Any]:
        return torch_optimizer_scalars(optimizer)

    # -- checkpoint path ---------------------------------------------------------------------------
    def save(self, model: Any, optimizer: Any, path: str) -> None:
        from olmo_core.distributed.checkpoint import save_model_and_optim_state

        save_model_and_optim_state(path, model, optimizer)

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        from olmo_core.distributed.checkpoint import load_model_and_optim_state

        load_model_and_optim_state(path, model, optimizer)

    # -- canonical views ---------------------------------------------------------------------------
    def expert_tensors(self, model: Any, optimizer: Any) -> Iterator[tuple[int, int, str, Any]]:
        state = optimizer.state if optimizer is not None else {}
        for fqn, p in model.named_parameters():
            layer, expert_name = _identify(fqn)
            if expert_name is None:
                continue
            assert layer is not None  # _identify names an expert weight only under blocks.<i>
            tensors = {expert_name: p} | {f"{expert_name}.{m}": state[p][m] for m in ADAM_MOMENTS
                                          if m in state.get(p, {})}
            for name, tensor in tensors.items():
                for g, row in _rows(model, tensor, where=f"layer {layer} {name}"):
                    yield layer, g, name, row

    def other_tensors(self, model: Any, optimizer: Any) -> Iterator[tuple[int | None, None, str, Any]]:
        state = optimizer.state if optimizer is not None else {}
        for fqn, p in model.named_parameters():
            layer, expert_name = _identify(fqn)
            if expert_name is not None:
                continue
            name = _short(fqn)
            yield layer, None, name, p
            for moment in ADAM_MOMENTS:
                if moment in state.get(p, {}):
                    yield layer, None, f"{name}.{moment}", state[p][moment]


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

    config = MoEConfig(name=MoEType(moe_type), num_experts=spec.num_experts, hidden_size=spec.hidden,
                       router=MoERouterConfig(top_k=min(spec.top_k, spec.num_experts)),
                       shared_mlp=FeedForwardConfig(hidden_size=spec.hidden, bias=False) if spec.shared_expert
                       else None, dtype=DType(spec.dtype))
    if getattr(torch, spec.dtype) != config.dtype.as_pt():
        raise ValueError(f"OLMo-core's DType has no {spec.dtype!r}")

    class MoEStack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleDict({str(i): config.build(spec.dim, n_layers=spec.num_layers,
                                                              init_device=device.type)
                                         for i in range(spec.num_layers)})

    return MoEStack().to(device)


@functools.cache
def _world_mesh(ep: int, fsdp: bool, device_type: str) -> Any:
    """OLMo-core's world mesh for EP degree ``ep`` (HSDP with EP on ``dp_shard``; plain FSDP at ep=1)."""
    import torch.distributed as dist
    from olmo_core.distributed import parallel
    from olmo_core.distributed.parallel import DataParallelConfig, DataParallelType, ExpertParallelConfig

    parallel._WORLD_MESH = None  # workaround: OLMo-core allows one world mesh per process (see the docstring)
    world = dist.get_world_size()
    if ep == 1:
        return parallel.build_world_mesh(dp=DataParallelConfig(name=DataParallelType.fsdp), device_type=device_type)
    dp = DataParallelConfig(name=DataParallelType.hsdp, num_replicas=world // ep, shard_degree=ep)
    return parallel.build_world_mesh(dp=dp, ep=ExpertParallelConfig(degree=ep), device_type=device_type)


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
            raise RuntimeError(f"OLMo-core's EP group for rank {dist.get_rank()} is ranks {framework} (its "
                               f"dp_shard dim: consecutive ranks), but this cell's layout gives {suite}")
        for moe in model.blocks.values():
            moe.apply_ep(ep_mesh)
    if not fsdp:
        return
    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None)
    for moe in model.blocks.values():
        moe.prepare_experts_for_fsdp(world_mesh=world_mesh, mp_policy=policy, reshard_after_forward=ep == 1)
    dp_mesh = get_dp_model_mesh(world_mesh)
    for moe in model.blocks.values():
        fully_shard(moe, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)


# -- identities and regions ----------------------------------------------------------------------
def _identify(fqn: str) -> tuple[int | None, str | None]:
    """``(layer, expert weight name or None)`` of a parameter FQN ``blocks.<i>.<rest>``."""
    parts = fqn.split(".")
    if parts[:1] != ["blocks"]:
        return None, None
    rest = ".".join(parts[2:])
    return int(parts[1]), (rest[len(_EXPERTS):] if rest.startswith(_EXPERTS) else None)


def _short(fqn: str) -> str:
    return ".".join(fqn.split(".")[2:]) if fqn.startswith("blocks.") else fqn


def _num_experts(model: Any) -> int:
    return next(iter(model.blocks.values())).num_experts


def _region(tensor: Any) -> tuple[Any, tuple[slice, ...]]:
    local, region = local_region(tensor)
    return local, region if region is not None else tuple(slice(0, n) for n in tensor.shape)


def _full(layer: int | None, expert_name: str | None, short: str, shape: tuple[int, ...], num_experts: int,
          make: Any) -> Any:
    """The whole global tensor from ``make(layer, expert, name, shape)``; flattened experts block by block."""
    import torch

    if expert_name is None:
        return make(layer, None, short, shape)
    rows = shape[0] // num_experts
    return torch.cat([make(layer, g, expert_name, (rows, *shape[1:])) for g in range(num_experts)])


def _fill(model: Any, make: Any, assign: Any) -> None:
    num_experts = _num_experts(model)
    for fqn, p in model.named_parameters():
        layer, expert_name = _identify(fqn)
        local, region = _region(p)
        full = _full(layer, expert_name, _short(fqn), tuple(p.shape), num_experts, make)
        assign(p, local, full[region].to(device=local.device, dtype=local.dtype))


def _overwrite(model: Any, make: Any) -> None:
    """Every parameter's local data := its region of the synthetic global tensor."""
    _fill(model, make, lambda p, local, value: local.copy_(value))


def _set_grads(model: Any, seed: int, step: int) -> None:
    from torch.distributed.tensor import DTensor

    def assign(p: Any, local: Any, value: Any) -> None:
        grad = value.contiguous()
        if isinstance(p, DTensor):
            grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        p.grad = grad

    _fill(model, lambda layer, g, name, shape: synthetic_grad(seed, step, layer, g, name, shape), assign)


def _rows(model: Any, tensor: Any, *, where: str) -> Iterator[tuple[int, Any]]:
    """``(global expert, whole per-expert tensor)`` for each expert block of a flattened weight on this rank.

    FSDP2 splits dim 0 into equal chunks, which need not end at expert boundaries (E=6 over 4 ranks: 24 of 96
    ``w1`` rows each, 16 per expert).  Where any rank holds part of an expert, every rank gathers the tensor
    (``DTensor.full_tensor``, decided from the placements alone, so all ranks take the same branch) and yields
    each expert it holds rows of, whole: the contract describes experts, and a part of one has no name in it.
    """
    num_experts = _num_experts(model)
    local, region = _region(tensor)
    rows = tensor.shape[0] // num_experts
    first, stop = region[0].start, region[0].stop
    if any(r.start != 0 or r.stop != n for r, n in zip(region[1:], tensor.shape[1:], strict=True)):
        raise NotImplementedError(f"{where}: this rank holds {region} of a {tuple(tensor.shape)} flattened expert "
                                  "tensor: a split of its other dims, which neither EP nor FSDP makes")
    if _splits_an_expert(tensor, rows):
        whole = tensor.full_tensor()
        for g in range(first // rows, -(-stop // rows) if stop > first else first // rows):
            yield g, whole[g * rows:(g + 1) * rows]
        return
    for i in range((stop - first) // rows):
        yield first // rows + i, local[i * rows:(i + 1) * rows]


def _splits_an_expert(tensor: Any, rows: int) -> bool:
    """Whether some rank of ``tensor``'s mesh holds a dim-0 chunk that does not end at an expert boundary."""
    import itertools

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return False
    mesh = tensor.device_mesh
    for coordinate in itertools.product(*(range(n) for n in mesh.shape)):
        shape, offset = _compute_local_shape_and_global_offset(tensor.shape, mesh.shape, list(coordinate),
                                                               tensor.placements)
        if offset[0] % rows or shape[0] % rows:
            return True
    return False

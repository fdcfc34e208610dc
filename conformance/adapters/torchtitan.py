"""The built-in ``torchtitan`` and ``torchtitan-local`` adapters: torchtitan 0.3.0 end to end.

They drive torchtitan's own code (nothing of the EP split or the checkpoint is re-implemented):
its ``MoE`` layers (router, ``GroupedExperts`` with packed ``w1_EFD``/``w2_EDF``/``w3_EFD``, the
shared-expert ``FeedForward``) from its config builders, in a decoder reduced to its MoE blocks so the
trainer's ``parallelize_qwen3`` applies unchanged (EP split, then ``apply_fsdp_to_decoder`` or
``skip_dp=True``), built on meta, ``to_empty``'d and ``init_states``'d as in ``Trainer.__init__``,
then filled by global expert id; ``ParallelDims.build_mesh`` (cached per (backend, ep));
``OptimizersContainer`` from ``default_adamw()``; and ``CheckpointManager``'s ``dcp_save`` /
``dcp_load`` (only its ``step-N`` folders are bypassed).  ``torchtitan`` sets
``spmd_backend="partial_dtensor"`` (experts DTensors ``Shard(0)`` over ``ep``); ``torchtitan-local``
keeps 0.3.0's default ``"spmd_types"`` (experts plain local tensors, a ``torch.chunk`` of the expert dim).

Workarounds for a CPU/gloo world (none changes what is checked):

* ``torchtitan.distributed.parallel_dims.device_type`` is set to the world's device: torchtitan picks
  it at import (``_get_available_device_type() or "cuda"``) and would build a CUDA mesh without a GPU.
* ``OptimizersContainer`` ``implementation="for-loop"``: torchtitan documents its default ``"fused"``
  as CUDA only, and the for-loop kernel is what torch picks on CPU.  (Both multi-tensor kinds also
  refuse EP without FSDP under ``partial_dtensor``, "got mixed torch.Tensor and DTensor" -- a model
  torchtitan's trainer never steps, since it always applies FSDP.)
* ``register_moe_load_balancing_hook`` is left out: no forward pass precedes a step, so its
  expert-bias update is zero, and the ground truth may not communicate.
* ``parallelize_qwen3`` gets ``mixed_precision_param`` at the cell's dtype (the default bf16 is a
  compute cast only; storage is unchanged), so the forward compares with the fp32 truth.
* The expert rows of a plain local tensor are identified by this rank's place on the ``ep`` mesh
  and ``spmd_types``' ``torch.chunk`` rule (recorded on the model at build); a DTensor's by its offset.

What the matrix finds: docs/frameworks/torchtitan.md.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from conformance.adapter import (
    ADAM_MOMENTS,
    Capabilities,
    FrameworkRefusal,
    NotApplicable,
    Spec,
    local_region,
    run_steps,
    torch_optimizer_scalars,
    world_device,
)
from conformance.synthetic import synthetic_grad, synthetic_weight

EXPERT_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")
_EXPERTS = "routed_experts.inner_experts."
#: attribute set on the built model: (rank on the ep mesh, ep degree) for plain local expert tensors.
_EP_COORDS = "_conformance_ep_coords"
#: attribute set on the built model: its torchtitan ParallelDims (None for the ground truth), for the forward.
_PARALLEL_DIMS = "_conformance_parallel_dims"


class TorchtitanAdapter:
    """torchtitan 0.3.0, ``spmd_backend="partial_dtensor"``: experts are DTensors over ``ep``."""

    name = "torchtitan"
    spmd_backend = "partial_dtensor"
    capabilities = Capabilities(kinds=("packed",), optimizer=True, fsdp=True, uneven=True, max_ep=64,
                                format="dcp", ep_orders=("consecutive",))
    preload = ("torchtitan.models.qwen3", "torchtitan.components.checkpoint", "torchtitan.components.optimizer")

    @property
    def version(self) -> str:
        """The installed torchtitan's version (read from its metadata, without importing it)."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("torchtitan")
        except PackageNotFoundError:
            return "not installed"

    # -- building ----------------------------------------------------------------------------------
    def build(self, spec: Spec, mesh: Any, seed: int) -> tuple[Any, Any]:
        import torch
        from torchtitan.config import ParallelismConfig
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.tools.utils import set_default_dtype

        if spec.kind != "packed":
            raise ValueError(f"torchtitan's GroupedExperts is packed; cannot build kind {spec.kind!r}")
        if spec.activation != "swiglu":
            raise ValueError(f"torchtitan's GroupedExperts is SwiGLU; cannot build activation {spec.activation!r}")
        dist_utils.set_spmd_backend(self.spmd_backend)  # what Trainer.__init__ does
        ep = 1 if mesh is None else mesh["ep"].size()
        device = world_device(mesh)
        parallelism = ParallelismConfig(expert_parallel_degree=ep, spmd_backend=self.spmd_backend)
        with torch.device("meta"), set_default_dtype(getattr(torch, spec.dtype)):
            model = _build_model(spec, parallelism, enable_ep=ep > 1)
        coords, parallel_dims = (0, 1), None
        if mesh is not None:
            parallel_dims = _parallel_dims(self.spmd_backend, ep, device.type)
            _parallelize(model, parallel_dims, parallelism, fsdp=spec.fsdp, dtype=spec.dtype)
            if ep > 1:
                coords = (parallel_dims.get_mesh("ep").get_local_rank(), ep)
        object.__setattr__(model, _EP_COORDS, coords)
        object.__setattr__(model, _PARALLEL_DIMS, parallel_dims)
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_states(buffer_device=None)
            _overwrite(model, lambda layer, expert, name, shape: synthetic_weight(seed, layer, expert, name, shape))
        if spec.optimizer_steps <= 0:
            return model, None
        from torchtitan.components.optimizer import default_adamw

        # CPU workaround: torchtitan documents its default "fused" as CUDA only; "for-loop" is what
        # torch itself picks on CPU (kept on any device, so every build runs the same kernels).
        # Both multi-tensor kinds, fused and foreach, also refuse a model with DTensor experts next
        # to plain dense weights -- EP without FSDP, which the trainer never builds -- with "got
        # mixed torch.Tensor and DTensor".
        config = default_adamw()
        config.implementation = "for-loop"
        for group in config.param_groups:  # the cell's learning rate (the load side builds with another)
            group.optimizer_kwargs = {**group.optimizer_kwargs, "lr": spec.lr}
        optimizers = config.build(model_parts=[model])
        run_steps(lambda index: self.step(model, optimizers, seed, index), 0, spec.optimizer_steps)
        return model, optimizers

    def step(self, model: Any, optimizer: Any, seed: int, step: int) -> None:
        _set_grads(model, seed, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def scalars(self, model: Any, optimizer: Any) -> dict[str, Any]:
        return torch_optimizer_scalars(optimizer)

    def forward(self, model: Any, batch: Any) -> Any:
        """torchtitan's own forward of every MoE block on ``batch`` as one sequence: router, its token dispatcher
        (the all-to-all one at ep > 1, local reordering at ep=1), ``GroupedExperts``, the shared expert.

        It runs inside torchtitan's own training context (``dist_utils.get_spmd_context``, as ``Trainer`` wraps
        each step: under ``spmd_types`` it registers the dense and sparse meshes the dispatcher reads).  FSDP2's
        parameters are resharded after it.  torchtitan's dispatcher splits the per-expert token counts
        over the EP ranks with ``view(ep, -1)``, which no E % ep != 0 can take: there every rank raises before
        any exchange, and the check is n/a with torchtitan's own error.
        """
        import contextlib
        import warnings

        import torch
        from torch.distributed.fsdp import FSDPModule
        from torchtitan.distributed import utils as dist_utils

        num_experts, (_, ep) = _num_experts(model), getattr(model, _EP_COORDS)
        device = next(model.parameters()).device
        if self.spmd_backend == "spmd_types" and ep > 1 and device.type == "cpu":
            # decided before the forward: a rank whose chunks happen to be equal would enter the exchange alone
            raise NotApplicable("under spmd_types torchtitan's AllToAllTokenDispatcher exchanges tokens with "
                                "spmd_types' all_to_all, a list all_to_all of uneven per-rank chunks, which "
                                "ProcessGroupGloo refuses (found: 'ProcessGroupGloo::alltoall: invalid tensor size "
                                "at index 1 (expected (15, 16), got (17, 16))')")
        parallel_dims = getattr(model, _PARALLEL_DIMS)
        context = (dist_utils.get_spmd_context(parallel_dims=parallel_dims)() if parallel_dims is not None
                   else contextlib.nullcontext())
        try:
            with torch.no_grad(), context, warnings.catch_warnings():
                # the router's fp32 autocast, which CPU autocast does not support (a no-op there)
                warnings.filterwarnings("ignore", "In CPU autocast, but the target dtype is not supported")
                out = model(batch.to(device)[None])[0]
        except RuntimeError as exc:
            if num_experts % ep == 0:
                raise
            raise NotApplicable(f"torchtitan's AllToAllTokenDispatcher cannot split the token counts of E="
                                f"{num_experts} experts over ep={ep} (_token_count_exchange: "
                                f"num_local_tokens_per_expert_E.view(ep, -1)): {type(exc).__name__}: {exc}") from exc
        finally:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        return out.full_tensor() if hasattr(out, "full_tensor") else out

    # -- checkpoint path ---------------------------------------------------------------------------
    def save(self, model: Any, optimizer: Any, path: str) -> None:
        from torchtitan.components.checkpoint import MODEL, AsyncMode

        manager = _manager(model, optimizer, path)
        # Model + optimizer: what CheckpointManager._save writes; model alone: its model-only
        # (last-step) save.  Written to ``path`` itself rather than ``<folder>/step-N``.
        states = manager._flattened_model_states_sd() if optimizer is not None else manager.states[MODEL].state_dict()
        manager.dcp_save(states, checkpoint_id=path, async_mode=AsyncMode.DISABLED)

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        manager = _manager(model, optimizer, path)
        states = manager._states_to_load(model_only=optimizer is None)
        manager.dcp_load(states, checkpoint_id=path, from_hf=False, from_quantized=False)

    # -- canonical views ---------------------------------------------------------------------------
    def expert_tensors(self, model: Any, optimizer: Any) -> Iterator[tuple[int, int, str, Any]]:
        state = _optimizer_state(optimizer)
        for fqn, p in model.named_parameters():
            layer, expert_name = _identify(fqn)
            if expert_name is None:
                continue
            assert layer is not None  # _identify names an expert weight only under layers.<i>
            moments = {f"{expert_name}.{m}": state[p][m] for m in ADAM_MOMENTS if m in state.get(p, {})}
            tensors = {expert_name: p} | moments
            for name, tensor in tensors.items():
                yield from _rows(model, layer, name, tensor)

    def other_tensors(self, model: Any, optimizer: Any) -> Iterator[tuple[int | None, None, str, Any]]:
        state = _optimizer_state(optimizer)
        for fqn, p in model.named_parameters():
            layer, expert_name = _identify(fqn)
            if expert_name is not None:
                continue
            name = _short(fqn)
            yield layer, None, name, p
            for moment in ADAM_MOMENTS:
                if moment in state.get(p, {}):
                    yield layer, None, f"{name}.{moment}", state[p][moment]


class TorchtitanLocalAdapter(TorchtitanAdapter):
    """torchtitan 0.3.0, ``spmd_backend="spmd_types"`` (its default): experts are plain local tensors."""

    name = "torchtitan-local"
    spmd_backend = "spmd_types"


# -- torchtitan objects (built inside rank processes only) ---------------------------------------
@functools.cache
def _parallel_dims(backend: str, ep: int, device_type: str) -> Any:
    """torchtitan's ParallelDims over the whole world at EP degree ``ep``, its mesh built once."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    # Workaround: torchtitan chose its device type at import ("cuda" on a machine without a GPU); its
    # mesh must be on the world's device (CPU under gloo).
    parallel_dims_module.device_type = device_type
    parallelism = ParallelismConfig(expert_parallel_degree=ep, spmd_backend=backend)
    parallel_dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    parallel_dims.build_mesh()
    return parallel_dims


def _build_model(spec: Spec, parallelism: Any, *, enable_ep: bool) -> Any:
    """``num_layers`` torchtitan MoE layers in a decoder-shaped container (``layers.<i>.moe``)."""
    from functools import partial

    from torch import nn
    from torchtitan.models.common.config_utils import (
        make_ffn_config,
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config
    from torchtitan.models.qwen3.sharding import _GROUPED_EXPERTS_PARAM_LAYOUT
    from torchtitan.protocols.module import ModuleDict

    linear_init = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
    experts_init = {w: partial(nn.init.normal_, std=0.02) for w in EXPERT_WEIGHTS}
    top_k = min(spec.top_k, spec.num_experts)
    config = make_moe_config(
        num_experts=spec.num_experts,
        router=make_router_config(dim=spec.dim, num_experts=spec.num_experts, gate_param_init=linear_init,
                                  top_k=top_k, score_func="softmax", route_norm=True),
        routed_experts=make_routed_experts_config(dim=spec.dim, hidden_dim=spec.hidden,
                                                  num_experts=spec.num_experts, top_k=top_k,
                                                  param_init=experts_init, comm_backend="standard"),
        shared_experts=(make_ffn_config(dim=spec.dim, hidden_dim=spec.hidden, w1_param_init=linear_init,
                                        w2w3_param_init=linear_init) if spec.shared_expert else None),
    )
    set_moe_sharding_config(config, enable_ep=enable_ep, enable_sp=parallelism.enable_sequence_parallel,
                            expert_param_layout=_GROUPED_EXPERTS_PARAM_LAYOUT)
    block_class, stack_class = _model_classes()
    layers = ModuleDict({str(i): block_class(config.build()) for i in range(spec.num_layers)})
    return stack_class(layers)


@functools.cache
def _model_classes() -> tuple[type, type]:
    """A transformer block reduced to its MoE (``x + moe(x)``) and a decoder reduced to its layers.

    They carry what torchtitan's ``apply_fsdp_to_decoder`` reads of a ``Decoder`` and its blocks
    (``layers``, ``moe_enabled``, ``moe``; no embeddings, final norm or head), so the trainer's
    parallelize function applies to them unchanged.
    """
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


def _parallelize(model: Any, parallel_dims: Any, parallelism: Any, *, fsdp: bool, dtype: str) -> None:
    """The trainer's parallelize_fn (Qwen3's, shared by torchtitan's MoE decoders)."""
    import tempfile

    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.qwen3 import parallelize_qwen3

    with tempfile.TemporaryDirectory(prefix="torchtitan-dump-") as dump_folder:
        try:
            # FSDP computes in the cell's dtype (torchtitan's default bf16 casts for compute only; storage is the
            # same), so the forward compares with the ground truth's, which has no FSDP.
            training = TrainingConfig(mixed_precision_param="bfloat16" if dtype == "bfloat16" else "float32")
            parallelize_qwen3(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                              compile_config=CompileConfig(), ac_config=None, dump_folder=dump_folder,
                              skip_dp=not fsdp)
        except Exception as exc:  # the framework's own failure, named with the configuration it failed in
            raise RuntimeError(f"torchtitan parallelize_qwen3 failed (spmd_backend={parallelism.spmd_backend!r}, "
                               f"ep={parallel_dims.ep}, {'FSDP' if fsdp else 'skip_dp=True'}): "
                               f"{type(exc).__name__}: {exc}") from exc


def _manager(model: Any, optimizer: Any, path: str) -> Any:
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(enable=True, folder=path, keep_latest_k=0)
    return CheckpointManager(config, dataloader=None, model_parts=[model], optimizers=optimizer,
                             lr_schedulers=None, states={}, sd_adapter=None)


# -- identities and regions ----------------------------------------------------------------------
def _short(fqn: str) -> str:
    from torchtitan.components.checkpointer.utils import canonical_fqn

    parts = canonical_fqn(fqn).split(".")
    return ".".join(parts[3:]) if parts[:1] == ["layers"] and parts[2:3] == ["moe"] else ".".join(parts)


def _identify(fqn: str) -> tuple[int | None, str | None]:
    """``(layer, expert weight name or None)`` of a parameter FQN ``layers.<i>.moe.<rest>``."""
    from torchtitan.components.checkpointer.utils import canonical_fqn

    parts = canonical_fqn(fqn).split(".")
    if parts[:1] != ["layers"] or parts[2:3] != ["moe"]:
        return None, None
    rest = ".".join(parts[3:])
    return int(parts[1]), (rest[len(_EXPERTS):] if rest.startswith(_EXPERTS) else None)


def _plain_rows(model: Any, rows: int, num_experts: int) -> int:
    """First global expert of a plain expert tensor of ``rows`` rows on this rank."""
    if rows == num_experts:
        return 0
    rank, ep = getattr(model, _EP_COORDS)
    chunk = -(-num_experts // ep)  # spmd_types.shard(I -> S(0)) is torch.chunk of the expert dim
    first = rank * chunk
    if first + rows > num_experts:
        raise FrameworkRefusal(
            f"torchtitan gave ep rank {rank} of {ep} a plain expert tensor of {rows} rows starting at global expert "
            f"{first}, past the {num_experts} experts: spmd_types.shard splits the expert dim into ceil(E/ep)="
            f"{chunk} rows per rank (its meta-device shape; torch.chunk on real data has no chunk for this rank), "
            f"which cannot hold E={num_experts} at ep={ep}")
    return first


def _local_region(model: Any, tensor: Any, expert: bool) -> tuple[Any, tuple[slice, ...]]:
    """``(local data, region of the global tensor)`` for a parameter or moment."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        local, region = local_region(tensor)
        assert region is not None
        return local, region
    if expert:
        num_experts = _num_experts(model)
        first = _plain_rows(model, tensor.shape[0], num_experts)
        return tensor, (slice(first, first + tensor.shape[0]), *(slice(0, n) for n in tensor.shape[1:]))
    return tensor, tuple(slice(0, n) for n in tensor.shape)


def _num_experts(model: Any) -> int:
    return next(iter(model.layers.values())).moe.routed_experts.inner_experts.num_experts


def _global_shape(model: Any, tensor: Any, expert: bool) -> tuple[int, ...]:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tuple(tensor.shape)
    if expert:
        return (_num_experts(model), *tensor.shape[1:])
    return tuple(tensor.shape)


def _full(model: Any, layer: int | None, expert_name: str | None, short: str, shape: tuple[int, ...],
          make: Any) -> Any:
    """The whole global tensor from ``make(layer, expert, name, shape)``, per expert for expert weights."""
    import torch

    if expert_name is None:
        return make(layer, None, short, shape)
    return torch.stack([make(layer, g, expert_name, shape[1:]) for g in range(shape[0])])


def _overwrite(model: Any, make: Any) -> None:
    """Every parameter's local data := its region of the synthetic global tensor."""
    for fqn, p in model.named_parameters():
        layer, expert_name = _identify(fqn)
        expert = expert_name is not None
        local, region = _local_region(model, p, expert)
        full = _full(model, layer, expert_name, _short(fqn), _global_shape(model, p, expert), make)
        local.copy_(full[region].to(device=local.device, dtype=local.dtype))


def _set_grads(model: Any, seed: int, step: int) -> None:
    from torch.distributed.tensor import DTensor

    for fqn, p in model.named_parameters():
        layer, expert_name = _identify(fqn)
        expert = expert_name is not None
        local, region = _local_region(model, p, expert)
        full = _full(model, layer, expert_name, _short(fqn), _global_shape(model, p, expert),
                     lambda lyr, g, name, shape: synthetic_grad(seed, step, lyr, g, name, shape))
        grad = full[region].to(device=local.device, dtype=local.dtype).contiguous()
        if isinstance(p, DTensor):
            grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        p.grad = grad


def _optimizer_state(optimizer: Any) -> dict[Any, dict[str, Any]]:
    if optimizer is None:
        return {}
    state: dict[Any, dict[str, Any]] = {}
    for optim in optimizer.optimizers:
        state.update(optim.state)
    return state


def _rows(model: Any, layer: int, name: str, tensor: Any) -> Iterator[tuple[int, int, str, Any]]:
    """One packed expert tensor (or moment) as per-expert rows with their global expert ids."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        local, region = _local_region(model, tensor, True)
        if all(r.start == 0 and r.stop == n for r, n in zip(region[1:], tensor.shape[1:], strict=True)):
            for i in range(local.shape[0]):  # whole rows: plain per-expert tensors
                yield layer, region[0].start + i, name, local[i]
        elif region[0].stop - region[0].start == tensor.shape[0]:
            for g in range(tensor.shape[0]):  # FSDP Shard(1) (efsdp * ep > E): each expert a DTensor row
                yield layer, g, name, tensor[g]
        else:
            raise NotImplementedError(f"{name}: local region {region} of a {tuple(tensor.shape)} DTensor "
                                      f"({tensor.placements}) cuts both the expert dim and another dim")
        return
    first = _plain_rows(model, tensor.shape[0], _num_experts(model))
    for i in range(tensor.shape[0]):
        yield layer, first + i, name, tensor[i]

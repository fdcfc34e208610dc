"""The built-in ``megatron-distopt*`` adapters: Megatron-Core 0.16.0's distributed optimizer, bf16,
on CPU.

What Megatron MoE users run at scale, where the ``megatron`` adapter drives the ``FP32Optimizer``
path: the model wrapped in Megatron's own ``DistributedDataParallel`` (grad buffers, gradients
reduce-scattered over the data-parallel group; at ep > 1 the experts' over the expert-data-parallel
group -- at ep=1 Megatron treats them as dense), and
``get_megatron_optimizer(use_distributed_optimizer=True)``: a ``DistributedOptimizer`` (ZeRO-1), one
for the dense and one for the expert parameters at ep > 1, a single one at ep=1, in **bf16 with fp32
main parameters** (Megatron's ``--bf16``, ``grad_reduce_in_fp32``), each rank holding a flat shard
of every main parameter and moment.  The layers, EP and expert-TP set-up, synthetic weights and the
forward are the ``megatron`` adapter's (:mod:`conformance.adapters.megatron`).

Each adapter saves the optimizer in one of the dist-checkpoint formats megatron-core 0.16.0 offers
(``DistributedOptimizer.sharded_state_dict``'s ``metadata['distrib_optim_sharding_type']``, read
from ``optimizer/distrib_optimizer.py``):

* ``megatron-distopt``: ``dp_reshardable``, what Megatron-LM's trainer passes by default
  (``megatron/training/checkpointing.py``): the flat bucket shards under data-parallel-rank keys;
  the docstring of the format says it reshards over DP only;
* ``megatron-distopt-fully_reshardable``: the trainer's ``--dist-ckpt-optim-fully-reshardable``:
  main parameters and moments in model space, sharded as the model's keys are;
* ``megatron-distopt-fully_sharded_model_space``: the method's own default when no format is passed
  (the trainer's ``--dist-ckpt-save-pre-mcore-014``);
* ``megatron-distopt-dp_zero_gather_scatter``: the deprecated format, the whole state gathered to DP
  rank 0 at the save (over the data-parallel group) and scattered from it at the load (over
  Megatron's gloo copy of that group).

The canonical views: every expert's (and dense) bf16 weight under the ``megatron`` adapter's names,
its fp32 main parameter as ``<name>.master`` and its Adam moments as ``<name>.exp_avg`` /
``.exp_avg_sq``, each gathered whole from the optimizer's data-parallel shards (a collective over
that group), so a main parameter left under a local name while the bf16 copy is global is compared
per (layer, expert).

Gradients: Megatron's DDP scales every gradient by ``1 / dp`` before it sums it over its group
(dense: all data parallel ranks; experts at ep > 1: the expert-data-parallel ones).  The adapter
writes ``dp x synthetic_grad`` into the ``main_grad`` of the first rank of that group and zeros
elsewhere, so Megatron's own reduce-scatter ends at ``synthetic_grad`` exactly -- for a power-of-two
``dp`` (every world here), which :func:`_set_main_grads` checks.

Workarounds beyond the ``megatron`` adapter's (each scoped to the adapter's call, restored
afterwards; the source lines are in docs/frameworks/megatron-distributed-optimizer.md):

* ``distributed/param_and_grad_buffer.py``, ``_ParamAndGradBuffer.__init__``: the param and grad
  buffers are allocated on ``torch.cuda.current_device()`` -- the CPU here, while the DDP wrap runs;
* ``optimizer/distrib_optimizer.py``, ``_build_model_and_main_param_groups`` and ``__init__``: a
  parameter must report ``type()`` ``torch.cuda.BFloat16Tensor`` (else ``TypeError``): each
  parameter answers so while the optimizer is built (an instance attribute, deleted afterwards);
* ``DistributedOptimizer.get_parameter_state_dp_zero`` (the save of ``fully_reshardable`` and
  ``dp_zero_gather_scatter``): receive buffers on ``torch.cuda.current_device()`` and
  ``send_tensor.cuda()``: the CPU, and ``Tensor.cuda`` returns the tensor itself while the save
  runs;
* not a CPU matter but a Megatron bug the adapter looks past, a finding of its own
  (docs/frameworks/megatron.md): ``DistributedOptimizer._set_main_param_and_optimizer_states``
  copies each state key the destination holds, and torch's AdamW (megatron-core without Transformer
  Engine or Apex) holds ``step``, which the ``fully_reshardable``, ``dp_zero_gather_scatter`` and
  ``fully_sharded_model_space`` loaders drop: every load in those formats raises
  ``KeyError: 'step'``.  A missing ``step`` keeps the destination's own, which ``load_state_dict``
  has already set from the saved param groups (as a fused Adam's state, which has no ``step``,
  would), so the checks see the rest;
* the ground truth's DDP needs a c10d-registered one-rank group
  (:func:`megatron_cpu.one_rank_view`).

What the matrix finds: docs/frameworks/megatron.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from conformance.adapter import ADAM_MOMENTS, Spec
from conformance.adapters.megatron import (
    WEIGHT_DECAY,
    MegatronAdapter,
    _assign,
    _buffers,
    _build_model,
    _dense,
    _expert_tp_mesh,
    _expert_views,
    _fill,
    _step,
    update_expert_biases,
)
from conformance.adapters.megatron_cpu import (
    _CpuTorch,
    _patched,
    megatron_on_cpu,
    one_rank_view,
    one_rank_world,
    set_up,
)
from conformance.synthetic import synthetic_grad

#: what the distributed optimizer keeps per main-parameter shard, and the name each has in the
#: canonical views.
_STATE_NAMES = {"param": "master", **{m: m for m in ADAM_MOMENTS}}


# -- Megatron on CPU, the distributed optimizer's part ---------------------------------------------
@contextlib.contextmanager
def _bf16_as_cuda(params: list[Any]) -> Iterator[None]:
    """Each parameter's ``type()`` as ``torch.cuda.<T>Tensor`` while the distributed optimizer is
    built (it accepts only CUDA tensor types); ``type()`` with arguments is torch's."""
    import torch

    shadowed = []
    try:
        for p in params:
            name = torch.Tensor.type(p).replace("torch.", "torch.cuda.", 1)
            p.type = (lambda *a, _p=p, _n=name,
                      **k: _n if not a and not k else torch.Tensor.type(_p, *a, **k))
            shadowed.append(p)
        yield
    finally:
        for p in shadowed:
            del p.type


def _keep_step(set_states: Callable[[Any, Any, dict[str, Any]],
                                    None]) -> Callable[[Any, Any, dict[str, Any]], None]:
    """``_set_main_param_and_optimizer_states`` with a ``step`` the loader dropped kept as the
    destination's."""

    def set_main_param_and_optimizer_states(self: Any, model_param: Any,
                                            tensors: dict[str, Any]) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"]}
        set_states(self, model_param, tensors)

    return set_main_param_and_optimizer_states


@contextlib.contextmanager
def distopt_on_cpu() -> Iterator[None]:
    """The distributed optimizer's save and load on CPU (the module docstring names each bypass)."""
    import torch
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    with (megatron_on_cpu(), _patched([
        (distrib_optimizer, "torch", _CpuTorch()),
        (torch.Tensor, "cuda", lambda self, *a, **k: self),
        (cls, "_set_main_param_and_optimizer_states",
         _keep_step(cls._set_main_param_and_optimizer_states)),
    ])):
        yield


# -- the model, gradients and the optimizer's state ------------------------------------------------
def _wrap(stack: Any, view: Any) -> Any:
    """``stack`` in Megatron's ``DistributedDataParallel`` (distributed optimizer, fp32 gradient
    reduction)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        param_and_grad_buffer,
    )

    stack.ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                     grad_reduce_in_fp32=True)
    with _patched([(param_and_grad_buffer, "torch", _CpuTorch())]):
        model = DistributedDataParallel(stack.config, stack.ddp_config, stack, pg_collection=view)
    model.moe_layers = stack.moe_layers
    model.etp_mesh = stack.etp_mesh
    return model


def _grad_groups(model: Any) -> Iterator[tuple[Any, Any]]:
    """``(parameter, the group DDP reduces its gradient over)``."""
    for p in model.module.parameters():
        yield p, model.intra_dp_cp_group if getattr(p, "allreduce",
                                                    True) else model.intra_expt_dp_group


def _set_main_grads(model: Any, seed: int, step: int) -> None:
    """Synthetic gradients into DDP's fp32 grad buffers, reduce-scattered by Megatron to
    ``synthetic_grad``."""
    import torch

    model.zero_grad_buffer()
    writes = {id(p): group.rank() == 0 for p, group in _grad_groups(model)}
    scale = model.dp_cp_group.size()
    if scale & (scale - 1):
        raise ValueError("the adapter's gradients are exact after Megatron's 1/dp scaling only for "
                         f"a power-of-two data-parallel size; this world's is {scale}")
    with torch.no_grad():
        for layer, moe in enumerate(model.moe_layers()):
            for g, name, p, view in _expert_views(moe, model.etp_mesh):
                if writes[id(p)]:
                    target = view(p.main_grad)
                    _assign(target,
                            synthetic_grad(seed, step, layer, g, name, target.shape) * scale)
        for layer, name, p in _dense(model):
            if writes[id(p)]:
                p.main_grad.copy_(synthetic_grad(seed, step, layer, None, name, p.shape) * scale)
    model.finish_grad_sync()


def _optimizer(model: Any, view: Any, lr: float, gloo_groups: bool) -> Any:
    """``get_megatron_optimizer`` in bf16 with the distributed optimizer (its CUDA type check
    answered; the truth's set-up as a one-rank world, without Megatron's gloo groups, which a
    ``pg_collection`` excludes)."""
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=lr, weight_decay=WEIGHT_DECAY, clip_grad=0.0, bf16=True,
        fp16=False, params_dtype=torch.bfloat16, use_distributed_optimizer=True)
    truth = one_rank_world() if view is not None else contextlib.nullcontext()
    with megatron_on_cpu(), truth, _bf16_as_cuda(list(model.parameters())):
        return get_megatron_optimizer(config, [model], use_gloo_process_groups=gloo_groups and view
                                      is None, pg_collection=view)


def _whole_states(optimizer: Any) -> dict[Any, dict[str, Any]]:
    """Model parameter -> ``{"master" | moment: the whole fp32 tensor}``, gathered from every
    distributed optimizer's data-parallel shards: per optimizer one all-reduce per state and one of
    which states any rank holds (each element is held by exactly one rank, so the sum is exact).  A
    collective: every rank asks it."""
    import torch
    import torch.distributed as dist

    found: dict[Any, dict[str, Any]] = {}
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = [p for buffer in inner.buffers for p in buffer.params]
        offsets, total = {}, 0
        for p in params:
            offsets[p], total = total, total + p.numel()
        flat = {key: torch.zeros(total, dtype=torch.float32) for key in _STATE_NAMES}
        present = torch.zeros(len(_STATE_NAMES), dtype=torch.int64)
        for range_maps in inner.gbuf_ranges:
            for bucket_maps in range_maps.values():
                for bucket in bucket_maps:
                    for p, ranges in bucket["param_map"].items():
                        held = inner._get_main_param_and_optimizer_states(p)
                        where = slice(offsets[p] + ranges["param"].start,
                                      offsets[p] + ranges["param"].end)
                        for i, key in enumerate(_STATE_NAMES):
                            if key in held:
                                flat[key][where] = held[key].detach().view(-1).float()
                                present[i] = 1
        group = inner.data_parallel_group
        if group.size() > 1:
            for tensor in (*flat.values(), present):
                dist.all_reduce(tensor, group=group)
        for p in params:
            found[p] = {name: flat[key][offsets[p]:offsets[p] + p.numel()].view(p.shape)
                        for i, (key, name) in enumerate(_STATE_NAMES.items()) if present[i]}
    return found


class MegatronDistOptAdapter(MegatronAdapter):
    """Megatron's DDP + DistributedOptimizer in bf16 with fp32 main parameters, saving in
    :attr:`sharding_type`."""

    name = "megatron-distopt"
    #: ``metadata['distrib_optim_sharding_type']`` of the optimizer's ``sharded_state_dict``.
    sharding_type = "dp_reshardable"
    #: Megatron's gloo copies of the data-parallel groups (the ``dp_zero_gather_scatter`` load
    #: asserts them).
    gloo_groups = False
    preload = (*MegatronAdapter.preload, "megatron.core.distributed",
               "megatron.core.optimizer.distrib_optimizer")

    def build(self, spec: Spec, mesh: Any, seed: int) -> tuple[Any, Any]:
        import torch.distributed as dist

        if spec.fsdp or spec.dtype != "float32":
            raise ValueError("this adapter drives Megatron's distributed optimizer in bf16 with "
                             "fp32 main parameters (spec.dtype float32 names those) without FSDP2; "
                             f"got fsdp={spec.fsdp}, dtype={spec.dtype!r}")
        if dist.is_initialized() and dist.get_backend() != "gloo":
            raise ValueError(f"this adapter runs Megatron on CPU over gloo; the world's backend is "
                             f"{dist.get_backend()!r}")
        etp_mesh = None
        if mesh is None:  # the ground truth: ep=1 on this rank alone, no parallel_state
            view, ep = one_rank_view(registered=True), 1
        else:
            ep, etp = mesh["ep"].size(), mesh["etp"].size()
            # experts count as dense at ep=1: _set_main_grads' one writer would be wrong
            if ep == 1 and etp > 1:
                raise ValueError("this adapter writes gradients for expert TP only at ep > 1; got "
                                 f"ep=1, etp={etp}")
            set_up(ep, etp, gloo_groups=self.gloo_groups)
            view = None
            if etp > 1:
                etp_mesh = _expert_tp_mesh(mesh)
        model = _wrap(_build_model(spec, ep, view, etp_mesh, bf16=True), view)
        # before the optimizer: it copies its fp32 main parameters at construction
        _fill(model.module, seed)
        if spec.optimizer_steps <= 0:
            return model, None
        optimizer = _optimizer(model, view, spec.lr, self.gloo_groups)
        for step in range(spec.optimizer_steps):
            self.step(model, optimizer, seed, step)
        return model, optimizer

    def step(self, model: Any, optimizer: Any, seed: int, step: int) -> None:
        """One step: synthetic gradients reduce-scattered by Megatron's DDP, the distributed
        optimizer's step (its parameter all-gather included)."""
        _set_main_grads(model, seed, step)
        update_expert_biases(model, seed, step)
        _step(optimizer)

    #: what Megatron-LM's trainer passes to ``sharded_state_dict``
    #: (``megatron/training/checkpointing.py``).
    @property
    def checkpoint_metadata(self) -> dict[str, Any]:  # type: ignore[override]
        return {"distrib_optim_sharding_type": self.sharding_type,
                "chained_optim_avoid_prefix": True, "singleton_local_shards": False}

    on_cpu = staticmethod(distopt_on_cpu)

    # the megatron adapter's legacy save covers the old format
    save_legacy = None  # type: ignore[assignment]

    def expert_tensors(self, model: Any, optimizer: Any) -> Iterator[tuple[int, int, str, Any]]:
        states = _whole_states(optimizer) if optimizer is not None else {}
        for layer, moe in enumerate(model.moe_layers()):
            for g, name, p, view in _expert_views(moe, model.etp_mesh):
                yield layer, g, name, view(p.data)
                for state, tensor in states.get(p, {}).items():
                    yield layer, g, f"{name}.{state}", view(tensor)

    def other_tensors(self, model: Any,
                      optimizer: Any) -> Iterator[tuple[int | None, None, str, Any]]:
        states = _whole_states(optimizer) if optimizer is not None else {}
        for layer, name, p in _dense(model):
            yield layer, None, name, p.data
            for state, tensor in states.get(p, {}).items():
                yield layer, None, f"{name}.{state}", tensor
        for layer, name, buffer in _buffers(model):
            yield layer, None, name, buffer


class MegatronDistOptFullyReshardableAdapter(MegatronDistOptAdapter):
    name = "megatron-distopt-fully_reshardable"
    sharding_type = "fully_reshardable"


class MegatronDistOptFullyShardedModelSpaceAdapter(MegatronDistOptAdapter):
    name = "megatron-distopt-fully_sharded_model_space"
    sharding_type = "fully_sharded_model_space"


class MegatronDistOptDpZeroAdapter(MegatronDistOptAdapter):
    name = "megatron-distopt-dp_zero_gather_scatter"
    sharding_type = "dp_zero_gather_scatter"
    gloo_groups = True

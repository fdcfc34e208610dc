"""The built-in ``megatron`` adapter: Megatron-Core 0.16.0's MoE layers and ``dist_checkpointing``,
on CPU.

It drives Megatron's own code: ``MoELayer``s from ``get_gpt_layer_local_spec(num_experts=E,
moe_grouped_gemm=...).submodules.mlp`` (fp32, SwiGLU, no biases, the ``allgather`` dispatcher;
*unpacked* is ``SequentialMLP``, *packed* the legacy ``GroupedMLP``, whose transposed views the
adapter yields so both kinds compare under the same names), EP and expert TP from
``parallel_state.initialize_model_parallel(expert_model_parallel_size=ep,
expert_tensor_parallel_size=etp)`` over the world's gloo group (consecutive EP groups; expert TP
innermost, the layout's ``etp`` dim), the optimizer from ``get_megatron_optimizer`` (a
``ChainedOptimizer`` of ``FP32Optimizer``s around torch's AdamW), and ``dist_checkpointing.save`` /
``load`` of the model's and optimizer's ``sharded_state_dict()`` (``torch_dist``).  Weights are
overwritten by *global* expert identity (``MoELayer.local_expert_indices``); each expert is compared
as ``linear_fc1.gate``, ``linear_fc1.up`` and ``linear_fc2`` (under expert TP a rank holds rows of
the first two and columns of the third: DTensor views over the ``etp`` mesh dim, see
:func:`_expert_views`).  The ground truth is built without ``parallel_state``, through
``pg_collection`` with a private single-rank ``ProcessGroupGloo`` (never registered).

The router is DeepSeek-V3's as Megatron-LM configures it: sigmoid scores, fp32 routing, and the
auxiliary-loss-free expert bias (``moe_router_enable_expert_bias``): each ``TopKRouter`` holds a
persistent fp32 ``expert_bias`` ``[E]`` (in ``other_tensors`` as ``router.expert_bias``), given
synthetic values from the seed (:data:`BIAS_SCALE`), and a non-persistent token counter.  Each step
writes :func:`conformance.synthetic_load`'s counts into the counters and runs Megatron's own update,
``_update_router_expert_bias`` (:func:`update_expert_biases`).  Multi-token prediction is out of
reach: its block needs a ``GPTModel``'s embedding and output layer, and these are bare MoE layers
(docs/frameworks/megatron.md).

Workarounds, none of which changes what is checked:

* CUDA hard-wires on Megatron's CPU path are bypassed, and process groups cleaned up, by
  :mod:`conformance.adapters.megatron_cpu` (each bypass named there with the file and function it
  works around; all scoped to this adapter's calls and restored afterwards).
* A step is ``prepare_grads()`` + ``step_with_ready_grads()``: ``ChainedOptimizer.step()`` minus the
  gradient-norm reduction, which with ``clip_grad=0`` is only reported (and allocates on CUDA).
* The model is not wrapped in Megatron's ``DistributedDataParallel`` (CUDA-only buffers; it reduces
  gradients, which the synthetic ones make moot); it gets the ``ddp_config`` and ``config``
  attributes the optimizer reads from a wrapped model.
* The save never starts Megatron's spawn ``Manager`` (writer results go through a process-local
  queue), and every process group Megatron creates for a cell is destroyed after the save and at the
  end of the cell (``end_cell``; ``destroy_model_parallel()`` leaves most alive): the loaded layers
  keep their EP groups for the forward.
* ``forward`` runs Megatron's ``MoELayer.forward`` (SequentialMLP, the ``allgather`` dispatcher)
  with three CUDA hard-wires bypassed
  (:func:`conformance.adapters.megatron_cpu.megatron_forward_on_cpu`); the packed kind's is n/a
  (:data:`GROUPED_MLP_NOT_RUN`).

What the matrix finds: docs/frameworks/megatron.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from functools import cache
from typing import Any, cast

from conformance.adapter import ADAM_MOMENTS, Capabilities, Spec, local_region
from conformance.adapters.megatron_cpu import (
    expert_bias_update_over,
    megatron_forward_on_cpu,
    megatron_on_cpu,
    one_rank_view,
    one_rank_world,
    set_up,
    tear_down,
)
from conformance.synthetic import synthetic_grad, synthetic_load, synthetic_weight

#: why the packed kind's forward does not run here.
GROUPED_MLP_NOT_RUN = ("GroupedMLP.forward calls grouped_gemm's gg.ops.gmm (a CUDA-only package, "
                       "not installed)")
WEIGHT_DECAY = 0.01
#: the router's expert-bias step per update (``moe_router_bias_update_rate``, Megatron's default and
#: DeepSeek-V3's).
BIAS_UPDATE_RATE = 1e-3
#: the synthetic expert bias's scale (:func:`conformance.synthetic_weight`'s).  The router's sigmoid
#: scores of the forward check's batch spread ~0.04-0.06 between a token's experts.  Measured at E=4
#: and 5, after 0 and 2 steps (seed 1234): a bias of this scale chooses other experts than a zero
#: bias for 31-50% of the tokens in each layer, and every expert is still chosen.
BIAS_SCALE = 0.01
# -- the model -------------------------------------------------------------------------------------
@cache
def _model_class() -> type:
    import torch

    class MegatronMoEStack(torch.nn.Module):
        """``num_layers`` Megatron MoE layers; the checkpoint keys are
        ``layers.<i>.mlp.<Megatron's key>``."""

        def __init__(self, layers: list[Any], config: Any, ddp_config: Any) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({"mlp": layer})
                                              for layer in layers)
            # what get_megatron_optimizer reads from a (DDP-wrapped) model chunk
            self.config = config
            self.ddp_config = ddp_config

        def moe_layers(self) -> list[Any]:
            return [cast(torch.nn.ModuleDict, block)["mlp"] for block in self.layers]

    return MegatronMoEStack


def _config(spec: Spec, ep: int, etp: int = 1, *, bf16: bool = False) -> Any:
    """Megatron's ``TransformerConfig`` for ``spec``; ``bf16``: bf16 parameters (Megatron's
    ``--bf16``), else ``spec.dtype``."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    if spec.activation != "swiglu":
        raise ValueError("this adapter builds Megatron's SwiGLU experts; got "
                         f"activation={spec.activation!r}")
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.dim, num_attention_heads=1,
        ffn_hidden_size=spec.hidden, num_moe_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.hidden, moe_router_topk=min(spec.top_k, spec.num_experts),
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        moe_shared_expert_intermediate_size=spec.hidden if spec.shared_expert else None,
        moe_token_dispatcher_type="allgather", expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, use_cpu_initialization=True,
        params_dtype=torch.bfloat16 if bf16 else getattr(torch, spec.dtype), bf16=bf16, fp16=False,
        # DeepSeek-V3's router as Megatron-LM's recipes configure it: sigmoid scores (the
        # expert bias requires them), the auxiliary-loss-free expert bias, fp32 routing
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=BIAS_UPDATE_RATE, moe_router_dtype="fp32")


def _build_model(spec: Spec, ep: int, view: Any, etp_mesh: Any = None, *,
                 bf16: bool = False) -> Any:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    packed = spec.kind == "packed"
    config = _config(spec, ep, 1 if etp_mesh is None else etp_mesh.size(), bf16=bf16)
    layer_spec = get_gpt_layer_local_spec(num_experts=spec.num_experts, moe_grouped_gemm=packed,
                                          moe_use_legacy_grouped_gemm=packed).submodules.mlp
    with megatron_on_cpu(), megatron_forward_on_cpu():  # the router allocates its bias on "cuda"
        layers = [build_module(layer_spec, config=config, layer_number=i + 1, pg_collection=view)
                  for i in range(spec.num_layers)]
    model = _model_class()(layers, config, DistributedDataParallelConfig())
    model.etp_mesh = etp_mesh
    # the group the expert-bias update sums token counts over: parallel_state's (None), or the
    # truth's own one-rank group (its view's: a ground truth built outside any world has no
    # default group to register one with)
    model.bias_group = None if view is None else view.tp
    return model


def _local_views(moe: Any) -> Iterator[tuple[int, str, Any, Any]]:
    """``(global expert id, linear, parameter, view)``; ``view`` maps the parameter (or its grad or
    moment) to this rank's part of that expert's weight in SequentialMLP's shape (``linear_fc1``:
    its gate rows then its up rows)."""
    experts = moe.experts
    if hasattr(experts, "local_experts"):  # SequentialMLP
        for g, expert in zip(moe.local_expert_indices, experts.local_experts, strict=True):
            yield g, "linear_fc1", expert.linear_fc1.weight, lambda t, _e=None: t
            yield g, "linear_fc2", expert.linear_fc2.weight, lambda t, _e=None: t
        return
    # GroupedMLP: transposed packed weights
    n, dim = experts.num_local_experts, experts.config.hidden_size
    for i, g in enumerate(moe.local_expert_indices):
        yield g, "linear_fc1", experts.weight1, lambda t, _i=i: t.view(n, dim, -1)[_i].t()
        yield g, "linear_fc2", experts.weight2, lambda t, _i=i: t.view(n, -1, dim)[_i].t()


def _expert_views(moe: Any, etp_mesh: Any) -> Iterator[tuple[int, str, Any, Any]]:
    """``(global expert id, canonical name, parameter, view)`` in the same names at every layout.

    ``linear_fc1`` is SwiGLU's gate and up projections stacked; Megatron's expert TP splits each of
    them by rows (and ``linear_fc2`` by columns), so a rank's ``linear_fc1`` is its gate rows then
    its up rows -- no single region of the stacked weight.  The canonical names are therefore
    ``linear_fc1.gate``, ``linear_fc1.up`` and ``linear_fc2``; at etp > 1 each view is a DTensor
    over the expert-TP mesh dim (``Shard`` of those rows or columns), so the checks compare each
    rank's part with its region of the ep=1 weight.
    """
    from torch.distributed.tensor import DTensor, Shard

    def placed(view: Any, dim: int) -> Any:
        if etp_mesh is None:
            return view
        return lambda t: DTensor.from_local(view(t), etp_mesh, [Shard(dim)], run_check=False)

    for g, linear, p, view in _local_views(moe):
        if linear == "linear_fc2":
            yield g, linear, p, placed(view, 1)
            continue
        for half, name in enumerate(("gate", "up")):
            yield g, f"{linear}.{name}", p, placed(lambda t, _v=view,
                                                   _h=half: _v(t).chunk(2, 0)[_h], 0)


def _assign(target: Any, value: Any) -> None:
    """``target`` (a view, or a DTensor over one) set to its region of ``value``, the whole (ep=1)
    tensor."""
    local, region = local_region(target)
    local.copy_(value if region is None else value[region])


def _dense(model: Any) -> Iterator[tuple[int, str, Any]]:
    """``(layer, name within the layer, parameter)`` for the router and the shared expert."""
    for layer, moe in enumerate(model.moe_layers()):
        experts = {id(p) for p in moe.experts.parameters()}
        for name, p in moe.named_parameters():
            if id(p) not in experts:
                yield layer, name, p


def _buffers(model: Any) -> Iterator[tuple[int, str, Any]]:
    """``(layer, name within the layer, buffer)`` of every persistent floating-point buffer of the
    MoE layers: the router's ``expert_bias`` (its token counter is not persistent)."""
    from conformance.adapters.torch_native import persistent_buffers

    for layer, moe in enumerate(model.moe_layers()):
        for name, buffer in persistent_buffers(moe):
            if buffer.is_floating_point():
                yield layer, name, buffer


def _fill(model: Any, seed: int) -> None:
    import torch

    with torch.no_grad():
        for layer, moe in enumerate(model.moe_layers()):
            for g, name, p, view in _expert_views(moe, model.etp_mesh):
                target = view(p.data)
                _assign(target, synthetic_weight(seed, layer, g, name, target.shape, dtype=p.dtype))
        for layer, name, p in _dense(model):
            p.copy_(synthetic_weight(seed, layer, None, name, p.shape, dtype=p.dtype))
        for layer, name, buffer in _buffers(model):
            buffer.copy_(synthetic_weight(seed, layer, None, name, buffer.shape, dtype=buffer.dtype,
                                          scale=BIAS_SCALE))


def update_expert_biases(model: Any, seed: int, step: int) -> None:
    """Megatron's expert-bias update on :func:`conformance.synthetic_load`'s counts for ``step``:
    written into each router's ``local_tokens_per_expert`` (on the first rank of the group Megatron
    sums them over, zeros elsewhere, so the sum is the synthetic load), then the two calls
    ``finalize_model_grads`` makes, ``_update_router_expert_bias`` (a collective over TP x DP x CP)
    and ``reset_model_temporary_tensors``.  ``model`` is the stack of layers or its DDP wrapper."""
    import contextlib

    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import (
        _update_router_expert_bias,
        reset_model_temporary_tensors,
    )

    stack = getattr(model, "module", model)
    group = stack.bias_group
    counts = group is not None or parallel_state.get_tensor_and_data_parallel_group(
        with_context_parallel=True).rank() == 0
    with torch.no_grad():
        for layer, moe in enumerate(stack.moe_layers()):
            load = synthetic_load(seed, step, layer, stack.config.num_moe_experts)
            moe.router.local_tokens_per_expert.copy_(load if counts else torch.zeros_like(load))
    with expert_bias_update_over(group) if group is not None else contextlib.nullcontext():
        _update_router_expert_bias([model], stack.config)
    reset_model_temporary_tensors(stack.config, [model])


def _set_grads(model: Any, seed: int, step: int) -> None:
    import torch

    for layer, moe in enumerate(model.moe_layers()):
        for g, name, p, view in _expert_views(moe, model.etp_mesh):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            target = view(p.grad)
            _assign(target, synthetic_grad(seed, step, layer, g, name, target.shape, dtype=p.dtype))
    for layer, name, p in _dense(model):
        p.grad = synthetic_grad(seed, step, layer, None, name, p.shape, dtype=p.dtype)


def _optimizer(model: Any, view: Any, lr: float) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=lr, weight_decay=WEIGHT_DECAY, clip_grad=0.0, bf16=False,
        fp16=False, params_dtype=model.config.params_dtype, use_distributed_optimizer=False)
    with megatron_on_cpu(), one_rank_world() if view is not None else contextlib.nullcontext():
        return get_megatron_optimizer(config, [model], use_gloo_process_groups=False,
                                      pg_collection=view)


def _step(optimizer: Any) -> None:
    """``ChainedOptimizer.step()`` without its gradient-norm reduction (reported only;
    clip_grad=0)."""
    if optimizer.prepare_grads():
        raise RuntimeError("Megatron's optimizer found inf/nan in the synthetic gradients")
    optimizer.step_with_ready_grads()
    optimizer.zero_grad(set_to_none=True)


def _state(optimizer: Any) -> dict[Any, Any]:
    """Parameter -> its torch.optim state, over the chained FP32Optimizers."""
    if optimizer is None:
        return {}
    found: dict[Any, Any] = {}
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        found.update(inner.optimizer.state)
    return found


def _sharded_state_dict(model: Any, optimizer: Any, *, loading: bool = False,
                        metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What Megatron's trainer hands dist_checkpointing: ``model`` and ``optimizer`` sharded state
    dicts, each call given its own copy of ``metadata`` (Megatron adds its data-parallel group to
    the dict it gets)."""

    def given() -> dict[str, Any] | None:
        return None if metadata is None else dict(metadata)

    model_state: dict[str, Any] = {}
    for layer, moe in enumerate(model.moe_layers()):
        model_state.update(moe.sharded_state_dict(prefix=f"layers.{layer}.mlp.", metadata=given()))
    out = {"model": model_state}
    if optimizer is not None:
        out["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=loading,
                                                        metadata=given())
    return out


def _expert_tp_mesh(mesh: Any) -> Any:
    """The harness mesh's ``etp`` dim, checked to be Megatron's expert-TP group with this rank at
    the same place (``parallel_state``'s expert rank generator puts expert TP innermost, as the
    layout does)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    etp_mesh = mesh["etp"]
    megatron = dist.get_process_group_ranks(parallel_state.get_expert_tensor_parallel_group())
    harness = dist.get_process_group_ranks(etp_mesh.get_group())
    if (megatron != harness
        or parallel_state.get_expert_tensor_parallel_rank() != etp_mesh.get_local_rank()):
        raise ValueError(f"Megatron's expert tensor-parallel group {megatron} (this rank at "
                         f"{parallel_state.get_expert_tensor_parallel_rank()}) is not the layout's "
                         f"etp group {harness} (at {etp_mesh.get_local_rank()})")
    return etp_mesh


class MegatronAdapter:
    name = "megatron"
    capabilities = Capabilities(kinds=("packed", "unpacked"), optimizer=True, fsdp=False,
                                uneven=False, max_ep=64,
                                format="dcp", cross_kind=True, ep_orders=("consecutive",), etp=True)
    #: imported once by the rank fork server, not once per cell (megatron.core takes ~2 s to
    #: import).
    preload: tuple[str, ...] = ("megatron.core.parallel_state", "megatron.core.dist_checkpointing",
               "megatron.core.optimizer", "megatron.core.models.gpt.gpt_layer_specs")

    @property
    def version(self) -> str:
        """The installed megatron-core's version (read without importing it); pinned to 0.16.0 in
        CI."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("megatron-core")
        except PackageNotFoundError:
            return "not installed"

    @property
    def refusal_errors(self) -> tuple[type, ...]:
        """What ``dist_checkpointing.load`` raises when it refuses a checkpoint."""
        from megatron.core.dist_checkpointing.core import CheckpointingException

        return (CheckpointingException,)

    # -- building ----------------------------------------------------------------------------------
    def build(self, spec: Spec, mesh: Any, seed: int) -> tuple[Any, Any]:
        import torch.distributed as dist

        if spec.fsdp or spec.dtype != "float32":
            raise ValueError("this adapter drives Megatron's MoE layers in fp32 without FSDP2; "
                             f"got fsdp={spec.fsdp}, dtype={spec.dtype!r}")
        if dist.is_initialized() and dist.get_backend() != "gloo":
            raise ValueError(f"this adapter runs Megatron on CPU over gloo; the world's backend is "
                             f"{dist.get_backend()!r}")
        etp_mesh = None
        if mesh is None:  # the ground truth: ep=1 over a one-rank view, no parallel_state
            view, ep = one_rank_view(), 1
        else:
            ep, etp = mesh["ep"].size(), mesh["etp"].size()
            set_up(ep, etp)
            view = None  # Megatron's default: the groups of parallel_state
            if etp > 1:
                etp_mesh = _expert_tp_mesh(mesh)
        model = _build_model(spec, ep, view, etp_mesh)
        _fill(model, seed)
        if spec.optimizer_steps <= 0:
            return model, None
        optimizer = _optimizer(model, view, spec.lr)
        for step in range(spec.optimizer_steps):
            self.step(model, optimizer, seed, step)
        return model, optimizer

    def step(self, model: Any, optimizer: Any, seed: int, step: int) -> None:
        """One step of Megatron's optimizer on synthetic_grad gradients, after the expert-bias
        update on synthetic loads (Megatron's order: ``finalize_model_grads`` updates the bias
        before ``optimizer.step()``)."""
        _set_grads(model, seed, step)
        update_expert_biases(model, seed, step)
        _step(optimizer)

    def forward(self, model: Any, batch: Any) -> Any:
        """Megatron's own ``MoELayer.forward``, layer after layer, on ``[tokens, 1, dim]``: the
        output and each MoE layer's own (:func:`forward_with_layers`).  Every rank feeds the same
        batch; the ``allgather`` dispatcher gathers every EP rank's tokens, each rank runs its
        experts, and a reduce-scatter gives each rank the sum for its own tokens.  Each layer's
        output is added to its input, as a decoder layer's residual stream does (no attention, no
        norms): a layer's own output is ~1e-4 of its input, so without it the next router would see
        scores that differ by ~1e-5 and choose by its expert bias alone.  The packed kind
        (GroupedMLP) is n/a: ``grouped_gemm`` is CUDA-only."""
        import torch

        from conformance.adapter import NotApplicable, forward_with_layers

        layers = model.moe_layers()
        if not hasattr(layers[0].experts, "local_experts"):  # GroupedMLP (packed)
            raise NotApplicable(GROUPED_MLP_NOT_RUN)

        def run() -> Any:
            # [sequence, micro-batch, hidden]
            hidden = batch.to(layers[0].router.weight.dtype).unsqueeze(1)
            for moe in layers:
                hidden = hidden + moe(hidden)[0]
            return hidden.squeeze(1)

        with torch.no_grad(), megatron_forward_on_cpu():
            return forward_with_layers(run,
                                       {f"layers.{i}.mlp": moe for i, moe in enumerate(layers)})

    def end_cell(self) -> None:
        """The cell's Megatron process groups, destroyed: kept after the load for the forward's
        dispatcher."""
        tear_down()

    # -- checkpoint path ---------------------------------------------------------------------------
    #: the ``metadata`` of the ``sharded_state_dict`` calls (``None``: Megatron's defaults).
    checkpoint_metadata: Mapping[str, Any] | None = None
    #: the CPU bypasses a save or load runs under (:mod:`conformance.adapters.megatron_cpu`).
    on_cpu = staticmethod(megatron_on_cpu)

    def _state_dicts(self, model: Any, optimizer: Any, *, loading: bool = False) -> dict[str, Any]:
        return _sharded_state_dict(model, optimizer, loading=loading,
                                   metadata=self.checkpoint_metadata)

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        from megatron.core import dist_checkpointing

        try:
            with self.on_cpu():
                dist_checkpointing.save(self._state_dicts(model, optimizer), path)
        finally:
            tear_down()

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        """``dist_checkpointing.load``; the process groups stay up for the checks after it
        (``end_cell`` ends them). The model state goes into the stack of MoE layers (inside a DDP
        wrapper's ``module``, if there is one)."""
        from megatron.core import dist_checkpointing

        with self.on_cpu():
            loaded = dist_checkpointing.load(self._state_dicts(model, optimizer, loading=True),
                                             path)
            getattr(model, "module", model).load_state_dict(loaded["model"], strict=True)
            if optimizer is not None:
                optimizer.load_state_dict(loaded["optimizer"])

    def save_legacy(self, model: Any, optimizer: Any, path: str) -> None:
        """Megatron-LM's pre-dist_checkpointing save: per EP rank, its plain state_dict (local
        expert names)."""
        import torch
        from megatron.core import parallel_state

        try:
            if parallel_state.get_expert_data_parallel_rank() == 0:
                ep_rank = parallel_state.get_expert_model_parallel_rank()
                folder = os.path.join(path, f"mp_rank_00_{ep_rank:03d}")
                os.makedirs(folder, exist_ok=True)
                state = {"model": model.state_dict()}
                if optimizer is not None:
                    state["optimizer"] = optimizer.state_dict()
                torch.save(state, os.path.join(folder, "model_optim_rng.pt"))
        finally:
            tear_down()

    # -- canonical views ---------------------------------------------------------------------------
    def expert_tensors(self, model: Any, optimizer: Any) -> Iterator[tuple[int, int, str, Any]]:
        state = _state(optimizer)
        for layer, moe in enumerate(model.moe_layers()):
            for g, name, p, view in _expert_views(moe, model.etp_mesh):
                yield layer, g, name, view(p.data)
                for moment in ADAM_MOMENTS:
                    if moment in state.get(p, {}):
                        yield layer, g, f"{name}.{moment}", view(state[p][moment])

    def other_tensors(self, model: Any,
                      optimizer: Any) -> Iterator[tuple[int | None, None, str, Any]]:
        state = _state(optimizer)
        for layer, name, p in _dense(model):
            yield layer, None, name, p
            for moment in ADAM_MOMENTS:
                if moment in state.get(p, {}):
                    yield layer, None, f"{name}.{moment}", state[p][moment]
        for layer, name, buffer in _buffers(model):
            yield layer, None, name, buffer

    def scalars(self, model: Any, optimizer: Any) -> dict[str, object]:
        """Step counts and param-group hyperparameters, as sorted distinct values over all param
        groups.

        Megatron puts expert parameters in a group (and a chained optimizer) of their own only at ep
        > 1 (``allreduce=False``), so per-group names would differ with the EP degree; the values
        may not.
        """
        if optimizer is None:
            return {}
        found: dict[str, set[Any]] = {key: set()
                                      for key in ("step", "lr", "betas", "weight_decay", "eps")}
        for inner in optimizer.chained_optimizers:
            for group in inner.optimizer.param_groups:
                found["step"] |= {float(inner.optimizer.state[p]["step"]) for p in group["params"]
                                  if "step" in inner.optimizer.state.get(p, {})}
                for key in ("lr", "betas", "weight_decay", "eps"):
                    value = group[key]
                    found[key].add(tuple(value) if isinstance(value, (list, tuple)) else value)
        return {key: sorted(values) for key, values in found.items()}

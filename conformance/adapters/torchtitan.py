"""The built-in ``torchtitan`` and ``torchtitan-local`` adapters: torchtitan 0.3.0 end to end, on
the torch-native base.

torchtitan's own code throughout: ``MoE`` layers from its config builders (router,
``GroupedExperts`` with packed ``w1_EFD``/``w2_EDF``/``w3_EFD``, the shared ``FeedForward``) in a
decoder reduced to its MoE blocks, so ``parallelize_qwen3`` applies unchanged; built on meta,
``to_empty``'d and ``init_states``'d as ``Trainer`` does; ``ParallelDims.build_mesh``;
``default_adamw()``'s ``OptimizersContainer``; ``CheckpointManager``'s ``dcp_save`` / ``dcp_load``.
``torchtitan`` sets ``spmd_backend="partial_dtensor"`` (experts DTensors ``Shard(0)`` over ``ep``);
``torchtitan-local`` keeps the default ``"spmd_types"`` (plain local chunks, placed by this rank's
place on ``ep``). For CPU (nothing checked changes): ``parallel_dims.device_type`` is the world's;
"for-loop" optimizers ("fused" is CUDA only); FSDP's ``mixed_precision_param`` is the cell's dtype.
torchtitan's objects (mesh, model, pipeline split, parallelize, checkpoint manager) are built in
:mod:`._torchtitan_objects`. Findings: docs/frameworks/torchtitan.md.

As its users train today's MoE models: ``load_balance_coeff`` (1e-3, ``make_moe_config``'s
default) gives every MoE layer an expert bias (``expert_bias_E``, given synthetic initial values:
:attr:`synthetic_buffers`), and the optimizers carry torchtitan's load-balancing hook, fed each
step with :func:`conformance.synthetic_load` through the layers' own counters, a share per
data-parallel rank (:func:`._torchtitan_objects.write_loads`).
"""

from __future__ import annotations

from typing import Any

from conformance.adapter import Capabilities, NotApplicable, Spec, world_device
from conformance.adapters import _torchtitan_objects as objects
from conformance.adapters.torch_native import Param, TorchNativeAdapter, reshard

_EXPERTS = "routed_experts.inner_experts."
#: attribute set on the built model: (rank on the ep mesh, ep degree) for plain local expert
#: tensors.
_EP_COORDS = "_conformance_ep_coords"


class TorchtitanAdapter(TorchNativeAdapter):
    """torchtitan 0.3.0, ``spmd_backend="partial_dtensor"``: experts are DTensors over ``ep``."""

    name = "torchtitan"
    spmd_backend = "partial_dtensor"
    capabilities = Capabilities(kinds=("packed",), optimizer=True, fsdp=True, uneven=True,
                                max_ep=64, format="dcp", ep_orders=("consecutive",), pp=(1, 2))
    preload = ("torchtitan.models.qwen3", "torchtitan.components.checkpoint",
               "torchtitan.components.optimizer")
    distribution = "torchtitan"
    #: the expert bias, a weight's synthetic values (std 0.02): of the order of the router's own
    #: score differences, it changes the top-2 of about half the forward batch's tokens (a wrong
    #: bias shows).
    synthetic_buffers = (objects.EXPERT_BIAS,)

    def build_model(self, spec: Spec, mesh: Any) -> Any:
        import torch
        from torchtitan.config import ParallelismConfig
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.tools.utils import set_default_dtype

        if (spec.kind, spec.activation) != ("packed", "swiglu"):
            raise ValueError(f"torchtitan's GroupedExperts is packed SwiGLU, not {spec.kind} "
                             f"{spec.activation}")
        dist_utils.set_spmd_backend(self.spmd_backend)  # what Trainer.__init__ does
        ep = 1 if mesh is None else mesh["ep"].size()
        pp = mesh["pp"].size() if mesh is not None and "pp" in (mesh.mesh_dim_names or ()) else 1
        device = world_device(mesh)
        parallelism = ParallelismConfig(expert_parallel_degree=ep, pipeline_parallel_degree=pp,
                                        spmd_backend=self.spmd_backend)
        with torch.device("meta"), set_default_dtype(getattr(torch, spec.dtype)):
            model = objects.build_model(spec, parallelism, enable_ep=ep > 1)
        coords, parallel_dims = (0, 1), None
        if mesh is not None:
            parallel_dims = objects.parallel_dims(self.spmd_backend, ep, device.type, pp)
            # this rank's stage, split as pipeline_llm splits it (its model part: layers keep their
            # names)
            if pp > 1:
                model = objects.stage(model, parallel_dims, spec.num_layers, device)
            objects.parallelize(model, parallel_dims, parallelism, fsdp=spec.fsdp, dtype=spec.dtype)
            if ep > 1:
                coords = (parallel_dims.get_mesh("ep").get_local_rank(), ep)
        object.__setattr__(model, _EP_COORDS, coords)
        object.__setattr__(model, objects.PARALLEL_DIMS, parallel_dims)
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_states(buffer_device=None)
        return model

    def build_optimizer(self, spec: Spec, model: Any) -> Any:
        from torchtitan.components.optimizer import default_adamw

        # "fused", its default, is CUDA only; "for-loop" is what torch picks on CPU
        config = default_adamw()
        config.implementation = "for-loop"
        for group in config.param_groups:  # the cell's learning rate
            group.optimizer_kwargs = {**group.optimizer_kwargs, "lr": spec.lr}
        optimizers = config.build(model_parts=[model])
        objects.register_load_balancing(optimizers, model, getattr(model, objects.PARALLEL_DIMS))
        return optimizers

    def step(self, model: Any, optimizer: Any, seed: int, step: int, state: Any = None) -> None:
        """This rank's share of the step's synthetic load into every layer's counter, then the
        base's step (synthetic grads; the optimizers' step, whose pre-hook steps the bias on the
        all-reduced load)."""
        objects.write_loads(model, getattr(model, objects.PARALLEL_DIMS), seed, step)
        super().step(model, optimizer, seed, step, state)

    def identify(self, model: Any, fqn: str, param: Any) -> Param:
        """``layers.<i>.moe.routed_experts.inner_experts.<w>`` (canonical FQN): layer i's packed
        expert weight."""
        from torch.distributed.tensor import DTensor
        from torchtitan.components.checkpointer.utils import canonical_fqn

        parts = canonical_fqn(fqn).split(".")
        if parts[:1] != ["layers"] or parts[2:3] != ["moe"]:
            return Param(None, ".".join(parts))
        layer, rest = int(parts[1]), ".".join(parts[3:])
        if rest.startswith(_EXPERTS):
            # a plain local chunk (spmd_types) is torch.chunk of the expert dim: Shard(0)'s rule,
            # from its ep place
            place = None if isinstance(param, DTensor) else getattr(model, _EP_COORDS)
            return Param(layer, rest[len(_EXPERTS):], "packed", ep_place=place,
                         num_experts=_num_experts(model))
        return Param(layer, rest)

    def forward(self, model: Any, batch: Any) -> Any:
        """torchtitan's forward of every MoE block on ``batch`` in its training context
        (``get_spmd_context``); its dispatcher's ``view(ep, -1)`` of the token counts cannot take E
        % ep != 0: n/a with its error."""
        import contextlib
        import warnings

        import torch
        from torchtitan.distributed import utils as dist_utils

        num_experts, (_, ep) = _num_experts(model), getattr(model, _EP_COORDS)
        device = next(model.parameters()).device
        if self.spmd_backend == "spmd_types" and ep > 1 and device.type == "cpu":
            # decided before the forward: a rank whose chunks happen to be equal would enter the
            # exchange alone
            raise NotApplicable("under spmd_types torchtitan's dispatcher sends tokens by a list "
                                "all_to_all of uneven per-rank chunks, which ProcessGroupGloo "
                                "refuses ('ProcessGroupGloo::alltoall: invalid tensor size at "
                                "index 1 (expected (15, 16), got (17, 16))')")
        parallel_dims = getattr(model, objects.PARALLEL_DIMS)
        stage = getattr(model, objects.STAGE, None)
        uneven = objects.UNEVEN_DISPATCH.format(num_experts=num_experts, ep=ep)
        # decided before the stages exchange: a stage that raised inside
        if stage is not None and num_experts % ep:
            raise NotApplicable(uneven)  # would leave the next in recv
        context = (dist_utils.get_spmd_context(parallel_dims=parallel_dims)() if parallel_dims
                   is not None else contextlib.nullcontext())
        try:
            with torch.no_grad(), context, warnings.catch_warnings():
                # the router's fp32 autocast, which CPU autocast does not support (a no-op there)
                warnings.filterwarnings("ignore",
                                        "In CPU autocast, but the target dtype is not supported")
                if stage is None:
                    out = model(batch.to(device)[None])[0]
                # the stages in turn (send/recv), not torchtitan's PipelineSchedule: it runs only
                # with a loss
                else:
                    from reference_impl.parallelize import pipeline_forward

                    out = pipeline_forward(lambda x: objects.plain(model(x[None])[0]),
                                           batch.to(device),
                                           parallel_dims.get_mesh("pp").get_group(), stage)
        except RuntimeError as exc:
            if num_experts % ep == 0:
                raise
            raise NotApplicable(f"{uneven}: {type(exc).__name__}: {exc}") from exc
        finally:
            reshard(model)
        return objects.plain(out)

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        from torchtitan.components.checkpoint import MODEL, AsyncMode

        manager = objects.manager(model, optimizer, path)
        # what CheckpointManager._save writes (model alone: its last-step save), to ``path``, not
        # ``step-N``
        states = (manager._flattened_model_states_sd() if optimizer is not None
                  else manager.states[MODEL].state_dict())
        manager.dcp_save(states, checkpoint_id=path, async_mode=AsyncMode.DISABLED)

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        manager = objects.manager(model, optimizer, path)
        states = manager._states_to_load(model_only=optimizer is None)
        manager.dcp_load(states, checkpoint_id=path, from_hf=False, from_quantized=False)


class TorchtitanLocalAdapter(TorchtitanAdapter):
    """torchtitan 0.3.0, ``spmd_backend="spmd_types"`` (its default): experts are plain local
    tensors."""

    name = "torchtitan-local"
    spmd_backend = "spmd_types"


def _num_experts(model: Any) -> int:
    return next(iter(model.layers.values())).moe.routed_experts.inner_experts.num_experts

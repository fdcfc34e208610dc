"""The built-in ``nemo_automodel`` adapter: NeMo Automodel 0.7.0 end to end.

It drives NeMo's own code (nothing of the EP split or of the checkpoint conversion is re-implemented):
NeMo ``MoE`` layers (``Gate``, ``GroupedExperts`` with packed ``gate_and_up_projs`` / ``down_projs``,
the shared-expert ``MLP``; ``BackendConfig`` all ``"torch"``, the backend without TE/DeepEP) at
``model.layers.<i>.mlp``, filled with synthetic weights by global expert id on the whole ep=1 model
before the split; ``parallelizer.apply_ep`` on NeMo's ``("ep_shard", "ep")`` MoE mesh and
``apply_fsdp`` as ``parallelize_model`` calls it; ``torch.optim.AdamW``; and NeMo's ``Checkpointer``
(``save_model`` / ``load_model`` through ``Qwen3MoeStateDictAdapter``'s per-expert HF keys, DCP, and
``save_optimizer`` / ``load_optimizer``).  Packed SwiGLU only; run on CPU/gloo, not yet with NCCL.

Workarounds (none changes what is checked):

* ``apply_ep`` is called directly: NeMo's top-level ``parallelize_model`` asserts
  ``n_routed_experts % ep == 0``, while ``apply_ep``, the state-dict adapter and ``state_dict_utils``
  accept any E, so the uneven cells show what those layers do with E % ep != 0.
* ``save_model(model, weights_path)`` always writes ``weights_path/model``; the suite reads the DCP
  metadata at the cell's directory, so each rank passes a private temporary ``weights_path`` whose
  ``model`` entry is a symlink to the cell's directory.  The optimizer goes to ``<cell dir>/optim``.
* NeMo's meshes are built with the suite's cached ``device_mesh`` (NeMo's ``MeshContext`` shapes and
  dim names, pp=cp=tp=dp_replicate=1), not ``MeshContext.build``, which makes new process groups at
  every build.
* FSDP's mixed-precision policy is fp32 throughout (NeMo's default casts parameters to bf16 for
  compute; storage is unchanged).
* ``forward`` runs NeMo's ``@torch.compile``d SwiGLU eagerly (``set_stance("force_eager")``): on CPU inductor
  compiles each variant in each rank process (the first forward took 126 s on 2 cores).

What the matrix finds: docs/frameworks/nemo_automodel.md.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from conformance.adapter import (
    ADAM_MOMENTS,
    Capabilities,
    NotApplicable,
    Spec,
    local_region,
    run_steps,
    torch_optimizer_scalars,
    world_device,
)
from conformance.synthetic import synthetic_grad, synthetic_weight
from reference_impl.regions import contiguous_stride

EXPERT_WEIGHTS = ("gate_and_up_projs", "down_projs")
#: attributes set on the built model: NeMo's MoE mesh (or None) and its dense FSDP mesh (or None).
_MOE_MESH = "_conformance_moe_mesh"


class NemoAutomodelAdapter:
    """NeMo Automodel 0.7.0: ``GroupedExperts`` split by ``apply_ep``, saved by ``Checkpointer``."""

    name = "nemo_automodel"
    version = "0.7.0"
    capabilities = Capabilities(kinds=("packed",), optimizer=True, fsdp=True, uneven=True, max_ep=64,
                                format="dcp", ep_orders=("consecutive",))
    preload = ("nemo_automodel.components.moe.layers", "nemo_automodel.components.moe.parallelizer",
               "nemo_automodel.components.checkpoint.checkpointing",
               "nemo_automodel.components.models.qwen3_moe.state_dict_adapter")

    # -- building ----------------------------------------------------------------------------------
    def build(self, spec: Spec, mesh: Any, seed: int) -> tuple[Any, Any]:
        import torch

        if spec.kind != "packed":
            raise ValueError(f"NeMo's GroupedExperts is packed; cannot build kind {spec.kind!r}")
        if spec.activation != "swiglu":
            raise ValueError(f"this adapter builds NeMo's SwiGLU experts; cannot build activation {spec.activation!r}")
        model = _model_class()(spec)
        _overwrite(model, seed)
        model.to(world_device(mesh))
        moe_mesh = None
        if mesh is not None:
            moe_mesh = _parallelize(model, spec, mesh)
        object.__setattr__(model, _MOE_MESH, moe_mesh)
        if spec.optimizer_steps <= 0:
            return model, None
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
        run_steps(lambda index: self.step(model, optimizer, seed, index), 0, spec.optimizer_steps)
        return model, optimizer

    def step(self, model: Any, optimizer: Any, seed: int, step: int) -> None:
        _set_grads(model, seed, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def scalars(self, model: Any, optimizer: Any) -> dict[str, Any]:
        return torch_optimizer_scalars(optimizer)

    def forward(self, model: Any, batch: Any) -> Any:
        """NeMo's own ``MoE.forward`` in every block (``Gate``, ``GroupedExperts`` -- at ep > 1 its all-gather of
        the tokens over the EP group and an all-reduce of the outputs -- and the shared expert) on ``batch``;
        FSDP2's parameters resharded after it (NeMo's ``apply_fsdp`` keeps them unsharded after a forward).

        ``GroupedExperts.forward`` asserts ``n_routed_experts % ep_size == 0`` on every rank before any
        exchange: there the check is n/a with NeMo's assertion.  NeMo's ``@torch.compile``d SwiGLU
        (``moe/megatron/moe_utils.py``, ``weighted_swiglu``) runs eagerly (``set_stance("force_eager")``): the same
        function, without inductor's CPU compile of each variant in each rank process (about a minute each on
        2 cores).
        """
        import torch
        from torch.distributed.fsdp import FSDPModule

        experts = next(iter(_moe_layers(model)))[1].experts
        ep = getattr(experts.gate_and_up_projs, "device_mesh", None)
        ep_size, num_experts = (1 if ep is None else ep.size()), experts.n_routed_experts
        try:
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                out = model(batch.to(next(model.parameters()).device))
        except AssertionError as exc:
            if num_experts % ep_size == 0:
                raise
            raise NotApplicable(f"NeMo's GroupedExperts.forward cannot run E={num_experts} experts at ep={ep_size}: "
                                f"AssertionError: {exc}") from exc
        finally:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        return out

    # -- checkpoint path ---------------------------------------------------------------------------
    def save(self, model: Any, optimizer: Any, path: str) -> None:
        import os
        import tempfile

        checkpointer = _checkpointer(model)
        # Workaround: save_model writes <weights_path>/model; point that at the cell's directory.  The link lives next
        # to the cell's directory (in the session's work directory, removed with it), not in /tmp: a rank killed
        # mid-save (a world replaced after another rank's failure) never runs the clean-up of its context.
        beside = os.path.dirname(os.path.abspath(path))
        with tempfile.TemporaryDirectory(prefix="nemo-weights-", dir=beside) as weights_path:
            os.symlink(os.path.abspath(path), os.path.join(weights_path, "model"))
            checkpointer.save_model(model, weights_path)
        if optimizer is not None:
            checkpointer.save_optimizer(optimizer, model, path)

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        checkpointer = _checkpointer(model)
        checkpointer.load_model(model, path)
        if optimizer is not None:
            checkpointer.load_optimizer(optimizer, model, path)

    # -- canonical views ---------------------------------------------------------------------------
    def expert_tensors(self, model: Any, optimizer: Any) -> Iterator[tuple[int, int, str, Any]]:
        state = optimizer.state if optimizer is not None else {}
        for layer, moe in _moe_layers(model):
            for weight_name in EXPERT_WEIGHTS:
                weight = getattr(moe.experts, weight_name)
                tensors = {weight_name: weight} | {f"{weight_name}.{m}": state[weight][m]
                                                   for m in ADAM_MOMENTS if m in state.get(weight, {})}
                for name, tensor in tensors.items():
                    for expert, row in _rows(tensor):
                        yield layer, expert, name, row

    def other_tensors(self, model: Any, optimizer: Any) -> Iterator[tuple[int | None, None, str, Any]]:
        state = optimizer.state if optimizer is not None else {}
        for layer, moe in _moe_layers(model):
            experts = {id(p) for p in moe.experts.parameters()}
            for name, p in moe.named_parameters():
                if id(p) in experts:
                    continue
                yield layer, None, f"mlp.{name}", p
                for moment in ADAM_MOMENTS:
                    if moment in state.get(p, {}):
                        yield layer, None, f"mlp.{name}.{moment}", state[p][moment]


# -- the model -------------------------------------------------------------------------------------
@functools.cache
def _model_class() -> type:
    """``Model(spec)``: ``model.layers.<i>.mlp`` NeMo MoE layers plus Qwen3-MoE's state-dict adapter.

    Defined on first use so that importing this module imports neither torch nor NeMo.
    """
    import torch
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.qwen3_moe.state_dict_adapter import (
        Qwen3MoeStateDictAdapter,
    )
    from nemo_automodel.components.moe.config import MoEConfig
    from nemo_automodel.components.moe.layers import MoE
    from torch import nn

    class Block(nn.Module):
        """A decoder layer reduced to its MoE: ``x + mlp(x)`` (no attention, no norms)."""

        def __init__(self, config: Any, backend: Any) -> None:
            super().__init__()
            self.mlp = MoE(config, backend)

        def forward(self, x: Any) -> Any:
            return x + self.mlp(x)

    class Decoder(nn.Module):
        def __init__(self, spec: Spec, config: Any, backend: Any) -> None:
            super().__init__()
            self.layers = nn.ModuleDict({str(i): Block(config, backend) for i in range(spec.num_layers)})

        def forward(self, x: Any) -> Any:
            for block in self.layers.values():
                x = block(x)
            return x

    class Model(nn.Module):
        def __init__(self, spec: Spec) -> None:
            super().__init__()
            dtype = getattr(torch, spec.dtype)
            # NeMo's default experts/dispatcher without TE or DeepEP (the only CPU-capable backend).
            backend = BackendConfig(attn="sdpa", linear="torch", rms_norm="torch", experts="torch",
                                    dispatcher="torch", rope_fusion=False, enable_hf_state_dict_adapter=True)
            # Qwen3-MoE's routing settings (see models/qwen3_moe/model.py), the suite's sizes.
            config = MoEConfig(
                n_routed_experts=spec.num_experts, n_shared_experts=1 if spec.shared_expert else 0,
                n_activated_experts=min(spec.top_k, spec.num_experts), n_expert_groups=0, n_limited_groups=0,
                train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0, score_func="softmax",
                route_scale=1.0, dim=spec.dim, inter_dim=spec.hidden, moe_inter_dim=spec.hidden,
                norm_topk_prob=False, expert_bias=False, router_bias=False, expert_activation="swiglu",
                softmax_before_topk=True, dtype=dtype)
            self.model = Decoder(spec, config, backend)
            self.state_dict_adapter = Qwen3MoeStateDictAdapter(None, config, backend, dtype=dtype)

        def forward(self, x: Any) -> Any:  # through the modules NeMo's apply_fsdp wraps, so its hooks run
            return self.model(x)

    return Model


def _moe_layers(model: Any) -> Iterator[tuple[int, Any]]:
    for key, block in model.model.layers.items():
        yield int(key), block.mlp


def _overwrite(model: Any, seed: int) -> None:
    """Synthetic weights on the unsplit model: expert rows by global id, the rest by name."""
    import torch

    with torch.no_grad():
        for layer, moe in _moe_layers(model):
            experts = {id(p) for p in moe.experts.parameters()}
            for name in EXPERT_WEIGHTS:
                weight = getattr(moe.experts, name)
                for g in range(weight.shape[0]):
                    weight[g].copy_(synthetic_weight(seed, layer, g, name, weight.shape[1:], dtype=weight.dtype))
            for name, p in moe.named_parameters():
                if id(p) not in experts:
                    p.copy_(synthetic_weight(seed, layer, None, f"mlp.{name}", p.shape, dtype=p.dtype))


def _parallelize(model: Any, spec: Spec, mesh: Any) -> Any:
    """NeMo's EP (and FSDP) on NeMo-shaped meshes; returns the MoE mesh (None at ep=1)."""
    import torch
    import torch.distributed as dist
    from nemo_automodel.components.moe.parallelizer import apply_ep, apply_fsdp
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from pytest_moe_ep.world.meshes import device_mesh

    if mesh["dp_replicate"].size() != 1:
        raise ValueError("this adapter maps the suite's mesh onto NeMo's with dp_replicate=1 only")
    world, ep = dist.get_world_size(), mesh["ep"].size()
    # NeMo: moe_mesh = (ep_shard, ep) with ep innermost, and None when ep == 1.
    moe_mesh = device_mesh((world // ep, ep), ("ep_shard", "ep")) if ep > 1 else None
    if moe_mesh is not None:
        apply_ep(model, moe_mesh["ep"], moe_mesh=moe_mesh)
    if spec.fsdp:
        dtype = getattr(torch, spec.dtype)
        ep_shard_mesh = moe_mesh["ep_shard"] if moe_mesh is not None else None
        apply_fsdp(model, device_mesh((world,), ("dp_shard_cp",)), ep_enabled=moe_mesh is not None,
                   ep_shard_enabled=ep_shard_mesh is not None and ep_shard_mesh.size() > 1,
                   ep_shard_mesh=ep_shard_mesh,
                   mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, output_dtype=None,
                                                  cast_forward_inputs=False))
    return moe_mesh


def _checkpointer(model: Any) -> Any:
    import torch.distributed as dist
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    config = CheckpointingConfig(checkpoint_dir="unused", model_save_format="torch_save", save_consolidated=False)
    return config.build(dp_rank=dist.get_rank(), tp_rank=0, pp_rank=0, moe_mesh=getattr(model, _MOE_MESH))


# -- gradients and canonical rows ------------------------------------------------------------------
def _region(tensor: Any) -> tuple[Any, tuple[int, ...]]:
    """A tensor's local data and the global offset of its first element (zeros for a plain tensor)."""

    local, region = local_region(tensor)
    return local, tuple(r.start for r in region) if region is not None else (0,) * tensor.dim()


def _rows(tensor: Any) -> Iterator[tuple[int, Any]]:
    """``(global expert id, row)`` for each expert row this rank holds (a part of a row as a DTensor)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    local, offset = _region(tensor)
    row_shape = tuple(tensor.shape[1:])
    for i in range(local.shape[0]):
        row = local[i]
        if tuple(row.shape) != row_shape:  # FSDP sharded the rows too: keep the row's region
            placements = [Shard(p.dim - 1) if isinstance(p, Shard) and p.dim > 0 else Replicate()
                          for p in tensor.placements]
            row = DTensor.from_local(row, tensor.device_mesh, placements, run_check=False, shape=torch.Size(row_shape),
                                     stride=contiguous_stride(row_shape))
        yield offset[0] + i, row


def _set_grads(model: Any, seed: int, step: int) -> None:
    """Gradients from synthetic_grad by global identity, cut to the region each parameter holds."""
    import torch
    from torch.distributed.tensor import DTensor

    for layer, moe in _moe_layers(model):
        experts = {id(p) for p in moe.experts.parameters()}
        params = [(name, getattr(moe.experts, name), True) for name in EXPERT_WEIGHTS]
        params += [(f"mlp.{name}", p, False) for name, p in moe.named_parameters() if id(p) not in experts]
        for name, p, is_expert in params:
            if is_expert:
                full = torch.stack([synthetic_grad(seed, step, layer, g, name, p.shape[1:])
                                    for g in range(p.shape[0])])
            else:
                full = synthetic_grad(seed, step, layer, None, name, p.shape)
            local, offset = _region(p)
            region = tuple(slice(o, o + n) for o, n in zip(offset, local.shape, strict=True))
            grad = full[region].to(device=local.device, dtype=p.dtype, copy=True)
            if isinstance(p, DTensor):
                grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                          stride=p.stride())
            p.grad = grad

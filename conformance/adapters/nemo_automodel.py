"""The built-in ``nemo_automodel`` adapter: NeMo Automodel 0.7.0 end to end.

It drives NeMo's own code (nothing of the EP split or of the checkpoint conversion is
re-implemented): NeMo ``MoE`` layers (``Gate``, ``GroupedExperts`` with the fused
``gate_and_up_projs`` and ``down_projs``, the shared-expert ``MLP``; ``BackendConfig`` all
``"torch"``, the backend without TE/DeepEP) at ``model.layers.<i>.mlp``, configured as NeMo's own
DeepSeek-V3 builds them (``models/deepseek_v3/model.py``: sigmoid scores, top-k weights normalised,
the auxiliary-loss-free balancing bias ``mlp.gate.e_score_correction_bias`` updated at
``gate_bias_update_factor=1e-3``, no auxiliary loss), filled with synthetic weights by global expert
id on the whole ep=1 model before the split; ``parallelizer.apply_ep`` on NeMo's
``("ep_shard", "ep")`` MoE mesh and ``apply_fsdp`` as ``parallelize_model`` calls it;
``torch.optim.AdamW``; and NeMo's ``Checkpointer`` (``save_model`` / ``load_model`` through
``DeepSeekV3StateDictAdapter``'s per-expert HF keys, DCP, and ``save_optimizer`` /
``load_optimizer``).  SwiGLU only; run on CPU/gloo, not yet with NCCL.

The expert bias: a persistent fp32 ``[E]`` buffer (a Replicate DTensor over every rank after
``apply_fsdp``), given synthetic values from the seed (:data:`BIAS_SCALE`) and stepped after each
optimizer step by NeMo's own ``Gate.update_bias`` on :func:`conformance.synthetic_load` counts
written into ``Gate._cumulative_expert_load`` (:func:`_update_biases`), as NeMo's recipe calls
``update_moe_gate_bias()`` after ``optimizer.step()``.

The experts' canonical views (:func:`_expert_views`): each expert's ``gate_and_up_projs`` row
``[dim, 2 * hidden]`` is ``[gate | up]`` along its last axis (NeMo's SwiGLU ``chunk(2, -1)``),
given as its halves ``gate`` and ``up`` transposed to ``[hidden, dim]``, and ``down_projs``' row as
``down`` ``[dim, hidden]``: the HF linears' orientation, so each view is the tensor the checkpoint
holds under ``experts.<g>.{gate,up,down}_proj.weight``.

Workarounds (none changes what is checked):

* ``apply_ep`` is called directly: NeMo's top-level ``parallelize_model`` asserts
  ``n_routed_experts % ep == 0``, while ``apply_ep``, the state-dict adapter and
  ``state_dict_utils`` accept any E, so the uneven cells show what those layers do with E % ep != 0.
* ``save_model(model, weights_path)`` always writes ``weights_path/model``; the suite reads the DCP
  metadata at the cell's directory, so each rank passes a private temporary ``weights_path`` whose
  ``model`` entry is a symlink to the cell's directory.  The optimizer goes to ``<cell dir>/optim``.
* NeMo's meshes are built with the suite's cached ``device_mesh`` (NeMo's ``MeshContext`` shapes and
  dim names, pp=cp=tp=dp_replicate=1), not ``MeshContext.build``, which makes new process groups at
  every build.
* FSDP's mixed-precision policy is fp32 throughout (NeMo's default casts parameters to bf16 for
  compute; storage is unchanged).
* ``forward`` runs NeMo's ``@torch.compile``d SwiGLU eagerly (``set_stance("force_eager")``): on CPU
  inductor compiles each variant in each rank process (the first forward took 126 s on 2 cores).
* The bias update's loads: ``update_bias`` sums ``_cumulative_expert_load`` over the bias's mesh
  when ``apply_fsdp`` made the bias a DTensor (every rank), and uses the rank's own load when it did
  not (the EP-only cells; NeMo's ``parallelize_model`` always applies FSDP over a data-parallel
  mesh of more than one rank).  So the first rank of the bias's mesh is given the step's counts and
  the others zeros, and a plain bias is given the counts on every rank: in each case the sum NeMo
  takes is :func:`conformance.synthetic_load`'s.

What the matrix finds: docs/frameworks/nemo_automodel.md.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from conformance.adapter import (
    ADAM_MOMENTS,
    Capabilities,
    ExpertBlock,
    NotApplicable,
    Spec,
    TensorEntry,
    local_region,
    run_steps,
    torch_optimizer_scalars,
    world_device,
)
from conformance.adapters.nemo_automodel_lora import LORA_VIEWS, apply_lora
from conformance.synthetic import (
    synthetic_grad,
    synthetic_grad_rows,
    synthetic_load,
    synthetic_weight,
)

#: each expert weight's canonical views, each the HF linear of that name (``[out, in]``): the
#: ``gate`` and ``up`` halves of ``gate_and_up_projs`` (``[E, dim, 2 * hidden]``, ``[gate | up]``
#: along the last axis) and ``down_projs`` (``[E, hidden, dim]``), transposed.
EXPERT_VIEWS = {"gate_and_up_projs": ("gate", "up"), "down_projs": ("down",)}
#: the name of the router's expert bias in ``other_tensors`` (its state-dict name within the layer).
BIAS = "mlp.gate.e_score_correction_bias"
#: NeMo's DeepSeek-V3 bias step per update (``models/deepseek_v3/model.py``).
BIAS_UPDATE_FACTOR = 1e-3
#: the synthetic bias's scale (:func:`conformance.synthetic_weight`'s).  The sigmoid scores of the
#: forward check's batch spread ~0.04-0.06 between a token's experts.  Measured at E=4 and 5, after
#: 0 and 2 steps (seed 1234): a bias of this scale chooses other experts than a zero bias for 31-56%
#: of the tokens in each layer, and every expert is still chosen; twice this scale leaves an expert
#: of some layers unchosen.
BIAS_SCALE = 0.01
#: attributes set on the built model: NeMo's MoE mesh (or None) and its dense FSDP mesh (or None).
_MOE_MESH = "_conformance_moe_mesh"


class NemoAutomodelAdapter:
    """NeMo Automodel 0.7.0: a DeepSeek-V3 MoE (sigmoid router with its expert bias),
    ``GroupedExperts`` split by ``apply_ep``, saved by ``Checkpointer``."""

    name = "nemo_automodel"
    version = "0.7.0"
    capabilities = Capabilities(kinds=("packed",), optimizer=True, fsdp=True, uneven=True,
                                max_ep=64, format="dcp", ep_orders=("consecutive",),
                                finetune=("lora",))
    preload = ("nemo_automodel.components.moe.layers", "nemo_automodel.components.moe.parallelizer",
               "nemo_automodel.components.checkpoint.checkpointing",
               "nemo_automodel.components.models.deepseek_v3.state_dict_adapter")

    # -- building ----------------------------------------------------------------------------------
    def build(self, spec: Spec, mesh: Any, seed: int) -> tuple[Any, Any]:
        import torch

        if spec.kind != "packed":
            raise ValueError(f"NeMo's GroupedExperts is packed; cannot build kind {spec.kind!r}")
        if spec.activation != "swiglu":
            raise ValueError(f"this adapter builds NeMo's SwiGLU experts; cannot build activation "
                             f"{spec.activation!r}")
        model = _model_class()(spec)
        _overwrite(model, seed)
        if spec.finetune:  # NeMo's order: PEFT on the whole model, then EP and FSDP
            apply_lora(model, spec)
            _overwrite(model, seed, lora_only=True)  # PEFT's zero B would hide misfiled adapters
        model.to(world_device(mesh))
        moe_mesh = None
        if mesh is not None:
            moe_mesh = _parallelize(model, spec, mesh)
        object.__setattr__(model, _MOE_MESH, moe_mesh)
        if spec.optimizer_steps <= 0:
            return model, None
        # a fine-tuned model's optimizer holds its adapters alone (NeMo's frozen base has no state)
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=spec.lr, weight_decay=0.01)
        run_steps(lambda index: self.step(model, optimizer, seed, index), 0, spec.optimizer_steps)
        return model, optimizer

    def step(self, model: Any, optimizer: Any, seed: int, step: int) -> None:
        """An AdamW step on synthetic gradients, then NeMo's expert-bias update on synthetic loads
        (the order of NeMo's recipe: ``update_moe_gate_bias()`` after ``optimizer.step()``)."""
        _set_grads(model, seed, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _update_biases(model, seed, step)

    def scalars(self, model: Any, optimizer: Any) -> dict[str, Any]:
        return torch_optimizer_scalars(optimizer)

    def forward(self, model: Any, batch: Any) -> Any:
        """NeMo's own ``MoE.forward`` in every block (``Gate``, ``GroupedExperts`` -- at ep > 1
        its all-gather of the tokens over the EP group and an all-reduce of the outputs -- and the
        shared expert) on ``batch``; FSDP2's parameters resharded after it (NeMo's ``apply_fsdp``
        keeps them unsharded after a forward).

        ``GroupedExperts.forward`` asserts ``n_routed_experts % ep_size == 0`` on every rank before
        any exchange: there the check is n/a with NeMo's assertion.  NeMo's ``@torch.compile``d
        SwiGLU (``moe/megatron/moe_utils.py``, ``weighted_swiglu``) runs eagerly
        (``set_stance("force_eager")``): the same function, without inductor's CPU compile of each
        variant in each rank process (about a minute each on 2 cores).  The model stays in train
        mode, as a training step's forward is; the load it counts is overwritten before any update.
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
            raise NotApplicable(f"NeMo's GroupedExperts.forward cannot run E={num_experts} experts "
                                f"at ep={ep_size}: AssertionError: {exc}") from exc
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
        # Workaround: save_model writes <weights_path>/model; point that at the cell's directory.
        # The link lives next to the cell's directory (in the session's work directory, removed
        # with it), not in /tmp: a rank killed mid-save (a world replaced after another rank's
        # failure) never runs the clean-up of its context.
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
    def expert_tensors(self, model: Any, optimizer: Any) -> Iterator[TensorEntry | ExpertBlock]:
        """Each expert weight's views (:data:`EXPERT_VIEWS`) and, in a fine-tuning cell, each packed
        adapter's (:data:`LORA_VIEWS`), with the same cuts of their Adam moments (a frozen base has
        none), as blocks of expert rows (row 0 is expert 0 of a DTensor, this rank's first of a
        plain tensor: the truth's, expert 0)."""
        state = optimizer.state if optimizer is not None else {}
        for layer, moe in _moe_layers(model):
            for weight_name, labels in _views(moe).items():
                weight = getattr(moe.experts, weight_name)
                tensors = {"": weight} | {f".{m}": state[weight][m] for m in ADAM_MOMENTS
                                          if m in state.get(weight, {})}
                for suffix, tensor in tensors.items():
                    for label, view in _expert_views(labels, tensor):
                        yield ExpertBlock(layer, 0, f"{label}{suffix}", view)

    def other_tensors(self, model: Any, optimizer: Any) -> Iterator[TensorEntry]:
        """The router and shared-expert parameters with their moments (the shared expert's LoRA
        adapters among them in a fine-tuning cell), and the router's expert bias (whole on every
        rank: a Replicate DTensor under FSDP2, a plain tensor otherwise)."""
        state = optimizer.state if optimizer is not None else {}
        for layer, moe in _moe_layers(model):
            for name, p in _dense(moe):
                yield TensorEntry(layer, None, f"mlp.{name}", p)
                for moment in ADAM_MOMENTS:
                    if moment in state.get(p, {}):
                        yield TensorEntry(layer, None, f"mlp.{name}.{moment}", state[p][moment])
            yield TensorEntry(layer, None, BIAS, moe.gate.e_score_correction_bias)


# -- the model -------------------------------------------------------------------------------------
@functools.cache
def _model_class() -> type:
    """``Model(spec)``: ``model.layers.<i>.mlp`` NeMo MoE layers and DeepSeek-V3's state-dict
    adapter.

    Defined on first use so that importing this module imports neither torch nor NeMo.
    """
    import torch
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v3.state_dict_adapter import (
        DeepSeekV3StateDictAdapter,
    )
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
            self.layers = nn.ModuleDict({str(i): Block(config, backend)
                                         for i in range(spec.num_layers)})

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
                                    dispatcher="torch", rope_fusion=False,
                                    enable_hf_state_dict_adapter=True)
            config = moe_config(spec)
            self.model = Decoder(spec, config, backend)
            self.state_dict_adapter = DeepSeekV3StateDictAdapter(None, config, backend, dtype=dtype)

        def forward(self, x: Any) -> Any:  # through the modules apply_fsdp wraps, so its hooks run
            return self.model(x)

    return Model


def moe_config(spec: Spec) -> Any:
    """NeMo's ``MoEConfig`` as its DeepSeek-V3 model builds it (``models/deepseek_v3/model.py``:
    ``gate_bias_update_factor=1e-3``, sigmoid scores, no auxiliary loss, top-k weights normalised
    and returned in fp32) at the suite's sizes: one expert group (the grouping is skipped), a route
    scale of 1, no linear biases (``expert_bias`` is GPT-OSS's per-expert linear bias, not the
    router's)."""
    import torch
    from nemo_automodel.components.moe.config import MoEConfig

    return MoEConfig(
        n_routed_experts=spec.num_experts, n_shared_experts=1 if spec.shared_expert else 0,
        n_activated_experts=min(spec.top_k, spec.num_experts), n_expert_groups=1,
        n_limited_groups=1, train_gate=True, gate_bias_update_factor=BIAS_UPDATE_FACTOR,
        aux_loss_coeff=0.0, score_func="sigmoid", route_scale=1.0, dim=spec.dim,
        inter_dim=spec.hidden, moe_inter_dim=spec.hidden, norm_topk_prob=True, expert_bias=False,
        router_bias=False, expert_activation="swiglu", router_weights_fp32=True,
        dtype=getattr(torch, spec.dtype))


def _moe_layers(model: Any) -> Iterator[tuple[int, Any]]:
    for key, block in model.model.layers.items():
        yield int(key), block.mlp


def _dense(moe: Any) -> Iterator[tuple[str, Any]]:
    """``(name within the MoE, parameter)`` of the router and the shared expert."""
    experts = {id(p) for p in moe.experts.parameters()}
    for name, p in moe.named_parameters():
        if id(p) not in experts:
            yield name, p


def _views(moe: Any) -> dict[str, tuple[str, ...]]:
    """The packed expert tensors of ``moe`` and their views' labels: the weights', and a fine-tuned
    layer's adapters' (:data:`LORA_VIEWS`) after them."""
    held = {name: labels for name, labels in LORA_VIEWS.items() if hasattr(moe.experts, name)}
    return EXPERT_VIEWS | held


def _overwrite(model: Any, seed: int, lora_only: bool = False) -> None:
    """Synthetic values on the unsplit model: expert weights (and adapters) by global id and view,
    the rest and the expert bias by name; ``lora_only``: the adapters alone, over what NeMo's PEFT
    drew for them (B zero, A from the process's RNG, which differs per rank)."""
    import torch

    with torch.no_grad():
        for layer, moe in _moe_layers(model):
            for name, labels in _views(moe).items():
                if lora_only and name not in LORA_VIEWS:
                    continue
                weight = getattr(moe.experts, name)
                experts = range(weight.shape[0])
                weight.copy_(_whole(labels, weight.shape, lambda label, shape, _l=layer,
                                    _e=experts: torch.stack([synthetic_weight(seed, _l, g, label,
                                                                              shape)
                                                             for g in _e])))
            for name, p in _dense(moe):
                if not lora_only or "lora_" in name:
                    p.copy_(synthetic_weight(seed, layer, None, f"mlp.{name}", p.shape,
                                             dtype=p.dtype))
            if not lora_only:
                bias = moe.gate.e_score_correction_bias
                bias.copy_(synthetic_weight(seed, layer, None, BIAS, bias.shape, scale=BIAS_SCALE))


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
                   mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype,
                                                  output_dtype=None, cast_forward_inputs=False))
    return moe_mesh


def _checkpointer(model: Any) -> Any:
    import torch.distributed as dist
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    config = CheckpointingConfig(checkpoint_dir="unused", model_save_format="torch_save",
                                 save_consolidated=False)
    return config.build(dp_rank=dist.get_rank(), tp_rank=0, pp_rank=0,
                        moe_mesh=getattr(model, _MOE_MESH))


# -- the expert views, gradients and bias updates ------------------------------------------------
def _whole(labels: tuple[str, ...], shape: Any, make: Any) -> Any:
    """The whole ``[E, ...]`` NeMo tensor from its views: ``make(label, view shape)`` gives each
    view's ``[E, out, in]`` rows (``labels``: :func:`_views`'), transposed into NeMo's
    ``[E, in, out]`` and concatenated along the last axis."""
    import torch

    view_shape = (shape[-1] // len(labels), shape[-2])
    return torch.cat([make(label, view_shape).transpose(-2, -1) for label in labels], dim=-1)


def _expert_views(labels: tuple[str, ...], tensor: Any) -> Iterator[tuple[str, Any]]:
    """``(label, view)`` of a NeMo expert weight or adapter (or moment), plain or DTensor: the
    columns of each view, transposed (a DTensor's slice of an axis no placement shards, and its
    transpose, are local operations: each rank keeps its rows, FSDP's shard of them moves to the
    view's last axis)."""
    width = tensor.shape[-1] // len(labels)
    for i, label in enumerate(labels):
        yield label, tensor[..., i * width:(i + 1) * width].transpose(-2, -1)


def _set_grads(model: Any, seed: int, step: int) -> None:
    """Gradients from synthetic_grad by global identity and view, cut to the region each parameter
    holds; a frozen parameter (a fine-tuned model's base) gets none."""
    from torch.distributed.tensor import DTensor

    for layer, moe in _moe_layers(model):
        views = _views(moe)
        params = [(name, getattr(moe.experts, name)) for name in views]
        params += [(f"mlp.{name}", p) for name, p in _dense(moe)]
        for name, p in params:
            if not p.requires_grad:
                continue
            if name in views:
                experts = range(p.shape[0])
                full = _whole(views[name], p.shape, lambda label, shape, _l=layer, _e=experts:
                              synthetic_grad_rows(seed, step, _l, _e, label, shape))
            else:
                full = synthetic_grad(seed, step, layer, None, name, p.shape)
            local, region = local_region(p)
            grad = (full if region is None else full[region]).to(device=local.device, dtype=p.dtype,
                                                                  copy=True)
            if isinstance(p, DTensor):
                grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False,
                                          shape=p.shape, stride=p.stride())
            p.grad = grad


def _update_biases(model: Any, seed: int, step: int) -> None:
    """NeMo's ``Gate.update_bias`` in every layer on :func:`conformance.synthetic_load`'s counts for
    ``step``, written where its forward would have counted them (``_cumulative_expert_load``): on
    the first rank of the bias's mesh when the bias is a DTensor (NeMo sums the counts over that
    mesh), on every rank when it is a plain tensor (NeMo takes the rank's own); a collective under
    FSDP2."""
    import torch
    from torch.distributed.tensor import DTensor

    for layer, moe in _moe_layers(model):
        gate = moe.gate
        bias = gate.e_score_correction_bias
        load = synthetic_load(seed, step, layer, gate.n_experts)
        if isinstance(bias, DTensor) and any(bias.device_mesh.get_coordinate() or ()):
            load = torch.zeros_like(load)
        gate._cumulative_expert_load = load.to(local_region(bias)[0].device)
        with torch.no_grad():
            gate.update_bias()

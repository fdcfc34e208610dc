"""The expert-parallel split of :mod:`reference_impl.model`, expert tensor parallelism, and FSDP on
top.

:func:`apply_expert_parallel` keeps only this rank's experts, exactly as frameworks do, and that is
the bug this project is about: afterwards a rank names and shapes its experts as if they were the
layer's only ones (``experts.0`` is global expert ``start``; a packed weight has
``num_local_experts`` rows), so a DCP checkpoint of the raw state dict keeps one rank's experts in
place of all of them.  :mod:`reference_impl.expert_layout` is the fix.  Which experts a rank keeps
comes from :func:`reference_impl.layout.expert_range`, the one layout rule.

:func:`apply_expert_parallel` also applies expert tensor parallelism (``etp``): each expert's
weights sharded over the ``etp`` mesh dim on the hidden axis, the forward still the ep=1 one.
:func:`apply_fsdp` composes FSDP2 (or HSDP) on top, sharding each rank's experts over ``dp_shard``.
:func:`apply_pipeline` keeps one pipeline stage's blocks, under their global names (apply it first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from reference_impl.layout import expert_range, mtp_stage, stage_layers
from reference_impl.lora import keep_expert_rows, split_hidden
from reference_impl.meshes import sliced
from reference_impl.model import (
    FUSED_HIDDEN_AXIS,
    FUSED_WEIGHT,
    MoEMLP,
    MoEModel,
    fused_frame,
    moe_modules,
)

__all__ = ["HIDDEN_AXIS", "apply_expert_parallel", "apply_fsdp", "apply_pipeline",
           "pipeline_forward", "pipeline_outputs"]


#: the tensor axis that expert tensor parallelism splits, per expert weight: the hidden axis
#: (``up``/``gate`` column-parallel, ``down`` row-parallel); packed weights add the expert axis.
HIDDEN_AXIS = {"gate": 0, "up": 0, "down": 1}


def apply_expert_parallel(model: nn.Module, device_mesh: Any) -> nn.Module:
    """Keep only this EP rank's experts in every :class:`MoEMLP` of ``model``, in place.

    Which experts: :func:`reference_impl.layout.expert_range` over ``device_mesh["ep"]`` (ranks
    past the last expert hold none).  The EP rank is the rank's coordinate on the ``ep`` dim,
    never its global rank, so EP groups of strided and of consecutive ranks both work.  Unpacked
    layers keep a ``ModuleList`` of their experts renumbered from 0; packed layers keep their rows
    as new Parameters (copies, so the full weights can be freed).

    With an ``etp`` dim of size > 1 (expert tensor parallelism) every expert weight also becomes a
    DTensor Parameter sharded over ``device_mesh["etp"]`` on its hidden axis (:data:`HIDDEN_AXIS`;
    ``up``/``gate`` column-parallel, ``down`` row-parallel), as DTensor's ``Shard`` splits it; the
    forward sums the partial outputs over etp.  A fused ``gate_up_w`` is sharded in its frame
    (:func:`~reference_impl.model.fused_frame`), see :func:`_split_hidden`.  Without ``ep``/``etp``
    dims, or with both of size 1, nothing changes.
    """
    names = getattr(device_mesh, "mesh_dim_names", None) or ()
    ep_mesh = sliced(device_mesh, ("ep",)) if "ep" in names else None
    etp_mesh = sliced(device_mesh, ("etp",)) if "etp" in names else None
    ep = ep_mesh.size() if ep_mesh is not None else 1
    etp = etp_mesh.size() if etp_mesh is not None else 1
    if ep == 1 and etp == 1:
        return model
    for moe in moe_modules(model):
        if moe.ep_world_size != 1 or moe.etp_world_size != 1:
            raise ValueError(f"MoE layer {moe.name!r} is already split over {moe.ep_world_size} EP "
                             f"and {moe.etp_world_size} ETP ranks")
        if ep > 1:
            assert ep_mesh is not None
            ep_rank = ep_mesh.get_local_rank()
            start, end = expert_range(moe.num_experts, ep, ep_rank)
            if moe.kind == "unpacked":
                moe.experts = nn.ModuleList(list(moe.experts)[start:end])
            elif moe.weight_hook is not None:  # fine-tuning state: every row of it moves as one
                keep_expert_rows(moe, start, end)
            else:
                for weight in moe.packed_weights():
                    full = getattr(moe, weight)
                    setattr(moe, weight, nn.Parameter(full.detach()[start:end].clone(),
                                                      requires_grad=full.requires_grad))
            moe.ep_world_size, moe.ep_rank, moe.ep_mesh = ep, ep_rank, ep_mesh
            moe.local_expert_start, moe.num_local_experts = start, end - start
        if etp > 1:
            _split_hidden(moe, etp_mesh)
    return model


def _split_hidden(moe: MoEMLP, etp_mesh: Any) -> None:
    """Shard every expert weight of ``moe`` over ``etp_mesh`` on its hidden axis (no communication).

    A fused ``gate_up_w`` ``[E, 2h, dim]`` becomes a DTensor of its frame, ``[E, 2, h, dim]``
    (concatenated) or ``[E, h, 2, dim]`` (interleaved) -- a free reshape of the contiguous weight --
    sharded on the hidden axis there (:data:`~reference_impl.model.FUSED_HIDDEN_AXIS`).  A plain
    ``Shard`` then splits each half on its own: every etp rank holds the same hidden rows of gate
    and of up, the pairs SwiGLU multiplies.  ``Shard(1)`` of the fused axis itself would give etp
    rank 0 of 2 all of gate and rank 1 all of up under the concatenated order (the bug transformers
    PR #48823 fixed), and split a gate/up pair whenever the etp degree does not divide ``h`` under
    the interleaved one; and no other DTensor placement says "the same rows of each half"
    (``_StridedShard`` is an FSDP-over-TP record that DCP does not save as one region).  Its local
    shard ``[n, 2, h/etp, dim]`` is, read as ``[n, 2h/etp, dim]``, the fused weight of an expert
    with ``h/etp`` hidden rows in the same order, which the forward multiplies as it is.
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    if moe.weight_hook is not None:  # adapters, blocks and scales: reference_impl.lora's plan
        split_hidden(moe, etp_mesh)
        return

    def shard(full: torch.Tensor, axis: int) -> nn.Parameter:
        # Every rank holds the same full weights, so each takes its own shard (src_data_rank=None).
        local = distribute_tensor(full.detach(), etp_mesh, [Shard(axis)], src_data_rank=None)
        return nn.Parameter(local, requires_grad=full.requires_grad)

    if moe.kind == "unpacked":
        for expert in moe.experts:
            for linear, axis in HIDDEN_AXIS.items():
                module = getattr(expert, linear, None)
                if module is not None:
                    module.weight = shard(module.weight, axis)
    else:
        for weight in moe.packed_weights():
            full = getattr(moe, weight)
            if weight == FUSED_WEIGHT:
                framed = nn.Parameter(fused_frame(full.detach(), moe.fused_order),
                                      requires_grad=full.requires_grad)
                setattr(moe, weight, shard(framed, FUSED_HIDDEN_AXIS[moe.fused_order]))
            else:
                setattr(moe, weight, shard(full, HIDDEN_AXIS[weight[:-2]] + 1))
    moe.etp_world_size, moe.etp_mesh = etp_mesh.size(), etp_mesh


def apply_fsdp(model: nn.Module, device_mesh: Any) -> nn.Module:
    """FSDP2 over ``device_mesh["dp_shard"]`` (HSDP with ``dp_replicate`` > 1): each
    :class:`MoEMLP`, then the model.

    Apply it after :func:`apply_expert_parallel`: each rank's experts are then sharded over
    dp_shard (FSDP2 pads uneven dim-0 shards, ranks may hold zero rows), and expert weights that
    expert tensor parallelism made DTensors over ``etp`` become 2-D (FSDP x ETP) DTensors.
    Parameters outside the experts are sharded over dp_shard and replicated over ep and etp, which
    a checkpoint stores once.  With a ``dp_replicate`` dim of size > 1 the mesh is
    ``("dp_replicate", "dp_shard")``, which FSDP2 applies as HSDP: replicate x shard.
    """
    from torch.distributed.fsdp import fully_shard

    names = getattr(device_mesh, "mesh_dim_names", None) or ()
    if "dp_shard" not in names:
        raise ValueError(f"apply_fsdp needs a mesh with a 'dp_shard' dimension, got {device_mesh}")
    hsdp = "dp_replicate" in names and sliced(device_mesh, ("dp_replicate",)).size() > 1
    dp_mesh = sliced(device_mesh, ("dp_replicate", "dp_shard") if hsdp else ("dp_shard",))
    for moe in list(moe_modules(model)):
        if moe is not model:
            fully_shard(moe, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def apply_pipeline(model: MoEModel, pp: int, stage: int) -> MoEModel:
    """Keep pipeline stage ``stage`` of ``pp``: its blocks
    (:func:`reference_impl.layout.stage_layers`, the one stage rule) under their global names, the
    final norm on the last stage only, and the MTP layers (``mtp.{i}``) on the stage
    :func:`reference_impl.layout.mtp_stage` names, the last (they read the main stack's last hidden
    state and feed the output head).  Apply it before the EP split.

    Nothing is copied or renamed: the stage's state dict is the whole model's restricted to its
    layers, so a checkpoint of the stages together holds what the pp=1 model's does (the layer's
    twin of :class:`~reference_impl.expert_layout.ExpertLayout`, free here because the blocks keep
    their names).  Running the stages in turn, each on the last one's output, is the pp=1 forward
    (:func:`pipeline_forward`).
    """
    if model.num_stages != 1:
        raise ValueError(f"the model is already pipeline stage {model.stage} of {model.num_stages}")
    start, end = stage_layers(model.num_layers, pp, stage)
    for index in model.layers.indices():
        if not start <= index < end:
            del model.layers[str(index)]
    if stage != pp - 1:
        model.norm = None
    if stage != mtp_stage(pp):
        model.mtp = None
    model.stage, model.num_stages = stage, pp
    return model


def pipeline_forward(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, pp_group: Any,
                     stage: int) -> torch.Tensor:
    """A pipeline's forward over ``pp_group`` (its ranks in stage order), stage by stage: stage
    ``s`` receives stage ``s - 1``'s activations, runs ``run`` (this rank's stage: its blocks) and
    sends the result on; the last stage's output goes back to every stage, so each rank returns the
    whole model's output.  Plain send/recv -- a schedule without micro-batches, enough to check that
    the stages together compute the pp=1 forward.  Activations keep ``x``'s shape (residual
    blocks)."""
    return pipeline_outputs(lambda h: [run(h)], x, pp_group, stage, 1)[0]


def pipeline_outputs(run: Callable[[torch.Tensor], Sequence[torch.Tensor]], x: torch.Tensor,
                     pp_group: Any, stage: int, outputs: int) -> list[torch.Tensor]:
    """:func:`pipeline_forward` where the last stage gives ``outputs`` tensors of ``x``'s shape (the
    output and each MTP depth's: ``run = lambda h: model(h, inputs, with_mtp=True)``) and every rank
    returns them all.  ``run`` returns a sequence: the activations alone on every other stage."""
    import torch.distributed as dist

    stages = dist.get_world_size(pp_group)
    if not 0 <= stage < stages:
        raise ValueError(f"pipeline_forward: stage {stage} is not among the pp group's {stages} "
                         "stages")
    peer = [dist.get_global_rank(pp_group, s) for s in range(stages)]
    if stage > 0:
        x = torch.empty_like(x)
        dist.recv(x, src=peer[stage - 1], group=pp_group)
    got = list(run(x))
    if stage < stages - 1:
        dist.send(got[0].contiguous(), dst=peer[stage + 1], group=pp_group)
        out = torch.empty((outputs, *got[0].shape), dtype=got[0].dtype, device=got[0].device)
    elif len(got) != outputs:
        raise ValueError(f"pipeline_outputs: the last stage gave {len(got)} outputs, expected "
                         f"{outputs}")
    else:
        out = torch.stack(got)
    dist.broadcast(out, src=peer[-1], group=pp_group)
    return list(out.unbind(0))

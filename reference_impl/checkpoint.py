"""Save and load an expert-parallel model and its optimizer with DCP, experts under global ids.

The whole fix is two calls around DCP::

    state = layout.to_global({"model": ..., "optimizer": ...})   # before dcp.save / dcp.load
    state = layout.to_local(state)                              # after dcp.load

and a guard, :func:`reference_impl.expert_layout.check_saved_experts`, that refuses a checkpoint
written without the layout before the load touches anything.

Each layer kind saves the form its weights already have (seed 001's ExpertLayout): a packed layer
one ``[E, ...]`` tensor per weight and moment, a fused layer the same with ``gate_up_w`` ``[E, 2, h,
dim]``, an unpacked layer one tensor per expert.  The packed form is one DCP item per weight and
moment per rank's chunk whatever E is, where the per-expert form of a packed layer is one per expert
(4,608 items at E=256 with AdamW: DCP's per-item cost dominates); either form loads into any kind,
so the form is a choice of speed and of what other tools read, never of what loads.  ``save(...,
per_expert=True)`` writes packed and fused layers per expert too (what Hugging Face and Megatron
checkpoints hold).  A router's ``expert_bias`` is saved and loaded as any whole replicated tensor;
its ``tokens_per_expert`` counter is non-persistent and never saved.

After ``dcp.load`` the model's parameters and the optimizer's moments already hold the loaded
values, because every tensor DCP loaded into is the original or a view of it.  What a load
cannot write in place are the optimizer's param-group settings (lr, betas, ...), which DCP
loads as new Python objects into the dict, so :func:`load` still hands the result to
``set_optimizer_state_dict``; ``set_model_state_dict`` would copy each tensor onto itself, so it
runs only when a loaded tensor is not the model's own.

:func:`save_legacy` saves the way frameworks did before the layout existed: it is the negative
control that shows the bug and that the guard catches it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from reference_impl.expert_layout import (
    ExpertLayout,
    check_saved_experts,
    expert_layout,
    packed_layers,
    saved_forms,
)
from reference_impl.tuned_checkpoint import adapters_only as tuned_adapters
from reference_impl.tuned_checkpoint import check_saved_tuning, own_forms

__all__ = ["WholeStateReader", "load", "load_whole", "save", "save_layout", "save_legacy",
           "state_dict"]


def state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` as get_model/optimizer_state_dict give them
    (rank-local)."""
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def save(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike[str], *,
         per_expert: bool = False, adapters_only: bool = False) -> None:
    """Save ``model`` (and ``optimizer``) so that every expert is stored once under its global id.

    Packed layers save the packed form (``up_w`` ``[E, ...]`` and its moments, each rank's rows at
    their global offset; nothing copied), fused layers the fused form (``gate_up_w`` ``[E, 2, h,
    dim]``), unpacked layers the per-expert form (``experts.G.up.weight``); ``per_expert=True``
    saves packed and fused layers per expert too.  Every form loads into every kind at any (ep, etp,
    FSDP/HSDP): :mod:`reference_impl.expert_layout`.

    Fine-tuning state (LoRA adapters, a quantized base: :mod:`reference_impl.tuned_checkpoint`) is
    saved in its layer's own form, under global expert ids.  ``adapters_only=True`` writes what a
    fine-tuning run's adapter checkpoint holds (PEFT's ``save_pretrained``): the adapters and their
    optimizer state, no base -- the base is a released checkpoint the run never changed, so a copy
    of it per save is gigabytes of nothing; :func:`load` with ``adapters_only=True`` reads it into a
    model whose base came from elsewhere.  A flag rather than a second function, because the same
    layout translates both and only the selection differs.
    """
    state = state_dict(model, optimizer)
    layout = save_layout(model, per_expert=per_expert)
    if layout is not None:
        state = layout.to_global(state)
    if adapters_only:
        state = tuned_adapters(state)
    dcp.save(state, checkpoint_id=os.fspath(path))


def save_layout(model: nn.Module, *, per_expert: bool = False) -> ExpertLayout | None:
    """The :class:`ExpertLayout` :func:`save` translates ``model``'s state with: packed and fused
    layers in their own form (per expert with ``per_expert``), unpacked layers per expert; ``None``
    when nothing needs translating."""
    return expert_layout(model, packed_form=() if per_expert else packed_layers(model))


def save_legacy(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                path: str | os.PathLike[str]) -> None:
    """Save the rank-local state dict as is: at ep > 1 the checkpoint keeps one rank's experts.

    Packed layers keep their raw ``[rows, ...]`` tensors, unpacked ones their local names, so the
    checkpoint is lossy in both kinds' ways, and :func:`check_saved_experts` refuses both.
    """
    dcp.save(state_dict(model, optimizer), checkpoint_id=os.fspath(path))


class WholeStateReader(StorageReader):
    """A DCP storage reader over whole tensors in memory, one chunk each: ``dcp.load`` through it
    reads what a checkpoint of the same tensors would give, with no file written or read.

    Every rank holds every tensor whole (a Hugging Face import's state: each rank reads the files
    itself), so a rank's read plan is served by slicing, and no plan crosses ranks.
    """

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.state = dict(state)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return Metadata(state_dict_metadata={
            key: TensorStorageMetadata(TensorProperties(dtype=t.dtype), t.size(), [
                ChunkStorageMetadata(torch.Size([0] * t.dim()), t.size())])
            for key, t in self.state.items()})

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise ValueError(f"{item.storage_index.fqn}: a whole-state reader holds tensors "
                                 "only, and the load asked for an object")
            source = self.state[item.storage_index.fqn]
            for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths,
                                                       strict=True)):
                source = source.narrow(dim, offset, length)
            target = planner.resolve_tensor(item).detach()
            if target.size() != source.size():  # copy_ would broadcast a wrong shape silently
                raise ValueError(f"{item.storage_index.fqn}: the region the load asks for is "
                                 f"{tuple(target.size())}, the state holds {tuple(source.size())} "
                                 "there")
            target.copy_(source)
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


def _in_place(model: nn.Module, loaded: dict[str, Any]) -> bool:
    """Whether every tensor ``loaded`` holds lives in the model's own parameters and buffers, so
    that the load already wrote the model and ``set_model_state_dict`` would copy each tensor onto
    itself (at 64 experts, ~0.3 s a load).  Anything else (a non-tensor entry, a copy) goes through
    ``set_model_state_dict``."""
    from torch.distributed.tensor import DTensor

    def storage(t: torch.Tensor) -> int:
        return int((t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr())

    own = {storage(t) for t in (*model.parameters(), *model.buffers())}
    return all(isinstance(v, torch.Tensor) and storage(v) in own for v in loaded.values())


def _load_here(state: dict[str, Any], reader: StorageReader, where: str) -> None:
    """``dcp.load`` of this rank's own state, then one all-reduce so that every rank fails if one
    does.

    A load plans nothing across ranks: each rank reads the regions its own tensors ask for, and
    DCP's central load plan is each rank's local plan unchanged.  In a process group ``dcp.load``
    still gathers every rank's plan (one read item per expert, weight and moment: thousands at 64
    experts), scatters them back and gathers once more after reading; ``no_dist=True`` runs the same
    planning and reading without those collectives, and the all-reduce here keeps what they gave:
    one rank's failure is every rank's.
    """
    if not (dist.is_available() and dist.is_initialized()):
        dcp.load(state, storage_reader=reader)
        return
    failed: BaseException | None = None
    try:
        dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        failed = exc
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([dist.get_rank() + 1 if failed is not None else 0], dtype=torch.int64,
                        device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if failed is not None:
        raise failed
    if int(flag.item()):
        raise RuntimeError(f"{where}: the load failed on rank {int(flag.item()) - 1} (and maybe "
                           f"others); every rank stops with it")


def load(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike[str], *,
         check_saved: bool = True, adapters_only: bool = False) -> None:
    """Load a checkpoint of :func:`save`, saved at any ep, into ``model`` (and ``optimizer``).

    Raises ValueError, before anything is loaded, when the checkpoint holds fewer experts of a layer
    than the model has (a legacy ep > 1 checkpoint).  ``check_saved=False`` skips that guard; only
    the conformance suite's ``legacy`` negative control uses it, to show the damage.  Either kind
    loads any form: the per-expert form, the packed form (``[E, ...]`` per weight, what :func:`save`
    writes for packed layers at any ep, or an ep=1 packed run's raw save) and the fused form --
    through views of the model's own tensors, or a stacked copy where no view can present them (the
    module docstring of :mod:`reference_impl.expert_layout`).

    A layer with fine-tuning state loads its own form only, and a checkpoint whose quantized scales
    do not match their blocks' grid is refused before anything is loaded
    (:class:`~reference_impl.quantized.QuantizedShapeError`).  ``adapters_only=True`` loads the
    adapters and their optimizer state alone (a :func:`save` with ``adapters_only``, or any
    checkpoint holding them), leaving the base as it is.
    """
    path = os.fspath(path)
    _load(model, optimizer, dcp.FileSystemReader(path), path, check_saved, adapters_only)


def load_whole(model: nn.Module, state: Mapping[str, torch.Tensor], where: str) -> None:
    """Load ``state`` -- whole tensors under the names :func:`save` writes, in any form it writes
    -- into ``model`` at its layout, as :func:`load` loads a checkpoint of them: each rank copies
    its own regions out of the whole tensors (:class:`WholeStateReader`), nothing written to disk.
    ``where`` names the source in errors."""
    _load(model, None, WholeStateReader({f"model.{k}": v for k, v in state.items()}), where, True)


def _load(model: nn.Module, optimizer: torch.optim.Optimizer | None, reader: StorageReader,
          path: str, check_saved: bool, adapters_only: bool = False) -> None:
    """:func:`load` from ``reader`` (``path`` names it in errors)."""
    saved = reader.read_metadata().state_dict_metadata
    # off only for the conformance suite's negative control, which must show the damage
    if check_saved:
        check_saved_experts(model, saved, where=path)
    check_saved_tuning(model, saved, path)  # blocks and scales agree, before anything is read
    # get_optimizer_state_dict creates a fresh optimizer's moments (a zero-lr step), so DCP has
    # tensors to load into.
    state = state_dict(model, optimizer)
    # a param group's "params" are this rank's own names, not state: the checkpoint holds one rank's
    # copy of each group's list (DCP keeps one of equal keys), and ranks of different pipeline
    # stages list different parameters
    own = [list(group["params"]) for group in state.get("optimizer", {}).get("param_groups", [])]
    forms = {**saved_forms(model, saved), **own_forms(model)}  # fine-tuning state: its own form
    layout = expert_layout(model, packed_form={n for n, f in forms.items() if f != "per-expert"},
                           fused_form={n for n, f in forms.items() if f == "fused"})
    if layout is not None:
        state = layout.to_global(state)
    if adapters_only:
        state = tuned_adapters(state)
    check_saved_tuning(model, saved, path, state["model"])
    _load_here(state, reader, path)
    if layout is not None:
        state = layout.to_local(state)
    if optimizer is not None:
        for group, params in zip(state["optimizer"]["param_groups"], own, strict=True):
            group["params"] = params
    if not _in_place(model, state["model"]):
        set_model_state_dict(model, state["model"],
                             options=StateDictOptions(strict=not adapters_only))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])

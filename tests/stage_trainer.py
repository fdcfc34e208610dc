"""A torch-native MoE trainer shaped like the one issue 59 reported, which
tests/test_stage_trainer.py adapts from docs/adapters.md alone.  Kept apart from the project's code
(it imports none of it), as a framework is:

- per layer a norm, a router, packed experts ``[E, dim, hidden]`` split over ``ep`` as DTensors
  ``Shard(0)`` (torch.chunk's rows: E=5 splits 3, 2 at ep=2), a shared expert of hidden 32 and a
  dense MLP of hidden 16 -- so the dense moments have 32 and 16 rows, never E, and layer 1's
  experts' moments are ``state.10`` and ``state.11`` beside its dense ``state.12`` to ``15``;
- FSDP2 over ``dp_shard`` (HSDP with ``dp_replicate``), the experts sharded on their inner axis;
- its optimizer a per-pipeline-stage container (:class:`Stages`) around torch's own AdamW, and an
  LR scheduler beside it;
- its own DCP checkpoint: ``{"state": {"model": ..., "optimizer": {"pp_0_stage_0":
  Optimizer.state_dict()}}}``, so a moment's key is ``state.optimizer.pp_0_stage_0.state.<id>.
  <stat>`` (torch numbers the parameters by position).  Its save takes the scheduler it is handed
  and leaves it out, as the reported trainer's recover checkpoint does (:func:`save`).

``keep_scheduler=True`` is the same trainer without that defect, and ``misfile=True`` the same
trainer with a real defect (the negative control): at ep > 1 each rank
saves its experts' ``exp_avg`` rows in reverse order, so another expert's moment is filed under each
expert's id.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

SHARED_HIDDEN, DENSE_HIDDEN = 32, 16
STAGE = "pp_0_stage_0"


class Experts(nn.Module):
    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w_out = nn.Parameter(torch.empty(num_experts, hidden, dim))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)


class Layer(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, bias=False)
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = Experts(num_experts, dim, hidden)
        self.shared = MLP(dim, SHARED_HIDDEN)
        self.dense = MLP(dim, DENSE_HIDDEN)


class Model(nn.Module):
    def __init__(self, num_layers: int, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.layers = nn.ModuleList(Layer(dim, hidden, num_experts) for _ in range(num_layers))


def parallelize(model: Model, mesh: Any, fsdp: bool) -> None:
    """Expert parallelism over ``mesh["ep"]``, then FSDP2 (HSDP) over the data-parallel dims when
    ``fsdp``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    ep_mesh = mesh["ep"]
    for layer in model.layers if ep_mesh.size() > 1 else ():
        for name in ("w_in", "w_out"):
            full = getattr(layer.experts, name).data
            setattr(layer.experts, name,
                    nn.Parameter(distribute_tensor(full, ep_mesh, [Shard(0)], src_data_rank=None)))
    if not fsdp:
        return
    dp = mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]

    def inner_axis(param: nn.Parameter) -> Shard | None:  # experts keep dim 0 for ep
        return Shard(1) if param.dim() == 3 else None

    for layer in model.layers:
        fully_shard(layer, mesh=dp, shard_placement_fn=inner_axis)
    fully_shard(model, mesh=dp)


class Stages:
    """The trainer's optimizer: one torch AdamW per pipeline stage (one stage here)."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        self.optimizers = {STAGE: torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)}

    def step(self) -> None:
        for optimizer in self.optimizers.values():
            optimizer.step()

    def zero_grad(self) -> None:
        for optimizer in self.optimizers.values():
            optimizer.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return {name: o.state_dict() for name, o in self.optimizers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, optimizer in self.optimizers.items():
            optimizer.load_state_dict(state[name])


def schedule(optimizer: Stages, warmup: int = 4) -> Any:
    """The LR warm-up the trainer steps beside its optimizer."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer.optimizers[STAGE],
                                             lambda it: min(1.0, (it + 1) / warmup))


def _state(model: nn.Module, optimizer: Stages | None, scheduler: Any = None) -> dict[str, Any]:
    state: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        state["lr_scheduler"] = scheduler.state_dict()
    return {"state": state}


def _misfiled(model: Model, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every expert's ``exp_avg`` rows reversed on this rank (the negative
    control's defect): another expert's moment filed under each expert's id."""
    from torch.distributed.tensor import DTensor, Shard

    params = {p: i for i, p in enumerate(model.parameters())}
    stage = state["state"]["optimizer"][STAGE]["state"]
    for layer in model.layers:
        for name in ("w_in", "w_out"):
            moment = stage[params[getattr(layer.experts, name)]]["exp_avg"]
            if isinstance(moment, DTensor) and Shard(0) in moment.placements:  # split over ep
                local = moment.to_local()
                local.copy_(local.flip(0))
    return state


def save(path: str, model: Model, optimizer: Stages | None, scheduler: Any = None,
         misfile: bool = False, keep_scheduler: bool = False) -> None:
    """The recover checkpoint: the model and the optimizer.  ``scheduler`` is taken and, unless
    ``keep_scheduler``, not saved (the reported trainer's defect)."""
    state = _state(model, optimizer, scheduler if keep_scheduler else None)
    if misfile and optimizer is not None:
        state = _misfiled(model, state)
    dcp.save(state, checkpoint_id=path)
    if misfile and optimizer is not None:
        _misfiled(model, state)  # the live moments back as they were


def load(path: str, model: Model, optimizer: Stages | None, scheduler: Any = None,
         keep_scheduler: bool = False) -> None:
    state = _state(model, optimizer, scheduler if keep_scheduler else None)
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["state"]["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["state"]["optimizer"])
    if scheduler is not None and keep_scheduler:
        scheduler.load_state_dict(state["state"]["lr_scheduler"])

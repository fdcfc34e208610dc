"""A small torch-native MoE trainer with a real checkpointer's habits, which
tests/test_checkpointer_trainer.py adapts from docs/adapters.md alone.  Kept apart from the
project's code (it imports none of it), as a framework is:

- packed experts ``[E, in, out]`` (``w_in`` is ``[E, dim, hidden]``: input first, as ``x @ w``
  wants) split over ``ep`` as DTensors ``Shard(0)``, a router and a shared expert per layer; or,
  with ``packed=False``, one module per expert, each rank keeping only its own (``experts.<global
  id>``);
- FSDP2 over ``dp_shard`` (HSDP with ``dp_replicate``), the experts sharded on their inner axis;
- its own optimizer container (:class:`Optimizer`): AdamW with the fused kernel wherever the
  parameters allow it (plain tensors: the kernel takes no DTensor here), a LambdaLR warm-up and an
  iteration counter, stepped together, and a ``zero_grad()`` of its own (no ``set_to_none``);
- its own DCP checkpointer (:class:`Checkpointer`): ``<root>/step-<iteration>/`` holding the model's
  ``state_dict()``, torch's own ``Optimizer.state_dict()`` (moments keyed by each parameter's
  *position*: ``optimizer.state.1.exp_avg``), the schedule's and the counter's state; ``load`` reads
  the newest step under the root.

It refuses an expert count that ``ep`` does not divide, as trainers of this kind do.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn


class PackedExperts(nn.Module):
    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w_out = nn.Parameter(torch.empty(num_experts, hidden, dim))


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(dim, hidden))
        self.w_out = nn.Parameter(torch.empty(hidden, dim))


class SharedExpert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)


class MoELayer(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, packed: bool) -> None:
        super().__init__()
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts: nn.Module = (
            PackedExperts(num_experts, dim, hidden) if packed else
            nn.ModuleDict({str(g): Expert(dim, hidden) for g in range(num_experts)}))
        self.shared = SharedExpert(dim, hidden)


class Model(nn.Module):
    def __init__(self, num_layers: int, dim: int, hidden: int, num_experts: int,
                 packed: bool = True) -> None:
        super().__init__()
        self.num_experts, self.packed = num_experts, packed
        self.layers = nn.ModuleList(MoELayer(dim, hidden, num_experts, packed)
                                    for _ in range(num_layers))


def parallelize(model: Model, mesh: Any, fsdp: bool) -> None:
    """Expert parallelism over ``mesh["ep"]``, then FSDP2 (HSDP) over the data-parallel dims when
    ``fsdp``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    ep_mesh = mesh["ep"]
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    if model.num_experts % ep:
        raise ValueError(f"checkpointer_trainer: {model.num_experts} experts do not split evenly "
                         f"over ep={ep}")
    for layer in model.layers if ep > 1 else ():
        if model.packed:
            for name in ("w_in", "w_out"):
                full = getattr(layer.experts, name).data
                rows = distribute_tensor(full, ep_mesh, [Shard(0)], src_data_rank=None)
                setattr(layer.experts, name, nn.Parameter(rows))
        else:
            per_rank = model.num_experts // ep
            layer.experts = nn.ModuleDict({g: e for g, e in layer.experts.items()
                                           if rank * per_rank <= int(g) < (rank + 1) * per_rank})
    if not fsdp:
        return
    dp = mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]

    def inner_axis(param: nn.Parameter) -> Shard | None:  # experts keep dim 0 for ep
        return Shard(1) if param.dim() == 3 else None

    for layer in model.layers:
        fully_shard(layer, mesh=dp, shard_placement_fn=inner_axis)
    fully_shard(model, mesh=dp)


class Progress:
    """The trainer's iteration counter, saved with the checkpoint."""

    def __init__(self) -> None:
        self.iteration = 0

    def state_dict(self) -> dict[str, int]:
        return {"iteration": self.iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])


class Optimizer:
    """AdamW, its warm-up schedule and the iteration counter, stepped together."""

    def __init__(self, model: nn.Module, lr: float, warmup: int = 4) -> None:
        from torch.distributed.tensor import DTensor

        params = list(model.parameters())
        # the fused kernel takes no DTensor here: the per-tensor loop where the layout makes them
        fused = not any(isinstance(p, DTensor) for p in params)
        self.adamw = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=fused,
                                       foreach=None if fused else False)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.adamw, lambda it: min(1.0, (it + 1) / warmup))
        self.progress = Progress()

    def step(self) -> None:
        self.adamw.step()
        self.schedule.step()
        self.progress.iteration += 1

    def zero_grad(self) -> None:
        for group in self.adamw.param_groups:
            for p in group["params"]:
                p.grad = None


STEP_DIR = re.compile(r"^step-(\d+)$")


class Checkpointer:
    """``<root>/step-<iteration>/``: DCP over the model's and the optimizer's own state dicts."""

    def __init__(self, root: str) -> None:
        self.root = root

    def _state(self, model: nn.Module, optimizer: Optimizer | None) -> dict[str, Any]:
        state: dict[str, Any] = {"model": model.state_dict()}
        if optimizer is not None:
            state.update(optimizer=optimizer.adamw.state_dict(),
                         schedule=optimizer.schedule.state_dict(),
                         progress=optimizer.progress.state_dict())
        return state

    def save(self, model: nn.Module, optimizer: Optimizer | None) -> str:
        iteration = optimizer.progress.iteration if optimizer is not None else 0
        path = os.path.join(self.root, f"step-{iteration}")
        dcp.save(self._state(model, optimizer), checkpoint_id=path)
        return path

    def latest(self) -> str:
        steps = sorted((int(m[1]), name) for name in os.listdir(self.root)
                       if (m := STEP_DIR.match(name)))
        if not steps:
            raise FileNotFoundError(f"checkpointer_trainer: no step-<n> checkpoint under "
                                    f"{self.root}")
        return os.path.join(self.root, steps[-1][1])

    def load(self, model: nn.Module, optimizer: Optimizer | None) -> None:
        state = self._state(model, optimizer)
        dcp.load(state, checkpoint_id=self.latest())
        model.load_state_dict(state["model"])
        if optimizer is not None:
            groups = zip(state["optimizer"]["param_groups"], optimizer.adamw.param_groups,
                         strict=True)
            for saved, mine in groups:  # the kernel is this layout's choice, not the save's
                saved.update(fused=mine["fused"], foreach=mine["foreach"])
            optimizer.adamw.load_state_dict(state["optimizer"])
            optimizer.schedule.load_state_dict(state["schedule"])
            optimizer.progress.load_state_dict(state["progress"])

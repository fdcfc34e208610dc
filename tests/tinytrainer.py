"""A tiny torch-native MoE trainer, the framework docs/adapters.md's first example adapts: packed
experts (``[E, ...]`` per weight) split over ``ep`` as DTensors ``Shard(0)``, AdamW, and DCP through
torch's state-dict API.  Kept apart from the project's code so the example adapts a framework, not
the harness."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w_out = nn.Parameter(torch.empty(num_experts, dim, hidden))


class Model(nn.Module):
    def __init__(self, num_layers: int, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.layers = nn.ModuleList(MoE(dim, hidden, num_experts) for _ in range(num_layers))


def parallelize(model: Model, ep_mesh: object) -> None:
    """Expert parallelism: each packed weight a DTensor ``Shard(0)`` over ``ep_mesh`` (its rows by
    torch.chunk)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for moe in model.layers:
        for name in ("w_in", "w_out"):
            setattr(moe, name,
                    nn.Parameter(distribute_tensor(getattr(moe, name).data, ep_mesh, [Shard(0)])))


def save(path: str, model: Model, optimizer: torch.optim.Optimizer | None) -> None:
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=path)


def load(path: str, model: Model, optimizer: torch.optim.Optimizer | None) -> None:
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])

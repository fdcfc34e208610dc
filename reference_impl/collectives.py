"""The two autograd functions :class:`~reference_impl.model.MoEMLP`'s forward crosses an EP or ETP
group with.

Every rank of the group sees the same tokens; each computes its experts' (or its hidden-axis part's)
share. The pair makes that forward, and its backward, the ep=1 one.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CopyToGroup", "ReduceOverGroup"]


class CopyToGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (EP, or ETP).

    The tokens and routing weights every EP rank shares feed only the rank's own experts (and
    every ETP rank's only its part of their hidden axis), so each rank's gradient for them is a
    part of the whole; the sum gives every rank the whole, and with it the router and everything
    upstream get the gradient an ep=1 model gets (Megatron's "copy to the model-parallel region").
    """

    @staticmethod
    def forward(ctx: Any, shared: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return shared.view_as(shared)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class ReduceOverGroup(torch.autograd.Function):
    """Sum the group's partial outputs; the gradient, the same on every rank, passes through.

    Every EP rank sees the same tokens and holds part of the experts (every ETP rank part of each
    expert's hidden axis, so its down projection gives a partial sum), so the layer's output is
    the sum of the ranks' parts (Megatron's "reduce from the model-parallel region").
    """

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None

"""A MoE layer's router, and auxiliary-loss-free load balancing (DeepSeek-V3's expert bias).

:class:`Router` scores every token against every expert (``softmax(x W^T)``, ``weight`` ``[E,
dim]``) and picks ``top_k`` experts.  With ``expert_bias`` it keeps two fp32 ``[E]`` buffers beside
its weight, as DeepSeek-V3 and Megatron-Core's router do (torchtitan keeps the same two on its MoE
module):

- ``expert_bias`` (**persistent**: it is in the state dict and a checkpoint holds it) is added to
  the scores only to *select* experts; the combine weights are the unbiased scores of the selected
  experts, renormalised, so the bias steers load without scaling any expert's output.
- ``tokens_per_expert`` (**non-persistent**: never in a checkpoint) counts the tokens each expert
  was selected for; every forward adds to it, and :func:`update_expert_bias` reads it, steps the
  bias and zeroes it.

Both are whole ``[E]`` vectors on every rank: expert parallelism splits the experts, never the
router, and FSDP2 shards parameters, not buffers, so the bias is replicated and a checkpoint holds
one copy under the layer's name (``layers.N.moe.router.expert_bias``).  They stay fp32 whatever the
model's dtype: a bf16 bias could not hold the small steps the update takes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from reference_impl.weights import expert_bias_values

__all__ = ["Router", "expert_bias_routers", "update_expert_bias"]


class Router(nn.Linear):
    """``weight`` ``[E, dim]`` (an ``nn.Linear`` without bias, so the state-dict key is
    ``router.weight``), and, with ``expert_bias``, the ``expert_bias`` and ``tokens_per_expert``
    buffers (module docstring)."""

    expert_bias: torch.Tensor
    tokens_per_expert: torch.Tensor

    def __init__(self, dim: int, num_experts: int, dtype: torch.dtype,
                 expert_bias: bool = False) -> None:
        super().__init__(dim, num_experts, bias=False, dtype=dtype)
        self.has_expert_bias = expert_bias
        if expert_bias:
            zeros = torch.zeros(num_experts, dtype=torch.float32)
            self.register_buffer("expert_bias", zeros, persistent=True)
            self.register_buffer("tokens_per_expert", zeros.clone(), persistent=False)

    def reset_expert_bias(self, scale: float, *key: object) -> None:
        """Give ``expert_bias`` its synthetic initial values
        (:func:`~reference_impl.weights.expert_bias_values`: non-zero, entry ``g`` a function of
        ``(*key, g)``) and zero the counter; nothing without a bias."""
        if not self.has_expert_bias or self.expert_bias.is_meta:
            return
        with torch.no_grad():
            self.expert_bias.copy_(expert_bias_values(scale, self.out_features, *key))
            self.tokens_per_expert.zero_()

    def route(self, tokens: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)`` ``[tokens, top_k]`` each: the chosen experts and their combine
        weights (the unbiased scores renormalised over the choice, in ``tokens``' dtype).  With a
        bias the choice is the top-k of scores + bias, and the choice is counted into
        ``tokens_per_expert``."""
        probs = self(tokens).float().softmax(dim=-1)
        if self.has_expert_bias:
            top_i = (probs + self.expert_bias).topk(top_k, dim=-1).indices
            top_w = probs.gather(-1, top_i)
            with torch.no_grad():
                counts = torch.bincount(top_i.flatten(), minlength=self.out_features)
                self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))
        else:
            top_w, top_i = probs.topk(top_k, dim=-1)
        return (top_w / top_w.sum(dim=-1, keepdim=True)).to(tokens.dtype), top_i


def expert_bias_routers(model: nn.Module) -> list[Router]:
    """Every :class:`Router` of ``model`` that keeps an expert bias, in ``model.modules()``
    order."""
    return [m for m in model.modules() if isinstance(m, Router) and m.has_expert_bias]


@torch.no_grad()
def update_expert_bias(model: nn.Module, rate: float, group: Any = None) -> int:
    """One auxiliary-loss-free balancing step on every router of ``model`` that keeps an expert
    bias; how many.

    Each router's load is its ``tokens_per_expert`` counter, and its bias takes a step of ``rate``
    against the sign of each expert's imbalance, ``expert_bias += rate * sign(mean(load) - load)``
    (DeepSeek-V3: an overloaded expert's bias goes down, an underloaded one's up, a balanced one's
    stays), then the counter is zeroed.  A training step calls it once per optimizer step.

    The counter is read as it stands, so loads set from outside count like counted ones: the
    conformance matrix, which drives training with synthetic gradients, writes synthetic loads into
    ``tokens_per_expert`` (as it writes synthetic gradients into ``.grad``) and then calls a
    framework's own update, whose rule then runs.

    A real trainer all-reduces the counter over the data-parallel group first: each data-parallel
    rank counted only its own tokens, and the ranks' biases stay equal only if each steps on the
    global load.  Pass that group as ``group`` (the sum is taken in place, so every rank's counter
    holds the global load before the step). In the reference every rank of a layer sees the same
    tokens, so its tests pass no group.
    """
    routers = expert_bias_routers(model)
    for router in routers:
        load = router.tokens_per_expert
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(load, group=group)
        router.expert_bias.add_(rate * torch.sign(load.mean() - load))
        load.zero_()
    return len(routers)

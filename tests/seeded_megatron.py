"""Seeded bugs on Megatron: an expert's fp32 main weight filed under another expert (the distributed
optimizer), and an expert bias the load leaves alone.

:class:`MainWeightMisfiledOnSave` is ``megatron-distopt-fully_reshardable`` (the format whose
checkpoint is EP-invariant) with layer 0's experts 0 and 1 trading places (the expert axis's offset)
for their fp32 main ``linear_fc2`` weights in the optimizer's sharded state dict, on the save and on
the load alike -- the bf16 weights and the moments stay where they belong.  It is the class of bug
issue 35 names: a main weight under the wrong (a local) identity while the bf16 copy is global.  A
rank holds both experts at ep 1 and 2 (E=4), so those saves misfile and load their own mistake back
(a round trip); at ep=4 they sit on two ranks and the save is right.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from conformance.adapters.megatron import MegatronAdapter
from conformance.adapters.megatron_distopt import MegatronDistOptFullyReshardableAdapter

#: the fully_reshardable optimizer key of layer 0's experts' fp32 main ``linear_fc2`` weights.
MAIN_FC2 = "optimizer.state.param.layers.0.mlp.experts.experts.linear_fc2.weight"


def _sharded_tensors(tree: Any) -> Iterator[Any]:
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _sharded_tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _sharded_tensors(value)
    elif hasattr(tree, "global_offset") and hasattr(tree, "key"):
        yield tree


class MainWeightMisfiledOnSave(MegatronDistOptFullyReshardableAdapter):
    def _state_dicts(self, model: Any, optimizer: Any, *, loading: bool = False) -> dict[str, Any]:
        out = super()._state_dicts(model, optimizer, loading=loading)
        if optimizer is not None:  # on the load too: a framework that reads its own mistake back
            shards = {(t.global_offset[0], t.global_offset[1:]): t
                      for t in _sharded_tensors(out["optimizer"]) if t.key == MAIN_FC2}
            for (expert, rest), first in shards.items():
                second = shards.get((1, rest))
                if expert == 0 and second is not None:
                    first.global_offset, second.global_offset = (
                        second.global_offset, first.global_offset)
        return out


class ExpertBiasLeftAtLoad(MegatronAdapter):
    """The load restores every tensor but each router's ``expert_bias``, which keeps the load
    side's own values: what a load that restores parameters only leaves (the reference's
    ``seeded-expert-bias-not-loaded``), here on Megatron's layers and ``dist_checkpointing``."""

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        import torch

        kept = [moe.router.expert_bias.clone() for moe in model.moe_layers()]
        super().load(model, optimizer, path)
        with torch.no_grad():
            for moe, bias in zip(model.moe_layers(), kept, strict=True):
                moe.router.expert_bias.copy_(bias)

"""Seeded forward bugs for the framework adapters: the negative controls of the ``forward`` check.

Each is the framework's own adapter with the router rows of experts 0 and 1 swapped while its
forward runs on a loaded model -- as a framework whose dispatch maps expert ids at run time
differently from how its checkpoint names them.  The stored tensors stay right (``values`` passes),
so only ``forward`` can catch it.  The ground truth (never loaded) runs unswapped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from conformance.adapters.megatron import MegatronAdapter
from conformance.adapters.nemo_automodel import NemoAutomodelAdapter
from conformance.adapters.torchtitan import TorchtitanAdapter

_LOADED = "_seeded_loaded"


@contextlib.contextmanager
def rows_swapped(weights: list[Any]) -> Iterator[None]:
    """Rows 0 and 1 (experts 0 and 1) of each router weight swapped for the block, swapped back
    after it."""
    import torch

    def swap() -> None:
        with torch.no_grad():
            for w in weights:
                w[[0, 1]] = w[[1, 0]]

    swap()
    try:
        yield
    finally:
        swap()


class _SwappedRouterAfterLoad:
    def routers(self, model: Any) -> list[Any]:
        raise NotImplementedError

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        super().load(model, optimizer, path)  # type: ignore[misc]
        object.__setattr__(model, _LOADED, True)

    def forward(self, model: Any, batch: Any) -> Any:
        if not getattr(model, _LOADED, False):
            return super().forward(model, batch)  # type: ignore[misc]
        with rows_swapped(self.routers(model)):
            return super().forward(model, batch)  # type: ignore[misc]


class TorchtitanSwappedRouter(_SwappedRouterAfterLoad, TorchtitanAdapter):
    def routers(self, model: Any) -> list[Any]:
        return [block.moe.router.gate.weight for block in model.layers.values()]


class NemoSwappedRouter(_SwappedRouterAfterLoad, NemoAutomodelAdapter):
    def routers(self, model: Any) -> list[Any]:
        return [block.mlp.gate.weight for block in model.model.layers.values()]


class MegatronSwappedRouter(_SwappedRouterAfterLoad, MegatronAdapter):
    def routers(self, model: Any) -> list[Any]:
        return [moe.router.weight for moe in model.moe_layers()]

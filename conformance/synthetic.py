"""Deterministic tensors for the conformance suite: the same values at every EP degree.

A checkpoint cell compares a load at ``ep=M`` with a save at ``ep=N`` bit for bit and without
communication, so every value an adapter puts into its model must be a pure function of global
identities -- the seed, the optimizer step, the MoE layer, the *global* expert id and the tensor's
name -- never of the rank that happens to hold it.  Each expert gets different values, so a rank
holding the wrong expert is caught and named.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

__all__ = ["synthetic_batch", "synthetic_grad", "synthetic_grad_rows", "synthetic_tensor", "synthetic_weight"]


def _seed(*parts: object) -> int:
    digest = hashlib.sha256("\x1f".join(map(repr, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


#: the draws already made in this process, per (shape, scale, seed): a session builds the same (seed, step, layer,
#: expert) many times -- every cell's save side, the truth, both kinds -- and at 256 experts a cell asked for
#: thousands (a hash and a seeded generator each).  Callers get a copy, so none can change an entry.
_DRAWN: dict[tuple[Any, ...], Any] = {}
#: 256 MiB of float32 per process, then it starts again: a whole tier at 256 experts draws ~19M elements of
#: gradients per seed and kind (at 64 MiB it started again within a tier and drew everything twice).
_DRAWN_MAX_ELEMENTS = 64 << 20
_drawn_elements = [0]


def _kept(cached: tuple[Any, ...], numel: int, make: Any) -> Any:
    """The kept tensor under ``cached``, made by ``make()`` the first time (one larger than the budget not kept)."""
    found = _DRAWN.get(cached)
    if found is None:
        found = make()
        if numel <= _DRAWN_MAX_ELEMENTS:
            if _drawn_elements[0] + numel > _DRAWN_MAX_ELEMENTS:
                _DRAWN.clear()
                _drawn_elements[0] = 0
            _drawn_elements[0] += numel
            _DRAWN[cached] = found
    return found


def _generate(shape: tuple[int, ...], scale: float, seed: int) -> Any:
    import torch

    drawn = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    return drawn if scale == 1.0 else drawn * scale  # times 1.0 is exact: skipped


def _draw(shape: tuple[int, ...], scale: float, seed: int) -> Any:
    # keyed by the seed itself: what decides the draw (1 and True differ there)
    return _kept((shape, scale, seed), math.prod(shape), lambda: _generate(shape, scale, seed))


def synthetic_tensor(shape: Sequence[int], *key: object, scale: float = 1.0, dtype: Any = None) -> Any:
    """A standard-normal tensor of ``shape`` (times ``scale``) determined by ``key`` alone (a new tensor each call)."""
    found = _draw(tuple(shape), scale, _seed(*key))
    return found.clone() if dtype is None else found.to(dtype, copy=True)


def synthetic_grad(seed: int, step: int, layer: int | None, global_expert_id: int | None, name: str,
                   shape: Sequence[int], dtype: Any = None) -> Any:
    """The gradient of ``name`` (an expert's weight when ``global_expert_id`` is set) at ``step``.

    Expert parameters use ``(seed, step, layer, global_expert_id, name)``; everything else passes
    ``global_expert_id=None`` (and ``layer=None`` outside MoE layers).  Deterministic, different for
    every expert, and identical at every EP degree.
    """
    return synthetic_tensor(shape, "grad", seed, step, layer, global_expert_id, name, dtype=dtype)


def synthetic_grad_rows(seed: int, step: int, layer: int | None, experts: range, name: str, shape: Sequence[int],
                        dtype: Any = None) -> Any:
    """:func:`synthetic_grad` of each expert in ``experts`` stacked (row ``i``: expert ``experts[i]``'s), for a
    packed weight's rows: one kept block instead of a draw and a copy per expert (a new tensor each call)."""
    import torch

    shape = tuple(shape)

    def make() -> Any:  # each row drawn as synthetic_grad draws it, but kept only in the block (not twice)
        rows = [_generate(shape, 1.0, _seed("grad", seed, step, layer, g, name)) for g in experts]
        return torch.stack(rows) if rows else torch.empty((0, *shape))

    found = _kept(("rows", shape, seed, step, layer, experts.start, experts.stop, name),
                  len(experts) * math.prod(shape), make)
    return found.clone() if dtype is None else found.to(dtype, copy=True)


def synthetic_weight(seed: int, layer: int | None, global_expert_id: int | None, name: str,
                     shape: Sequence[int], dtype: Any = None, scale: float = 0.02) -> Any:
    """Initial weights keyed like :func:`synthetic_grad`, for adapters whose framework init is not."""
    return synthetic_tensor(shape, "weight", seed, layer, global_expert_id, name, scale=scale, dtype=dtype)


def synthetic_batch(dim: int, seed: int, tokens: int = 16, dtype: Any = None) -> Any:
    """A ``[tokens, dim]`` batch of hidden states for a forward check; the same on every rank."""
    return synthetic_tensor((tokens, dim), "batch", seed, dtype=dtype)

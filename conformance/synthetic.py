"""Deterministic tensors for the conformance suite: the same values at every EP degree.

A checkpoint cell compares a load at ``ep=M`` with a save at ``ep=N`` bit for bit and without
communication, so every value an adapter puts into its model must be a pure function of global
identities -- the seed, the optimizer step, the MoE layer, the *global* expert id and the tensor's
name -- never of the rank that happens to hold it.  Each expert gets different values, so a rank
holding the wrong expert is caught and named.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from conformance.world_state import world_state

__all__ = ["synthetic_batch", "synthetic_grad", "synthetic_grad_rows", "synthetic_tensor",
           "synthetic_weight"]


def _seed(*parts: object) -> int:
    return _seed_of(hashlib.sha256("\x1f".join(map(repr, parts)).encode()))


def _seed_of(hashed: Any) -> int:
    return int.from_bytes(hashed.digest()[:8], "little") & ((1 << 63) - 1)


def _row_seeds(head: tuple[Any, ...], last: object,
               experts: Iterable[int]) -> Iterator[tuple[int, int]]:
    """``(g, _seed(*head, g, last))`` for each expert ``g``, the common prefix hashed once (a
    256-expert tier asks for thousands of rows a process)."""
    prefix = hashlib.sha256("".join(f"{part!r}\x1f" for part in head).encode())
    tail = f"\x1f{last!r}"
    for g in experts:
        hashed = prefix.copy()
        hashed.update(f"{g!r}{tail}".encode())
        yield g, _seed_of(hashed)


#: the draws already made in this process, per (shape, scale, seed) (the world state's): a session
#: builds the same (seed, step, layer, expert) many times -- every cell's save side, the truth, both
#: kinds -- and at 256 experts a cell asked for thousands (a hash and a seeded generator each).
#: Callers get a copy, so none can change an entry.
_DRAWN = world_state().store("synthetic draws")


def _kept(cached: tuple[Any, ...], make: Any) -> Any:
    """The kept tensor under ``cached``, made by ``make()`` the first time."""
    return _DRAWN.keep(cached, make)


def _generate(shape: tuple[int, ...], scale: float, seed: int) -> Any:
    import torch

    drawn = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    return drawn if scale == 1.0 else drawn * scale  # times 1.0 is exact: skipped


def _draw(shape: tuple[int, ...], scale: float, seed: int) -> Any:
    # keyed by the seed itself: what decides the draw (1 and True differ there)
    return _kept((shape, scale, seed), lambda: _generate(shape, scale, seed))


def synthetic_tensor(shape: Sequence[int], *key: object, scale: float = 1.0,
                     dtype: Any = None) -> Any:
    """A standard-normal tensor of ``shape`` (times ``scale``) determined by ``key`` alone (a new
    tensor each call)."""
    found = _draw(tuple(shape), scale, _seed(*key))
    return found.clone() if dtype is None else found.to(dtype, copy=True)


def synthetic_grad(seed: int, step: int, layer: int | None, global_expert_id: int | None, name: str,
                   shape: Sequence[int], dtype: Any = None) -> Any:
    """The gradient of ``name`` (an expert's weight when ``global_expert_id`` is set) at ``step``.

    Expert parameters use ``(seed, step, layer, global_expert_id, name)``; everything else passes
    ``global_expert_id=None`` (and ``layer=None`` outside MoE layers).  Deterministic, different for
    every expert, and identical at every EP degree.
    """
    if not isinstance(global_expert_id, int) or isinstance(global_expert_id,
                                                           bool) or global_expert_id < 0:
        return synthetic_tensor(shape, "grad", seed, step, layer, global_expert_id, name,
                                dtype=dtype)
    g = global_expert_id
    return synthetic_grad_rows(seed, step, layer, range(g, g + 1), name, shape, dtype)[0]


def synthetic_grad_rows(seed: int, step: int, layer: int | None, experts: range, name: str,
                        shape: Sequence[int], dtype: Any = None) -> Any:
    """:func:`synthetic_grad` of each expert in ``experts`` stacked (row ``i``: expert
    ``experts[i]``'s), for a packed weight's rows (a new tensor each call)."""
    import torch

    shape = tuple(shape)
    if experts.step != 1 or experts.start < 0:
        rows = [synthetic_grad(seed, step, layer, g, name, shape) for g in experts]
        found = torch.stack(rows) if rows else torch.empty((0, *shape))
    else:
        found = _expert_rows(shape, ("grad", seed, step, layer, name), experts)
    return found.clone() if dtype is None else found.to(dtype, copy=True)


#: the expert rows drawn so far, per (shape, family) (the world state's): row ``g`` is expert
#: ``g``'s draw (seeded by the family's key with ``g`` before its last part), ``drawn[g]`` whether
#: it has been. One array a family: a rank asks for the same experts under many ranges (the truth's
#: all, ep=2's halves, ep=4's quarters, a kind's single experts), and each row is drawn once
#: whatever the ranges.
_ROWS = world_state().store("synthetic expert rows")


def _expert_rows(shape: tuple[int, ...], family: tuple[Any, ...], experts: range) -> Any:
    """Rows ``experts`` (step 1) of ``family``'s expert draws, as a view of the kept array (never
    handed out)."""
    import torch

    key = (shape, family)
    data, drawn = _ROWS.get(key) or (None, bytearray())
    if data is None or data.shape[0] < experts.stop:
        size = max(experts.stop, 0 if data is None else int(data.shape[0]))
        grown = torch.empty((size, *shape), dtype=torch.float32)
        if data is not None:
            grown[:data.shape[0]] = data
        data, drawn = grown, drawn + bytearray(size - len(drawn))
        _ROWS.put(key, (data, drawn), grown.element_size() * grown.numel())
    first = drawn.find(0, experts.start, experts.stop)  # -1: every row asked for was drawn before
    if first >= 0:
        *head, last = family
        # manual_seed resets all of its state: one generator serves every row
        generator = torch.Generator()
        for g, seed in _row_seeds(tuple(head), last,
                                  (g for g in range(first, experts.stop) if not drawn[g])):
            # as synthetic_tensor draws (seed, .., g, last)
            data[g].normal_(generator=generator.manual_seed(seed))
            drawn[g] = 1
    return data[experts.start:experts.stop]


def synthetic_weight(seed: int, layer: int | None, global_expert_id: int | None, name: str,
                     shape: Sequence[int], dtype: Any = None, scale: float = 0.02) -> Any:
    """Initial weights keyed like :func:`synthetic_grad`, for adapters whose framework init is
    not."""
    return synthetic_tensor(shape, "weight", seed, layer, global_expert_id, name, scale=scale,
                            dtype=dtype)


def synthetic_load(seed: int, step: int, layer: int | None, num_experts: int) -> Any:
    """The tokens each expert of ``layer``'s router was chosen for at ``step``: a float32 ``[E]`` of
    whole numbers in ``[0, 64)``, a pure function of ``(seed, step, layer, expert)``, the same at
    every EP degree.

    An expert-bias router (auxiliary-loss-free balancing) steps its bias on these counts as a
    training step steps weights on :func:`synthetic_grad`: an adapter writes them into the
    framework's own counter before its optimizer step (or before calling its update), so the
    framework's own update rule runs.  Some experts are over the mean and some under, so every step
    moves the bias."""
    import torch

    draws = [synthetic_tensor((), "load", seed, step, layer, g) for g in range(num_experts)]
    return torch.stack(draws).abs().mul(24).floor().clamp(max=63) if draws else torch.zeros(0)


def synthetic_batch(dim: int, seed: int, tokens: int = 16, dtype: Any = None) -> Any:
    """A ``[tokens, dim]`` batch of hidden states for a forward check; the same on every rank."""
    return synthetic_tensor((tokens, dim), "batch", seed, dtype=dtype)

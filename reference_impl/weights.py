"""The reference model's synthetic values: every weight and buffer a pure function of its global
identity.

A value depends only on ``(seed, name in the model, expert, weight)``, never on the expert-parallel
degree, the layer form or the rank, so a model built at any layout holds the same global expert
``g`` and a test compares a load at ``ep=4`` with a save at ``ep=2`` bit for bit with no
communication.  :mod:`reference_impl.model` fills its parameters with :func:`fill` and
:func:`fill_rows`; the routers' expert bias is :func:`expert_bias_values`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from reference_impl.memo import Memo

__all__ = ["expert_bias_values", "fill", "fill_rows", "normal", "stable_seed"]


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` that is the same in every process (unlike ``hash()``)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def normal(shape: tuple[int, ...], std: float, dtype: torch.dtype, *key: object) -> torch.Tensor:
    """``N(0, std)`` of ``shape`` drawn from a generator seeded with ``key`` alone."""
    generator = torch.Generator().manual_seed(stable_seed(*key))
    return (torch.randn(shape, generator=generator) * std).to(dtype)


#: :func:`fill`'s draws, per (shape, std, key): a session builds the same model (seed, layer,
#: expert) for many cells and every form, and at 64-256 experts drawing each expert's weights again
#: was most of a build.  Entries are never handed out (:func:`fill` copies from them), so no caller
#: can change one.
#: 64 MiB of float32 per process, then it starts again.
_DRAWN = Memo("weight draws", 16 << 20, size=lambda t: t.numel())


def _drawn(shape: tuple[int, ...], std: float, key: tuple[object, ...],
           draw: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The kept draw of ``(shape, std, key)``, made by ``draw()`` the first time (never handed out
    to change)."""
    found = _DRAWN.get((shape, std, key))
    return _DRAWN.put((shape, std, key), draw()) if found is None else found


def fill(param: torch.Tensor, std: float, *key: object, mean: float = 0.0) -> None:
    """Write ``mean + N(0, std)`` drawn from ``key`` into ``param``; a meta tensor has no data to
    fill."""
    if param.is_meta:
        return
    shape = tuple(param.shape)
    found = _drawn(shape, std, key, lambda: normal(shape, std, torch.float32, *key))
    with torch.no_grad():
        param.copy_(mean + found)


def fill_rows(packed: torch.Tensor, std: float, first: int, *key: object) -> None:
    """Write row ``i`` of ``packed`` as :func:`fill` writes expert ``first + i``'s weight (``key``
    with the expert id before its last part), through one kept block: at 256 experts a row at a time
    was most of a packed build. ``packed`` may be a view (a fused weight's gate or up half): the
    block is copied into it."""
    if packed.is_meta or not packed.shape[0]:
        return
    shape, row = tuple(packed.shape), tuple(packed.shape[1:])

    def stack() -> torch.Tensor:  # each row drawn in place as normal() draws it, or fill's kept
        block = torch.empty(shape, dtype=torch.float32)
        generator = torch.Generator()  # manual_seed resets all its state: one serves every row
        kept: dict[int, torch.Tensor] = {}
        for i in range(shape[0]):
            ids = (*key[:-1], first + i, key[-1])
            found = _DRAWN.get((row, std, ids))
            if found is not None:
                kept[i] = found
            else:
                block[i].normal_(generator=generator.manual_seed(stable_seed(*ids)))
        block.mul_(std)  # as normal() scales its draw
        for i, found in kept.items():
            block[i] = found
        return block

    found = _drawn(shape, std, ("rows", first, *key), stack)
    with torch.no_grad():
        packed.copy_(found)


def expert_bias_values(scale: float, num_experts: int, *key: object) -> torch.Tensor:
    """The initial expert bias of a router: fp32 ``[num_experts]``, entry ``g`` a function of
    ``(*key, g)`` alone.

    Each entry is ``scale * (2u - 1)`` for ``u = (s + 1/2) / 2**63`` of
    ``s = stable_seed(*key, g)``: uniform in ``(-scale, scale)`` and never 0 (``2s + 1`` is odd,
    ``2**63`` even), so a checkpoint of a model that never trained holds a bias that a load must
    restore, and one expert's entry is the same whatever the number of experts or the rank that
    builds it.
    """
    values = [scale * ((2 * stable_seed(*key, g) + 1) / float(1 << 63) - 1.0)
              for g in range(num_experts)]
    return torch.tensor(values, dtype=torch.float32)

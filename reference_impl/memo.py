"""The reference's memos: results of pure functions kept per process, each bounded, cleared
together.

A session builds the same model (seed, layer, expert) for many cells, and walks the same DTensor
placements many times a cell, so the reference keeps its weight draws and its placement walks.  Each
:class:`Memo` has a bound of its own (how much it keeps before it starts again); :func:`clear` drops
them all -- a harness that keeps state across calls (the conformance matrix's world state) calls it
when a new session begins, so its lifetime is the session's.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

#: every memo, for :func:`clear`: one per module that keeps one, made when it is imported.
_MEMOS: list[Memo] = []


class Memo:
    """A bounded mapping: past ``limit`` units (entries, or what ``size`` counts), it starts
    again."""

    def __init__(self, name: str, limit: int, size: Callable[[Any], int] = lambda _: 1) -> None:
        self.name, self.limit, self._size = name, limit, size
        self._kept: dict[Hashable, Any] = {}
        self.held = 0
        _MEMOS.append(self)

    def get(self, key: Hashable) -> Any:
        return self._kept.get(key)

    def put(self, key: Hashable, value: Any) -> Any:
        """Keep ``value`` (one larger than the whole bound is returned, not kept)."""
        size = self._size(value)
        if size > self.limit:
            return value
        if self.held + size > self.limit:
            self.clear()
        self._kept[key] = value
        self.held += size
        return value

    def clear(self) -> None:
        self._kept.clear()
        self.held = 0


def clear() -> None:
    """Drop what every memo of the reference keeps."""
    for memo in _MEMOS:
        memo.clear()


__all__ = ["Memo", "clear"]

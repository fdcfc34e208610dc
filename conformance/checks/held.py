"""What a rank holds, as the checks read it: a tensor per ``(layer, expert, name)``, kept a packed block at a time.

The checks name every difference by expert, so they read a rank's state as one entry per expert row.  A packed
weight's rows are one tensor, though, and at 256 experts making, comparing and sending 7,000 row views a cell was
most of the harness's time.  :class:`Held` (tensors with their regions) and :class:`State` (whole tensors: the
ground truth, what a checkpoint holds) keep each block whole and answer per row as a mapping -- a row is a view
made when asked -- and :func:`settle` compares a block with its reference at once, leaving the per-row checks only
the rows that differ.  A mapping that is not one of these (a test's dict) is read row by row, as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from conformance.checks.verdict import Key

Region = tuple[slice, ...] | None
#: a region as it crosses the ranks: ``(start, stop)`` per axis, or None for a whole tensor.
Box = tuple[tuple[int, int], ...] | None


def box_of(region: Region) -> Box:
    """``region`` as plain ``(start, stop)`` pairs (what crosses the ranks)."""
    return None if region is None else tuple((s.start, s.stop) for s in region)


@dataclass(frozen=True)
class Rows:
    """Consecutive expert rows of one packed tensor: row ``i`` of ``data`` is expert ``first + i``, each row at
    ``region`` of that expert's whole tensor (``None``: whole)."""

    layer: Any
    first: int
    name: str
    data: Any
    region: Region

    @property
    def stop(self) -> int:
        return self.first + int(self.data.shape[0])

    def keys(self) -> list[Key]:
        return [(self.layer, e, self.name) for e in range(self.first, self.stop)]


class _Store(Mapping[Key, Any]):
    """Single tensors and :class:`Rows` blocks under one row-keyed index; a key given twice keeps the later."""

    def __init__(self) -> None:
        self._single: dict[Key, tuple[Any, Region]] = {}
        self._blocks: list[Rows | None] = []
        self._row: dict[Key, tuple[int, int]] = {}

    def _value(self, tensor: Any, region: Region) -> Any:
        raise NotImplementedError

    def put(self, key: Key, tensor: Any, region: Region = None) -> bool:
        """Hold ``tensor`` under ``key``; False when ``key`` was held already (the new one replaces it)."""
        new = key not in self
        if key in self._row:
            self._explode(self._row[key][0])
        self._single[key] = (tensor, region)
        return new

    def put_rows(self, rows: Rows) -> list[Key]:
        """Hold a block; the keys held already (each replaced by its row)."""
        keys = rows.keys()
        again = sorted(self._row.keys() & keys | self._single.keys() & keys, key=keys.index) if self else []
        if again:  # an adapter that yields a row twice: rows one by one, the later winning, as a dict would
            for i, key in enumerate(keys):
                self.put(key, rows.data[i], rows.region)
            return again
        index = len(self._blocks)
        self._blocks.append(rows)
        self._row.update((key, (index, i)) for i, key in enumerate(keys))
        return []

    def _explode(self, index: int) -> None:
        """Block ``index`` as single rows (one of its keys is being replaced)."""
        block = self._blocks[index]
        assert block is not None
        self._blocks[index] = None
        for i, key in enumerate(block.keys()):
            if self._row.get(key, (None,))[0] == index:
                del self._row[key]
                self._single[key] = (block.data[i], block.region)

    def blocks(self) -> list[Rows]:
        return [b for b in self._blocks if b is not None]

    def singles(self) -> dict[Key, tuple[Any, Region]]:
        return self._single

    def block_of(self, key: Key) -> Rows | None:
        """The block of whole rows (region ``None``) that holds ``key``, if one does."""
        at = self._row.get(key)
        block = None if at is None else self._blocks[at[0]]
        return block if block is not None and block.region is None else None

    def whole_rows(self, layer: Any, name: str, first: int, stop: int) -> Any:
        """Experts ``first..stop-1`` of ``(layer, name)`` as one tensor (a view), when one whole block holds them
        all; else ``None``."""
        block = self.block_of((layer, first, name))
        if block is None or stop > block.stop:
            return None
        return block.data[first - block.first:stop - block.first]

    def nbytes(self) -> int:
        found = [t for t, _ in self._single.values()] + [b.data for b in self.blocks()]
        return sum(t.numel() * t.element_size() for t in found)

    # -- the mapping: a row per key ---------------------------------------------------------------
    def __getitem__(self, key: Key) -> Any:
        found = self._single.get(key)
        if found is not None:
            return self._value(*found)
        index, i = self._row[key]
        block = self._blocks[index]
        assert block is not None
        return self._value(block.data[i], block.region)

    def __contains__(self, key: object) -> bool:
        return key in self._single or key in self._row

    def __iter__(self) -> Iterator[Key]:
        yield from self._single
        yield from self._row

    def __len__(self) -> int:
        return len(self._single) + len(self._row)


class Held(_Store):
    """``(layer, expert, name) -> (local tensor, region)``: what a rank's adapter yields (:func:`canonical`)."""

    def _value(self, tensor: Any, region: Region) -> Any:
        return tensor, region

    def tensors(self) -> State:
        """The same tensors without their regions (sharing the storage): the ground truth's form."""
        state = State()
        state._single, state._blocks, state._row = self._single, self._blocks, self._row
        return state


class State(_Store):
    """``(layer, expert, name) -> whole tensor``: the ground truth, or what a checkpoint holds."""

    def _value(self, tensor: Any, region: Region) -> Any:
        return tensor

    def __setitem__(self, key: Key, tensor: Any) -> None:
        self.put(key, tensor)


def _cut_rows(rows: Any, region: Region) -> Any:
    """A block's rows cut to each row's ``region`` (``None`` when it does not fit them)."""
    if region is None:
        return rows
    if len(region) != rows.dim() - 1 or any(r.stop > n for r, n in zip(region, rows.shape[1:], strict=True)):
        return None
    index = (slice(None), *region)
    return rows[index]


def settle(held: Mapping[Key, Any], reference: Mapping[Key, Any]) -> tuple[list[Key], list[Key], list[Key]]:
    """``(keys equal to the reference bit for bit, keys that differ from it, keys left to check one by one)``, a
    block at a time.

    ``held`` is a :class:`Held` (or a :class:`State`: regions ``None``), ``reference`` whole tensors.  A block's
    rows are compared when ``reference`` keeps their experts in a whole block of the same shape and dtype (as
    :func:`conformance.checks.values.equal` compares); every other key -- single tensors, rows the reference does not
    keep as a block -- is left for the per-key checks.  Anything but these classes: all left.
    """
    import torch

    if not isinstance(held, _Store) or not isinstance(reference, _Store):
        return [], [], list(held)
    same: list[Key] = []
    differ: list[Key] = []
    rest: list[Key] = list(held.singles())
    for block in held.blocks():
        want = reference.whole_rows(block.layer, block.name, block.first, block.stop)
        want = None if want is None else _cut_rows(want, block.region)
        keys = block.keys()
        if want is None or want.shape != block.data.shape or want.dtype != block.data.dtype:
            rest += keys
            continue
        if torch.equal(block.data, want):
            same += keys
            continue
        equal = (block.data == want).reshape(len(keys), -1).all(dim=1).tolist()
        for key, ok in zip(keys, equal, strict=True):
            (same if ok else differ).append(key)
    return same, differ, rest

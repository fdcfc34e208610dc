"""What a rank holds, as the checks read it: a tensor per ``(layer, expert, name)``, kept a packed
block at a time.

The checks name every difference by expert, so they read a rank's state as one entry per expert row.
A packed weight's rows are one tensor, though, and at 256 experts making, comparing and sending
7,000 row views a cell was most of the harness's time.  :class:`Held` (tensors with their regions)
and :class:`State` (whole tensors: the ground truth, what a checkpoint holds) keep each block whole
and answer per row as a mapping -- a row is a view made when asked -- and :func:`settle` compares a
block with its reference at once, leaving the per-row checks only the rows that differ.  A mapping
that is not one of these (a test's dict) is read row by row.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, overload

from conformance.adapter import ExpertBlock
from conformance.checks.verdict import Key

Region = tuple[slice, ...] | None
#: a region as it crosses the ranks: ``(start, stop)`` per axis, or None for a whole tensor.
Box = tuple[tuple[int, int], ...] | None


def box_of(region: Region) -> Box:
    """``region`` as plain ``(start, stop)`` pairs (what crosses the ranks)."""
    return None if region is None else tuple((s.start, s.stop) for s in region)


@dataclass(frozen=True)
class Rows:
    """Consecutive expert rows of one packed tensor: row ``i`` of ``data`` is expert ``first + i``,
    each row at ``region`` of that expert's whole tensor (``None``: whole)."""

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
    """Single tensors and :class:`Rows` blocks, read as one row-keyed mapping; a key given twice
    keeps the later.

    Blocks are found per ``(layer, name)`` (a family holds a block or a few), not through an index
    of every row: at 256 experts such an index was 7,000 entries made per state, and a cell makes
    several states."""

    def __init__(self) -> None:
        self._single: dict[Key, tuple[Any, Region]] = {}
        self._blocks: list[Rows | None] = []
        # (layer, name) -> its live blocks' indices
        self._family: dict[tuple[Any, str], list[int]] = {}
        self._rows = 0  # rows in live blocks

    def _value(self, tensor: Any, region: Region) -> Any:
        raise NotImplementedError

    def _find(self, key: Key) -> tuple[int, int] | None:
        """``(block index, row)`` of the live block holding ``key``, if one does."""
        layer, expert, name = key
        for index in self._family.get((layer, name), ()):
            block = self._blocks[index]
            if block is not None and isinstance(expert, int) and block.first <= expert < block.stop:
                return index, expert - block.first
        return None

    def put(self, key: Key, tensor: Any, region: Region = None) -> bool:
        """Hold ``tensor`` under ``key``; False when ``key`` was held already (the new one replaces
        it)."""
        new = key not in self
        at = self._find(key)
        if at is not None:
            self._explode(at[0])
        self._single[key] = (tensor, region)
        return new

    def put_rows(self, rows: Rows) -> list[Key]:
        """Hold a block; the keys held already (each replaced by its row)."""
        family = self._family.setdefault((rows.layer, rows.name), [])
        overlaps = any(b is not None and b.first < rows.stop and rows.first < b.stop
                       for b in (self._blocks[i] for i in family))
        if overlaps or self._single:
            keys = rows.keys()
            again = [k for k in keys
                     if k in self] if overlaps else [k for k in keys if k in self._single]
            # an adapter that yields a row twice: rows one by one, the later winning, as a dict
            # would
            if again:
                for i, key in enumerate(keys):
                    self.put(key, rows.data[i], rows.region)
                return again
        family.append(len(self._blocks))
        self._blocks.append(rows)
        self._rows += rows.stop - rows.first
        return []

    def _explode(self, index: int) -> None:
        """Block ``index`` as single rows (one of its keys is being replaced)."""
        block = self._blocks[index]
        assert block is not None
        self._blocks[index] = None
        self._family[(block.layer, block.name)].remove(index)
        self._rows -= block.stop - block.first
        for i, key in enumerate(block.keys()):
            self._single[key] = (block.data[i], block.region)

    def blocks(self) -> list[Rows]:
        return [b for b in self._blocks if b is not None]

    def singles(self) -> dict[Key, tuple[Any, Region]]:
        return self._single

    def block_of(self, key: Key) -> Rows | None:
        """The block of whole rows (region ``None``) that holds ``key``, if one does."""
        at = self._find(key)
        block = None if at is None else self._blocks[at[0]]
        return block if block is not None and block.region is None else None

    def whole_rows(self, layer: Any, name: str, first: int, stop: int) -> Any:
        """Experts ``first..stop-1`` of ``(layer, name)`` as one tensor (a view), when one whole
        block holds them all; else ``None``."""
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
        at = self._find(key)
        if at is None:
            raise KeyError(key)
        block = self._blocks[at[0]]
        assert block is not None
        return self._value(block.data[at[1]], block.region)

    def __contains__(self, key: object) -> bool:
        return key in self._single or (isinstance(key, tuple) and len(key) == 3
                                       and self._find(key) is not None)

    def __iter__(self) -> Iterator[Key]:
        yield from self._single
        for block in self.blocks():
            yield from block.keys()

    def __len__(self) -> int:
        return len(self._single) + self._rows


class Held(_Store):
    """``(layer, expert, name) -> (local tensor, region)``: what a rank's adapter yields
    (:func:`canonical`)."""

    def _value(self, tensor: Any, region: Region) -> Any:
        return tensor, region

    def tensors(self) -> State:
        """The same tensors without their regions (sharing the storage): the ground truth's form."""
        state = State()
        state._single, state._blocks, state._family, state._rows = (self._single, self._blocks,
                                                                    self._family, self._rows)
        return state


class State(_Store):
    """``(layer, expert, name) -> whole tensor``: the ground truth, or what a checkpoint holds."""

    #: the ground truth's: the parameters of each torch optimizer of the build, by position
    #: (:class:`conformance.inspection.positional.ParamAt`), which place the optimizer state a
    #: checkpoint keys by position (:func:`conformance.checks.truth.optimizer_positions`).
    positions: tuple[tuple[Any, ...], ...] = ()

    def _value(self, tensor: Any, region: Region) -> Any:
        return tensor

    def __setitem__(self, key: Key, tensor: Any) -> None:
        self.put(key, tensor)


def _cut_rows(rows: Any, region: Region) -> Any:
    """A block's rows cut to each row's ``region`` (``None`` when it does not fit them)."""
    if region is None:
        return rows
    if len(region) != rows.dim() - 1 or any(r.stop > n
                                            for r, n in zip(region, rows.shape[1:], strict=True)):
        return None
    index = (slice(None), *region)
    return rows[index]


class Keys(Sequence[Key]):
    """The keys of runs of blocks' rows, made into keys only when read (most of what :func:`settle`
    returns is only counted, or left unread)."""

    def __init__(self) -> None:
        self._spans: list[tuple[Rows, int, int]] = []  # (block, first row, stop row)

    def rows(self, block: Rows, start: int = 0, stop: int | None = None) -> None:
        self._spans.append((block, start, block.stop - block.first if stop is None else stop))

    def __len__(self) -> int:
        return sum(stop - start for _, start, stop in self._spans)

    def __iter__(self) -> Iterator[Key]:
        for block, start, stop in self._spans:
            yield from ((block.layer, e, block.name)
                        for e in range(block.first + start, block.first + stop))

    @overload
    def __getitem__(self, index: int) -> Key: ...
    @overload
    def __getitem__(self, index: slice) -> list[Key]: ...
    def __getitem__(self, index: int | slice) -> Key | list[Key]:
        return list(self)[index]


def settle(held: Mapping[Key, Any], reference: Mapping[Key, Any]) -> tuple[Keys, Keys, list[Key]]:
    """``(keys equal to the reference bit for bit, keys that differ from it, keys left to check one
    by one)``, a block at a time.

    ``held`` is a :class:`Held` (or a :class:`State`: regions ``None``), ``reference`` whole
    tensors.  A block's rows are compared when ``reference`` keeps their experts in a whole block of
    the same shape and dtype (as :func:`conformance.checks.values.equal` compares); every other key
    -- single tensors, rows the reference does not keep as a block -- is left for the per-key
    checks.  Anything but these classes: all left.
    """
    import torch

    same, differ = Keys(), Keys()
    if not isinstance(held, _Store) or not isinstance(reference, _Store):
        return same, differ, list(held)
    rest: list[Key] = list(held.singles())
    for block in held.blocks():
        want = reference.whole_rows(block.layer, block.name, block.first, block.stop)
        want = None if want is None else _cut_rows(want, block.region)
        if want is None or want.shape != block.data.shape or want.dtype != block.data.dtype:
            rest += block.keys()
            continue
        if torch.equal(block.data, want):
            same.rows(block)
            continue
        equal = _equal_rows(block.data, want)
        bounds = [0, *(equal[1:] != equal[:-1]).nonzero().flatten().add(1).tolist(), len(equal)]
        for start, stop in itertools.pairwise(bounds):  # runs of equal rows and of differing ones
            (same if equal[start] else differ).rows(block, start, stop)
    return same, differ, rest


def _equal_rows(data: Any, want: Any) -> Any:
    """Whether each row of ``data`` equals that of ``want`` (same shape, at least one row), as a
    bool tensor, reading whole rows only where their first elements agree: a block that differs (a
    load side's own build, before the load) differs in nearly every row, and is told so from one
    element a row."""
    import torch

    if not data[0].numel():
        return torch.ones(data.shape[0], dtype=torch.bool)
    first = (slice(None), *([0] * (data.dim() - 1)))
    equal = data[first] == want[first]
    maybe = equal.nonzero().flatten()
    if len(maybe):
        equal[maybe] = (data[maybe] == want[maybe]).reshape(len(maybe), -1).all(dim=1)
    return equal


class HeldTensor(NamedTuple):
    """One tensor of this rank as the checks read it: its key, its local data and its region
    (``None``: whole)."""

    layer: int | None
    expert: int | None
    name: str
    local: Any
    region: tuple[slice, ...] | None


class HeldBlock(NamedTuple):
    """An :class:`ExpertBlock` as the checks read it: row ``i`` of ``local`` is expert
    ``first + i``, each row at ``region`` of its expert's whole tensor (``None``: whole)."""

    layer: int | None
    first: int
    name: str
    local: Any
    region: tuple[slice, ...] | None


def held_blocks(entries: Iterable[Any], copy: bool = False) -> Iterator[HeldTensor | HeldBlock]:
    """``expert_tensors`` / ``other_tensors`` entries as :class:`HeldTensor`, an
    :class:`ExpertBlock` as one :class:`HeldBlock`: the one place the harness turns what an adapter
    yields into tensors (the layout check reads only a block's ids, from the same
    :func:`~reference_impl.regions.block_region`).  ``copy``: each local tensor a detached CPU copy
    (a block copied once)."""
    from reference_impl.regions import block_region
    from reference_impl.regions import local_region as reference_local_region

    for entry in entries:
        if isinstance(entry, ExpertBlock):
            local, first, region = block_region(entry.tensor, entry.first,
                                                where=f"{entry.name!r} of layer {entry.layer}")
            yield HeldBlock(entry.layer, first, entry.name,
                            local.detach().cpu().clone() if copy else local, region)
            continue
        layer, expert, name, tensor = entry
        local, region = reference_local_region(tensor)
        yield HeldTensor(layer, expert, name, local.detach().cpu().clone() if copy else local,
                         region)


def held_tensors(entries: Iterable[Any], copy: bool = False) -> Iterator[HeldTensor]:
    """:func:`held_blocks` a row each: a block's rows are views of its one (copied) local tensor."""
    for held in held_blocks(entries, copy):
        if isinstance(held, HeldBlock):
            for i in range(held.local.shape[0]):
                yield HeldTensor(held.layer, held.first + i, held.name, held.local[i], held.region)
        else:
            yield held

"""What outlives a cell in a rank process: one owner, one lifetime, one memory bound.

A world's rank processes serve cell after cell, and some work is worth keeping between them: the
ground truths (an ep=1 build per spec), what each save held (the reference its loads must give
back), what the truth checkpoint taught about expert keys, the digests of a checkpoint's rows, the
synthetic draws.  All of it lives in this process's :class:`WorldState`, in named stores
(:meth:`WorldState.store`), and nowhere else.

*Lifetime.*  A matrix session sends its id with every cell (:class:`conformance.saves.CellPlan`); a
rank that sees a new id drops everything first (:meth:`WorldState.begin`), with the reference's own
memos (:func:`reference_impl.memo.clear`).  Two sessions that share a fork server or a world never
share what they kept.

*Memory bound.*  Every store counts what it keeps in bytes against one budget per process,
:data:`BUDGET_BYTES`; past it, the least recently used entry of any store goes first.

*What lives elsewhere.*  A ``functools.cache`` on a function of the code alone (a contract's member
list, a class a module defines); the size of a dtype (:mod:`conformance.inspection.digests`,
bounded); the reference's own memos (bounded, and cleared here: :mod:`reference_impl` does not
import this package); and the meshes and process groups made once per layout (a world forms few,
and a store could drop one still in use).  Nothing keyed by a checkpoint's or a model's data (a
path, a key, a tensor) is kept outside a store.

*Why a cell run alone gives its tier's verdict.*  Nothing kept decides a verdict: a store holds a
pure function's result (truths, draws, digests, what the truth checkpoint teaches, the same for
every cell of its spec), or what a save of this session held -- and a cell whose save is not kept
(its world started after the save) compares the load with the truth within a kernel's rounding and
says so.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

#: what one rank process keeps across cells, at most (a world of 8 ranks: 8 times this).
BUDGET_BYTES = 1 << 30
#: what an entry whose size is not told counts (a small object: a learned pattern, a verdict).
SMALL = 1 << 10

T = TypeVar("T")


def nbytes(value: Any) -> int:
    """What ``value`` holds, roughly: a tensor's bytes, an object's own ``nbytes()``, else
    :data:`SMALL`."""
    told = getattr(value, "nbytes", None)
    if callable(told):
        return int(told())
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.element_size() * value.numel())
    return SMALL


class Store:
    """One named part of the world state: a mapping whose entries count against the shared
    budget."""

    def __init__(self, owner: WorldState, name: str) -> None:
        self._owner, self.name = owner, name

    def get(self, key: Hashable) -> Any:
        """The entry under ``key`` (``None`` when there is none); it becomes the most recently
        used."""
        return self._owner._get(self.name, key)

    def put(self, key: Hashable, value: T, size: int | None = None) -> T:
        """Keep ``value`` under ``key`` (``size`` bytes; :func:`nbytes` when not told)."""
        self._owner._put(self.name, key, value, nbytes(value) if size is None else size)
        return value

    def keep(self, key: Hashable, make: Callable[[], T]) -> T:
        """The entry under ``key``, made by ``make()`` and kept the first time."""
        found = self.get(key)
        return self.put(key, make()) if found is None else found

    def pop(self, key: Hashable) -> Any:
        return self._owner._pop(self.name, key)

    def __contains__(self, key: Hashable) -> bool:
        return (self.name, key) in self._owner._entries

    def __len__(self) -> int:
        return sum(1 for store, _ in self._owner._entries if store == self.name)


class WorldState:
    """Every store of one rank process, one LRU order across them, one byte budget."""

    def __init__(self, budget: int = BUDGET_BYTES) -> None:
        self.budget, self.session = budget, ""
        self._entries: OrderedDict[tuple[str, Hashable], tuple[Any, int]] = OrderedDict()
        self._stores: dict[str, Store] = {}
        self.held = 0

    def store(self, name: str) -> Store:
        """The store called ``name`` (made on first use)."""
        if name not in self._stores:
            self._stores[name] = Store(self, name)
        return self._stores[name]

    def begin(self, session: str) -> None:
        """Start serving ``session``: what another session kept is dropped."""
        if session != self.session:
            self.clear()
            self.session = session

    def clear(self) -> None:
        from reference_impl.memo import clear as clear_reference_memos

        self._entries.clear()
        self.held = 0
        clear_reference_memos()

    def _get(self, store: str, key: Hashable) -> Any:
        found = self._entries.get((store, key))
        if found is None:
            return None
        self._entries.move_to_end((store, key))
        return found[0]

    def _put(self, store: str, key: Hashable, value: Any, size: int) -> None:
        self._pop(store, key)
        self._entries[(store, key)] = (value, size)
        self.held += size
        while self.held > self.budget and len(self._entries) > 1:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.held -= dropped

    def _pop(self, store: str, key: Hashable) -> Any:
        found = self._entries.pop((store, key), None)
        if found is None:
            return None
        self.held -= found[1]
        return found[0]


_STATE = WorldState()


def world_state() -> WorldState:
    """This process's world state."""
    return _STATE


__all__ = ["BUDGET_BYTES", "Store", "WorldState", "nbytes", "world_state"]

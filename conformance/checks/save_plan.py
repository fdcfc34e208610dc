"""A save DCP refuses, said in expert terms: which ranks offered which rows of which expert's
tensor.

When the ranks' local save plans do not tile each tensor exactly once, DCP's coordinator refuses the
global plan ("Failed to validate global plan") and every rank raises its ``CheckpointException``,
whose text names at best one key and two volumes.  :func:`recorded` keeps, on each rank, the chunks
its planner offered (DCP's :class:`~torch.distributed.checkpoint.DefaultSavePlanner` and any
subclass that calls it); :func:`explain` -- a collective, entered only on that refusal, which every
rank sees -- gathers them and raises :class:`SaveRefused` naming, per (layer, expert, key), the
ranks and rows offered, the rows no rank offered, the rows two ranks offered differently, and ranks
that disagree on the global shape.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from conformance.inspection import classify_keys, expert_ranges

REFUSED = "Failed to validate global plan"
SHOWN = 6
#: tensors larger than this are checked by volume only, not element by element.
MASK_LIMIT = 1 << 26


class SaveRefused(Exception):
    """DCP refused the save's global plan; the message says where, in expert terms."""


@dataclass(frozen=True)
class Offer:
    """One chunk a rank's plan offered: ``key``'s global ``size``, at ``offsets`` with ``sizes``."""

    rank: int
    key: str
    size: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@contextlib.contextmanager
def recorded() -> Iterator[list[Offer]]:
    """Record this rank's planned chunks while the block saves (DCP's default save planner)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    offers: list[Offer] = []
    real = DefaultSavePlanner.create_local_plan
    rank = dist.get_rank() if dist.is_initialized() else 0

    def create_local_plan(self: Any) -> Any:
        plan = real(self)
        for item in getattr(self, "plan", plan).items:
            data = item.tensor_data
            if data is not None:
                offers.append(Offer(rank, item.index.fqn, tuple(data.size),
                                    tuple(data.chunk.offsets), tuple(data.chunk.sizes)))
        return plan

    DefaultSavePlanner.create_local_plan = create_local_plan  # type: ignore[method-assign]
    try:
        yield offers
    finally:
        DefaultSavePlanner.create_local_plan = real  # type: ignore[method-assign]


def refused(exc: BaseException) -> bool:
    """Whether ``exc`` is DCP refusing the global save plan (raised on every rank alike)."""
    return REFUSED in str(exc)


def _span(a: int, b: int) -> str:
    return f"{a}" if b - a == 1 else f"{a}..{b - 1}"


def _rows(offsets: tuple[int, ...], sizes: tuple[int, ...], size: tuple[int, ...]) -> str:
    """A chunk in words: the axes it does not span whole (``axis 0 rows 0..31 of 64``); an empty one
    as such (a rank that holds no expert offers one)."""
    empty = next((axis for axis, n in enumerate(sizes) if n == 0), None)
    if empty is not None:
        return f"nothing (an empty chunk at axis {empty} row {offsets[empty]})"
    parts = [f"axis {axis} rows {_span(o, o + n)} of {full}"
             for axis, (o, n, full) in enumerate(zip(offsets, sizes, size, strict=True))
             if (o, n) != (0, full)]
    return ", ".join(parts) or "the whole tensor"


def _uncovered(size: tuple[int, ...],
               chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[str, list[int]]:
    """The rows no chunk covers, per axis, in words ("" when covered), and the axis-0 rows with a
    gap."""
    import math

    import torch

    total = math.prod(size)
    if not size or total == 0:
        return "", []
    if total > MASK_LIMIT:
        offered = sum(math.prod(n) for _, n in chunks)
        return ("" if offered >= total else f"{total - offered} of {total} elements"), []
    mask = torch.zeros(size, dtype=torch.bool)
    for offsets, sizes in chunks:
        mask[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=False))] = True
    if bool(mask.all()):
        return "", []
    missing = ~mask
    parts: list[str] = []
    first: list[int] = []
    for axis, n in enumerate(size):
        hit = (missing.any(dim=[d for d in range(len(size)) if d != axis]) if len(size) > 1
               else missing)
        idx = hit.nonzero().flatten().tolist()
        first = first or idx
        if len(idx) < n:
            parts.append(f"axis {axis} rows {expert_ranges(idx)} of {n}")
    return ", ".join(parts) or "every element", first


def _overlaps(chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[tuple[int, int]]:
    """Pairs of distinct chunks that intersect (identical chunks are replicas: DCP keeps one)."""
    found = []
    for i, (oa, na) in enumerate(chunks):
        for j in range(i + 1, len(chunks)):
            ob, nb = chunks[j]
            meet = all(a < b + m and b < a + n for a, n, b, m in zip(oa, na, ob, nb, strict=False))
            if (oa, na) != (ob, nb) and meet:
                found.append((i, j))
    return found


def _where(key: str, info: Any, rows: list[int]) -> str:
    """``layer L, expert G, key K`` (per-expert keys), or the experts a packed key's rows are."""
    layer = f"layer {info.layer}, " if info is not None and info.layer is not None else ""
    if info is not None and info.expert is not None:
        return f"{layer}expert {info.expert}, key {key!r}"
    if info is not None and info.kind == "packed" and rows:
        return f"{layer}expert{'s' if len(rows) > 1 else ''} {expert_ranges(rows)}, key {key!r}"
    return f"{layer}key {key!r}"


def diagnose(offers: list[Offer]) -> list[str]:
    """One line per key whose offered chunks DCP cannot accept, in expert terms (the worst
    first)."""
    by_key: dict[str, list[Offer]] = defaultdict(list)
    for offer in offers:
        by_key[offer.key].append(offer)
    infos = classify_keys(by_key)
    lines: list[str] = []
    for key in sorted(by_key, key=lambda k: (infos.get(k) is None or infos[k].layer is None, k)):
        found = by_key[key]
        info = infos.get(key)
        sizes = defaultdict(list)
        for o in found:
            sizes[o.size].append(o.rank)
        if len(sizes) > 1:
            claims = "; ".join(f"ranks {sorted(set(r))} say {s}" for s, r in sorted(sizes.items()))
            lines.append(f"{_where(key, info, [])}: the ranks disagree on its global shape: "
                         f"{claims}")
            continue
        size = found[0].size
        chunks: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = defaultdict(list)
        for o in found:
            chunks[(o.offsets, o.sizes)].append(o.rank)
        order = sorted(chunks)
        gap, gap_rows = _uncovered(size, order)
        clashes = _overlaps(order)
        outside = [c for c in order
                   if any(off + n > s for off, n, s in zip(c[0], c[1], size, strict=False))]
        if not gap and not clashes and not outside:
            continue
        rows = gap_rows or sorted({r for i, j in clashes for r in range(
            max(order[i][0][0], order[j][0][0]),
            min(order[i][0][0] + order[i][1][0], order[j][0][0] + order[j][1][0]))} if size
                                  else set())
        offered = "; ".join(f"ranks {sorted(set(chunks[c]))} offered {_rows(*c, size)}"
                            for c in order)
        parts = []
        if gap:
            parts.append(f"no rank offered {gap}")
        for i, j in clashes:
            parts.append(
                f"ranks {sorted(set(chunks[order[i]]))} and {sorted(set(chunks[order[j]]))} "
                f"offered overlapping chunks ({_rows(*order[i], size)} / {_rows(*order[j], size)})")
        for c in outside:
            parts.append(f"ranks {sorted(set(chunks[c]))} offered {c} beyond its global shape "
                         f"{size}")
        lines.append(f"{_where(key, info, rows)}: {'; '.join(parts)} ({offered})")
    return lines


def explain(exc: BaseException, offers: list[Offer]) -> None:
    """A collective on DCP's refusal of the global plan: raise :class:`SaveRefused` saying where, on
    every rank.

    Returns (for the caller to re-raise ``exc``) when ``exc`` is no such refusal -- then not every
    rank need be here -- or when the plans show nothing wrong.
    """
    import torch.distributed as dist

    if not refused(exc):
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, offers)
    lines = diagnose([o for found in everyone for o in found])
    if not lines:
        return
    more = f" (and {len(lines) - 1} more keys)" if len(lines) > 1 else ""
    text = " ".join(str(exc).split())
    raise SaveRefused(f"DCP refused the save's global plan: {lines[0]}{more}\n"
                      + "".join(f"  {line}\n" for line in lines[1:SHOWN])
                      + f"DCP said: {type(exc).__name__}: {text[:400]}") from exc

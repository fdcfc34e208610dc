"""The `missing` check: every name the ground truth holds is held after the load, per replica group.

A *replica group* is a set of ranks that together hold one whole copy of the model (its EP ranks,
times its expert-tensor-parallel and, under FSDP2, its dp_shard ranks: see
:meth:`~conformance.layout.ParallelLayout.replica_groups`).  Each must hold every ``(layer, expert,
name)`` of the truth -- optimizer moments included -- and, where the ranks hold shards (expert TP,
FSDP2), every element of it: a replica whose ranks hold only etp shard 0 of an expert holds the name
but not the expert.  A union over the whole world would not do: an EP split that takes the global
rank for its EP rank gives one group half of the experts twice and another group the other half, and
the world as a whole still holds them all.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from conformance.checks.context import CheckContext, required
from conformance.checks.held import Box, Held, box_of
from conformance.checks.verdict import Key, RankVerdict
from conformance.inspection import expert_ranges
from conformance.layout import ParallelLayout

SHOWN = 4
def _held(held: Mapping[Key, Any] | set[Key]) -> list[tuple[Key, Box, int]]:
    """What this rank holds, as it crosses the ranks: each key with its region (a dict of
    ``(tensor, region)``), or whole (a set); a packed block as one entry ``(its first row's key,
    each row's region, its row count)``."""
    if isinstance(held, Held):
        found = [(k, box_of(region), 0) for k, (_, region) in held.singles().items()]
        found += [((b.layer, b.first, b.name), box_of(b.region), b.stop - b.first)
                  for b in held.blocks()]
        return sorted(found, key=repr)
    if isinstance(held, Mapping):
        return sorted(((k, box_of(v[1]), 0) for k, v in held.items()), key=repr)
    return sorted(((k, None, 0) for k in held), key=repr)


#: one family's pieces: ``(first expert, stop, what)`` -- a rank's box, or the truth's row shape.
Pieces = dict[tuple[Any, str], list[tuple[int, int, Any]]]


def _pieces(found: list[tuple[Key, Box, int]], into: Pieces, dense: dict[Key, list[Box]]) -> None:
    """:func:`_held`'s entries added to ``into`` per ``(layer, name)`` (expert keys) or to
    ``dense``."""
    for key, box, rows in found:
        layer, first, name = tuple(key)
        if first is None:
            dense.setdefault((layer, None, name), []).append(box)
        else:
            into.setdefault((layer, name), []).append((first, first + (rows or 1), box))


def _truth_pieces(truth: Mapping[Key, Any] | set[Key]) -> tuple[Pieces, dict[Key, Any]]:
    """The truth's experts per ``(layer, name)`` as ``(first, stop, row shape or None)`` (a kept
    block is one piece), and its dense keys with their shapes (``None`` when ``truth`` is keys
    only)."""
    experts: Pieces = {}
    dense: dict[Key, Any] = {}
    blocks = getattr(truth, "blocks", None)
    if blocks is not None:
        singles: Iterable[tuple[Key, tuple[Any, Any]]]
        singles = truth.singles().items()  # type: ignore[union-attr]
    elif isinstance(truth, Mapping):
        singles = ((k, (v, None)) for k, v in truth.items())
    else:
        singles = ((k, (None, None)) for k in truth)
    for (layer, expert, name), (tensor, _) in singles:
        shape = None if tensor is None else tuple(tensor.shape)
        if expert is None:
            dense[(layer, None, name)] = shape
        else:
            experts.setdefault((layer, name), []).append((expert, expert + 1, shape))
    for block in blocks() if blocks is not None else ():
        experts.setdefault((block.layer, block.name), []).append((block.first, block.stop,
                                                                   tuple(block.data.shape[1:])))
    return experts, dense


def _spans(wanted: list[tuple[int, int, Any]], pieces: list[tuple[int, int, Any]]
           ) -> Iterator[tuple[int, int, Any, list[Box]]]:
    """The truth's experts (``wanted``: disjoint ``(first, stop, row shape)``) cut where any piece
    starts or ends: ``(a, b, row shape, the boxes of the pieces covering experts a..b-1)`` -- the
    experts of a span are held alike, so a span is checked once for all of them (a packed block: one
    span, not a row each).  One sweep, in order."""
    starts: dict[int, list[int]] = defaultdict(list)
    stops: dict[int, list[int]] = defaultdict(list)
    for i, (first, stop, _) in enumerate(pieces):
        starts[first].append(i)
        stops[stop].append(i)
    truth_at = {first: (stop, shape) for first, stop, shape in wanted}
    cuts = sorted({*starts, *stops, *truth_at, *(stop for _, stop, _ in wanted)})
    active: dict[int, Box] = {}
    current: tuple[int, Any] | None = None
    for a, b in itertools.pairwise(cuts):
        for i in stops.get(a, ()):
            active.pop(i, None)
        for i in starts.get(a, ()):
            active[i] = pieces[i][2]
        if current is not None and a >= current[0]:
            current = None
        current = truth_at.get(a, current)
        if current is not None:
            yield a, b, current[1], list(active.values())


def _lacking(found: list[list[tuple[Key, Box, int]]], wanted: tuple[Pieces, dict[Key, Any]],
             etp: int
             ) -> tuple[set[Key], dict[Key, str]]:
    """``(keys of the truth no entry holds, {key: the part of it none holds})`` over one replica
    group's entries (:func:`_held`'s, a rank each) against the truth's pieces
    (:func:`_truth_pieces`)."""
    pieces: Pieces = {}
    dense: dict[Key, list[Box]] = {}
    for entries in found:
        _pieces(entries, pieces, dense)
    truth_experts, truth_dense = wanted
    missing = {k for k in truth_dense if k not in dense}
    gaps = {k: gap for k, shape in truth_dense.items() if k in dense and shape is not None
            for gap in [_gap(shape, dense[k], etp)] if gap}
    for (layer, name), experts in truth_experts.items():
        for a, b, shape, boxes in _spans(experts, pieces.get((layer, name), [])):
            gap = "" if not boxes or shape is None else _gap(shape, boxes, etp)
            if not boxes:
                missing.update((layer, e, name) for e in range(a, b))
            elif gap:
                gaps.update(((layer, e, name), gap) for e in range(a, b))
    return missing, gaps


def _gap(shape: tuple[int, ...], boxes: list[Box], etp: int) -> str:
    """What of a ``shape`` tensor the ``boxes`` leave uncovered, in words ("" when they cover it
    all)."""
    import torch

    if any(b is None for b in boxes) or not shape:
        return ""
    # the usual case (FSDP's and expert TP's shards tile it): arithmetic only
    if _disjoint_cover(boxes, shape):
        return ""
    mask = torch.zeros(shape, dtype=torch.bool)
    for box in boxes:
        assert box is not None  # a None box returned above
        mask[tuple(slice(a, b) for a, b in box)] = True
    if bool(mask.all()):
        return ""
    missing = ~mask
    parts = []
    for axis, n in enumerate(shape):
        hit = (missing.any(dim=[d for d in range(len(shape)) if d != axis]) if len(shape) > 1
               else missing)
        idx = hit.nonzero().flatten().tolist()
        if len(idx) == n:
            continue
        span = (f"{idx[0]}..{idx[-1]}" if idx == list(range(idx[0], idx[-1] + 1))
                else expert_ranges(idx))
        shard = ""
        if etp > 1 and n % etp == 0 and len(idx) == n // etp and idx[0] % (n // etp) == 0:
            shard = f": the expert-TP shard {idx[0] // (n // etp)} of {etp}"
        parts.append(f"axis {axis} rows {span} of {n}{shard}")
    return ", ".join(parts) or "some elements"


def _disjoint_cover(boxes: list[Box], shape: tuple[int, ...]) -> bool:
    """Whether ``boxes`` (none ``None``) are pairwise disjoint, inside ``shape``, and fill it by
    their volume."""
    fits = [b for b in boxes if b is not None and len(b) == len(shape)
            and all(0 <= lo < hi <= n for (lo, hi), n in zip(b, shape, strict=True))]
    if len(fits) != len(boxes) or sum(math.prod(hi - lo for lo, hi in b)
                                      for b in fits) != math.prod(shape):
        return False
    return all(any(a[d][1] <= b[d][0] or b[d][1] <= a[d][0] for d in range(len(shape)))
               for i, a in enumerate(fits) for b in fits[i + 1:])


def _missing_lines(missing: set[Key], group: list[int]) -> list[str]:
    """One line per (layer, name): the experts of it the group lacks."""
    by_name: dict[tuple[Any, str], list[int]] = defaultdict(list)
    dense = []
    for layer, expert, name in missing:
        if expert is None:
            dense.append(f"layer {layer}, tensor {name!r}" if layer is not None
                         else f"tensor {name!r}")
        else:
            by_name[(layer, name)].append(expert)
    ranks = ", ".join(map(str, group))
    lines = [f"after the load the ranks [{ranks}] (one replica) hold no {name!r} of layer {layer}, "
             f"expert{'s' if len(ids) > 1 else ''} {expert_ranges(ids)}"
             for (layer, name), ids in sorted(by_name.items(), key=repr)]
    lines += [f"after the load the ranks [{ranks}] (one replica) hold no {what}"
              for what in sorted(dense)]
    return lines


def _partial_lines(gaps: dict[Key, str], group: list[int]) -> list[str]:
    """One line per (layer, name, gap): the experts of which the group holds only part (shards
    missing)."""
    by_gap: dict[tuple[Any, str, str], list[int]] = defaultdict(list)
    dense = []
    for (layer, expert, name), gap in gaps.items():
        if expert is None:
            dense.append(f"{name!r}" + (f" of layer {layer}" if layer is not None else "")
                         + f" ({gap})")
        else:
            by_gap[(layer, name, gap)].append(expert)
    ranks = ", ".join(map(str, group))
    lines = [f"after the load the ranks [{ranks}] (one replica) hold only part of {name!r} of "
             f"layer {layer}, expert{'s' if len(ids) > 1 else ''} {expert_ranges(ids)}: no rank "
             f"holds {gap}" for (layer, name, gap), ids in sorted(by_gap.items(), key=repr)]
    lines += [f"after the load the ranks [{ranks}] (one replica) hold only part of {what}"
              for what in sorted(dense)]
    return lines


def check_replicas(rank: int, held: Mapping[Key, Any] | set[Key], truth: Mapping[Key, Any]
                   | set[Key], layout: ParallelLayout, fsdp: bool, verdict: RankVerdict) -> None:
    """A collective: rank 0 reports each replica group's missing names and missing shards.

    ``held`` is this rank's ``(tensor, region)`` per key
    (:func:`conformance.checks.values.canonical`), or only its keys; ``truth`` the ground truth's
    tensors (for their shapes), or only its keys -- with keys alone, only whole names are checked.
    """
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, _held(held))
    if rank != 0:
        return
    wanted = _truth_pieces(truth)
    lines: list[str] = []
    for group in layout.replica_groups(fsdp):
        missing, gaps = _lacking([everyone[r] for r in group], wanted, layout.etp)
        lines += _missing_lines(missing, group)
        lines += _partial_lines(gaps, group)
    if len(lines) > SHOWN:
        lines[SHOWN - 1] += f" (and {len(lines) - SHOWN} more missing tensor families)"
    for line in lines[:SHOWN]:
        verdict.problem("missing", line)


def run(ctx: CheckContext) -> None:
    """What the load gave, against the load side's ground truth, per replica group."""
    check_replicas(ctx.rank, required(ctx.got, "the loaded state"),
                   required(ctx.truth, "the ground truth").tensors, ctx.cell.load, ctx.cell.fsdp,
                   ctx.verdict)

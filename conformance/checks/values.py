"""Values: every tensor the adapter yields after the load equals what the checkpoint holds, bit for
bit.

What the checkpoint holds is the save side's state (:mod:`conformance.checks.saved`), itself held to
the ep=1 ground truth within a kernel's rounding (:mod:`conformance.rounding`); where it was not
kept, the truth within rounding is the reference.  A difference is explained, not just counted, by
searching the whole reference for what the tensor holds instead: another expert's values (the
classic bug of local expert names), another layer's or another weight's, the two halves of a fused
gate/up weight swapped, only one of those halves, or its own pre-load (seed B) values -- the load
did not write it.  Only when nothing matches does it read "values differ".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conformance.checks.context import CheckContext, TimedAdapter, required
from conformance.checks.held import Held, HeldBlock, Region, Rows, held_blocks, settle
from conformance.checks.verdict import Key, Mismatch, RankVerdict
from conformance.rounding import ROUNDING_ULPS, describe, ulps, within_rounding


def canonical(adapter: TimedAdapter, model: Any, optimizer: Any, rank: int, verdict: RankVerdict
              | None = None, *, copy: bool = True) -> Held:
    """``(layer, expert, name) -> (local data copy, region)`` for everything the adapter yields; a
    packed block kept as one copy (:class:`~conformance.checks.held.Held`).  ``copy=False``: the
    tensors themselves (on the CPU), for a state checked before anything changes the model again (a
    copy of 256 experts' state is not free)."""
    out = Held()
    for source in (adapter.expert_tensors(model, optimizer),
                   adapter.other_tensors(model, optimizer)):
        for entry in held_blocks(source, copy=copy):
            local = entry.local if copy else entry.local.detach().cpu()
            if isinstance(entry, HeldBlock):
                again = out.put_rows(Rows(entry.layer, entry.first, str(entry.name), local,
                                          entry.region))
            else:
                key = (entry.layer, entry.expert, str(entry.name))
                again = [] if out.put(key, local, entry.region) else [key]
            for key in again:
                if verdict is not None:
                    verdict.problem("setup", f"rank {rank}: the adapter yielded {key} twice")
    return out


def cut(full: Any, region: Region) -> Any:
    """``full`` cut to ``region`` (``None``: whole); ``None`` when the region does not fit it."""
    if full is None or region is None or not full.dim():
        return full
    if len(region) != full.dim() or any(r.stop > n
                                        for r, n in zip(region, full.shape, strict=True)):
        return None
    return full[region]


def expected(truth: Mapping[Key, Any], key: Key, region: Region) -> Any:
    """The truth for ``key``, cut to ``region`` when the tensor compared is a shard."""
    return cut(truth.get(key), region)


def equal(a: Any, b: Any) -> bool:
    import torch

    return (a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a, b))


def _describe(key: Key) -> str:
    layer, expert, name = key
    parts = [f"layer {layer}"] if layer is not None else []
    parts += [f"expert {expert}"] if expert is not None else []
    return f"{name!r} of {', '.join(parts)}" if parts else repr(name)


def _halves(t: Any) -> tuple[Any, Any] | None:
    if not t.dim() or t.shape[0] % 2:
        return None
    h = t.shape[0] // 2
    return t[:h], t[h:]


def _rows(region: tuple[slice, ...]) -> str:
    return ", ".join(f"axis {a} rows {r.start}..{r.stop - 1}" for a, r in enumerate(region))


def _tiles(full: Any, shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """The regions of ``full`` of ``shape`` at offsets that are multiples of it (where shards
    sit)."""
    import itertools

    if full.dim() != len(shape) or any(n == 0 or f % n
                                       for f, n in zip(full.shape, shape, strict=True)):
        return []
    return [tuple(slice(i * n, (i + 1) * n) for i, n in zip(index, shape, strict=True))
            for index in itertools.product(*(range(f // n)
                                             for f, n in zip(full.shape, shape, strict=True)))]


def _shard_of(got: Any, region: Region, full: Any) -> str:
    """Whether ``got`` (a shard at ``region``) holds another shard of its own tensor, or one of its
    transpose."""
    if region is None or full is None or not got.dim():
        return ""
    split = [a for a, (r, n) in enumerate(zip(region, full.shape, strict=False))
             if (r.start, r.stop) != (0, n)]
    for tile in _tiles(full, tuple(got.shape)):
        if tile != region and equal(got, full[tile]):
            moved = [a for a, (t, r) in enumerate(zip(tile, region, strict=True)) if t != r]
            if set(moved) <= set(split):
                return (f"holds another expert-TP rank's shard ({_rows(tile)}) instead of its own "
                        f"({_rows(region)})")
            return (f"holds the shard of the other axis ({_rows(tile)}) instead of its own "
                    f"({_rows(region)}): the expert-TP split on the wrong axis")
    if full.dim() >= 2:
        flipped = full.transpose(-1, -2)
        for tile in _tiles(flipped, tuple(got.shape)):
            if equal(got, flipped[tile]):
                own = (" (its own shard, transposed)"
                       if tile == (*region[:-2], region[-1], region[-2]) else "")
                return (f"holds a shard of its transposed weight ({_rows(tile)} of the "
                        f"transpose){own}: the expert-TP shard taken on the wrong axis of an [in, "
                        "out] layout")
    return ""


def diagnose(key: Key, got: Any, region: Region, truth: Mapping[Key, Any],
             before: Mapping[Key, Any], source: str = "the ep=1 ground truth") -> str:
    """Why ``got`` is not ``truth[key]``: what in ``truth`` (``source``: the ground truth, or what
    the checkpoint holds) it holds instead."""
    layer, expert, name = key
    if key in before and equal(got, before[key][0]):
        return "still holds its pre-load (seed B) values: the load did not write it"
    mine = _halves(got)
    for other, full in truth.items():
        if other == key:
            continue
        candidate = cut(full, region)
        if equal(got, candidate):
            if other[0] == layer and other[2] == name and expert is not None:
                return f"holds expert {other[1]}'s values instead of expert {expert}'s"
            sibling = _sibling(name)
            if sibling is not None and other == (layer, expert, sibling[1]):
                return (f"holds its {sibling[1]} half's values instead: the fused gate/up weight's "
                        "halves swapped")
            return f"holds {_describe(other)} instead"
    # another expert's values as a kernel rounded them (a fused optimizer's shard)
    if expert is not None:
        for other in sorted((k for k in truth if k != key and k[0] == layer and k[2] == name),
                            key=repr):
            if within_rounding(got, cut(truth[other], region)):
                return (f"holds expert {other[1]}'s values (within a kernel's rounding) instead of "
                        f"expert {expert}'s")
    # expert TP: another etp rank's shard, or the other axis's
    shard = _shard_of(got, region, truth.get(key))
    if shard:
        return shard
    for other, full in truth.items():  # a fused gate/up weight: halves swapped, or only one of them
        candidate = cut(full, region)
        if candidate is None:
            continue
        theirs = _halves(candidate) if candidate.shape == got.shape else None
        if mine and theirs and equal(mine[0], theirs[1]) and equal(mine[1], theirs[0]):
            return (f"holds {_describe(other)} with its two halves swapped (gate and up in the "
                    "wrong order?)")
        halves = _halves(candidate)
        for label, half in zip(("first", "second"), halves or (), strict=False):
            if equal(got, half):
                return f"holds only the {label} half of {_describe(other)}"
    fused = _fused_reading(key, got, region, truth)
    if fused:
        return fused
    want = expected(truth, key, region)
    if want is None:
        return f"holds rows {region} outside the {tuple(truth[key].shape)} tensor of {source}"
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    if got.numel() and not got.any() and want.any():
        return "holds zeros where it should hold values: the load left it zeroed"
    if got.dim() >= 2 and got.shape[-1] != got.shape[-2] and equal(
            got, want.transpose(-1, -2).reshape(want.shape)):
        return (f"holds its transpose's elements in its own shape {tuple(want.shape)}: a "
                f"{list(want.shape[-2:][::-1])} layout read by reshaping, not transposing")
    rounded = _rounded_through(got, want)
    if rounded:
        return (f"holds the values of {source} rounded to {rounded}: saved or loaded through "
                f"{rounded}")
    return f"values differ from {source} and match no tensor of it: {describe(got, want)}"


#: the halves of a fused gate/up weight, as the canonical names an adapter yields them under.
HALVES = ("gate", "up")


def _sibling(name: str) -> tuple[int, str] | None:
    """``(this half's index, the other half's name)`` of a fused weight's half or its moment."""
    head, _, moment = name.partition(".")
    if head not in HALVES:
        return None
    other = HALVES[1 - HALVES.index(head)]
    return HALVES.index(head), f"{other}.{moment}" if moment else other


def _fused_reading(key: Key, got: Any, region: Region, truth: Mapping[Key, Any]) -> str:
    """Which misreading of a fused gate/up weight ``got`` (its gate or up half) is: the halves'
    rows interleaved where they are concatenated (or the reverse), or a shard of the fused dim cut
    across the two halves (it holds rows of the other half).  "" when none."""
    import torch

    found = _sibling(key[2])
    if found is None or (key[0], key[1], found[1]) not in truth or key not in truth:
        return ""
    index, other = found
    halves = [truth[key], truth[(key[0], key[1], other)]]
    gate, up = halves if index == 0 else halves[::-1]
    if gate.shape != up.shape or not gate.dim():
        return ""
    joined = torch.cat([gate, up])
    woven = torch.stack([gate, up], dim=1).reshape(joined.shape)
    h = gate.shape[0]
    readings = [(joined[index::2], "the interleaved gate/up rows read as concatenated halves"),
                (woven[index * h:(index + 1) * h],
                 "the concatenated gate/up halves read as interleaved rows")]
    for full, what in readings:
        if equal(got, cut(full, region)):
            return f"holds rows of both halves of the fused weight: {what}"
    for tile in _tiles(halves[1], tuple(got.shape)):
        if equal(got, halves[1][tile]):
            return (f"holds its {other} half's {_rows(tile)} instead of its own {HALVES[index]} "
                    "rows: a shard of the fused gate/up dim cut across its two halves")
    return ""


def _rounded_through(got: Any, want: Any) -> str:
    """The coarser float dtype ``want`` was rounded through to give ``got`` ("" when none)."""
    import torch

    if not want.is_floating_point() or not want.numel():
        return ""
    for coarse in (torch.bfloat16, torch.float16):
        if (torch.finfo(coarse).eps > torch.finfo(want.dtype).eps
            and equal(got, want.to(coarse).to(want.dtype))):
            return str(coarse).removeprefix("torch.")
    return ""


def agrees(got: Any, want: Any, verdict: RankVerdict) -> bool:
    """Whether ``got`` is ``want`` bit for bit, or within a kernel's rounding (counted in
    ``verdict``)."""
    if equal(got, want):
        return True
    found = ulps(got, want) if want is not None else float("inf")
    if found <= ROUNDING_ULPS:
        verdict.rounded(found)
        return True
    return False


def compare(rank: int, got: Held, truth: Mapping[Key, Any], before: Held, verdict: RankVerdict,
            saved: Mapping[Key, Any] | None = None) -> None:
    """Every tensor ``got`` holds against ``saved`` (what the checkpoint holds) bit for bit where it
    holds the key, else against the truth within a kernel's rounding; a name the truth lacks is
    named too.  Blocks equal to their reference are settled at once
    (:func:`~conformance.checks.held.settle`); the rest one by one."""
    done, differ, rest = settle(got, saved if saved is not None else truth)
    verdict.compared += len(done)
    for key in sorted([*differ, *rest], key=repr):
        tensor, region = got[key]
        layer, expert, name = key
        verdict.compared += 1
        if key not in truth:
            verdict.add(Mismatch(rank, layer, expert, name,
                                 "not in the ep=1 ground truth (unexpected name)"))
            continue
        if saved is not None and key in saved:
            if not equal(tensor, cut(saved[key], region)):
                verdict.add(_named(Mismatch(rank, layer, expert, name,
                                            diagnose(key, tensor, region, saved, before,
                                                     "what the checkpoint holds")),
                                   tensor, cut(saved[key], region), truth))
            continue
        if not agrees(tensor, expected(truth, key, region), verdict):
            verdict.add(_named(Mismatch(rank, layer, expert, name,
                                        diagnose(key, tensor, region, truth, before)),
                               tensor, expected(truth, key, region), truth))


def _named(mismatch: Mismatch, got: Any, want: Any, truth: Mapping[Key, Any]) -> Mismatch:
    """A per-expert vector's difference (an expert bias: one entry per expert, replicated on every
    rank) named by the first expert whose entry differs, and which entries do."""
    if mismatch.expert is not None or want is None or got.shape != want.shape or got.dim() != 1:
        return mismatch
    count = 1 + max((k[1] for k in truth if k[0] == mismatch.layer and k[1] is not None),
                    default=-1)
    if got.shape[0] != count or not count:
        return mismatch
    differ = [g for g in range(count) if not equal(got[g], want[g])]
    if not differ:
        return mismatch
    entries = ", ".join(f"expert {g}: expected {want[g].item():.6g}, got {got[g].item():.6g}"
                        for g in differ[:3])
    more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
    mismatch.expert = differ[0]
    mismatch.problem = f"{mismatch.problem} (per-expert entries differ: {entries}{more})"
    return mismatch


def run(ctx: CheckContext) -> None:
    """What the load gave against what the checkpoint holds (the save side's state, where this world
    kept it) and that against the ep=1 truth; else against the truth within rounding, saying so."""
    from conformance.checks.saved import check_against_truth  # it reads values with this module's

    verdict, kept = ctx.verdict, ctx.kept
    if kept is None:
        verdict.skipped["values against the checkpoint"] = (
            "the save side's state was not kept in this world (started after the save): the load "
            "was compared with the ep=1 truth within a kernel's rounding")
    elif ctx.saved_truth is not None:
        check_against_truth(kept, ctx.saved_truth, verdict)
    compare(ctx.rank, required(ctx.got, "the loaded state"),
            required(ctx.truth, "the ground truth").tensors,
            required(ctx.before, "the state before the load"), verdict,
            kept.tensors if kept is not None else None)

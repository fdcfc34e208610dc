"""Does a checkpoint hold every expert of every MoE layer exactly once under its global id?

Metadata only: :func:`inspect_index` looks at keys, global shapes and chunks, never at values.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from conformance.inspection.keys import DEFAULT_PATTERNS, KeyInfo, KeyPattern, classify_keys
from conformance.inspection.model import (
    CheckpointIndex,
    CheckpointProblem,
    Entry,
    expert_ranges,
    paused_gc,
)
from conformance.world_state import world_state

__all__ = ["ExpertGroup", "Inspection", "inspect_checkpoint", "inspect_index"]


@dataclass(frozen=True)
class ExpertGroup:
    """One expert-holding tensor family of one layer: a packed key, or the per-expert keys of one
    name (``key`` with ``*`` for the expert id).  ``stat`` is the optimizer state's name (None for
    the weight); ``extent`` the packed key's rows or the number of per-expert keys; ``experts``
    the global ids present (fully covered rows, or the ids of the keys)."""

    layer: int | None
    key: str
    kind: str
    stat: str | None
    extent: int
    experts: tuple[int, ...]


@dataclass(frozen=True)
class Inspection:
    """What :func:`inspect_index` found in one checkpoint: its experts (``groups``) and its
    problems (``findings``, named as the ``--json`` output names them)."""

    path: str
    format: str
    num_experts: int | None
    # "given", "router 'K'", "largest expert id + 1", "largest packed extent"
    num_experts_source: str
    moe_layers: tuple[int, ...]
    groups: tuple[ExpertGroup, ...]
    findings: tuple[CheckpointProblem, ...]
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not self.findings

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "num_experts": self.num_experts,
                "num_experts_source": self.num_experts_source, "moe_layers": list(self.moe_layers),
                "counts": dict(self.counts), "clean": self.clean,
                "findings": [f.as_dict() for f in self.findings],
                "groups": [{"layer": g.layer, "key": g.key, "kind": g.kind, "stat": g.stat,
                            "extent": g.extent,
                            "experts": expert_ranges(g.experts)} for g in self.groups]}


# -- chunks ---------------------------------------------------------------------------------------
def _whole(entry: Entry) -> bool:
    if len(entry.chunks) != 1:
        return False
    offsets, sizes = entry.chunks[0]
    return sizes == entry.shape and not any(offsets)


def _overlaps(chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether any two boxes overlap: a sweep along dim 0, full box test only for neighbours."""
    boxes = sorted(c for c in chunks if c[1] and all(c[1]))
    for i, (o1, s1) in enumerate(boxes):
        end = o1[0] + s1[0]
        for o2, s2 in boxes[i + 1:]:
            if o2[0] >= end:
                break
            if all(a < b + m and b < a + n for a, n, b, m in zip(o1, s1, o2, s2, strict=True)):
                return True
    return False


#: ``_chunk_verdict``'s results (the world state's): most keys share a few layouts.
_CHUNK_VERDICTS = world_state().store("chunk coverage")


def _chunk_verdict(shape: tuple[int, ...], chunks: Any) -> tuple[int, int, bool]:
    """``(elements, elements the chunks hold, overlap)``."""
    verdict = _CHUNK_VERDICTS.get((shape, chunks))
    if verdict is None:
        total = math.prod(shape)
        volume = sum(math.prod(s) for _, s in chunks)
        verdict = _CHUNK_VERDICTS.put((shape, chunks),
                                      (total, volume, volume >= total and _overlaps(chunks)),
                                      200 + 100 * len(chunks))
    return verdict


def _chunk_problems(entry: Entry, info: KeyInfo) -> list[CheckpointProblem]:
    if not entry.shape or _whole(entry):
        return []
    total, volume, overlap = _chunk_verdict(entry.shape, entry.chunks)
    if volume == total and not overlap:
        return []
    out = []
    if volume < total or (volume > total and not overlap):
        out.append(CheckpointProblem("chunk_hole", entry.key,
                                     f"its {len(entry.chunks)} chunk(s) cover {volume} of "
                                     f"{total} elements of shape {entry.shape}", info.layer,
                                     (info.expert,) if info.expert is not None else ()))
    if overlap:
        out.append(CheckpointProblem("chunk_overlap", entry.key,
                                     f"its {len(entry.chunks)} chunks overlap (they hold "
                                     f"{volume} elements for {total})", info.layer,
                                     (info.expert,) if info.expert is not None else ()))
    return out


def _rows(entry: Entry) -> tuple[list[int], list[int], list[int]]:
    """Rows of the expert axis fully covered once, covered partly or not at all, covered twice."""
    rows = entry.shape[0] if entry.shape else 0
    if _whole(entry):
        return list(range(rows)), [], []
    row_volume = math.prod(entry.shape[1:]) if entry.shape else 0
    delta = [0] * (rows + 1)
    for offsets, sizes in entry.chunks:
        if not sizes or not sizes[0]:
            continue
        per_row = math.prod(sizes[1:])
        delta[offsets[0]] += per_row
        delta[min(offsets[0] + sizes[0], rows)] -= per_row
    full: list[int] = []
    missing: list[int] = []
    twice: list[int] = []
    acc = 0
    for r in range(rows):
        acc += delta[r]
        (full if acc == row_volume else missing if acc < row_volume else twice).append(r)
    return full, missing, twice


# -- the inspection -------------------------------------------------------------------------------
def _local_counts(num_experts: int) -> dict[int, int]:
    """What one EP rank holds under the layout rule (``ceil(E / ep)``), by count: the smallest ep
    giving it."""
    out: dict[int, int] = {}
    for ep in range(num_experts, 1, -1):
        out[-(-num_experts // ep)] = ep
    return out


def _ep_hint(num_experts: int, held: int) -> str:
    ep = _local_counts(num_experts).get(held)
    return f" (what one of ep={ep} ranks holds)" if ep else ""


def inspect_checkpoint(path: str | os.PathLike[str], num_experts: int | None = None,
                       patterns: Sequence[KeyPattern] = DEFAULT_PATTERNS) -> Inspection:
    """``inspect_index(read_checkpoint(path), ...)``: the one call the matrix's metadata check
    makes."""
    from conformance.inspection.readers import read_checkpoint

    return inspect_index(read_checkpoint(path), num_experts, patterns)


def inspect_index(index: CheckpointIndex, num_experts: int | None = None,
                  patterns: Sequence[KeyPattern] = DEFAULT_PATTERNS) -> Inspection:
    """Every layer's experts present once, with global extent; optimizer state for every expert."""
    with paused_gc():
        return _inspect(index, num_experts, patterns)


def _inspect(index: CheckpointIndex, num_experts: int | None,
             patterns: Sequence[KeyPattern]) -> Inspection:
    entries = index.entries
    infos = classify_keys(entries, patterns)
    problems: list[CheckpointProblem] = list(index.problems)
    routers: dict[int | None, tuple[str, int]] = {}
    families: dict[str, dict[int, Entry]] = defaultdict(dict)
    family_info: dict[str, KeyInfo] = {}
    packed: list[tuple[KeyInfo, Entry]] = []
    counts = {"keys": len(entries), "tensors": 0, "non_tensors": 0, "expert_keys": 0,
              "optimizer_keys": 0}
    for key, info in infos.items():
        entry = entries[key]
        if not entry.is_tensor:
            counts["non_tensors"] += 1
            continue
        counts["tensors"] += 1
        counts["optimizer_keys"] += info.stat is not None
        if info.role == "router" and entry.shape:
            routers[info.layer] = max(routers.get(info.layer, (key, 0)), (key, entry.shape[0]),
                                      key=lambda r: r[1])
        elif info.role == "expert":
            counts["expert_keys"] += 1
            if info.kind == "per_expert" and info.expert is not None:
                families[info.family][info.expert] = entry
                family_info.setdefault(info.family, info)
            elif entry.shape:  # a packed 0-d entry (Adam's step) has no expert axis
                packed.append((info, entry))
        problems += _chunk_problems(entry, info) if info.kind != "packed" else []

    # the number of experts
    source = "given"
    if num_experts is None and routers:
        key, num_experts = max(routers.values(), key=lambda r: r[1])
        source = f"router {key!r}"
    elif num_experts is None and (families or packed):
        by_id = max((max(ids) + 1 for ids in families.values()), default=0)
        by_rows = max((e.shape[0] for _, e in packed if e.shape), default=0)
        num_experts = max(by_id, by_rows)
        source = "largest expert id + 1" if by_id >= by_rows else "largest packed extent"
    if not families and not packed:
        routed = sorted(k for k in routers if k is not None)
        why = (f", although layer(s) {expert_ranges(routed)} have a router: their experts are "
               "missing, or named in a form no pattern knows" if routed
               else ", so no expert was checked")
        problems.append(CheckpointProblem("no_expert_keys", "",
                                          f"none of the {len(entries)} keys matched an expert "
                                          f"pattern{why}; name them with --expert-key REGEX"))
        return Inspection(
            index.path, index.format, num_experts, source if num_experts else "unknown",
            tuple(sorted(k for k in routers if k is not None)), (), tuple(problems), counts)
    assert num_experts is not None
    every = set(range(num_experts))
    groups: list[ExpertGroup] = []

    for family, held in sorted(families.items()):
        info = family_info[family]
        ids = set(held)
        missing, unknown = sorted(every - ids), sorted(ids - every)
        groups.append(ExpertGroup(info.layer, family, "per_expert", info.stat, len(ids),
                                  tuple(sorted(ids))))
        if missing and ids == set(range(len(ids))) and len(ids) in _local_counts(num_experts):
            problems.append(CheckpointProblem(
                "local_numbering", family, f"per-expert keys are numbered 0..{len(ids) - 1} "
                f"only: {len(ids)} of {num_experts} experts{_ep_hint(num_experts, len(ids))}, "
                "one EP rank's local names; the other experts are not in the checkpoint",
                info.layer, tuple(missing)))
        elif missing:
            problems.append(CheckpointProblem("missing_experts", family,
                                              f"{len(missing)} of {num_experts} experts have no "
                                              "key", info.layer, tuple(missing)))
        if unknown:
            problems.append(CheckpointProblem("unknown_experts", family,
                                              f"keys for expert ids >= {num_experts}, the number "
                                              "of experts", info.layer, tuple(unknown)))
        kinds: dict[tuple[Any, Any], list[int]] = defaultdict(list)
        for g, e in held.items():
            kinds[(e.shape, e.dtype)].append(g)
        if len(kinds) > 1:
            common = max(kinds, key=lambda k: len(kinds[k]))
            odd = sorted(g for k, gs in kinds.items() if k != common for g in gs)
            problems.append(CheckpointProblem("shape_mismatch", family,
                                              f"shape/dtype differ from the other experts' "
                                              f"{common[0]} {common[1]}", info.layer, tuple(odd)))

    for info, entry in packed:
        rows = entry.shape[0] if entry.shape else 0
        full, part, twice = _rows(entry)
        groups.append(ExpertGroup(info.layer, entry.key, "packed", info.stat, rows, tuple(full)))
        if rows < num_experts:
            problems.append(CheckpointProblem(
                "local_extent", entry.key, f"its expert axis has {rows} rows, expected "
                f"{num_experts} (the global extent): {rows} is a local count"
                f"{_ep_hint(num_experts, rows)}, so these experts have no row"
                + (f" and rows 0..{rows - 1} hold one EP rank's experts" if rows else ""),
                info.layer, tuple(range(rows, num_experts))))
        elif rows > num_experts:
            problems.append(CheckpointProblem(
                "extent_mismatch", entry.key, f"its expert axis has {rows} rows, but the "
                f"model has {num_experts} experts", info.layer, tuple(range(num_experts, rows))))
        if part:
            problems.append(CheckpointProblem(
                "missing_experts", entry.key, "no chunk (or only part of one) covers these rows of "
                f"the expert axis: {len(part)} of {rows} experts not stored", info.layer,
                tuple(part)))
        if twice:
            problems.append(CheckpointProblem("duplicate_experts", entry.key,
                                              "these rows of the expert axis are stored by "
                                              "more than one chunk", info.layer, tuple(twice)))
        elif _overlaps(entry.chunks):
            problems += [f for f in _chunk_problems(entry, info) if f.problem == "chunk_overlap"]

    problems += _layer_problems(infos, routers, num_experts)
    problems += _optimizer_problems(infos, entries, num_experts)
    moe_layers = {i.layer for i in infos.values() if i.role == "expert"} | set(routers)
    return Inspection(index.path, index.format, num_experts, source,
                      tuple(sorted(x for x in moe_layers if x is not None)), tuple(groups),
                      tuple(problems), counts)


def _layer_problems(infos: dict[str, KeyInfo], routers: dict[int | None, Any],
                    num_experts: int) -> list[CheckpointProblem]:
    """An expert tensor the MoE layers hold, absent from one of them: that layer's experts are
    gone."""
    present: dict[str, set[int]] = defaultdict(set)
    for info in infos.values():
        if info.role == "expert" and info.layer is not None:
            present[info.cls].add(info.layer)
    expert_layers = set().union(*present.values()) if present else set()
    moe_layers = expert_layers | {x for x in routers if x is not None}
    out: list[CheckpointProblem] = []
    every = tuple(range(num_experts))
    for layer in sorted(moe_layers - expert_layers):
        example = sorted(present)[0].replace("#", str(layer), 1)
        out.append(CheckpointProblem("layer_missing", example,
                                     f"the layer has a router but none of the {len(present)} "
                                     "expert tensors the other MoE layers hold: a whole layer's "
                                     "experts are missing", layer, every))
    # A layer whose tensor a class with another prefix holds is not missing from this one:
    # stage-prefixed names (``stage1.layers.0`` for layer 2) or a second stack (``mtp.layers.0``)
    # number their own layers.
    held_as: dict[str, set[int]] = defaultdict(set)  # by what follows the layer index
    for cls, layers in present.items():
        held_as[cls.split("#", 1)[-1]] |= layers
    for cls, layers in sorted(present.items()):
        for layer in sorted(expert_layers - held_as[cls.split("#", 1)[-1]]):
            out.append(CheckpointProblem("layer_missing", cls.replace("#", str(layer), 1),
                                         f"absent, but layers {expert_ranges(sorted(layers))} hold "
                                         "it: this layer's experts are missing from it", layer,
                                         every))
    return out


def _optimizer_problems(infos: dict[str, KeyInfo], entries: Any,
                        num_experts: int) -> list[CheckpointProblem]:
    """Optimizer state for some experts' weights must exist for every expert of that weight."""
    weights = {i.key: i for i in infos.values() if i.role == "expert" and i.stat is None}
    stats_of: dict[str, set[str]] = defaultdict(set)
    expected: dict[str, set[str]] = defaultdict(set)
    orphans: dict[tuple[str, str], list[int]] = defaultdict(list)
    orphan_layer: dict[tuple[str, str], int | None] = {}
    for info in infos.values():
        if info.role != "expert" or info.stat is None:
            continue
        weight = info.param if info.param in weights else f"model.{info.param}"
        if weight not in weights:
            if weights and not info.param.isdigit():  # a positional id names no weight: no orphan
                orphans[(info.family, info.stat)].append(info.expert if info.expert is not None
                                                         else -1)
                orphan_layer[(info.family, info.stat)] = info.layer
            continue
        stats_of[weight].add(info.stat)
        expected[weights[weight].cls].add(info.stat)
    missing: dict[tuple[str, str], list[int]] = defaultdict(list)
    where: dict[tuple[str, str], int | None] = {}
    for key, info in weights.items():
        for stat in sorted(expected.get(info.cls, set()) - stats_of.get(key, set())):
            experts = [info.expert] if info.kind == "per_expert" else list(range(num_experts))
            missing[(info.family, stat)] += [e for e in experts if e is not None]
            where[(info.family, stat)] = info.layer
    out = [CheckpointProblem("optimizer_missing", family,
                             f"no optimizer state {stat!r} for these experts, although other "
                             "experts' weights of this kind have it", where[(family, stat)],
                             tuple(sorted(experts)))
           for (family, stat), experts in sorted(missing.items())]
    out += [CheckpointProblem("optimizer_orphan", f"{family} [{stat}]",
                              "optimizer state for an expert weight the checkpoint does not hold "
                              "(saved under another name?)", orphan_layer[(family, stat)],
                              tuple(sorted(e for e in experts if e >= 0)))
            for (family, stat), experts in sorted(orphans.items())]
    return out

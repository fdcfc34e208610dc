"""Do two checkpoints hold the same logical content?  The EP-invariance check.

:func:`compare_indexes` compares a checkpoint (``got``, say saved at ep=4) with another of the same
model (``want``, the ep=1 truth): keys, global shapes and dtypes from the metadata; with
``values=True`` every value too.  Values are streamed: each checkpoint is read in batches of at
most ``memory_bytes`` (one key alone when it is larger), and only a 128-bit BLAKE2b digest of each
tensor and of each row of each expert axis is kept.  Digests make the diagnosis cheap -- "key K
holds the other checkpoint's key K2", "rows 2..3 of K's expert axis are experts 0..1" -- because
every tensor and row of ``want`` can be looked up without holding it.  Only a tensor that matches
nothing is read again, from both sides, for its max abs difference; peak memory is about
``max(memory_bytes, 2 x the largest such tensor)``.  Equal digests are taken as bitwise equality.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from conformance.inspection.digests import (
    Digest,
    _fingerprints,
    _is_digest,
    packed_rows,
    whole_only,
)
from conformance.inspection.keys import (
    DEFAULT_PATTERNS,
    KeyInfo,
    KeyPattern,
    classify_keys,
    field_of,
)
from conformance.inspection.model import (
    CheckpointIndex,
    CheckpointProblem,
    Entry,
    expert_ranges,
    paused_gc,
)
from conformance.inspection.positional import moved_ids, positional
from conformance.scalars import is_configuration
from pytest_moe_ep.text import shorten

__all__ = ["DEFAULT_MEMORY_BYTES", "compare_indexes"]

DEFAULT_MEMORY_BYTES = 1 << 30
#: an optimizer param group's parameter-name list: DCP stores one rank's copy of this non-tensor,
#: and at ep > 1 each rank lists only its own experts, so it is compared as a subset of the other's
#: list.
RANK_LOCAL_NAMES = re.compile(r"(?:^|\.)param_groups\.\d+\.params$")


def compare_indexes(got: CheckpointIndex, want: CheckpointIndex, *, values: bool = False,
                    patterns: Sequence[KeyPattern] = DEFAULT_PATTERNS, ignore: Sequence[str] = (),
                    memory_bytes: int = DEFAULT_MEMORY_BYTES,
                    names: tuple[str, str] = ("checkpoint", "other checkpoint"),
                    rounding_ulps: float = 0.0,
                    owners: Mapping[str, Any] | None = None) -> list[CheckpointProblem]:
    """Problems where ``got`` does not hold what ``want`` holds; empty when they are the same.

    ``ignore``: regexes of keys that legitimately differ (an adapter's EP-dependent keys).  An
    optimizer's configuration (a param group's kernel choice:
    :func:`conformance.scalars.is_configuration`) is no state and is not compared either. ``names``:
    what messages call the two checkpoints ("ep=2 checkpoint", "ep=1 checkpoint").
    ``rounding_ulps``: a tensor (or packed row) that matches nothing else but is within this many
    ulps of its own counterpart (:func:`conformance.rounding.ulps`) is a kernel's rounding, not a
    problem; 0: bit for bit. ``owners``: ``want``'s keys in model terms (key -> (layer, global
    expert, name)), to name the parameters whose positional optimizer ids moved
    (:mod:`conformance.inspection.positional`). Problems come worst first (:data:`ORDER`): ids
    moved, wrong values, then absent, re-keyed and extra keys.
    """
    with paused_gc():
        found = _compare(got, want, values, patterns, ignore, memory_bytes, names, rounding_ulps,
                         owners or {})
    return sorted(found, key=lambda f: ORDER.get(f.problem, len(ORDER)))


#: how bad each comparison problem is, worst first: what a red cell's first line should lead with.
#: A key whose values moved under other names (re-keyed) is still no EP-invariant checkpoint, but it
#: says less than a value that is wrong.
ORDER = {code: i for i, code in enumerate((
    "ids_moved", "holds_other_key", "rows_are_other_experts", "values_differ", "value_differs",
    "shape_differs", "dtype_differs", "entry_kind_differs", "key_missing", "key_rekeyed",
    "key_unexpected"))}


def _compare(got: CheckpointIndex, want: CheckpointIndex, values: bool,
             patterns: Sequence[KeyPattern],
             ignore: Sequence[str], memory_bytes: int, names: tuple[str, str],
             rounding_ulps: float, owners: Mapping[str, Any]) -> list[CheckpointProblem]:
    skip: list[Callable[[str], object]] = [*(re.compile(r).search for r in ignore),
                                           is_configuration]
    g_keys = [k for k in got.entries if not any(s(k) for s in skip)]
    w_keys = [k for k in want.entries if not any(s(k) for s in skip)]
    g_info, w_info = classify_keys(g_keys, patterns), classify_keys(w_keys, patterns)
    missing = sorted(set(w_keys) - set(g_keys))
    unexpected = sorted(set(g_keys) - set(w_keys))
    problems: list[CheckpointProblem] = []
    common = [k for k in g_keys if k in want.entries]
    readable: list[str] = []
    for key in common:
        a, b, info = got.entries[key], want.entries[key], g_info[key]
        experts = (info.expert,) if info.expert is not None else ()
        if a.is_tensor != b.is_tensor:
            problems.append(CheckpointProblem("entry_kind_differs", key,
                                              f"a {_kind(a)} here, a {_kind(b)} in the {names[1]}",
                                              info.layer, experts))
            continue
        if a.dtype != b.dtype:
            problems.append(CheckpointProblem("dtype_differs", key,
                                              f"dtype {a.dtype}, the {names[1]}'s is {b.dtype}",
                                              info.layer, experts))
            continue
        if a.shape != b.shape:
            problems.append(_shape_problem(key, a, b, info, names))
            if not (a.shape and b.shape and a.shape[1:] == b.shape[1:] and info.kind == "packed"):
                continue
        readable.append(key)
    holds: dict[str, str] = {}
    seen: dict[str, dict[str, Any]] = {"got": {}, "want": {}}
    if values:
        # positional ids of another shape may hold other ids' state: looked up as extra keys are
        reshaped = [k for k in common
                    if k not in readable and positional(k) and got.entries[k].is_tensor]
        problems += _compare_values(got, want, readable, [*unexpected, *reshaped], w_keys, g_info,
                                    w_info, memory_bytes, names, holds, rounding_ulps, seen)
        held = [*holds.items(),
                *((f.key, f.other_key) for f in problems if f.problem == "holds_other_key")]
        problems += [f for f in (moved_ids(held, owners, names),) if f is not None]
    rekeyed, missing, unexpected = _rekeyed(missing, unexpected, got, want, holds, seen, names,
                                            values)
    problems = _key_problems(missing, unexpected, got, want, g_info, w_info, names,
                             holds) + rekeyed + problems
    return problems


def _rekeyed(missing: list[str], unexpected: list[str], got: CheckpointIndex, want: CheckpointIndex,
             holds: Mapping[str, str], seen: Mapping[str, Mapping[str, Any]],
             names: tuple[str, str], values: bool
             ) -> tuple[list[CheckpointProblem], list[str], list[str]]:
    """Non-tensor entries the checkpoint holds under other keys than the other one does (an
    optimizer's settings per group at ep=1, per parameter at ep>1): one ``key_rekeyed`` problem per
    parent of the absent keys, saying where their fields went and whether the values agree.  Returns
    the problems and the keys left unexplained.

    Two keys are the same field re-keyed when they share the top-level name and the last component
    (``optimizer.param_groups.0.lr``, ``optimizer.param_groups.layers.0.mlp.w1.lr``); the values
    agree when both sides hold the same set of values for that field."""
    held_elsewhere = set(holds.values())
    gone = [k for k in missing if not want.entries[k].is_tensor and k not in held_elsewhere]
    new = [k for k in unexpected if not got.entries[k].is_tensor and k not in holds]
    by_field_new: dict[tuple[str, str], list[str]] = defaultdict(list)
    for key in new:
        by_field_new[field_of(key)].append(key)
    parents = {key.rsplit(".", 1)[0] for key in gone if field_of(key) in by_field_new}
    by_parent: dict[str, list[str]] = defaultdict(list)
    # a re-keyed parent's fields with no counterpart (its group's ``params``) go with it
    for key in gone:
        if key.rsplit(".", 1)[0] in parents:
            by_parent[key.rsplit(".", 1)[0]].append(key)
    if not by_parent:
        return [], missing, unexpected
    out: list[CheckpointProblem] = []
    explained_old: set[str] = set()
    explained_new: set[str] = set()
    for parent, keys in sorted(by_parent.items()):
        fields = sorted({field_of(k) for k in keys if field_of(k) in by_field_new})
        alone = sorted({field_of(k)[1] for k in keys if field_of(k) not in by_field_new})
        keys = [k for k in keys if field_of(k) in by_field_new or field_of(k)[1] in alone]
        targets = sorted({t for f in fields for t in by_field_new[f]})
        disagree = []
        for f in fields:
            olds = [k for k in keys if field_of(k) == f]
            if values:
                mine = {_short(seen["got"].get(t)) for t in by_field_new[f]}
                theirs = {_short(seen["want"].get(k)) for k in olds}
                if mine != theirs:
                    disagree.append(f"{f[1]}: {sorted(mine)} here, {sorted(theirs)} in the "
                                    f"{names[1]}")
        explained_old.update(keys)
        explained_new.update(targets)
        leaves = ", ".join(f[1] for f in fields)
        shown = ", ".join(repr(t) for t in targets[:2]) + (", ..." if len(targets) > 2 else "")
        verdict = ("values not compared" if not values else
                   "the values agree" if not disagree
                   else "the values do not agree: " + "; ".join(disagree[:3])
                   + (f" and {len(disagree) - 3} more fields" if len(disagree) > 3 else ""))
        rest = f"; absent with no counterpart: {', '.join(alone)}" if alone else ""
        out.append(CheckpointProblem("key_rekeyed", f"{parent}.*",
                                     f"re-keyed: its {len(fields)} field(s) ({leaves}) are absent "
                                     f"from the {names[0]}, which holds them under "
                                     f"{len(targets)} other key(s) ({shown}); {verdict}{rest}",
                                     None, (), targets[0]))
    return (out, [k for k in missing if k not in explained_old],
            [k for k in unexpected if k not in explained_new])


def _kind(entry: Entry) -> str:
    return f"tensor {entry.shape} {entry.dtype}" if entry.is_tensor else "non-tensor entry"


def _shape_problem(key: str, a: Entry, b: Entry, info: KeyInfo,
                   names: tuple[str, str]) -> CheckpointProblem:
    message = f"global shape {a.shape}, the {names[1]}'s is {b.shape}"
    experts: tuple[int, ...] = (info.expert,) if info.expert is not None else ()
    if info.kind == "packed" and a.shape and b.shape and a.shape[0] < b.shape[0]:
        message += f": its expert axis has {a.shape[0]} rows, not all {b.shape[0]} experts"
        experts = tuple(range(a.shape[0], b.shape[0]))
    return CheckpointProblem("shape_differs", key, message, info.layer, experts)


def _key_problems(missing: list[str], unexpected: list[str], got: CheckpointIndex,
                  want: CheckpointIndex, g_info: dict[str, KeyInfo], w_info: dict[str, KeyInfo],
                  names: tuple[str, str], holds: Mapping[str, str]) -> list[CheckpointProblem]:
    """Absent keys grouped in expert terms: one problem per family, or per layer when all its
    experts went.  An absent key whose value another key holds (and the other checkpoint does not
    have) is that key re-keyed: one ``key_rekeyed`` problem names both (Megatron's
    ``chained_0.optimizer.state.*`` for ``optimizer.state.*``)."""
    out: list[CheckpointProblem] = []
    absent = set(missing)
    moved = {target: holder for holder, target in holds.items() if target in absent}
    missing = [k for k in missing if k not in moved]
    by_layer_all: dict[int, set[str]] = defaultdict(set)
    for key, info in w_info.items():
        if info.role == "expert" and info.layer is not None:
            by_layer_all[info.layer].add(key)
    gone: dict[tuple[str, int | None], list[int]] = defaultdict(list)
    whole_layers = {layer for layer, keys in by_layer_all.items() if keys and keys <= set(missing)}
    for layer in sorted(whole_layers):
        keys = sorted(by_layer_all[layer])
        rows = max((shape[0] for k in keys if w_info[k].kind == "packed"
                    and (shape := want.entries[k].shape)),
                   default=0)
        ids = {w_info[k].expert for k in keys if w_info[k].expert is not None} | set(range(rows))
        out.append(CheckpointProblem("key_missing", w_info[keys[0]].family,
                                     f"all {len(keys)} expert keys of layer {layer} are absent "
                                     f"from the {names[0]} (layer {layer}'s experts)", layer,
                                     tuple(sorted(i for i in ids if i is not None))))
    for key in missing:
        info = w_info[key]
        if info.role == "expert" and info.layer in whole_layers:
            continue
        if info.role == "expert" and info.kind == "per_expert":
            gone[(info.family, info.layer)].append(info.expert if info.expert is not None else -1)
            continue
        entry = want.entries[key]
        row_ids = tuple(range(entry.shape[0])) if info.kind == "packed" and entry.shape else ()
        what = f" (layer {info.layer}'s experts)" if info.role == "expert" else ""
        out.append(CheckpointProblem("key_missing", key, f"absent from the {names[0]}{what}",
                                     info.layer, row_ids))
    for (family, family_layer), expert_ids in sorted(gone.items(),
                                                     key=lambda kv: (kv[0][0], str(kv[0][1]))):
        out.append(CheckpointProblem("key_missing", family,
                                     f"absent from the {names[0]} for {len(expert_ids)} expert(s)",
                                     family_layer, tuple(sorted(expert_ids))))
    for target, key in sorted(moved.items()):
        info = g_info[key]
        expert = info.expert if info.expert is not None else w_info[target].expert
        out.append(CheckpointProblem("key_rekeyed", key,
                                     f"re-keyed: holds the {names[1]}'s {target!r}, which is "
                                     f"absent from the {names[0]}; the values agree", info.layer,
                                     (expert,) if expert is not None else (), target))
    for key in unexpected:
        if key in moved.values():
            continue
        info = g_info[key]
        extra = f"; it holds the {names[1]}'s {holds[key]!r}" if key in holds else ""
        out.append(CheckpointProblem("key_unexpected", key, f"not in the {names[1]}{extra}",
                                     info.layer, (info.expert,) if info.expert is not None else (),
                                     holds.get(key)))
    return out


# -- values ---------------------------------------------------------------------------------------
def _same_value(a: Any, b: Any) -> bool:
    """Equal non-tensor entries, compared through containers: a saved object that nests tensors
    (Megatron's ``dp_zero_gather_scatter`` param state: dicts of buffers) is equal when its
    structure and every tensor are -- ``==`` on such a dict asks a tensor for its truth value and
    raises."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and bool(torch.equal(a, b)))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:
        return False


def _short(value: Any) -> str:
    return shorten(repr(value), 80)


def _pick(candidates: list[tuple[str, int | None]], key: str, info: KeyInfo,
          w_info: dict[str, KeyInfo]
          ) -> tuple[str, int | None]:
    """The likeliest source among equal-valued candidates: the same key, family, then layer."""
    def rank(c: tuple[str, int | None]) -> tuple[int, int, int]:
        other = w_info.get(c[0])
        return (c[0] != key, other is None or other.family != info.family,
                other is None or other.layer != info.layer)
    return min(candidates, key=rank)


def _compare_values(got: CheckpointIndex, want: CheckpointIndex, readable: list[str],
                    unexpected: list[str], w_keys: list[str], g_info: dict[str, KeyInfo],
                    w_info: dict[str, KeyInfo], memory_bytes: int, names: tuple[str, str],
                    holds: dict[str, str], rounding_ulps: float,
                    seen: dict[str, dict[str, Any]]) -> list[CheckpointProblem]:
    # whole digests first: a packed key's row digests are needed only where some tensor differs
    # (7,000 rows a checkpoint at 256 experts; an equal checkpoint, the usual cell, then hashes each
    # value once)
    g_whole, _ = _fingerprints(got, [*readable, *unexpected], whole_only, memory_bytes)
    w_whole, _ = _fingerprints(want, w_keys, whole_only, memory_bytes)
    g_rows: dict[str, list[Digest]] = {}
    w_rows: dict[str, list[Digest]] = {}
    if any(_is_digest(g_whole[k]) and g_whole[k] != w_whole[k] for k in readable):
        g_whole, g_rows = _fingerprints(got, [*readable, *unexpected], packed_rows(g_info),
                                        memory_bytes)
        w_whole, w_rows = _fingerprints(want, w_keys, packed_rows(w_info), memory_bytes)
    seen["got"], seen["want"] = g_whole, w_whole
    by_whole: dict[Any, list[tuple[str, int | None]]] = defaultdict(list)
    by_row: dict[Digest, list[tuple[str, int | None]]] = defaultdict(list)
    for key, d in w_whole.items():
        if _is_digest(d):
            by_whole[d].append((key, None))
            if w_info[key].kind == "per_expert":
                by_row[d].append((key, None))
    for key, ds in w_rows.items():
        for r, d in enumerate(ds):
            by_row[d].append((key, r))
    out: list[CheckpointProblem] = []
    unexplained: list[tuple[str, list[int] | None]] = []
    for key in unexpected:
        d = g_whole.get(key)
        if isinstance(d, tuple) and d in by_whole:
            holds[key] = _pick(by_whole[d], key, g_info[key], w_info)[0]
    for key in readable:
        a, b, info = g_whole[key], w_whole[key], g_info[key]
        experts = (info.expert,) if info.expert is not None else ()
        if not _is_digest(a):
            if RANK_LOCAL_NAMES.search(key) and isinstance(a, list) and isinstance(b, list):
                extra = [n for n in a if n not in set(b)]
                if extra:
                    out.append(CheckpointProblem(
                        "value_differs", key, f"lists {len(extra)} parameter name(s) the "
                        f"{names[1]}'s group does not, first {_short(extra[:3])}", info.layer))
            elif not _same_value(a, b):
                out.append(CheckpointProblem("value_differs", key,
                                             f"is {_short(a)}, the {names[1]}'s is {_short(b)}",
                                             info.layer, experts))
            continue
        if a == b:
            continue
        if key in g_rows:
            found, bad = _row_problems(key, g_rows[key], w_rows.get(key, []), by_row, info, w_info,
                                       names)
            out += found
            if bad:
                unexplained.append((key, bad))
            continue
        if a in by_whole:
            source, _ = _pick(by_whole[a], key, info, w_info)
            other = w_info[source]
            if other.family == info.family and other.expert is not None and info.expert is not None:
                text = (f"holds expert {other.expert}'s values instead of expert {info.expert}'s "
                        f"(the {names[1]}'s {source!r})")
            else:
                text = f"holds the {names[1]}'s {source!r}" + (
                    f" (layer {other.layer}, expert {other.expert})" if other.expert is not None
                    else "")
            out.append(CheckpointProblem("holds_other_key", key, text, info.layer, experts, source))
        elif a in by_row:
            source, row = _pick(by_row[a], key, info, w_info)
            out.append(CheckpointProblem("holds_other_key", key,
                                         f"holds row {row} (expert {row}) of the {names[1]}'s "
                                         f"{source!r}", info.layer, experts, source))
        else:
            unexplained.append((key, None))
    out += _diff_problems(got, want, unexplained, g_info, names, rounding_ulps)
    return out


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """``[(row, source_row)]`` -> ``[(first row, last row, first source, last source)]`` of steps by
    one."""
    runs: list[list[int]] = []
    for r, s in sorted(pairs):
        if runs and r == runs[-1][1] + 1 and s == runs[-1][3] + 1:
            runs[-1][1], runs[-1][3] = r, s
        else:
            runs.append([r, r, s, s])
    return [tuple(x) for x in runs]  # type: ignore[misc]


def _span(a: int, b: int) -> str:
    return str(a) if a == b else f"{a}..{b}"


def _row_problems(key: str, rows: list[Digest], truth_rows: list[Digest],
                  by_row: Mapping[Digest, list[Any]],
                  info: KeyInfo, w_info: dict[str, KeyInfo], names: tuple[str, str]
                  ) -> tuple[list[CheckpointProblem], list[int]]:
    """Which experts the wrong rows of ``key``'s expert axis hold, one problem per source key."""
    moved: dict[str, list[tuple[int, int]]] = defaultdict(list)
    bad: list[int] = []
    for r, d in enumerate(rows):
        if r < len(truth_rows) and truth_rows[r] == d:
            continue
        if d in by_row:
            source, s = _pick(by_row[d], key, info, w_info)
            moved[source].append((r, s if s is not None else (w_info[source].expert or 0)))
        else:
            bad.append(r)
    out = []
    for source, pairs in sorted(moved.items()):
        runs = _runs(pairs)
        parts = [f"rows {_span(a, b)} are experts {_span(c, d)}" for a, b, c, d in runs[:4]]
        more = f" and {len(runs) - 4} more runs" if len(runs) > 4 else ""
        whose = "" if source == key else f" of the {names[1]}'s {source!r}"
        out.append(CheckpointProblem(
            "rows_are_other_experts", key, f"its expert axis holds other experts' values: "
            f"{', '.join(parts)}{more}{whose}", info.layer, tuple(r for r, _ in pairs), source))
    return out, bad


def _diff_problems(
        got: CheckpointIndex, want: CheckpointIndex, keys: list[tuple[str, list[int] | None]],
        g_info: dict[str, KeyInfo], names: tuple[str, str],
        rounding_ulps: float) -> list[CheckpointProblem]:
    """Tensors that match nothing: read both once more, one key at a time, for the max abs diff;
    those within ``rounding_ulps`` of their counterpart (rows of a packed key one by one) are no
    problem."""
    from conformance.rounding import ulps

    out = []
    for key, rows in keys:
        a = got.reader([key])[key] if got.reader else None
        b = want.reader([key])[key] if want.reader else None
        info = g_info[key]
        if rounding_ulps and a is not None and b is not None:
            if rows is None and ulps(a, b) <= rounding_ulps:
                continue
            if rows is not None and b.dim():
                rows = [r for r in rows if r >= b.shape[0] or ulps(a[r], b[r]) > rounding_ulps]
                if not rows:
                    continue
        if rows is not None:
            # a key with rows is a packed tensor in both checkpoints, and _fingerprints required
            # both readers
            assert a is not None and b is not None
            a, b = a[rows], b[[r for r in rows if r < b.shape[0]]] if b.dim() else b
        diff = "n/a"
        if a is not None and b is not None and a.shape == b.shape and a.numel():
            diff = f"{(a.double() - b.double()).abs().max().item():.3g}"
        where = (f"row{'s' if len(rows) > 1 else ''} {expert_ranges(rows)} of its expert axis "
                 if rows is not None else "")
        experts = tuple(rows) if rows is not None else ((info.expert,
                                                        ) if info.expert is not None else ())
        out.append(CheckpointProblem("values_differ", key,
                                     f"{where}differ from the {names[1]}'s (max abs diff {diff}) "
                                     "and match no tensor or row of it", info.layer, experts))
    return out


def attribute_experts(index: CheckpointIndex, owners: Mapping[Digest, tuple[Any, Any, str]], *,
                      patterns: Sequence[KeyPattern] = DEFAULT_PATTERNS,
                      memory_bytes: int = DEFAULT_MEMORY_BYTES) -> list[CheckpointProblem]:
    """Expert keys (and packed rows) whose value is the model's tensor of *another* expert or layer.

    ``owners`` maps the digest of each of the model's own tensors to
    ``(layer, global expert, name)``: the ground truth's view of the model.  This catches what no
    comparison of two checkpoints of the same framework can: experts filed under consistently wrong
    ids at every EP degree, ep=1 included. A value that matches none of the model's tensors (a fused
    or transposed form) is left alone.
    """
    infos = classify_keys(index.entries, patterns)
    keys = [k for k, i in infos.items() if i.role == "expert" and index.entries[k].is_tensor
            and index.entries[k].shape]
    whole, rows = _fingerprints(index, keys, packed_rows(infos), memory_bytes)
    found: list[CheckpointProblem] = []
    for key in keys:
        info = infos[key]
        held = ([(info.expert, whole[key])] if info.kind == "per_expert"
                else list(enumerate(rows.get(key, []))))
        for expert, value in held:
            owner = owners.get(value)
            if owner is None or owner[1] is None:
                continue
            layer, other, name = owner
            if other != expert or (info.layer is not None and layer is not None
                                   and layer != info.layer):
                where = "" if info.kind == "per_expert" else f"row {expert}: "
                found.append(CheckpointProblem(
                    "holds_other_expert", key, f"{where}holds the model's {name!r} of layer "
                    f"{layer}, expert {other}, not expert {expert}'s", info.layer,
                    (expert,) if expert is not None else ()))
    return found

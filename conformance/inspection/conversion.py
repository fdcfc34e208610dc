"""A training checkpoint against its Hugging Face export, expert by expert, by value.

A conversion tool renames every key, fuses or splits the gate and up projections, may transpose a
projection and may cast to bf16, so no key of the export is named as the training checkpoint names
it.  What stays is the values: each expert's projection is one matrix on both sides.  So both
checkpoints are cut into *atoms* -- one matrix of one expert (a per-expert key, one row of a packed
key's expert axis, the shared expert's projections), and where the shapes say one side fuses what
the other keeps apart, each half of a fused matrix (concatenated or interleaved, along either
axis) -- and every atom is digested in one orientation (fewer rows than columns), so a transposed
copy digests alike.  Matching digests is the mapping, learned from the values alone; the names on
each side only say what the atom *should* be (layer, expert or shared expert, gate / up / down),
and an atom that holds another one's values is a problem in those terms: "layer 3, expert 17,
down_proj: holds expert 16's values".

What counts as right is what most atoms show, where names cannot say: the layer numbering of the
export (a framework's stage-local or dense-first numbering) and the orientation of its projections
(an export may transpose every projection, as gpt-oss does; one projection transposed against the
others is a problem).  Values are read one batch of at most ``memory_bytes`` at a time and only
digests are kept; the training side is cast to the export's dtype first when they differ (an fp32
checkpoint exported as bf16), and said so.  An atom whose counterpart (same layer, expert and
projection) differs is compared once more, within ``rounding_ulps``.

Values cannot decide between matrices the training side holds equal (two experts initialised
alike, zeros): those *ties* are paired by name instead -- the names both sides parse, or, given
``hf_names``, transformers' own names for the export's class -- and counted as such, so a reader
knows that part of the mapping rests on names.  A tied value the export files where no tied
matrix's name says is still a problem: a tie never hides a misfile.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from conformance.inspection.atoms import DIGITS, Atom, Piece, Side, owner
from conformance.inspection.digests import Digest, _batches, digest
from conformance.inspection.keys import DEFAULT_PATTERNS, KeyPattern
from conformance.inspection.model import (
    CheckpointIndex,
    CheckpointProblem,
    expert_ranges,
    paused_gc,
)

__all__ = ["ConversionReport", "compare_conversion", "is_conversion"]

#: the problems, worst first: values where others belong, then values absent, then extra ones.
ORDER = ("export_holds_other", "export_missing", "export_values_differ", "export_transposed",
         "export_unexpected")


@dataclass
class ConversionReport:
    """What :func:`compare_conversion` found: ``problems`` (each a :class:`CheckpointProblem`),
    ``notes`` (keys on one side only that hold no expert: no problem), ``mapping`` (one line per
    key family: where its values went), ``cast`` (the cast applied to the training side, if any),
    ``atoms`` (expert matrices of the training checkpoint compared)."""

    problems: list[CheckpointProblem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    mapping: list[str] = field(default_factory=list)
    cast: str | None = None
    atoms: int = 0
    #: matrices whose values were equal to another's and that were paired by name instead
    tied: int = 0
    #: whose names paired them: "the names both sides parse" or transformers' class
    tie_names: str = "the names both sides parse"

    def as_dict(self) -> dict[str, Any]:
        return {"cast": self.cast, "atoms": self.atoms, "mapping": self.mapping,
                "tied": self.tied, "tie_names": self.tie_names,
                "notes": self.notes, "findings": [p.as_dict() for p in self.problems]}


def is_conversion(a: CheckpointIndex, b: CheckpointIndex) -> bool:
    """Whether two checkpoints are a training checkpoint and its export (one of each format: a DCP
    save and safetensors), compared by :func:`compare_conversion` rather than key by key."""
    return a.format != b.format and "safetensors" in (a.format, b.format)


def compare_conversion(training: CheckpointIndex, export: CheckpointIndex, *,
                       patterns: Sequence[KeyPattern] = DEFAULT_PATTERNS,
                       memory_bytes: int = 1 << 30, rounding_ulps: float = 0.0,
                       names: tuple[str, str] = ("training checkpoint", "export"),
                       hf_names: tuple[str, Collection[str]] | None = None
                       ) -> ConversionReport:
    """Whether ``export`` holds every expert of ``training`` where its names say, by value (see the
    module docstring); problems come named by the export's keys, in model terms.  ``hf_names``:
    ``(class, its keys in either naming)``, transformers' names that pair tied matrices (equal
    values) in place of the names parsed from the export's keys."""
    if training.reader is None or export.reader is None:
        raise ValueError("a conversion is compared by value: both checkpoints must be readable")
    with paused_gc():
        return _compare(training, export, patterns, memory_bytes, rounding_ulps, names,
                        hf_names)


def _dtype(side: Side) -> str | None:
    found = Counter(side.index.entries[k].dtype for k in side.expert_keys)
    return found.most_common(1)[0][0] if found else None


def _compare(training: CheckpointIndex, export: CheckpointIndex, patterns: Sequence[KeyPattern],
             memory_bytes: int, rounding_ulps: float, names: tuple[str, str],
             hf_names: tuple[str, Collection[str]] | None) -> ConversionReport:
    import torch

    report = ConversionReport()
    a, b = Side(training, patterns), Side(export, patterns)
    a_dtype, b_dtype = _dtype(a), _dtype(b)
    cast = None
    if a_dtype and b_dtype and a_dtype != b_dtype:
        target = getattr(torch, b_dtype, None)
        if isinstance(target, torch.dtype) and target.is_floating_point:
            cast = target
            report.cast = (f"the {names[0]}'s {a_dtype} values cast to {b_dtype}, as the "
                           f"{names[1]} holds them")
    a_shapes, b_shapes = a.shapes(), b.shapes()
    b.read(a_shapes, memory_bytes, None)
    a.read(b_shapes, memory_bytes, cast)
    report.atoms = sum(1 for atom in a.atoms if not atom.split)
    if hf_names is not None:
        report.tie_names = f"transformers' {hf_names[0]} names"
    _judge(a, b, report, names, rounding_ulps, cast, hf_names)
    report.notes = _notes(a, b, names, memory_bytes, cast)
    report.problems.sort(key=lambda f: (ORDER.index(f.problem), str(f.layer), f.key))
    return report


def _index(side: Side) -> dict[Digest, list[int]]:
    where: dict[Digest, list[int]] = defaultdict(list)
    for i, d in enumerate(side.digests):
        where[d].append(i)
    return where


def _matches(a: Side, b: Side) -> list[tuple[int, int]]:
    """``(a atom, b atom)`` pairs of equal digests, preferring whole pieces: a piece matched whole
    is not matched again by its halves, on either side.  A value several atoms of the training side
    share (zeros) names none of them and is left out."""
    b_at = _index(b)
    a_count = Counter(a.digests)
    pairs = [(i, j) for i, d in enumerate(a.digests) if a_count[d] == 1 for j in b_at.get(d, ())]
    whole_a = {a.atoms[i].piece for i, j in pairs if not a.atoms[i].split}
    whole_b = {b.atoms[j].piece for i, j in pairs if not b.atoms[j].split}
    return [(i, j) for i, j in pairs
            if not (a.atoms[i].split and a.atoms[i].piece in whole_a)
            and not (b.atoms[j].split and b.atoms[j].piece in whole_b)]


def _majority(votes: dict[Any, Counter[Any]]) -> dict[Any, Any]:
    return {k: c.most_common(1)[0][0] for k, c in votes.items()}


_HF_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_HF_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")


def _export_name(b: Side, j: int, hf_keys: Collection[str] | None
                 ) -> tuple[int | None, int | None, str | None] | None:
    """What the export's atom ``j`` is by name: ``(layer, expert, projection)``.  Given
    transformers' keys for the class, read by its naming (``layers.N.mlp.experts.G.gate_proj``
    or a row of the fused ``experts.gate_up_proj``), and ``None`` for a key the class does not
    have: a name transformers would not load cannot vouch for a tie."""
    atom = b.atoms[j]
    piece = b.pieces[atom.piece]
    if hf_keys is None:
        return piece.layer, piece.expert, b.role(atom)
    if piece.key not in hf_keys:
        return None
    layer, expert = _HF_LAYER.search(piece.key), _HF_EXPERT.search(piece.key)
    number = int(expert[1]) if expert else piece.row
    return (int(layer[1]) if layer else None), number if piece.expert is not None else None, \
        b.role(atom)


def _ties(a: Side, b: Side, pairs: list[tuple[int, int]], layers: dict[Any, Any],
          hf_keys: Collection[str] | None) -> tuple[list[tuple[int, int]], set[int]]:
    """Where values cannot decide (a value several training atoms share): ``(pairs by name, the
    export's atoms holding a tied value under no tied atom's name)``.  The second are misfiles the
    tie would otherwise hide; whole pieces are preferred to their halves, as in :func:`_matches`."""
    a_count = Counter(a.digests)
    b_at = _index(b)
    found: list[tuple[int, int]] = []
    for i, d in enumerate(a.digests):
        if a_count[d] < 2:
            continue
        pa = a.pieces[a.atoms[i].piece]
        ra = a.role(a.atoms[i])
        for j in b_at.get(d, ()):
            name = _export_name(b, j, hf_keys)
            if name is None:
                continue
            layer, expert, rb = name
            if (layers.get(pa.layer, pa.layer) == layer and pa.expert == expert
                    and not (ra and rb and ra != rb)):
                found.append((i, j))
    whole_a = {a.atoms[i].piece for i, j in (*pairs, *found) if not a.atoms[i].split}
    whole_b = {b.atoms[j].piece for i, j in (*pairs, *found) if not b.atoms[j].split}
    found = [(i, j) for i, j in found
             if not (a.atoms[i].split and a.atoms[i].piece in whole_a)
             and not (b.atoms[j].split and b.atoms[j].piece in whole_b)]
    paired_b = {j for _, j in (*pairs, *found)}
    held_pieces_b = {b.atoms[j].piece for j in paired_b if not b.atoms[j].split}
    misfiled = {j for j, d in enumerate(b.digests)
                if a_count[d] > 1 and j not in paired_b
                and b.atoms[j].piece not in held_pieces_b
                and not (b.atoms[j].split and b.role(b.atoms[j]) is None)}
    return found, misfiled


def _judge(a: Side, b: Side, report: ConversionReport, names: tuple[str, str],
           rounding_ulps: float, cast: Any,
           hf_names: tuple[str, Collection[str]] | None = None) -> None:
    pairs = _matches(a, b)
    # what most atoms show: the export's layer for each training layer, and its orientation
    layer_votes: dict[Any, Counter[Any]] = defaultdict(Counter)
    flips: Counter[bool] = Counter()
    for i, j in pairs:
        pa, pb = a.pieces[a.atoms[i].piece], b.pieces[b.atoms[j].piece]
        layer_votes[pa.layer][pb.layer] += 1
        flips[a.atoms[i].transposed != b.atoms[j].transposed] += 1
    layers = _majority(layer_votes)
    flipped = flips.most_common(1)[0][0] if flips else False
    tied, misfiled = _ties(a, b, pairs, layers, hf_names[1] if hf_names else None)
    report.tied = len(tied)
    report.mapping = _mapping(a, b, pairs, flipped) + _mapping(
        a, b, tied, flipped, f"paired by {report.tie_names}: their values equal")
    pairs = pairs + tied
    grouped: dict[tuple[str, str, Any, str], list[int]] = defaultdict(list)
    held_a: set[int] = set()
    held_b: set[int] = set(misfiled)
    sharing: dict[Digest, list[int]] = defaultdict(list)
    for i, d in enumerate(a.digests):
        sharing[d].append(i)
    for j in sorted(misfiled):
        pb = b.pieces[b.atoms[j].piece]
        whose = sorted({owner(a.pieces[a.atoms[i].piece]) + (
            f" (layer {a.pieces[a.atoms[i].piece].layer})"
            if layers.get(a.pieces[a.atoms[i].piece].layer) != pb.layer else "")
            for i in sharing[b.digests[j]]})
        text = (f"{b.name(b.atoms[j])}: holds the values {' and '.join(whose)} share (equal "
                f"to each other; by name none of them), not its own")
        if hf_names and _export_name(b, j, hf_names[1]) is None:
            text += f" (transformers' {hf_names[0]} has no such key)"
        grouped[("export_holds_other", pb.key if pb.row is not None else _family(pb.key),
                 pb.layer, text)].append(pb.expert if pb.expert is not None else -1)
    for i, j in pairs:
        ai, bj = a.atoms[i], b.atoms[j]
        pa, pb = a.pieces[ai.piece], b.pieces[bj.piece]
        held_a.add(i)
        held_b.add(j)
        what = b.name(bj)
        wrong = []
        if layers.get(pa.layer) != pb.layer:
            wrong.append(f"layer {pa.layer}'s")
        if pa.expert != pb.expert:
            wrong.append("the shared expert's" if pa.expert is None else
                         f"expert {pa.expert}'s")
        ra, rb = a.role(ai), b.role(bj)
        if ra and rb and ra != rb:
            wrong.append(f"the {ra} projection's")
        if wrong:
            text = f"{what}: holds {' '.join(wrong)} values, not its own"
            if pa.expert is None and pb.expert is not None:
                text += f" (the shared expert filed as routed expert {pb.expert})"
            if pa.expert != pb.expert or layers.get(pa.layer) != pb.layer:
                text += f" (the {names[0]}'s {_where(pa)})"
            grouped[("export_holds_other", pb.key if pb.row is not None else _family(pb.key),
                     pb.layer, text)].append(pb.expert if pb.expert is not None else -1)
        elif (ai.transposed != bj.transposed) != flipped:
            grouped[("export_transposed", pb.key if pb.row is not None else _family(pb.key),
                     pb.layer, f"{what}: stored transposed against the other projections "
                     f"(the {names[0]}'s {_family(pa.key)} is not)")].append(
                pb.expert if pb.expert is not None else -1)
    # by identity: the training side's unmatched atoms, and what the export holds in their place
    place: dict[tuple[Any, Any, str | None], list[int]] = defaultdict(list)
    for j, atom in enumerate(b.atoms):
        p = b.pieces[atom.piece]
        place[(p.layer, p.expert, b.role(atom))].append(j)
    pieces_held_a = {a.atoms[i].piece for i in held_a}
    missing: dict[Any, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
    cut = {atom.piece for atom in a.atoms if atom.split}
    first_key: dict[Any, str] = {}  # per layer: the first key whose experts are missing
    for i, atom in enumerate(a.atoms):
        if i in held_a or atom.piece in pieces_held_a:
            continue
        if atom.split and a.role(atom) is None:
            continue  # a cut the other side's shapes suggested, of no fused piece: no identity
        pa = a.pieces[atom.piece]
        if not atom.split and pa.role == "gate_up" and atom.piece in cut:
            continue  # judged by its halves
        there = [j for j in place.get((layers.get(pa.layer, pa.layer), pa.expert, a.role(atom)),
                                      ()) if j not in held_b]
        if there:
            j = there[0]
            held_b.update(there)
            found = _differs(a, b, i, j, flipped, rounding_ulps, cast, names)
            if found is not None:
                report.problems.append(found)
            continue
        # a key that numbers no layer (torchtitan's ``mtp_layers.0``) is named by the layer the
        # export files its other experts under, as most atoms show
        layer = pa.layer if pa.layer is not None else layers.get(None)
        missing[layer][a.role(atom) or _family(pa.key)].add(
            pa.expert if pa.expert is not None else -1)
        first_key.setdefault(layer, pa.key)
    for layer, roles in sorted(missing.items(), key=lambda kv: str(kv[0])):
        gone: set[int] = set().union(*roles.values())
        ids = tuple(sorted(e for e in gone if e >= 0))
        who = (f"experts {expert_ranges(ids)}" if ids else "") + (
            (" and " if ids else "") + "the shared expert" if -1 in gone else "")
        what = ", ".join(f"{role} of {expert_ranges(sorted(e for e in got if e >= 0)) or 'shared'}"
                         if got != gone else role for role, got in sorted(roles.items()))
        report.problems.append(CheckpointProblem(
            "export_missing", _family(first_key.get(layer, "")), f"{who} missing from the "
            f"{names[1]}: their values ({what}) are nowhere in it", layer, ids))
    for (code, key, layer, text), experts in grouped.items():
        ids = tuple(sorted({e for e in experts if e >= 0}))
        report.problems.append(CheckpointProblem(code, key, text, layer, ids))
    held_pieces_b = {b.atoms[j].piece for j in held_b}
    extra: dict[tuple[Any, str], list[int]] = defaultdict(list)
    for piece_index, p in enumerate(b.pieces):
        if piece_index in held_pieces_b:
            continue
        extra[(p.layer, p.key if p.row is not None else _family(p.key))].append(
            p.expert if p.expert is not None else -1)
    for (layer, key), experts in sorted(extra.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        ids = tuple(sorted({e for e in experts if e >= 0}))
        report.problems.append(CheckpointProblem(
            "export_unexpected", key, f"holds expert values the {names[0]} does not have "
            f"(no expert of it, nor its counterpart)", layer, ids))


def _where(p: Piece) -> str:
    return repr(p.key) + (f" row {p.row}" if p.row is not None else "")


def _family(key: str) -> str:
    """A per-expert key with its expert id as ``*`` (``experts.*.down_proj.weight``)."""
    return re.sub(r"(?<=experts\.)\d+(?=\.)", "*", key)


def _differs(a: Side, b: Side, i: int, j: int, flipped: bool, rounding_ulps: float, cast: Any,
             names: tuple[str, str]) -> CheckpointProblem | None:
    """The export's atom ``j`` in the place of the training side's ``i``, whose values it does not
    hold: within ``rounding_ulps`` no problem, else how far apart."""
    from conformance.rounding import ulps

    want, got = a.value(a.atoms[i], cast), b.value(b.atoms[j], None)
    pb = b.pieces[b.atoms[j].piece]
    what = b.name(b.atoms[j])
    if want.shape == got.shape and want.dtype == got.dtype:
        far = ulps(got, want)
        if far <= rounding_ulps:
            return None
        diff = (got.double() - want.double()).abs().max().item()
        text = (f"{what}: differs from {owner(pb)}'s values in the {names[0]} (max abs diff "
                f"{diff:.3g}, {far:.3g} ulps) and matches no other")
    else:
        text = (f"{what}: shape {tuple(got.shape)} {got.dtype}, the {names[0]}'s "
                f"{tuple(want.shape)} {want.dtype}")
    return CheckpointProblem("export_values_differ", pb.key, text, pb.layer,
                             (pb.expert,) if pb.expert is not None else (),
                             a.pieces[a.atoms[i].piece].key)


def _mapping(a: Side, b: Side, pairs: list[tuple[int, int]], flipped: bool,
             how: str = "") -> list[str]:
    """One line per (training family, export family, cut): where the values went, and how many
    matrices; ``how`` says when names, not values, paired them (ties)."""
    found: Counter[tuple[str, str]] = Counter()
    for i, j in pairs:
        ai, bj = a.atoms[i], b.atoms[j]
        pa, pb = a.pieces[ai.piece], b.pieces[bj.piece]
        left = DIGITS.sub("#", _family(pa.key)) + ("[e]" if pa.row is not None else "")
        left += _cut_text(ai)
        right = DIGITS.sub("#", _family(pb.key)) + ("[e]" if pb.row is not None else "")
        right += _cut_text(bj)
        if ai.transposed != bj.transposed:
            right += " transposed"
        found[(left, right)] += 1
    how = f", {how}" if how else ""
    return [f"{left} -> {right} ({n} matrices{how})"
            for (left, right), n in sorted(found.items())]


def _cut_text(atom: Atom) -> str:
    if not atom.split:
        return ""
    how = "interleaved" if atom.split.startswith("il") else "concatenated"
    return f" {how} half {atom.half} along axis {atom.split[-1]}"


def _notes(a: Side, b: Side, names: tuple[str, str], memory_bytes: int,
           cast: Any) -> list[str]:
    """Keys that hold no expert and that one side alone holds (by value): an export adds what
    training never had (attention, embeddings, a head), training keeps what no export does
    (optimizer state, counters).  Notes, not problems."""
    a_dense = [k for k, i in a.infos.items() if k not in a.expert_keys and i.stat is None]
    b_dense = [k for k in b.infos if k not in b.expert_keys]
    a_vals = dict(_flat_digests(a.index, a_dense, memory_bytes, cast))
    b_vals = dict(_flat_digests(b.index, b_dense, memory_bytes, None))
    b_set, a_set = set(b_vals.values()), set(a_vals.values())
    only_a = [k for k, d in a_vals.items() if d not in b_set]
    only_b = [k for k, d in b_vals.items() if d not in a_set]
    out = []
    optimizer = sum(1 for i in a.infos.values() if i.stat is not None)
    others = sum(1 for e in a.index.entries.values() if not e.is_tensor)
    if optimizer or others:
        out.append(f"only in the {names[0]}: {optimizer} optimizer state tensor(s) and {others} "
                   "other entries (an export holds no training state)")
    for side, keys in ((names[0], only_a), (names[1], only_b)):
        if keys:
            shown = ", ".join(keys[:6]) + (f", ... ({len(keys) - 6} more)" if len(keys) > 6
                                           else "")
            out.append(f"only in the {side}, holding no expert: {len(keys)} key(s): {shown}")
    return out


def _flat_digests(index: CheckpointIndex, keys: list[str], memory_bytes: int,
                  cast: Any) -> Iterator[tuple[str, Digest]]:
    """Each key's digest, its shape left out (a bias saved ``[E]`` and exported ``[1, E]``)."""
    for batch in _batches(index, keys, memory_bytes):
        assert index.reader is not None, "the caller checked both indexes have readers"
        for key, value in index.reader(batch).items():
            if cast is not None and value.is_floating_point() and value.dtype != cast:
                value = value.to(cast)
            yield key, digest(value.reshape(-1))

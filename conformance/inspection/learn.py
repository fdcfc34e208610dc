"""Which checkpoint keys hold which experts, learned from a checkpoint's *content* rather than its
names.

The matrix knows the model it saved: each expert tensor (weights and moments) with its layer and
global expert id, from the ep=1 build.  :func:`learn_expert_keys` reads the ep=1 (truth) checkpoint
once and matches values: a key whose whole value is one expert's tensor is a per-expert key of that
expert; a key whose rows (along the first axis) are experts' tensors is a packed key.
:func:`learned_patterns` turns that into :class:`~conformance.inspection.keys.KeyPattern` s --
anchored regexes, the digit run that is the expert id (and, where one is, the layer) as named
groups, every other digit run literal (a positional optimizer id names one parameter) -- which the
metadata inspection and the comparison then use for every checkpoint of that model.  So a framework
passes whatever it names its keys; name patterns stay as hints for what values cannot show (fused or
transposed expert weights) and for ``moe-ep-inspect`` on a checkpoint without a model.

A template is learned only when *every* key of it agrees (the same digit run is the expert id in
each): experts filed under consistently wrong ids learn nothing and are left to the name hints and
the attribution, which then say so.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from conformance.inspection.compare import DEFAULT_MEMORY_BYTES
from conformance.inspection.digests import (
    Digest,
    _batches,
    _fingerprints,
    _row_digests,
    digest,
    every_row,
    whole_only,
)
from conformance.inspection.keys import Evidence, KeyPattern, Placed, optimizer_parts
from conformance.inspection.model import CheckpointIndex, paused_gc
from conformance.inspection.positional import ParamAt, resolve

__all__ = ["LearnedKey", "evidence", "key_owners", "learn_expert_keys", "learned_patterns",
           "owners_of", "unexplained_volume"]

_DIGITS = re.compile(r"\d+")
#: who holds a tensor of the model: ``(layer, global expert, name)``.
Owner = tuple[Any, Any, str]


@dataclass(frozen=True)
class LearnedKey:
    """A key the content shows to hold experts: ``kind`` "per_expert" (``experts`` one id), "packed"
    (``experts[r]`` the expert row ``r`` holds) or "blocks" (experts flattened into the first axis,
    ``experts[b]`` the expert block ``b`` holds); ``layer`` the model's layer index."""

    key: str
    kind: str
    layer: Any
    experts: tuple[int, ...]
    #: the model's name of the tensor it holds (``experts.w_in.exp_avg``)
    name: str = ""


def learn_expert_keys(index: CheckpointIndex, owners: Mapping[Digest, Owner], *,
                      memory_bytes: int = DEFAULT_MEMORY_BYTES) -> dict[str, LearnedKey]:
    """Every tensor key of ``index`` whose value, or each of whose rows, is one of the model's
    expert tensors."""
    import torch

    if index.reader is None:
        return {}
    keys = [k for k, e in index.entries.items() if e.is_tensor and e.shape]
    shapes = {shape for _, (_, expert, _), shape in _owner_shapes(owners) if expert is not None}
    found: dict[str, LearnedKey] = {}
    with paused_gc():
        # The whole-tensor digests come from (and stay in) the comparison's per-checkpoint cache:
        # the attribution and the comparison with this checkpoint then read it no more.  Only a key
        # whose whole value is no tensor of the model is read again, for its rows or blocks.
        whole, _ = _fingerprints(index, keys, whole_only, memory_bytes)
        rest = []
        for key in keys:
            owner = owners.get(whole.get(key))  # type: ignore[arg-type]
            if owner is None:
                rest.append(key)
            elif owner[1] is not None:
                found[key] = LearnedKey(key, "per_expert", owner[0], (int(owner[1]),), owner[2])
        # a key read for its rows keeps them in the same cache: the attribution (rows of every
        # packed key) reads the checkpoint no more
        multi = [k for k in rest if len(index.entries[k].shape or ()) > 1]
        _, rows_of = _fingerprints(index, multi, every_row, memory_bytes)
        blocky = [k for k in rest
                  if _block_shape(tuple(index.entries[k].shape or ()), shapes) is not None]
        for key in rest:
            if _learn_rows(found, key, "packed", rows_of.get(key), owners):
                continue
            # experts flattened into the first axis (OLMo-core): read for its blocks
            if key in blocky:
                for value in index.reader([key]).values():
                    if isinstance(value, torch.Tensor):
                        _learn_rows(found, key, "blocks", _row_digests(_blocks(value, shapes)),
                                    owners)
    return found


def _learn_rows(found: dict[str, LearnedKey], key: str, kind: str, rows: list[Digest] | None,
                owners: Mapping[Digest, Owner]) -> bool:
    """Whether every row of ``key`` (their digests) is an expert tensor of the model; if so it is
    learned."""
    held = [owners.get(d) for d in rows or ()]
    if not held or not all(o is not None and o[1] is not None for o in held):
        return False
    layers = {o[0] for o in held if o is not None}
    names = {o[2] for o in held if o is not None}
    found[key] = LearnedKey(key, kind, layers.pop() if len(layers) == 1 else None,
                            tuple(int(o[1]) for o in held if o is not None),
                            names.pop() if len(names) == 1 else "")
    return True


def _owner_shapes(owners: Mapping[Digest, Owner]) -> list[tuple[Digest, Owner, tuple[int, ...]]]:
    return [(d, o, tuple(d[1])) for d, o in owners.items()]


def _block_shape(shape: tuple[int, ...], shapes: set[tuple[int, ...]]) -> tuple[int, ...] | None:
    """The expert tensor shape whose blocks tile a ``shape`` tensor along its first axis (experts
    stored flattened, ``[E * rows, ...]``, as OLMo-core does), if one does."""
    for found in sorted(shapes):
        if (len(shape) == len(found) and shape[1:] == found[1:] and found[0] and shape[0] % found[0]
            == 0 and shape[0] > found[0]):
            return found
    return None


def _blocks(value: Any, shapes: set[tuple[int, ...]]) -> Any:
    """``value`` cut along its first axis into ``[blocks, *shape]`` of an expert tensor's shape (see
    :func:`_block_shape`)."""
    shape = _block_shape(tuple(value.shape), shapes)
    assert shape is not None, "only a key _block_shape accepts is cut"
    return value.reshape(-1, *shape)


def _param(key: str) -> str:
    """The parameter part of a key (an optimizer state's parameter), which patterns are matched
    against."""
    parts = optimizer_parts(key)
    return parts[1] if parts else key


def _run_index(runs: list[list[int]], values: list[Any]) -> list[int]:
    """Indices of the digit runs equal to ``values`` in every key."""
    width = min(len(r) for r in runs)
    return [i for i in range(width)
            if all(v is not None and r[i] == v for r, v in zip(runs, values, strict=True))]


def learned_patterns(learned: Mapping[str, LearnedKey],
                     keys: Iterable[str] = ()) -> tuple[KeyPattern, ...]:
    """Anchored patterns for the keys of ``learned``, one per key template and literal part.

    A digit run becomes a pattern only where the learned keys show it varying as a layer or an
    expert: the run that equals the layer of every learned key of its template, and has no letter
    either side, is the named group ``layer`` (torchtitan's MTP layer 2 is
    ``mtp_layers.0...w2_EDF``: the 2 is the weight's name, not its layer); for per-expert keys, the
    run that equals the expert id is the group ``expert``.
    Every other run stays the digits it is: a positional optimizer id (torch's own
    ``Optimizer.state_dict()``: ``state.1.exp_avg`` is the second parameter's, whatever the
    parameter) names one parameter, and as ``\\d+`` it would match every other parameter's moments
    and read a dense tensor's rows as experts.

    ``keys``: every key of the checkpoint the content was learned from.  A pattern that would match
    one the content did not show to hold experts (a positional id that happens to equal its layer)
    keeps its layer's digits literal too, or, per-expert and still matching it, is left out (the
    name hints then decide)."""
    learned_params = {_param(k) for k in learned}
    # by template: a template's regexes match no other template's names
    others: dict[str, set[str]] = defaultdict(set)
    for param in map(_param, keys):
        if param not in learned_params:
            others[_DIGITS.sub("#", param)].add(param)
    templates: dict[tuple[str, str], list[tuple[str, LearnedKey]]] = defaultdict(list)
    for info in learned.values():
        param = _param(info.key)
        templates[(_DIGITS.sub("#", param), info.kind)].append((param, info))
    out: list[KeyPattern] = []
    seen: set[str] = set()
    for (template, kind), members in sorted(templates.items()):
        # experts flattened into one axis: compared by value, never read as an expert axis
        if kind == "blocks":
            regex = "^" + "\\d+".join(re.escape(p) for p in template.split("#")) + "$"
            if regex not in seen:
                seen.add(regex)
                out.append(KeyPattern(re.compile(regex), "flattened",
                                      "learned: experts flattened into one axis"))
            continue
        for regex in _template_regexes(template, kind, members, others[template]):
            if regex not in seen:
                seen.add(regex)
                literal = bool(_DIGITS.search(regex.replace("\\d+", "")))
                out.append(KeyPattern(re.compile(regex), kind,
                                      "learned from the ep=1 checkpoint's content",
                                      template if literal else ""))
    return tuple(out)


def _template_regexes(template: str, kind: str, members: list[tuple[str, LearnedKey]],
                      others: set[str]) -> list[str]:
    """The regexes of one key template's learned keys (see :func:`learned_patterns`)."""
    runs = [[int(m) for m in _DIGITS.findall(param)] for param, _ in members]
    # a layer's index stands apart (layers.2, layer_2), never digits inside a word (w2_EDF)
    pieces = template.split("#")
    whole = [not pieces[i][-1:].isalpha() and not pieces[i + 1][:1].isalpha()
             for i in range(len(pieces) - 1)]
    layers = [info.layer for _, info in members]
    layer_runs = [run for run in _run_index(runs, layers) if whole[run]]
    expert_at: int | None = None
    if kind == "per_expert":
        candidates = _run_index(runs, [i.experts[0] for _, i in members])
        if not candidates:
            return []  # ids disagree with the content: leave the key to the name hints
        expert_at = next((c for c in reversed(candidates) if c not in layer_runs), candidates[-1])
    layer_at = next((c for c in layer_runs if c != expert_at), None)
    regexes = _regexes(template, runs, expert_at, layer_at)
    if layer_at is not None and any(_matches(r, others) for r in regexes):
        regexes = _regexes(template, runs, expert_at, None)
    if expert_at is not None and any(_matches(r, others) for r in regexes):
        return []
    return regexes


def _regexes(template: str, runs: list[list[int]], expert_at: int | None,
             layer_at: int | None) -> list[str]:
    """One regex per distinct literal part of ``runs``: the expert's and the layer's runs as named
    groups, every other run its own digits."""
    pieces = template.split("#")
    found: list[str] = []
    for run in runs:
        regex = "^" + re.escape(pieces[0])
        for i, piece in enumerate(pieces[1:]):
            group = ("(?P<expert>\\d+)" if i == expert_at else
                     "(?P<layer>\\d+)" if i == layer_at else str(run[i]))
            regex += group + re.escape(piece)
        regex += "$"
        if regex not in found:
            found.append(regex)
    return found


def _matches(regex: str, params: set[str]) -> bool:
    compiled = re.compile(regex)
    return any(compiled.match(p) for p in params)


def key_owners(index: CheckpointIndex, owners: Mapping[Digest, Owner], keys: Sequence[str], *,
               memory_bytes: int = DEFAULT_MEMORY_BYTES) -> dict[str, Owner]:
    """``key -> (layer, global expert, name)`` of each of ``keys`` whose whole value is one of the
    model's tensors (read from the comparison's cache: :func:`learn_expert_keys` read them already).
    """
    if index.reader is None:
        return {}
    entries = index.entries
    tensors = [k for k in keys if k in entries and entries[k].is_tensor and entries[k].shape]
    with paused_gc():
        whole, _ = _fingerprints(index, tensors, whole_only, memory_bytes)
    return {k: owner for k in tensors
            if (owner := owners.get(whole.get(k))) is not None}  # type: ignore[arg-type]


def evidence(index: CheckpointIndex, owners: Mapping[Digest, Owner],
             learned: Mapping[str, LearnedKey], patterns: Iterable[KeyPattern],
             positions: Sequence[Sequence[ParamAt]] = (), *,
             memory_bytes: int = DEFAULT_MEMORY_BYTES) -> Evidence:
    """What the truth checkpoint ``index`` shows of its keys, with the ``patterns`` its checkpoints
    are read by.

    - a key ``learned`` to hold experts (by its value or its rows) holds them; experts flattened
      into one axis are compared whole, as plain tensors;
    - a key whose whole value is one of the model's dense tensors (a dense weight, a dense
      parameter's moment) holds none, whatever its name, digit runs or row count;
    - optimizer state keyed by position is its parameter's, as the live optimizer of the ep=1
      build holds it (``positions``, :func:`conformance.inspection.positional.resolve`): an expert
      parameter's state holds experts, a dense one's none -- what the values showed of it only
      refines the experts' ids.
    """
    experts = {k: Placed(i.kind, i.layer, i.experts[0] if i.kind == "per_expert" else None,
                         i.name)
               for k, i in learned.items() if i.kind in ("per_expert", "packed")}
    tensors = [k for k in index.entries if k not in learned]
    dense = {k for k, owner in key_owners(index, owners, tensors,
                                          memory_bytes=memory_bytes).items() if owner[1] is None}
    for key, (param, stat) in resolve(index, positions).items():
        if param.kind == "dense":
            experts.pop(key, None)
            dense.add(key)
        elif param.kind in ("packed", "per_expert"):
            dense.discard(key)
            experts.setdefault(key, Placed(param.kind, param.layer, param.expert,
                                           f"{param.name}.{stat}" if param.name else ""))
    return Evidence(patterns, experts, dense)


def owners_of(state: Mapping[Any, Any]) -> tuple[dict[Digest, Owner], int]:
    """``(digest -> (layer, expert, name) of every non-scalar tensor of a ground-truth state, the
    experts' element count)``; a value two tensors share (zeros) identifies neither and is left
    out."""
    owners: dict[Digest, Owner | None] = {}
    volume = 0
    for (layer, expert, name), d, numel in _digests(state):
        # two tensors alike: say nothing
        owners[d] = (layer, expert, name) if d not in owners else None
        volume += numel if expert is not None else 0
    return {d: o for d, o in owners.items() if o is not None}, volume


def _digests(state: Mapping[Any, Any]) -> Iterator[tuple[Owner, Digest, int]]:
    """``(key, digest, element count)`` of each non-scalar tensor of ``state``; a state that keeps
    packed rows as blocks (``blocks()`` and ``singles()``: :class:`conformance.checks.held.State`)
    has each block's rows hashed from one array (256 experts: thousands of row views otherwise)."""
    blocks = getattr(state, "blocks", None)
    if blocks is None:
        yield from ((key, digest(t), t.numel()) for key, t in state.items() if t.dim())
        return
    for key, (t, _) in state.singles().items():  # type: ignore[attr-defined]
        if t.dim():
            yield key, digest(t), t.numel()
    for block in blocks():
        numel = block.data[0].numel() if block.data.shape[0] else 0
        for i, d in enumerate(_row_digests(block.data) if block.data.dim() > 1 else []):
            yield (block.layer, block.first + i, block.name), d, numel


def unexplained_volume(index: CheckpointIndex, owners: Mapping[Digest, Owner],
                       keys: Sequence[str]) -> int:
    """Elements of ``keys`` (tensors) whose value is none of the model's dense tensors: room for
    experts."""
    import torch

    total = 0
    if index.reader is None:
        return sum(index.entries[k].nbytes_hint for k in keys)
    for batch in _batches(index, list(keys), DEFAULT_MEMORY_BYTES):
        for value in index.reader(batch).values():
            if isinstance(value, torch.Tensor) and value.dim():
                owner = owners.get(digest(value))
                if owner is None or owner[1] is not None:
                    total += value.numel()
    return total

"""The `checkpoint` check: the checkpoint itself is EP-invariant, holding what the ep=1 save holds.

Two questions, both answered by :mod:`conformance.inspection` (the same code ``python -m
conformance.inspect`` runs on real checkpoints):

- does the checkpoint hold every expert of every layer once under its global id (metadata alone:
  expert axes, chunk coverage, per-expert ids, layers, optimizer moments)?
- does it hold the same keys, global shapes, dtypes and values -- tensors and non-tensor entries
  (step, lr) alike -- as the ep=1 save of the same model (the truth checkpoint)?  Values within a
  kernel's rounding of the truth's (:mod:`conformance.rounding`) are the same: a fused optimizer
  steps a shard differently.

and, of the truth checkpoint itself: does each expert key (or packed row) hold the model's own
tensor of that expert -- the ground truth's view of the model -- and not another expert's?

A bug that round-trips its own mistake (experts saved and loaded under the same wrong ids) passes
every check of the loaded model, and only this one catches it: the comparison with the ep=1 save
when the mistake depends on the EP degree, the attribution when it does not.  A DCP checkpoint is
read directly from its files on one rank, with no process group; another format through the
adapter's optional ``read_checkpoint``.  Keys the adapter declares EP-dependent
(``ep_dependent_keys``) are left out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conformance.checks.context import CheckContext, TimedAdapter
from conformance.checks.truth import ground_truth
from conformance.rounding import ROUNDING_ULPS
from conformance.world_state import world_state

if TYPE_CHECKING:
    from conformance.inspection import KeyPattern


def read_index(adapter: TimedAdapter, path: str) -> Any:
    """The checkpoint's index, or ``None`` when this adapter's format cannot be read here.

    ``adapter`` here and below is the cell's: its ``members`` are what the controller resolved of
    it."""
    from conformance.inspection import index_state_dict, read_dcp

    members = adapter.members
    if members.capabilities.format == "dcp":
        return read_dcp(path)
    if members.has("read_checkpoint"):
        return index_state_dict(adapter.read_checkpoint(path), path,
                                format=members.capabilities.format)
    return None


def declared_patterns(adapter: TimedAdapter, extra: Sequence[str] = ()) -> tuple[KeyPattern, ...]:
    """The expert-key regexes the adapter declares (``expert_keys``) and the user gives
    (``--moe-ep-expert-key``)."""
    from conformance.inspection import pattern

    return tuple(pattern(r, "declared") for r in (*adapter.members.value("expert_keys"), *extra))


@dataclass(frozen=True)
class Knowledge:
    """What the truth checkpoint taught about a model's expert keys: the patterns every checkpoint
    of its spec is read with, and a note when its experts could be identified neither by value nor
    by name."""

    patterns: tuple[KeyPattern, ...]
    note: str = ""
    #: the truth's positional optimizer-state keys (``optimizer.state.1.exp_avg``) in model terms,
    #: to name the parameters whose ids moved in another checkpoint
    #: (:mod:`conformance.inspection.positional`).
    owners: Mapping[str, tuple[Any, Any, str]] = field(default_factory=dict)


#: per truth checkpoint path (the world state's): cells reuse what the first one learned.
_KNOWLEDGE = world_state().store("expert keys learned")


def known(truth_path: str) -> Knowledge | None:
    """What this process already knows of ``truth_path`` (rank 0 learned it; the others were sent
    it)."""
    found = _KNOWLEDGE.get(truth_path)
    return found if isinstance(found, Knowledge) else None


def remember(truth_path: str, found: Knowledge) -> None:
    """Keep what rank 0 learned, on a rank that did not learn it itself."""
    _KNOWLEDGE.put(truth_path, found)


def knowledge(adapter: TimedAdapter, truth_path: str, truth_state: Callable[[], Mapping[Any, Any]],
              declared: tuple[KeyPattern, ...] = ()) -> Knowledge:
    """The :class:`Knowledge` of ``truth_path``, learned once from its content and the ground
    truth's tensors."""
    found = known(truth_path)
    if found is None:
        _learn(adapter, truth_path, truth_state(), declared)
        found = known(truth_path)
        assert found is not None, "_learn keeps what it learned"
    return found


def _learn(adapter: TimedAdapter, truth_path: str, state: Mapping[Any, Any],
           declared: tuple[KeyPattern, ...]) -> list[str]:
    """Learn the truth checkpoint's expert keys; its findings (attribution, experts missing from
    it)."""
    from conformance.inspection import DEFAULT_PATTERNS, attribute_experts, inspect_index
    from conformance.inspection.learn import (
        evidence,
        key_owners,
        learn_expert_keys,
        learned_patterns,
        owners_of,
        unexplained_volume,
    )
    from conformance.inspection.positional import positional

    index = read_index(adapter, truth_path)
    owners, volume = owners_of(state)
    keys = learn_expert_keys(index, owners)
    learned = learned_patterns(keys, index.entries)
    by_position = key_owners(index, owners, [k for k in index.entries if positional(k)])
    patterns = evidence(index, owners, keys, (*declared, *learned, *DEFAULT_PATTERNS),
                        getattr(state, "positions", ()))
    found = [f"the ep=1 checkpoint: {f}"
             for f in attribute_experts(index, owners, patterns=patterns)]
    found += _layers_missing(index, owners, keys, state)
    note = ""
    if not learned and any(f.problem == "no_expert_keys"
                           for f in inspect_index(index, patterns=patterns).findings):
        tensors = [k for k, e in index.entries.items() if e.is_tensor and e.shape]
        room = unexplained_volume(index, owners, tensors)
        if room < volume:
            found.append("the ep=1 checkpoint holds none of the model's expert tensors: its "
                         f"{len(index.entries)} keys hold the dense tensors and {room} other "
                         f"elements, the experts need {volume}: the experts are missing from it")
        else:
            note = ("no key of the ep=1 checkpoint holds an expert's tensor as the model holds it "
                    "and no name pattern matched (a fused or transposed form?): the checkpoints "
                    "were compared key by key and value by value without expert attribution; name "
                    "the expert keys with the adapter's expert_keys or --moe-ep-expert-key for "
                    "findings in expert terms")
    _KNOWLEDGE.put(truth_path, Knowledge(patterns, note, by_position))
    return found


def _layers_missing(index: Any, owners: Mapping[Any, Any], keys: Mapping[str, Any],
                    state: Mapping[Any, Any]) -> list[str]:
    """Layers of the model none of whose experts any key of the ep=1 checkpoint holds, while other
    layers' experts are found by their values (a layer left out of every save: MTP layers a save
    skipped).  Not said where the keys not understood have room for them (another form)."""
    from conformance.inspection.learn import unexplained_volume

    held = {learned.layer for learned in keys.values()}
    if not held:
        return []
    wanted: dict[Any, list[Any]] = {}
    for (layer, expert, name), tensor in state.items():
        if expert is not None and layer not in held:
            wanted.setdefault(layer, []).append((name, tensor.numel()))
    if not wanted:
        return []
    rest = [k for k, e in index.entries.items() if e.is_tensor and e.shape and k not in keys]
    room = unexplained_volume(index, owners, rest)
    if room >= sum(n for found in wanted.values() for _, n in found):
        return []
    return [f"the ep=1 checkpoint: layer {layer}: no key holds any of its experts' tensors "
            f"({', '.join(repr(n) for n in sorted({name for name, _ in found}))}): the layer is "
            "missing from it"
            for layer, found in sorted(wanted.items(), key=lambda kv: repr(kv[0]))]


def checkpoint_findings(adapter: TimedAdapter, path: str, truth_path: str, num_experts: int,
                        patterns: Sequence[KeyPattern] | None = None) -> list[str]:
    """Every way the checkpoint at ``path`` differs from an EP-invariant one, in expert terms.

    ``patterns``: the expert keys as learned from the truth (:func:`knowledge`).  "No key matched an
    expert pattern" is no finding here: the comparison with the ep=1 checkpoint names any expert key
    it lacks.
    """
    from conformance.inspection import DEFAULT_PATTERNS, compare_indexes, inspect_index

    patterns = patterns if patterns else DEFAULT_PATTERNS  # an Evidence stays one
    index, truth = read_index(adapter, path), read_index(adapter, truth_path)
    found = [str(f)
             for f in inspect_index(index, num_experts=num_experts, patterns=patterns).findings
             if f.problem != "no_expert_keys"]
    ignore = adapter.members.value("ep_dependent_keys")
    learned = known(truth_path)
    owners = learned.owners if learned is not None else None
    compared = compare_indexes(index, truth, values=True, ignore=ignore, patterns=patterns,
                               names=("checkpoint", "ep=1 checkpoint"),
                               rounding_ulps=ROUNDING_ULPS, owners=owners)
    # positional ids that moved leads: every key of the checkpoint is then read as the ep=1 save's
    # key of that name, which here holds another parameter's state -- what the rest follows from
    moved = [str(f) for f in compared if f.problem == "ids_moved"]
    found = [*moved, *found, *(str(f) for f in compared)]
    return list(dict.fromkeys(found))


def non_persistent_buffers(model: Any) -> tuple[str, ...]:
    """The names of ``model``'s non-persistent buffers (a router's token counter): state for one
    step, which no checkpoint should hold.  Nothing for a model that is no torch module."""
    named = getattr(model, "named_modules", None)
    if not callable(named):
        return ()
    return tuple(sorted(f"{prefix}.{name}" if prefix else name for prefix, module in named()
                        for name in getattr(module, "_non_persistent_buffers_set", ())))


def transient_findings(adapter: TimedAdapter, truth_path: str,
                       transient: Sequence[str]) -> list[str]:
    """Keys of the ep=1 checkpoint that hold a non-persistent buffer of the model (by its name,
    under any prefix the framework's save adds)."""
    if not transient:
        return []
    keys = list(read_index(adapter, truth_path).entries)
    return [f"the ep=1 checkpoint: key {key!r} holds the non-persistent buffer {name!r} (state for "
            "one step, which a checkpoint must not hold)" for name in transient for key in keys
            if key == name or key.endswith(f".{name}")]


def truth_findings(adapter: TimedAdapter, truth_path: str, truth_state: Mapping[Any, Any],
                   declared: tuple[KeyPattern, ...] = ()) -> list[str]:
    """Learn the truth checkpoint's expert keys from its content; expert keys (or rows) holding
    another expert's tensor of the model, and experts missing from it altogether."""
    return _learn(adapter, truth_path, truth_state, declared)


def run(ctx: CheckContext) -> None:
    """Inspect the checkpoint in the cell that wrote it (rank 0; every rank gets the findings), and
    report what the inspections found of it and of the truth checkpoint; then give every rank what
    rank 0 knows of the truth's expert keys, so that a load that raises is read with the same keys
    everywhere, with no new work while ranks raise (:func:`known`)."""
    import torch.distributed as dist

    adapter, plan, verdict, rank = ctx.adapter, ctx.plan, ctx.verdict, ctx.rank
    if plan.save:
        found: list[Any] = [()]
        if rank == 0 and plan.truth_path:
            started = time.perf_counter()
            patterns = _knowledge(ctx).patterns
            found[0] = tuple(checkpoint_findings(adapter, plan.path, plan.truth_path,
                                                 ctx.cell.num_experts, patterns))
            verdict.timings["inspect"] = time.perf_counter() - started
        dist.broadcast_object_list(found, src=0)
        verdict.findings = tuple(found[0])
    if rank == 0:
        for finding in (*verdict.truth_findings, *verdict.findings):
            verdict.problem("checkpoint", f"checkpoint: {finding}")
    if not plan.truth_path:
        verdict.skipped["checkpoint"] = adapter.members.unreadable()
        return
    sent: list[Any] = [_knowledge(ctx) if rank == 0 else None]
    dist.broadcast_object_list(sent, src=0)
    if rank != 0:
        remember(plan.truth_path, sent[0])
    elif sent[0].note:
        verdict.skipped["checkpoint attribution"] = sent[0].note


def _knowledge(ctx: CheckContext) -> Knowledge:
    """What this rank knows of the truth checkpoint's expert keys, learned now if it does not yet
    (from the save side's ground truth)."""
    adapter, spec, rank, truth_path = ctx.adapter, ctx.save_spec, ctx.rank, ctx.plan.truth_path
    assert truth_path is not None
    return knowledge(adapter, truth_path, lambda: ground_truth(adapter, spec, rank).tensors,
                     declared_patterns(adapter, ctx.plan.expert_keys))

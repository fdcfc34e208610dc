"""Positional optimizer ids: when they move with the layout, which parameters moved.

torch's own ``Optimizer.state_dict()`` keys each parameter's state by its position among the
parameters the optimizer holds (``optimizer.state.1.exp_avg``), and a trainer that saves it through
DCP writes those ids as keys. With packed experts every rank holds the same parameters in the same
order, so the ids are the same at every EP degree and such a checkpoint can be EP-invariant (the
learned key patterns keep such ids literal: :func:`conformance.inspection.learn.learned_patterns`).
With one module per expert a rank holds only its own experts, the ids after them shift with EP, and
DCP keeps one rank's copy of each id: the checkpoint holds other parameters' state under the ids the
ep=1 save gives them.  :func:`moved_ids` names those parameters, from the value matching the
comparison already did (which key here holds which key's value there).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from conformance.inspection.model import CheckpointIndex, CheckpointProblem

__all__ = ["POSITIONAL", "ParamAt", "moved_ids", "positional", "resolve"]

#: an optimizer state keyed by position: ``<...>state.<id>.<stat>``
#: (``optimizer.state.4.exp_avg_sq``).
POSITIONAL = re.compile(r"^(?P<head>(?:.+\.)?state)\.(?P<id>\d+)\.(?P<stat>[A-Za-z_]\w*)$")
SHOWN = 4


def positional(key: str) -> tuple[str, int, str] | None:
    """``(head, id, stat)`` of a positional optimizer-state key, else ``None``."""
    found = POSITIONAL.match(key)
    return (found["head"], int(found["id"]), found["stat"]) if found else None


class ParamAt(NamedTuple):
    """The parameter a torch optimizer holds at one position, as the live optimizer of the ep=1
    truth shows it (its param groups in order, as ``torch.distributed.checkpoint.state_dict`` maps
    ids to FQNs): its FQN in the model, its global shape, and what the adapter's walks yield of it
    -- ``kind`` "packed" (a row per expert), "per_expert" (one expert's, ``expert``) or "dense";
    ``layer`` and ``name`` the model's."""

    fqn: str
    shape: tuple[int, ...]
    kind: str
    layer: Any = None
    expert: Any = None
    name: str = ""


def resolve(index: CheckpointIndex,
            optimizers: Sequence[Sequence[ParamAt]]) -> dict[str, tuple[ParamAt, str]]:
    """``key -> (the parameter, the state's name)`` of each positional optimizer-state tensor of
    ``index`` (however deep the trainer nests ``Optimizer.state_dict()``: ``state.optimizer.
    pp_0_stage_0.state.12.exp_avg``) that one of the live ``optimizers`` explains.  The keys of one
    head (the part before ``.state.<id>``) are one optimizer's: the one whose parameters have the
    shapes of every tensor state under that head, where exactly one has (else the head is left
    unresolved)."""
    heads: dict[str, list[tuple[str, int, str]]] = defaultdict(list)
    for key, entry in index.entries.items():
        found = positional(key)
        if found is not None and entry.is_tensor and entry.shape:
            heads[found[0]].append((key, found[1], found[2]))
    out: dict[str, tuple[ParamAt, str]] = {}
    for keys in heads.values():
        fits = [params for params in optimizers
                if all(i < len(params) and params[i].shape == tuple(index.entries[k].shape or ())
                       for k, i, _ in keys)]
        if len(fits) == 1:
            out.update((k, (fits[0][i], stat)) for k, i, stat in keys)
    return out


def _parameter(owners: Mapping[str, Any], head: str, number: int, stats: Iterable[str]) -> str:
    """The parameter the other checkpoint keeps at ``number``, in model terms where its value was
    identified (``owners``: key -> (layer, global expert, name))."""
    for stat in sorted(stats):
        owner = owners.get(f"{head}.{number}.{stat}")
        if owner is not None:
            layer, expert, name = owner
            name = name[: -len(stat) - 1] if name.endswith(f".{stat}") else name
            where = [f"layer {layer}"] if layer is not None else []
            where += [f"expert {expert}"] if expert is not None else []
            return f"{name!r}" + (f" ({', '.join(where)})" if where else "")
    return f"the parameter at id {number}"


def moved_ids(pairs: Iterable[tuple[str, str | None]], owners: Mapping[str, Any],
              names: tuple[str, str]) -> CheckpointProblem | None:
    """One problem naming the parameters whose positional ids differ between the two checkpoints, or
    ``None``.

    ``pairs``: ``(key here, the other checkpoint's key whose value it holds)``; ``owners``: the
    other checkpoint's keys in model terms; ``names``: what the two checkpoints are called."""
    moved: dict[tuple[str, int], set[int]] = defaultdict(set)
    stats: dict[tuple[str, int], set[str]] = defaultdict(set)
    for here, there in pairs:
        a, b = positional(here), positional(there or "")
        if a is not None and b is not None and (a[0], a[2]) == (b[0], b[2]) and a[1] != b[1]:
            moved[(b[0], b[1])].add(a[1])
            stats[(b[0], b[1])].add(b[2])
    if not moved:
        return None
    parts = [f"{_parameter(owners, head, was, stats[(head, was)])} is at id {was} in the "
             f"{names[1]}, {', '.join(map(str, sorted(now)))} here"
             for (head, was), now in sorted(moved.items())]
    more = f"; and {len(parts) - SHOWN} more" if len(parts) > SHOWN else ""
    heads = sorted({head for head, _ in moved})
    return CheckpointProblem(
        "ids_moved", f"{heads[0]}.*", "positional optimizer ids moved: "
        f"{'; '.join(parts[:SHOWN])}{more}: the state of {len(parts)} parameter(s) is under other "
        f"ids than in the {names[1]} (torch's Optimizer.state_dict() numbers the parameters each "
        "rank holds; a rank that holds other parameters at this layout shifts the ids after them)")

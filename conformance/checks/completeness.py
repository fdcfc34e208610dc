"""Nothing goes missing: every name the ground truth holds is held after the load, per replica group.

A *replica group* is a set of ranks that together hold one whole copy of the model (its EP ranks,
times its expert-tensor-parallel and, under FSDP2, its dp_shard ranks: see
:meth:`~conformance.layout.ParallelLayout.replica_groups`).  Each must hold every ``(layer, expert,
name)`` of the truth -- optimizer moments included.  A union over the whole world would not do: an
EP split that takes the global rank for its EP rank gives one group half of the experts twice and
another group the other half, and the world as a whole still holds them all.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from conformance.checks.verdict import Key, RankVerdict
from conformance.inspection import expert_ranges
from conformance.layout import ParallelLayout

SHOWN = 4


def _missing_lines(missing: set[Key], group: list[int]) -> list[str]:
    """One line per (layer, name): the experts of it the group lacks."""
    by_name: dict[tuple[Any, str], list[int]] = defaultdict(list)
    dense = []
    for layer, expert, name in missing:
        if expert is None:
            dense.append(f"layer {layer}, tensor {name!r}" if layer is not None else f"tensor {name!r}")
        else:
            by_name[(layer, name)].append(expert)
    ranks = ", ".join(map(str, group))
    lines = [f"after the load the ranks [{ranks}] (one replica) hold no {name!r} of layer {layer}, "
             f"expert{'s' if len(ids) > 1 else ''} {expert_ranges(ids)}"
             for (layer, name), ids in sorted(by_name.items(), key=repr)]
    lines += [f"after the load the ranks [{ranks}] (one replica) hold no {what}" for what in sorted(dense)]
    return lines


def check_replicas(rank: int, held: set[Key], truth: set[Key], layout: ParallelLayout, fsdp: bool,
                   verdict: RankVerdict) -> None:
    """A collective: rank 0 reports each replica group's missing names (and ranks holding none at all)."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(held, key=repr))
    if rank != 0:
        return
    by_rank = [{tuple(k) for k in found} for found in everyone]
    lines: list[str] = []
    for group in layout.replica_groups(fsdp):
        union: set[Key] = set().union(*(by_rank[r] for r in group))
        lines += _missing_lines(truth - union, group)
    if len(lines) > SHOWN:
        lines[SHOWN - 1] += f" (and {len(lines) - SHOWN} more missing tensor families)"
    for line in lines[:SHOWN]:
        verdict.problem("missing", line)

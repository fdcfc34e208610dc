"""Whether a world whose call failed on every rank may serve the next call.

Starting a world is cheap (a fork), but what its ranks built up is not: a matrix's ground truths,
the expert keys learned from the truth checkpoint, the digests of checkpoints read.  A framework
that refuses half the matrix's loads would pay all of it again after every refusal.  So a call in
which *every* rank raised and returned keeps its world -- if the ranks are still in step:

1. every process group a rank belongs to has run the same number of collectives on each of its
   members (torch's per-group sequence number).  A rank that posted a collective its peers never
   reached (an ``async_op`` left unwaited when it raised) would otherwise pair that collective with
   the peers' next one;
2. then one real all-reduce on the default group, under a short deadline, returns the world size
   on every rank: the transport itself still works.

Anything else -- a rank that died, hung or returned while another raised, a probe that fails or
disagrees, an NCCL world (whose communicators may hold an asynchronous error) -- and the world is
killed as before: a call never inherits a world that is not known to be sound.
:func:`collective_positions` and :func:`all_reduce_world_size` run on the ranks,
:func:`why_replaced` and :func:`out_of_step` on the controller.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pytest_moe_ep.world.engine import RankFailure, WorldError

#: one rank's report: process group name -> (its members' global ranks, collectives it has run).
Positions = dict[str, tuple[tuple[int, ...], int]]

#: the backends whose worlds may be kept after a failed call.
KEPT_BACKENDS = ("gloo",)
#: how long each probe call may take before the world counts as broken (seconds).
PROBE_TIMEOUT_S = 10.0


def collective_positions() -> Positions:
    """This rank's position in every process group it belongs to (runs on a rank)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    found: Positions = {}
    for group, name in list(c10d._world.pg_names.items()):
        members = c10d._world.pg_group_ranks.get(group)
        if members is None or dist.get_rank() not in members:
            continue
        # torch's stubs omit the getter; gloo and NCCL groups both count their collectives
        count = group._get_sequence_number_for_group()  # type: ignore[attr-defined]
        found[name] = (tuple(sorted(members)), int(count))
    return found


def all_reduce_world_size() -> int:
    """One all-reduce of ones over the default group: the world size when the transport works."""
    import torch
    import torch.distributed as dist

    ones = torch.ones(1)
    dist.all_reduce(ones)
    return int(ones.item())


def out_of_step(reports: Sequence[Positions]) -> str | None:
    """Why the ranks' :func:`collective_positions` (``reports[r]`` is rank ``r``'s) show them out of
    step, or ``None`` when every group's members agree."""
    groups: dict[str, tuple[int, ...]] = {}
    for positions in reports:
        for name, (members, _) in positions.items():
            groups.setdefault(name, members)
    for name, members in sorted(groups.items()):
        seen: Mapping[int, tuple[tuple[int, ...], int] | None] = {
            r: reports[r].get(name) if r < len(reports) else None for r in members}
        absent = [r for r, found in seen.items() if found is None]
        if absent:
            return (f"process group {name} (ranks {list(members)}) is unknown to rank(s) "
                    f"{absent}")
        counts = {r: found[1] for r, found in seen.items() if found is not None}
        if len(set(counts.values())) > 1:
            listed = ", ".join(f"rank {r}: {n}" for r, n in sorted(counts.items()))
            return f"process group {name} ran different numbers of collectives ({listed})"
    return None


def why_replaced(exc: BaseException, world_size: int, backend: str, alive: bool,
                 probe: Callable[[Callable[[], Any], bool], list[Any]]) -> str:
    """Why a world whose call raised ``exc`` must be replaced ("" when it may serve on).

    ``probe(fn, agree)`` runs ``fn`` on every rank under :data:`PROBE_TIMEOUT_S` and returns the
    values in rank order, raising :class:`WorldError` when it cannot; ``agree=False`` skips the
    ranks' agreement on the call id, itself a collective, before the positions are known."""
    if not isinstance(exc, RankFailure) or len(exc.errors) < world_size:
        return "not every rank raised and returned"
    if backend not in KEPT_BACKENDS or not alive:
        return f"a {backend} world is not kept after a failure"
    try:
        why = out_of_step(probe(collective_positions, False))
        if why:
            return why
        sums = probe(all_reduce_world_size, True)
    except WorldError as failed:
        return f"the probe of the ranks' process groups failed: {failed.cause}"
    if sums != [world_size] * world_size:
        return f"an all-reduce of ones over the world gave {sums}"
    return ""

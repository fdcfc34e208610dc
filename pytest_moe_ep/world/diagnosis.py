"""Why a call failed: each rank's state, the ranks at fault, and the :class:`WorldError` that says
so.

On a deadline the supervisor sends every live rank ``STACK_SIGNAL``; ``faulthandler`` writes all
threads' stacks into the rank's stack file, whose first line names the main thread.  A rank whose
main thread is inside ``torch.distributed`` is a *victim*, blocked in a collective waiting for
someone; a rank running anything else, or a dead one, is a *suspect*.

A hang is not always seen as a deadline: the process group's own timeout may fire first on the ranks
waiting in a collective, so they *raise* while the stuck rank still runs its own code.  That is
still a hang, and it is reported as one, with the stuck rank's ``file:line``.  So is a deadlock:
every rank waiting in a collective that no other rank will join (each rank calls a different one,
or the same one on another group).  Nobody runs their own code there, so the story is where each
rank waits: the collective it is in and the code that called it (:func:`waiting_in`), whether the
deadline found them there or the process group's timeout made them raise (the call's first failure
came no sooner than that timeout: the transport's own text, which names no call, comes after).
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from enum import Enum

from pytest_moe_ep.text import first_line, shorten
from pytest_moe_ep.world.engine import RankFailure, RankOutput, Section, WorldError, WorldTimeout
from pytest_moe_ep.world.protocol import RankError

__all__ = ["Observed", "RankState", "RankStatus", "diagnose", "shorten", "suspects", "waiting_in"]

_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)", re.MULTILINE)
_HEADER = re.compile(r"^main thread (0x[0-9a-f]+)$", re.MULTILINE)


def main_thread_stack(header: str, dump: str) -> str:
    """The block of ``dump`` for the main thread named in ``header``; all of ``dump`` if not
    found."""
    found = _HEADER.search(header)
    if not found:
        return dump
    ident = int(found.group(1), 16)
    starts = list(_THREAD.finditer(dump))
    for i, m in enumerate(starts):
        if int(m.group(1), 16) == ident:
            end = starts[i + 1].start() if i + 1 < len(starts) else len(dump)
            return dump[m.start():end].rstrip()
    return dump.rstrip()


def _frames(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip().startswith("File ")]


def _signature(error: RankError) -> tuple[str, ...]:
    """What makes two ranks' errors the same: the exception type and the frames it was raised
    through."""
    return (error.type_name, *_frames(error.traceback))


def in_collective(stack: str) -> bool:
    """True when a faulthandler dump (innermost frame first) is inside torch.distributed code."""
    return any("torch/distributed/" in line for line in _frames(stack)[:8])


def raised_in_collective(traceback_text: str) -> bool:
    """True when a Python traceback (innermost frame last) ends inside torch.distributed code."""
    return any("torch/distributed/" in line for line in _frames(traceback_text)[-3:])


class RankStatus(str, Enum):
    """What one rank was doing when its call failed; the value is the word the report prints."""

    RETURNED = "returned"
    RAISED = "raised"
    RAISED_IN_COLLECTIVE = "raised in a collective"
    DEAD = "dead"
    IN_COLLECTIVE = "in a collective"
    OUTSIDE_COLLECTIVE = "outside any collective"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


#: the ranks that waited for others: in a collective, or in one when the process group's timeout
#: fired.
_WAITING = (RankStatus.IN_COLLECTIVE, RankStatus.RAISED_IN_COLLECTIVE)


@dataclass(frozen=True)
class RankState:
    rank: int
    state: RankStatus
    #: the rank's own story: its error's headline, or how it died ("died of signal SIGKILL ...").
    detail: str = ""


def suspects(states: list[RankState]) -> list[int]:
    """The ranks at fault in a failed or hung call, most direct cause first.

    A dead rank or one that raised or hangs in its own code is at fault; ranks that merely saw a
    collective fail or block because of it are victims.  Only when nobody else is to blame do ranks
    that raised inside a collective, or that left the call while others wait in one, count.
    """
    direct = (RankStatus.DEAD, RankStatus.RAISED, RankStatus.OUTSIDE_COLLECTIVE)
    for group in (direct, (RankStatus.RAISED_IN_COLLECTIVE,)):
        found = [s.rank for s in states if s.state in group]
        if found:
            return found
    waiting = [s.rank for s in states if s.state is RankStatus.IN_COLLECTIVE]
    left = [s.rank for s in states if s.state is RankStatus.RETURNED]
    return left if (waiting and left) else waiting


# a faulthandler dump's frame (``line 12 in f``) or a Python traceback's (``line 12, in f``)
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)')
#: where a chained traceback's first exception (the root cause, raised innermost) ends.
_CHAINED = re.compile(r"^(?:The above exception was the direct cause|During handling of the "
                      r"above exception)", re.MULTILINE)


@dataclass(frozen=True)
class Frame:
    path: str
    line: str
    func: str

    @property
    def in_collective(self) -> bool:
        return "torch/distributed/" in self.path

    @property
    def place(self) -> str:
        """``file:line``, the file by its last three path parts."""
        return f"{'/'.join(self.path.split('/')[-3:])}:{self.line}"

    def __str__(self) -> str:
        return f"{self.place} in {self.func}"


def frames(text: str, innermost_first: bool) -> list[Frame]:
    """The frames of a faulthandler dump (``innermost_first``) or of a Python traceback's root
    cause, innermost first."""
    if not innermost_first:
        text = text[:m.start()] if (m := _CHAINED.search(text)) else text
    found = [Frame(m["path"], m["line"], m["func"])
             for m in map(_FRAME.match, text.splitlines()) if m]
    return found if innermost_first else found[::-1]


def location(stack: str) -> str:
    """``file:line in function`` of the innermost frame of a faulthandler dump ("" when it has
    none)."""
    found = frames(stack, innermost_first=True)
    return str(found[0]) if found else ""


def waiting_in(text: str, innermost_first: bool) -> str:
    """Where a rank was, from its stack dump or traceback: ``in all_reduce (torch/distributed/
    distributed_c10d.py:2950) from x/y.py:40 in save`` -- the collective and the code outside
    ``torch.distributed`` that called it -- or ``at x/y.py:12 in f`` outside any collective ("" when
    the text has no frame)."""
    found = frames(text, innermost_first)
    if not found:
        return ""
    if not found[0].in_collective:
        return f"at {found[0]}"
    caller = next((f for f in found if not f.in_collective), None)
    return f"in {found[0].func} ({found[0].place})" + (f" from {caller}" if caller else "")


def describe_exit(code: int | None) -> str:
    if code is None:
        return "died (exit status unknown)"
    if code < 0:
        try:
            return f"died of signal {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"died of signal {-code} (exit code {code})"
    return f"exited with code {code}"


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _grouped_details(states: list[RankState], at_fault: list[int], errors: dict[int, RankError],
                     locations: dict[int, str]) -> str:
    """What the ranks at fault did, ranks with the same story named once: "ranks 0, 1 raised X:
    m"."""
    groups: dict[str, list[int]] = {}
    for s in states:
        if s.rank not in at_fault:
            continue
        if s.rank in errors:
            e = errors[s.rank]
            key = f"raised {e.type_name}: {first_line(e.message)}".rstrip(": ")
        elif s.state is RankStatus.DEAD:
            key = s.detail
        else:
            where = locations.get(s.rank)
            key = f"was still running, {s.state}" + (f" at {where}" if where else "")
        groups.setdefault(key, []).append(s.rank)
    return "; ".join(f"{_ranks(r)} {shorten(what, 400)}" for what, r in groups.items())


@dataclass
class Observed:
    """What the supervisor saw of one failed call, rank by rank."""

    fn: str
    world_size: int
    backend: str
    timeout_s: float
    returned: set[int]
    errors: dict[int, RankError]
    dead: dict[int, int | None]
    #: main-thread stacks of the ranks still running when the call was given up.
    stacks: dict[int, str]
    #: the call passed its deadline with no rank having failed first.
    timed_out: bool
    #: what each rank said it was doing (:mod:`~pytest_moe_ep.world.activity`): where a rank that
    #: raised raised, where a hung or dead one last was.
    activity: dict[int, dict[str, str]] = field(default_factory=dict)
    #: the process group's timeout, and how long after the call began its first rank failed: a
    #: failure no sooner than the timeout, every rank in a collective, is a deadlock.
    collective_timeout_s: float | None = None
    first_failure_s: float | None = None


def _where_each(seen: Observed, ranks: list[int]) -> str:
    """Where each of ``ranks`` was, ranks in the same place named once: "ranks 0, 2 in all_reduce
    (...) from x.py:40 in save; rank 1 in barrier (...) from ..."."""
    groups: dict[str, list[int]] = {}
    for r in ranks:
        if r in seen.stacks:
            where = waiting_in(seen.stacks[r], innermost_first=True)
        elif r in seen.errors:
            where = waiting_in(seen.errors[r].traceback, innermost_first=False)
        else:
            where = ""
        groups.setdefault(where or "(no stack)", []).append(r)
    return "; ".join(f"{_ranks(r)} {where}" for where, r in groups.items())


def diagnose(seen: Observed, outputs: list[RankOutput], crashes: dict[int, str]) -> WorldError:
    """The :class:`WorldError` for a failed call: who is at fault, a hang or a failure, every rank's
    story."""
    states: list[RankState] = []
    for r in range(seen.world_size):
        if r in seen.errors:
            raised = (RankStatus.RAISED_IN_COLLECTIVE
                      if raised_in_collective(seen.errors[r].traceback) else RankStatus.RAISED)
            states.append(RankState(r, raised, seen.errors[r].headline()))
        elif r in seen.dead:
            states.append(RankState(r, RankStatus.DEAD, describe_exit(seen.dead[r])))
        elif r in seen.returned:
            states.append(RankState(r, RankStatus.RETURNED))
        elif r in seen.stacks:
            where = (RankStatus.IN_COLLECTIVE if in_collective(seen.stacks[r])
                     else RankStatus.OUTSIDE_COLLECTIVE)
            states.append(RankState(r, where))
    at_fault = suspects(states)
    locations = {r: location(seen.stacks[r]) for r in at_fault if r in seen.stacks}
    stuck = [s.rank for s in states if s.state is RankStatus.OUTSIDE_COLLECTIVE]
    # The process group's timeout fired on the ranks waiting for a rank stuck in its own code: a
    # hang.
    pg_timeout_hang = bool(stuck) and all(
        s.state in (*_WAITING, RankStatus.OUTSIDE_COLLECTIVE, RankStatus.RETURNED) for s in states
    ) and any(s.state is RankStatus.RAISED_IN_COLLECTIVE for s in states)
    # every rank that did not return waits in (or timed out in) a collective nobody else joins
    in_collectives = not stuck and all(
        s.state in (*_WAITING, RankStatus.RETURNED) for s in states) and any(
        s.state in _WAITING for s in states)
    timed_out_in_collectives = (
        in_collectives and any(s.state is RankStatus.RAISED_IN_COLLECTIVE for s in states)
        and seen.collective_timeout_s is not None and seen.first_failure_s is not None
        and seen.first_failure_s >= seen.collective_timeout_s)
    hung = seen.timed_out or pg_timeout_hang or timed_out_in_collectives
    waiting = [s.rank for s in states if s.state in _WAITING and s.rank not in at_fault]
    if hung and in_collectives:
        ranks = [s.rank for s in states if s.state in _WAITING]
        how = (f"passed its {seen.timeout_s:g}s deadline with every rank waiting in a collective"
               if seen.timed_out else "every rank timed out in a collective after the process "
               f"group's {seen.collective_timeout_s:g}s timeout")
        failed = [r for r in ranks if r in seen.errors]
        transport = (f"; the transport: {_grouped_details(states, failed, seen.errors, locations)}"
                     if failed else "")
        returned = sorted(seen.returned)
        left = f"; {_ranks(returned)} had returned" if returned else ""
        cause = f"hung: {how} (a deadlock): {_where_each(seen, ranks)}{left}{transport}"
    elif hung:
        how = (f"passed its {seen.timeout_s:g}s deadline" if seen.timed_out
               else "timed out in a collective waiting for a stuck rank")
        stuck_at = "; ".join(f"rank {r} at {locations[r]}" for r in at_fault if locations.get(r))
        cause = (f"hung: {how}; suspect {_ranks(at_fault)}" + (f" ({stuck_at})" if stuck_at else "")
                 + (f"; {_ranks(waiting)} waiting in a collective" if waiting else ""))
    else:
        cause = f"failed on rank(s) {', '.join(map(str, at_fault))}: " \
                f"{_grouped_details(states, at_fault, seen.errors, locations)}"
    cls = WorldTimeout if hung else RankFailure
    return cls(fn=seen.fn, world_size=seen.world_size, backend=seen.backend, cause=cause,
               at_fault=at_fault, waiting=waiting, locations=locations, errors=dict(seen.errors),
               states={s.rank: s.state.value for s in states}, activity=dict(seen.activity),
               sections=_sections(seen, states, at_fault, crashes), outputs=outputs)


def _sections(seen: Observed, states: list[RankState], at_fault: list[int],
              crashes: dict[int, str]) -> list[Section]:
    """Every rank's state, then one full traceback per distinct error of the ranks at fault, and
    only their stacks; the rest -- victims, and ranks that raised the same error at the same place
    -- in a line each."""
    first_with: dict[tuple[str, ...], int] = {}
    # the first rank at fault with an error -> later ranks with that error
    same: dict[int, list[int]] = {}
    for r in sorted(set(seen.errors) & set(at_fault)):
        first = first_with.setdefault(_signature(seen.errors[r]), r)
        if first != r:
            same.setdefault(first, []).append(r)
    folded = {r for ranks in same.values() for r in ranks}
    listing = [f"rank {s.rank}: {s.state.value}" + (" <- suspect" if s.rank in at_fault else "")
               for s in states]
    sections = [Section("ranks", "\n".join(listing), tuple(s.rank for s in states))]
    for r in range(seen.world_size):
        if r in seen.errors and r in at_fault:
            if r not in folded:
                sections.append(Section(f"rank {r} traceback", seen.errors[r].traceback
                                        or seen.errors[r].headline(), (r,)))
            if r in same:
                sections.append(
                    Section(f"{_ranks(same[r])}: the same error at the same place as rank {r}",
                            "\n".join(seen.errors[o].headline() for o in same[r]), tuple(same[r])))
        elif r in seen.errors:
            sections.append(Section(f"rank {r} (victim)", seen.errors[r].headline(), (r,)))
        if r in seen.dead:
            sections.append(Section(f"rank {r} {describe_exit(seen.dead[r])}",
                                    crashes.get(r) or "(no Python stack recorded)", (r,)))
        if r in seen.stacks and r in at_fault:
            sections.append(Section(f"rank {r} stack when given up (suspect)", seen.stacks[r], (r,
                                    )))
        elif r in seen.stacks:
            where = "waiting in a collective" if in_collective(seen.stacks[r]) else "running"
            sections.append(Section(f"rank {r} (victim)", f"{where} at {location(seen.stacks[r])}",
                                    (r,)))
    return sections

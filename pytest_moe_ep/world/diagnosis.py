"""Why a call failed: each rank's state, the ranks at fault, and the :class:`WorldError` that says
so.

On a deadline the supervisor sends every live rank ``STACK_SIGNAL``; ``faulthandler`` writes all
threads' stacks into the rank's stack file, whose first line names the main thread.  A rank whose
main thread is inside ``torch.distributed`` is a *victim*, blocked in a collective waiting for
someone; a rank running anything else, or a dead one, is a *suspect*.

A hang is not always seen as a deadline: the process group's own timeout may fire first on the ranks
waiting in a collective, so they *raise* while the stuck rank still runs its own code.  That is
still a hang, and it is reported as one, with the stuck rank's ``file:line``.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from enum import Enum

from pytest_moe_ep.text import first_line, shorten
from pytest_moe_ep.world.engine import RankFailure, RankOutput, Section, WorldError, WorldTimeout
from pytest_moe_ep.world.protocol import RankError

__all__ = ["Observed", "RankState", "RankStatus", "diagnose", "shorten", "suspects"]

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


_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def location(stack: str) -> str:
    """``file:line in function`` of the innermost frame of a faulthandler dump ("" when it has
    none)."""
    for line in stack.splitlines():
        found = _FRAME.match(line)
        if found:
            path = "/".join(found["path"].split("/")[-3:])
            return f"{path}:{found['line']} in {found['func']}"
    return ""


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
    hung = seen.timed_out or pg_timeout_hang
    waiting = [s.rank for s in states if s.state in _WAITING and s.rank not in at_fault]
    if hung:
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
               states={s.rank: s.state.value for s in states},
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

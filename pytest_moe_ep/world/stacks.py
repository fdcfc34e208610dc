"""Reading the Python stacks ranks dump on a hang, and naming the suspect.

On a deadline the supervisor sends every live rank ``STACK_SIGNAL``; ``faulthandler`` writes all
threads' stacks into the rank's stack file, whose first line names the main thread.  A rank whose
main thread is inside ``torch.distributed`` is a *victim*, blocked in a collective waiting for
someone; a rank running anything else, or a dead one, is a *suspect*.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)", re.MULTILINE)
_HEADER = re.compile(r"^main thread (0x[0-9a-f]+)$", re.MULTILINE)


def main_thread_stack(header: str, dump: str) -> str:
    """The block of ``dump`` for the main thread named in ``header``; all of ``dump`` if not found."""
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


def in_collective(stack: str) -> bool:
    """True when a faulthandler dump (innermost frame first) is inside torch.distributed code."""
    return any("torch/distributed/" in line for line in _frames(stack)[:8])


def raised_in_collective(traceback_text: str) -> bool:
    """True when a Python traceback (innermost frame last) ends inside torch.distributed code."""
    return any("torch/distributed/" in line for line in _frames(traceback_text)[-3:])


@dataclass(frozen=True)
class RankState:
    rank: int
    #: "returned", "raised", "raised in a collective", "dead", "in a collective" or "outside any collective"
    state: str
    detail: str = ""


def suspects(states: list[RankState]) -> list[int]:
    """The ranks at fault in a failed or hung call, most direct cause first.

    A dead rank or one that raised or hangs in its own code is at fault; ranks that merely saw a
    collective fail or block because of it are victims.  Only when nobody else is to blame do ranks
    that raised inside a collective, or that left the call while others wait in one, count.
    """
    for group in (("dead", "raised", "outside any collective"), ("raised in a collective",)):
        found = [s.rank for s in states if s.state in group]
        if found:
            return found
    waiting = [s.rank for s in states if s.state == "in a collective"]
    left = [s.rank for s in states if s.state == "returned"]
    return left if (waiting and left) else waiting

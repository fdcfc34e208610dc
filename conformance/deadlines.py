"""How long a matrix cell may run before it counts as hung: the one rule, and what it measured.

A whole distributed test gets ``moe_ep_timeout`` (300 s) by default, which is right for a test
that trains for minutes and wrong for a matrix cell: a cell of the reference's default tier costs
0.15-0.7 s, so a framework whose save deadlocks would wait out 300 s in each cell that meets it.
So, unless the user gave ``moe_ep_timeout`` (``--moe-ep-timeout``, the ini value, ``-o``), which
wins, a cell's deadline comes from what this session measured: :data:`FACTOR` times the slowest cell
so far, never below :data:`FLOOR_S`, and never longer than the call would get otherwise
(pytest-timeout's value for the cell -- a project's blanket ``timeout = 600`` is a bound for whole
tests, not a cell's deadline -- else ``moe_ep_timeout``'s default:
:func:`pytest_moe_ep.distributed.timeout_source`; the caller, :mod:`conformance.items`, takes the
shorter).  The slowest *whole* cell is the measure, not one phase: the first
cell of each spec builds and saves the ep=1 truth, and every cell repeats the truth's build, save
and load a few times at its own layouts, with the harness's gathers and inspection beside them; a
cell that hung (or waited out a collective timeout) is not measured.  Before any cell finished, a
cell gets :data:`UNMEASURED_S`.  Each record says which deadline its cell had and where it came
from (``deadline_s``, ``deadline_from``).

Only a local world's cells get a derived deadline: its supervisor kills a hung world and the next
cell starts another.  Under torchrun a hung collective holds the launch itself, and the engine's
own deadline stays.
"""

from __future__ import annotations

from dataclasses import dataclass

#: a cell's deadline before this session measured any (the first cell, which also starts the world's
#: work: its first builds and saves): far below a whole test's 300 s, far above a first cell's
#: seconds.
UNMEASURED_S = 60.0
#: a cell's deadline is this many times the slowest cell measured: a busy 2-core machine runs a cell
#: several times slower than an idle one, and a spec's first cell (its truth built and saved) costs
#: a few times a later one.
FACTOR = 20.0
#: and never less: a deadlock is still known within seconds.
FLOOR_S = 10.0

#: where a deadline came from, as the record's ``deadline_from`` says it.
MEASURED, UNMEASURED = "measured", "unmeasured"


@dataclass
class Deadlines:
    """The session's measurements and the deadline of the next cell."""

    #: the slowest cell measured so far (its slowest rank's seconds inside the cell), 0: none yet.
    slowest_s: float = 0.0

    def measured(self, seconds: float) -> None:
        """A cell ran to its end (or stopped without hanging) in ``seconds`` on its slowest
        rank."""
        self.slowest_s = max(self.slowest_s, seconds)

    def next(self) -> tuple[float, str]:
        """The next cell's deadline in seconds, and where it came from."""
        if self.slowest_s <= 0:
            return UNMEASURED_S, UNMEASURED
        return round(max(FLOOR_S, FACTOR * self.slowest_s), 1), MEASURED  # as a first line says it


def deadlines_for(engine: object) -> Deadlines | None:
    """The session's cell deadlines: a local world's only, whose supervisor kills a hung world;
    under torchrun the engine's own deadline stays (``None``)."""
    from pytest_moe_ep.world.supervisor import Supervisor

    return Deadlines() if isinstance(engine, Supervisor) else None


__all__ = ["FACTOR", "FLOOR_S", "MEASURED", "UNMEASURED", "UNMEASURED_S", "Deadlines",
           "deadlines_for"]

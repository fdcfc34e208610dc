"""A cell's outcome as every report shows it: one word, what counts as red, what counts as expected.

A finished record (:class:`~conformance.record.CellRecord`) has a pytest-facing ``status`` (``pass``,
``fail``, ``error``, ``n/a``, ``interrupted``) and, when it is red, its ``findings`` worst first
(:mod:`conformance.findings`).  What a person reads is neither alone: a framework's loud refusal is
an ``error`` to pytest (the cell could not run its checks) and ``refused`` to a release page.  So
every consumer -- the terminal, the Markdown, HTML and JSON reports, expectations, the status table
-- asks this module, and shows :func:`outcome`, never the status word:

``pass``, ``silent``, ``on-disk``, ``refused``, ``error``, ``n/a``, ``interrupted``

*Red* is a cell whose checks found something or could not run (:func:`is_red`); *expected* is a red
cell the expectations file (or ``--moe-ep-tolerate``, or an update run that rewrote the file) says
is red (:func:`is_expected`).  Each is defined here once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from conformance.findings import ERROR, FINDINGS, PASS

#: a cell that does not apply to the adapter, and one that was running when the session was stopped.
NA, INTERRUPTED = "n/a", "interrupted"
#: every outcome a report shows, in the order it lists them: green, the findings worst first, the rest.
OUTCOMES = (PASS, *FINDINGS, NA, INTERRUPTED)
#: the statuses of a red cell: its checks found something (``fail``) or it could not run them (``error``).
RED_STATUSES = ("fail", "error")
#: how a red cell stood against the expectations when it was expected (``updated``: the run rewrote the
#: file, which now expects it).
EXPECTED_STATES = ("met", "tolerated", "updated")


def is_red(record: Mapping[str, Any]) -> bool:
    """Whether the cell is red: the one test every consumer uses."""
    return record.get("status") in RED_STATUSES


def outcome(record: Mapping[str, Any]) -> str:
    """The one word a report shows for the cell: ``pass``, its worst finding, ``n/a`` or ``interrupted``."""
    status = record.get("status")
    if status in RED_STATUSES:
        return str(record.get("finding") or ERROR)
    if status == PASS:
        return PASS
    return INTERRUPTED if status == INTERRUPTED else NA


def judged_outcome(record: Mapping[str, Any]) -> str | None:
    """The outcome an expectations file speaks of: ``pass`` or a finding; ``None`` for n/a and interrupted."""
    found = outcome(record)
    return None if found in (NA, INTERRUPTED) else found


def is_expected(record: Mapping[str, Any]) -> bool:
    """Whether the cell is red and its red was expected."""
    return is_red(record) and record.get("expectation") in EXPECTED_STATES


def outcome_counts(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Cells counted by :func:`outcome`, every outcome named (``interrupted`` only when there is one)."""
    counts = Counter(outcome(r) for r in records)
    return {o: counts.get(o, 0) for o in OUTCOMES if o != INTERRUPTED or counts.get(o)}


def expected_line(records: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """``(expected, red)``: how many red cells were expected, of how many."""
    red = [r for r in records if is_red(r)]
    return sum(is_expected(r) for r in red), len(red)


__all__ = [
    "EXPECTED_STATES",
    "INTERRUPTED",
    "NA",
    "OUTCOMES",
    "RED_STATUSES",
    "expected_line",
    "is_expected",
    "is_red",
    "judged_outcome",
    "outcome",
    "outcome_counts",
]

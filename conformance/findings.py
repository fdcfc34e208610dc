"""How bad a red cell is: its *finding*, one word a release page and an expectations file can say.

A cell that is not green is one of four kinds of red, worst first:

``silent``
    a load that reported success left the state wrong (``values``, ``missing``, ``scalars``,
    ``resume``, ``forward``): the run resumes on wrong numbers and nobody is told.  This is what the
    matrix exists for.
``on-disk``
    the checkpoint on disk is not EP-invariant (an expert or a moment missing, misfiled, mislabelled
    or re-keyed against the ep=1 save): the damage, or the trap for the next reader, is in the file,
    whether or not this cell's load noticed.
``refused``
    the framework raised or refused loudly (its build, save or load) and handed nothing wrong back:
    a limitation, not a corruption.  Its own file and line travel with it.
``error``
    the adapter or the harness failed (the layout the adapter declared was not formed, an exception
    raised in the adapter's own code, a rank that died or hung): not a finding about the framework.

A cell gets every finding that applies (``findings``, worst first) and is known by the worst
(``finding``). The order is the one place that says which is worse; expectations
(:mod:`conformance.expectations`) compare outcomes by it.  This module is plain data and logic: the
ranks and the controller both import it.
"""

from __future__ import annotations

from collections.abc import Iterable

SILENT, ON_DISK, REFUSED, ERROR = "silent", "on-disk", "refused", "error"
#: the findings, worst first.
FINDINGS = (SILENT, ON_DISK, REFUSED, ERROR)
#: a cell with no finding: what an expectations file says of a cell expected green.
PASS = "pass"
#: what each finding means, one line each (the report's legend, ``--help``).
MEANING = {
    SILENT: "a load that reported success left the state wrong",
    ON_DISK: "the checkpoint on disk is not EP-invariant",
    REFUSED: "the framework refused loudly and handed nothing wrong back",
    ERROR: "the adapter or the harness failed: not a finding about the framework",
}


def __getattr__(name: str) -> dict[str, str]:
    """``CHECK_FINDING``: the finding each check's problem is evidence of, from the checks' table
    (:data:`conformance.checks.table.CHECK_FINDING`) -- read when asked, so that what reads only
    the findings (the report, an expectations file) does not import the checks."""
    if name == "CHECK_FINDING":
        from conformance.checks.table import CHECK_FINDING

        return CHECK_FINDING
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def ordered(found: Iterable[str]) -> list[str]:
    """``found``'s findings once each, worst first (an unknown name is an ``error``: never silently
    dropped)."""
    seen = {f if f in FINDINGS else ERROR for f in found}
    return [f for f in FINDINGS if f in seen]


def worst(found: Iterable[str]) -> str:
    """The worst of ``found``, or :data:`PASS` when there is none."""
    listed = ordered(found)
    return listed[0] if listed else PASS


def severity(outcome: str) -> int:
    """``outcome`` (a finding or :data:`PASS`) as a rank: 0 is ``pass``, higher is worse."""
    return 0 if outcome == PASS else len(FINDINGS) - FINDINGS.index(outcome)


def headline(findings: Iterable[str]) -> str:
    """What a red cell's first line leads with: ``silent, on-disk:``."""
    return ", ".join(ordered(findings)) + ":"


# CHECK_FINDING is this module's __getattr__'s
__all__ = ["CHECK_FINDING", "ERROR", "FINDINGS", "MEANING", "ON_DISK", "PASS",  # noqa: F822
           "REFUSED", "SILENT", "headline", "ordered", "severity", "worst"]

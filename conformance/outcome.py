"""A cell's outcome as every report shows it: one word, what counts as red, what counts as expected.

A finished record (:class:`~conformance.record.CellRecord`) has a pytest-facing ``status``
(``pass``, ``fail``, ``error``, ``n/a``, ``interrupted``) and, when it is red, its ``findings``
worst first (:mod:`conformance.findings`).  What a person reads is neither alone: a framework's loud
refusal is an ``error`` to pytest (the cell could not run its checks) and ``refused`` to a release
page.  So every consumer -- the terminal, the Markdown, HTML and JSON reports, expectations, the
status table -- asks this module, and shows :func:`outcome`, never the status word:

``pass``, ``silent``, ``on-disk``, ``refused``, ``error``, ``n/a``, ``interrupted``

*Red* is a cell whose checks found something or could not run (:func:`is_red`); *expected* is a red
cell the expectations file (or ``--moe-ep-tolerate``, or an update run that rewrote the file) says
is red (:func:`is_expected`).  Each is defined here once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conformance.checks.verdict import CHECKS, LISTED, VERDICT, RankVerdict
from conformance.findings import (
    CHECK_FINDING,
    ERROR,
    FINDINGS,
    ON_DISK,
    PASS,
    REFUSED,
    SILENT,
    headline,
    ordered,
)
from conformance.summary import summarize, summarize_functions
from pytest_moe_ep.text import first_line

if TYPE_CHECKING:
    from conformance.matrix import Cell
    from pytest_moe_ep.world.engine import WorldError

#: a cell that does not apply to the adapter, and one that was running when the session was stopped.
NA, INTERRUPTED = "n/a", "interrupted"
#: every outcome a report shows, in the order it lists them: green, the findings worst first, the
#: rest.
OUTCOMES = (PASS, *FINDINGS, NA, INTERRUPTED)
#: the statuses of a red cell: its checks found something (``fail``) or it could not run them
#: (``error``).
RED_STATUSES = ("fail", "error")
#: how a red cell stood against the expectations when it was expected (``updated``: the run rewrote
#: the file, which now expects it).
EXPECTED_STATES = ("met", "tolerated", "updated")


def is_red(record: Mapping[str, Any]) -> bool:
    """Whether the cell is red: the one test every consumer uses."""
    return record.get("status") in RED_STATUSES


def outcome(record: Mapping[str, Any]) -> str:
    """The one word a report shows for the cell: ``pass``, its worst finding, ``n/a`` or
    ``interrupted``."""
    status = record.get("status")
    if status in RED_STATUSES:
        return str(record.get("finding") or ERROR)
    if status == PASS:
        return PASS
    return INTERRUPTED if status == INTERRUPTED else NA


def judged_outcome(record: Mapping[str, Any]) -> str | None:
    """The outcome an expectations file speaks of: ``pass`` or a finding; ``None`` for n/a and
    interrupted."""
    found = outcome(record)
    return None if found in (NA, INTERRUPTED) else found


def is_expected(record: Mapping[str, Any]) -> bool:
    """Whether the cell is red and its red was expected."""
    return is_red(record) and record.get("expectation") in EXPECTED_STATES


def outcome_counts(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Cells counted by :func:`outcome`, every outcome named (``interrupted`` only when there is
    one)."""
    counts = Counter(outcome(r) for r in records)
    return {o: counts.get(o, 0) for o in OUTCOMES if o != INTERRUPTED or counts.get(o)}


def expected_line(records: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """``(expected, red)``: how many red cells were expected, of how many."""
    red = [r for r in records if is_red(r)]
    return sum(is_expected(r) for r in red), len(red)


# -- the outcome of a cell, from what its ranks sent -----------------------------------------------
@dataclass
class CellOutcome:
    """What a finished cell comes to, built here and nowhere else: its status, its findings (worst
    first), the diagnosis (``detail``: the first line leads with the findings and names rank, layer,
    expert and tensor), every problem structured, each rank's error in full, and the checks that ran
    to their end without a problem (``passed``)."""

    status: str
    detail: str
    findings: list[str] = field(default_factory=list)
    problems: list[dict[str, Any]] = field(default_factory=list)
    errors: dict[str, str] | None = None
    passed: list[str] = field(default_factory=list)


def _failure_findings(verdict: RankVerdict) -> list[str]:
    """What a rank that stopped on an exception found: ``on-disk`` when the checkpoint check had
    found the save not EP-invariant (whatever raised next); ``refused`` when the framework's code
    raised in one of its calls, or DCP refused the save's global plan; ``error`` when the adapter's
    or the harness's code raised, or the framework did not form the cell's layout."""
    failure = verdict.failure
    assert failure is not None
    found = []
    if verdict.findings or verdict.truth_findings or failure.kind == "checkpoint":
        found.append(ON_DISK)
    refused = failure.kind == "save-plan" or (
        failure.raised_in == "framework" and failure.member is not None
        and failure.kind not in ("layout", "adapter"))
    found.append(REFUSED if refused else ERROR)
    return ordered(found)


def _check_findings(cell: Cell, verdicts: Iterable[RankVerdict]) -> list[str]:
    """Every finding the ranks' checks are evidence of, worst first."""
    verdicts = list(verdicts)
    found = [CHECK_FINDING.get(m.check, ERROR) for v in verdicts for m in v.mismatches]
    found += [CHECK_FINDING.get(p.check, ERROR) for v in verdicts for p in v.problems]
    if cell.legacy and not all(v.refused for v in verdicts):
        # the lossy file was taken: the trap is on disk; loaded without a word it is silent, raised
        # loud
        found.append(ON_DISK)
        if any(v.load_raised for v in verdicts if not v.refused):
            found.append(REFUSED)
    return ordered(found)


def _problems(verdicts: Iterable[RankVerdict]) -> list[dict[str, Any]]:
    """Every difference and problem the ranks found, as the record keeps them: one dict each."""
    verdicts = sorted(verdicts, key=lambda v: v.rank)
    out: list[dict[str, Any]] = []
    for v in verdicts:
        out += [{"check": m.check, "finding": CHECK_FINDING.get(m.check, ERROR), "rank": m.rank,
                 "layer": m.layer, "expert": m.expert, "tensor": m.name,
                 "text": f"{m.where()}: {m.problem}"} for m in v.mismatches]
        if v.not_refused and not v.refused:
            out.append({"check": "refusal", "finding": ON_DISK, "rank": v.rank,
                        "text": v.not_refused})
    ranks: dict[tuple[str, str], list[int]] = {}
    for v in verdicts:
        for p in v.problems:
            ranks.setdefault((p.check, p.text), []).append(v.rank)
    order = list(CHECKS)
    for (check, text), where in sorted(ranks.items(), key=lambda kv: _order(order, kv[0][0])):
        out.append({"check": check, "finding": CHECK_FINDING.get(check, ERROR),
                    "ranks": sorted(set(where)), "text": text})
    return out


def _order(order: list[str], check: str) -> int:
    return order.index(check) if check in order else len(order)


def _passed(verdicts: Iterable[RankVerdict], problems: list[dict[str, Any]]) -> list[str]:
    """The listed checks every rank ran to their end and none found anything in."""
    verdicts = list(verdicts)
    if not verdicts:
        return []
    failed = {p.get("check") for p in problems}
    return [c for c in LISTED if all(c in v.ran for v in verdicts) and c not in failed]


def checkpoint_outcome(cell: Cell, verdicts: list[RankVerdict], adapter: str) -> CellOutcome:
    """A checkpoint cell whose every rank returned its verdict."""
    status, detail = summarize(cell, verdicts, adapter)
    if status == PASS:
        return CellOutcome(PASS, detail, passed=_passed(verdicts, []))
    findings = _check_findings(cell, verdicts) or [ERROR]
    problems = _problems(verdicts)
    passed = _passed(verdicts, problems)
    if passed:
        detail += f"\nchecks that passed: {', '.join(passed)}"
    return CellOutcome("fail", f"{headline(findings)} {detail}", findings, problems, passed=passed)


def rank_verdicts(error: WorldError) -> dict[int, RankVerdict]:
    """The verdicts the failed ranks sent with their exceptions (a rank that hung or died sent
    none)."""
    return {rank: e.fields[VERDICT] for rank, e in error.errors.items()
            if isinstance(e.fields.get(VERDICT), RankVerdict)}


def error_outcome(error: WorldError, environment: str = "") -> CellOutcome:
    """A cell whose world call failed: the findings of the ranks at fault (a victim that timed out
    waiting for them says nothing of its own); a world that hung, died or never started is an
    ``error``, and so is a cell the machine failed (``environment``: a full disk)."""
    verdicts = rank_verdicts(error)
    blamed = [v for rank, v in verdicts.items() if not error.at_fault or rank in error.at_fault]
    found = [f for v in blamed if v.failure is not None for f in _failure_findings(v)]
    if error.kind in ("hang", "start"):
        found = [f for f in found if f == ON_DISK] + [ERROR]
    findings = [ERROR] if environment else (ordered(found) or [ERROR])
    problems = _error_problems(error, verdicts)
    passed = _passed(verdicts.values(), problems) if len(verdicts) == error.world_size else []
    errors: dict[str, str] = {}
    for rank, e in sorted(error.errors.items()):
        if e.message not in errors.values():
            errors[str(rank)] = e.message
    detail = f"{headline(findings)} {_lead(findings, blamed)}{error.cause}"
    if passed:
        detail += f"\nchecks that passed before it: {', '.join(passed)}"
    return CellOutcome("error", detail, findings, problems, errors or None, passed)


def _lead(findings: list[str], blamed: list[RankVerdict]) -> str:
    """What a red cell's first sentence says before the engine's cause, so that it is about the
    finding it leads with: a cell on-disk whose ranks then stopped for another reason (a build
    refused, an adapter error) names the checkpoint's first difference first."""
    if not findings or findings[0] != ON_DISK:
        return ""
    if any(v.failure is not None and v.failure.kind == "checkpoint" for v in blamed):
        return ""  # the load's own message leads with the checkpoint's difference
    first = next((f for v in blamed for f in (*v.truth_findings, *v.findings)), None)
    return f"the checkpoint is not EP-invariant: {first}; then " if first else ""


def _error_problems(error: WorldError, verdicts: dict[int, RankVerdict]) -> list[dict[str, Any]]:
    """Each rank's stop, the checkpoint findings and check problems it had, structured."""
    out = [p for p in _problems(verdicts.values()) if p["check"] != "checkpoint"]
    seen: set[str] = set()
    for rank, v in sorted(verdicts.items()):
        for finding in (*v.truth_findings, *v.findings):
            text = f"checkpoint: {finding}"
            if text not in seen:
                seen.add(text)
                out.append({"check": "checkpoint", "finding": ON_DISK, "rank": rank, "text": text})
    for rank, e in sorted(error.errors.items()):
        mine = verdicts.get(rank)
        f = mine.failure if mine is not None else None
        if f is None or mine is None:
            out.append({"check": "run", "finding": ERROR, "rank": rank, "exception": e.type_name,
                        "raised_in": None, "raised_at": "", "text": first_line(e.message)})
            continue
        out.append({"check": f.phase, "finding": _failure_findings(mine)[-1], "rank": rank,
                    "exception": f.exception, "raised_in": f.raised_in, "raised_at": f.raised_at,
                    "text": _without_place(first_line(e.message), f.raised_at)})
    if not error.errors:  # a hang or a rank that died: the engine's cause is all there is
        out.append({"check": "run", "finding": ERROR, "ranks": list(error.at_fault),
                    "text": error.cause})
    return out


def _without_place(text: str, raised_at: str) -> str:
    """A problem's text without the ``raised at`` its own field holds (named once where shown)."""
    if not raised_at:
        return text
    for form in (f" (raised at {raised_at})", f"; raised at {raised_at}"):
        text = text.replace(form, "")
    return text


def functions_outcome(cell: Any, records: list[dict[str, Any]]) -> CellOutcome:
    """A functions cell from its functions' merged records: a function that answers wrong without a
    word is ``silent``."""
    status, detail = summarize_functions(cell, records)
    if status == PASS:
        return CellOutcome(PASS, detail)
    return CellOutcome("fail", f"{headline([SILENT])} {detail}", [SILENT])


#: a functions record's finding by its status: a function that answers wrong without a word is
#: silent.
FUNCTION_FINDING = {"fail": SILENT, "error": ERROR}


__all__ = [
    "EXPECTED_STATES",
    "FUNCTION_FINDING",
    "INTERRUPTED",
    "NA",
    "OUTCOMES",
    "RED_STATUSES",
    "CellOutcome",
    "checkpoint_outcome",
    "error_outcome",
    "expected_line",
    "functions_outcome",
    "is_expected",
    "is_red",
    "judged_outcome",
    "outcome",
    "outcome_counts",
    "rank_verdicts",
]

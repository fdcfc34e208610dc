"""A cell's outcome as every report shows it: one word, what counts as red, what counts as expected.

Two fields of a finished record (:class:`~conformance.record.CellRecord`) say what became of it,
and their words never overlap:

- ``status`` says how far the cell ran: its checks ran to their end and found nothing (``pass``)
  or something (``fail``); it ``stopped`` before they ended (a rank raised, hung or died, or the
  harness failed); it did not apply (``n/a``); the session was stopped while it ran
  (``interrupted``).  Reports before schema 6 wrote ``error`` for ``stopped``; it is read as it.
- ``outcome`` says what a person reads: ``pass``, the cell's worst finding (``silent``,
  ``on-disk``, ``refused``, ``error``: :mod:`conformance.findings`), ``n/a`` or ``interrupted``.
  A framework's loud refusal is ``stopped`` and ``refused``; ``error`` is only ever the finding
  that the adapter or the harness failed.

Every consumer -- the terminal, the JSON, Markdown, HTML and SVG reports, the step summary,
expectations, the status table -- asks this module and shows :func:`outcome`.  *Red* is a cell
that failed or stopped (:func:`is_red`; an interrupted cell is not red: it has no verdict);
*expected* is a red cell the expectations file (or ``--moe-ep-tolerate``, or an update run that
rewrote the file) says is red (:func:`is_expected`); the counts of both, and the sentence that
says them, are :func:`expected_line` and :func:`expected_phrase`.  Each is defined here once, and
so is whether a cell is green (:func:`is_green`: a legacy cell is green when every rank refused
the lossy file).
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
#: a cell whose checks ran to their end and found something, and one that stopped before they ended.
FAIL, STOPPED = "fail", "stopped"
#: every ``status`` a record has, in the order the JSON's ``summary`` counts them.
STATUSES = (PASS, FAIL, STOPPED, NA, INTERRUPTED)
#: what reports before schema 6 wrote for :data:`STOPPED` (read as it; never written).
OLD_STOPPED = "error"
#: every outcome a report shows, in the order it lists them: green, the findings worst first, the
#: rest.
OUTCOMES = (PASS, *FINDINGS, NA, INTERRUPTED)
#: the statuses of a red cell: its checks found something, or it stopped before they ended.
RED_STATUSES = (FAIL, STOPPED, OLD_STOPPED)
#: how a red cell stood against the expectations when it was expected (``updated``: the run rewrote
#: the file, which now expects it).
EXPECTED_STATES = ("met", "tolerated", "updated")
#: how a cell stood against the expectations when it did not come back as the file said.
UNMET = "unmet"


def status_of(record: Mapping[str, Any]) -> str:
    """The record's status, an old report's ``error`` read as ``stopped``."""
    found = str(record.get("status") or "")
    return STOPPED if found == OLD_STOPPED else found


def is_red(record: Mapping[str, Any]) -> bool:
    """Whether the cell is red: the one test every consumer uses."""
    return record.get("status") in RED_STATUSES


def outcome(record: Mapping[str, Any]) -> str:
    """The one word a report shows for the cell: ``pass``, its worst finding, ``n/a`` or
    ``interrupted``."""
    found = record.get("status")
    if found in RED_STATUSES:
        return str(record.get("finding") or ERROR)
    if found == PASS:
        return PASS
    return INTERRUPTED if found == INTERRUPTED else NA


def judged_outcome(record: Mapping[str, Any]) -> str | None:
    """The outcome an expectations file speaks of: ``pass`` or a finding; ``None`` for n/a and
    interrupted."""
    found = outcome(record)
    return None if found in (NA, INTERRUPTED) else found


def is_expected(record: Mapping[str, Any]) -> bool:
    """Whether the cell is red and its red was expected."""
    return is_red(record) and record.get("expectation") in EXPECTED_STATES


def is_unmet(record: Mapping[str, Any]) -> bool:
    """Whether the cell did not come back as the expectations file said (red or green)."""
    return record.get("expectation") == UNMET


def outcome_counts(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Cells counted by :func:`outcome`, every outcome named (``interrupted`` only when there is
    one)."""
    counts = Counter(outcome(r) for r in records)
    return {o: counts.get(o, 0) for o in OUTCOMES if o != INTERRUPTED or counts.get(o)}


def finding_counts(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Red cells counted by their finding (the worst one), every finding named."""
    counts = outcome_counts(records)
    return {f: counts.get(f, 0) for f in FINDINGS}


def status_counts(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Cells counted by :func:`status_of`, every status named (``interrupted`` only when there is
    one)."""
    counts = Counter(status_of(r) for r in records)
    return {s: counts.get(s, 0) for s in STATUSES if s != INTERRUPTED or counts.get(s)}


def expected_line(records: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """``(expected, red)``: how many red cells were expected, of how many."""
    red = [r for r in records if is_red(r)]
    return sum(is_expected(r) for r in red), len(red)


def expected_phrase(records: Iterable[Mapping[str, Any]]) -> str:
    """``N of M red cell(s) expected``: the words every output says :func:`expected_line` in."""
    expected, red = expected_line(records)
    return f"{expected} of {red} red cell(s) expected"


def judged(records: Iterable[Mapping[str, Any]]) -> bool:
    """Whether any cell was judged against expectations (else "expected" says nothing)."""
    return any(r.get("expectation") for r in records)


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
    found += [p.finding or CHECK_FINDING.get(p.check, ERROR) for v in verdicts for p in v.problems]
    if cell.legacy and not _all_refused(verdicts):
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
    ranks: dict[tuple[str, str, str], list[int]] = {}
    for v in verdicts:
        for p in v.problems:
            ranks.setdefault((p.check, p.text, p.finding), []).append(v.rank)
    order = list(CHECKS)
    for (check, text, finding), where in sorted(ranks.items(),
                                                key=lambda kv: _order(order, kv[0][0])):
        out.append({"check": check, "finding": finding or CHECK_FINDING.get(check, ERROR),
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


def _all_refused(verdicts: Iterable[RankVerdict]) -> bool:
    """Every rank refused the legacy (lossy) checkpoint: what a legacy cell must do."""
    return all(v.refused for v in verdicts)


def is_green(cell: Cell, verdicts: list[RankVerdict]) -> bool:
    """Whether a checkpoint cell whose every rank returned its verdict passes: a legacy cell when
    every rank refused the lossy file (whatever else it found: nothing was loaded), any other cell
    when no rank found a difference or a problem."""
    if cell.legacy:
        return _all_refused(verdicts)
    return not any(v.mismatches or v.problems for v in verdicts)


def checkpoint_outcome(cell: Cell, verdicts: list[RankVerdict], adapter: str) -> CellOutcome:
    """A checkpoint cell whose every rank returned its verdict."""
    green = is_green(cell, verdicts)
    detail = summarize(cell, verdicts, adapter, green)
    if green:
        return CellOutcome(PASS, detail, passed=_passed(verdicts, []))
    findings = _check_findings(cell, verdicts) or [ERROR]
    problems = _problems(verdicts)
    passed = _passed(verdicts, problems)
    if passed:
        detail += f"\nchecks that passed: {', '.join(passed)}"
    return CellOutcome(FAIL, f"{headline(findings)} {detail}", findings, problems, passed=passed)


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
    detail = f"{headline(findings)} {_lead(findings, blamed)}{_where_stopped(error)}"
    if passed:
        detail += f"\nchecks that passed before it: {', '.join(passed)}"
    return CellOutcome(STOPPED, detail, findings, problems, errors or None, passed)


def doing(fields: Mapping[str, str]) -> str:
    """What a rank said it was doing (:mod:`pytest_moe_ep.world.activity`, as
    :mod:`conformance.checks.cell` says it), in words: ``the save side's save()``, ``the load side's
    check 'values'``, ``the ep=1 truth`` (the harness's own code there)."""
    side = {"truth": "the ep=1 truth", None: "the cell"}.get(fields.get("side"),
                                                            f"the {fields.get('side')} side")
    call, check = fields.get("call"), fields.get("check")
    if call:
        return f"{side}'s {call}()" + (f" (in the check {check!r})" if check else "")
    return f"{side}'s check {check!r}" if check else side


def _where_stopped(error: WorldError) -> str:
    """The engine's cause, led by where the ranks at fault were when the cell hung or a rank died:
    those stories name no side and no call of their own (a deadlock's ranks all sit in
    ``torch.distributed``; the transport's text names a socket), so the first line says them."""
    dead = [r for r, state in error.states.items() if state == "dead"]
    if error.kind != "hang" and not dead:
        return error.cause
    ranks = [r for r in (error.at_fault or sorted(error.activity)) if r in error.activity]
    groups: dict[str, list[int]] = {}
    for r in ranks:
        groups.setdefault(doing(error.activity[r]), []).append(r)
    if not groups:
        return error.cause
    where = next(iter(groups)) if len(groups) == 1 else "; ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} in {words}"
        for words, r in groups.items())
    if error.kind == "hang":
        return f"{where} hung: {error.cause.removeprefix('hung: ')}"
    return f"{where}: {error.cause}"


def not_tried_again(what: str, failed_in: str, error: WorldError) -> CellOutcome:
    """A cell whose ``what`` (its save, or the ep=1 truth checkpoint it is compared with) failed
    or hung in an earlier cell, ``failed_in``: it is not tried again -- a checkpoint is a pure
    function of the adapter and its save side, so it would fail the same way, or hang a deadline
    more -- and the cell stops with that cell's findings and first line (what it would say run
    alone: one verdict, whatever ran before it), the next line saying where it failed."""
    found = error_outcome(error)
    first, *rest = found.detail.splitlines()
    note = (f"not tried again: {what} failed in {failed_in}, so this cell stopped with that cell's "
            "findings without asking the world")
    return CellOutcome(STOPPED, "\n".join([first, note, *rest]), list(found.findings),
                       list(found.problems))


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


def harness_outcome(text: str) -> CellOutcome:
    """A cell the harness's own code failed in this process (not on a rank): it stopped, and the
    finding is ``error``, not one about the framework."""
    return CellOutcome(STOPPED, f"{headline([ERROR])} {text}", [ERROR])


def functions_outcome(cell: Any, records: list[dict[str, Any]]) -> CellOutcome:
    """A functions cell from its functions' merged records: a function that answers wrong without a
    word is ``silent``."""
    green = all(r.get("status") == PASS for r in records)
    detail = summarize_functions(cell, records, green)
    if green:
        return CellOutcome(PASS, detail)
    return CellOutcome(FAIL, f"{headline([SILENT])} {detail}", [SILENT])


def function_findings(record: Mapping[str, Any]) -> list[str]:
    """One function's findings from its merged record: one that answers wrong without a word is
    ``silent``; one that stopped (or an old report's ``error``) is ``error``; a pass has none."""
    found = status_of(record)
    return [SILENT] if found == FAIL else [ERROR] if found == STOPPED else []


__all__ = [
    "EXPECTED_STATES",
    "FAIL",
    "INTERRUPTED",
    "NA",
    "OLD_STOPPED",
    "OUTCOMES",
    "RED_STATUSES",
    "STATUSES",
    "STOPPED",
    "UNMET",
    "CellOutcome",
    "checkpoint_outcome",
    "doing",
    "error_outcome",
    "expected_line",
    "expected_phrase",
    "finding_counts",
    "function_findings",
    "functions_outcome",
    "harness_outcome",
    "is_expected",
    "is_green",
    "is_red",
    "is_unmet",
    "judged",
    "judged_outcome",
    "not_tried_again",
    "outcome",
    "outcome_counts",
    "rank_verdicts",
    "status_counts",
    "status_of",
]

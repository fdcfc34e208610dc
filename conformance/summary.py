"""A cell's outcome in words, from every rank's verdict (or, for a functions cell, every function's
merged record): the first line is the diagnosis.  What the outcome *is* (green or red, status,
findings) is decided in :mod:`conformance.outcome`, which asks this module for the words of what it
decided, so a cell's words can never disagree with its outcome.

The first line is what the report's failure list, the index and the README table show, so it names
the rank, layer, expert and tensor (or the checkpoint key and experts) and ends with the cell's
context; the lines after it add the other ranks and the other checks, each prefixed with its check.
"""

from __future__ import annotations

from typing import Any

from conformance.checks import CHECKS, Mismatch, RankVerdict
from conformance.checks.table import checks_run
from conformance.matrix import Cell
from conformance.rounding import ROUNDING_ULPS

SHOWN_PROBLEMS = 6


def _context(cell: Cell, adapter: str) -> str:
    return (f"(E={cell.num_experts}, saved at {cell.save.describe()}, loaded at "
            f"{cell.load.describe()}; adapter {adapter})")


def mismatch_lines(verdicts: list[RankVerdict]) -> list[str]:
    """The first difference by rank, one from each other rank, and a count of the rest."""
    found: list[Mismatch] = [m for v in sorted(verdicts, key=lambda v: v.rank)
                             for m in v.mismatches]
    if not found:
        return []
    found.sort(key=lambda m: (m.check != "values", m.rank))
    count = sum(v.mismatch_count for v in verdicts)
    first = found[0]
    lines = [f"first difference: {first.where()}: {first.problem}"]
    others = [m for m in found[1:] if m.rank != first.rank][:3]
    lines += [f"  also {m.where()}: {m.problem}" for m in others]
    if count > 1:
        ranks = sorted({v.rank for v in verdicts if v.mismatch_count})
        lines.append(f"{count - 1} other difference(s), on rank(s) {', '.join(map(str, ranks))}")
    return lines


def _problem_lines(verdicts: list[RankVerdict]) -> list[str]:
    """The ranks' problems by check, each check's in the order they were found (the checkpoint
    check's worst first: :data:`conformance.inspection.compare.ORDER`), by rank."""
    order = list(CHECKS)
    seen = list(dict.fromkeys(p for v in sorted(verdicts, key=lambda v: v.rank)
                              for p in v.problems))
    problems = sorted(seen, key=lambda p: order.index(p.check) if p.check in order else len(order))
    lines = [f"[{p.check}] {p.text}" for p in problems[:SHOWN_PROBLEMS]]
    if len(problems) > SHOWN_PROBLEMS:
        lines.append(f"... and {len(problems) - SHOWN_PROBLEMS} more problems (the record has them "
                     "all; -v shows them)")
    return lines


def _rounding(verdicts: list[RankVerdict]) -> str:
    """`` (bit for bit)`` or how many tensors a kernel's rounding left within :data:`ROUNDING_ULPS`
    of it."""
    count = sum(v.rounded_count for v in verdicts)
    if not count:
        return " bit for bit"
    worst = max(v.rounded_ulps for v in verdicts)
    return (f" ({count} of them within a kernel's rounding of it: at most {worst:.2g} ulps, the "
            f"tolerance is {ROUNDING_ULPS})")


def summarize(cell: Cell, verdicts: list[RankVerdict], adapter: str, green: bool) -> str:
    """The detail of a cell from every rank's verdict, in words that fit one screen; ``green``:
    whether :func:`conformance.outcome.is_green` passed it.  Its findings, and the headline that
    leads with them, are :mod:`conformance.outcome`'s."""
    context = _context(cell, adapter)
    if cell.legacy:
        refused = {v.rank: v.refused for v in verdicts if v.refused}
        if green:
            return f"refused on every rank: {next(iter(refused.values()))}"
        silent = [v for v in verdicts if not v.refused]
        ranks = ", ".join(str(v.rank) for v in silent)
        lines = [f"legacy checkpoint {silent[0].not_refused or 'not refused'} on rank(s) {ranks} "
                 f"{context}", *mismatch_lines(verdicts)]
        return "\n".join(lines)
    problems = _problem_lines(verdicts)
    mismatches = mismatch_lines(verdicts)
    if green:
        compared = sum(v.compared for v in verdicts)
        skipped = {k: why for v in verdicts for k, why in v.skipped.items()}
        ran = checks_run(cell, verdicts, skipped)
        tail = "".join(f"; {k} check skipped: {why}" for k, why in sorted(skipped.items()))
        return (f"{compared} tensors on {len(verdicts)} ranks equal what the checkpoint "
                f"holds bit for bit, and the ep=1 ground truth{_rounding(verdicts)} "
                f"(checks: {', '.join(ran)}){tail}")
    # A wrong value leads (it names rank, layer, expert and tensor); else the checks' problems, the
    # checkpoint's own findings first, and a difference only the next step shows last.
    values_first = any(m.check == "values" for v in verdicts for m in v.mismatches)
    lines = mismatches + problems if values_first else problems + mismatches
    lines[0] = f"{lines[0]} {context}"
    return "\n".join(lines)


def summarize_functions(cell: Any, records: list[dict[str, Any]], green: bool) -> str:
    """The detail of a functions cell from its functions' merged records (one per function);
    ``green``: whether :mod:`conformance.outcome` passed it."""
    if green:
        return f"{len(records)} functions agree with the reference"
    failed = [r for r in records if r["status"] != "pass"]
    lines = [f"{len(failed)} of {len(records)} functions disagree with the reference on "
             f"mesh {cell.mesh} {cell.placements}, k={cell.k}:"]
    lines += [f"  {r['function']}: {r['detail']} ({r.get('count', 1)} case(s))" for r in failed]
    return "\n".join(lines)

"""What a rank reports back about one cell: its differences, its problems, its timings.

Everything here crosses the rank's pipe, so it is plain data.  A :class:`Problem` names the check
that found it (one per promise of the matrix) and, where it can, the rank, layer, expert and tensor
or checkpoint key; the controller sorts, folds and prints them (:mod:`conformance.summary`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: mismatches a rank keeps (the record holds them all; the terminal shows a few): a bound against a
#: pathological model, far above any cell's tensor count (E=256 x 2 layers x 3 weights x 3 with
#: moments is 4,608).
KEEP = 100_000

Key = tuple[Any, Any, str]

#: the key under which a rank that stopped on an exception sends its verdict through the engine's
#: structured channel (:data:`pytest_moe_ep.world.protocol.FIELDS_ATTR`).
VERDICT = "verdict"  # (layer, global_expert_id or None, name)


def __getattr__(name: str) -> Any:
    """``CHECKS``, ``LISTED`` and ``WHERE_RUN``, derived from the checks' table
    (:mod:`conformance.checks.table`), whose checks import this module: read from it when asked."""
    if name in ("CHECKS", "LISTED", "WHERE_RUN"):
        from conformance.checks import table

        return getattr(table, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class Mismatch:
    rank: int
    layer: Any
    expert: int | None
    name: str
    problem: str
    check: str = "values"

    def where(self) -> str:
        what = f"expert {self.expert}, " if self.expert is not None else ""
        return f"rank {self.rank}, layer {self.layer}, {what}tensor {self.name!r}"


@dataclass(frozen=True, order=True)
class Problem:
    """One finding that is not a single tensor's values: ``text`` already says where.
    ``finding``: what it is evidence of where that is not its check's finding (an optional
    member that raised inside its check is a refusal, not what the check finds); "" for the
    check's."""

    check: str
    text: str
    finding: str = ""


@dataclass
class RankFailure:
    """Why this rank's part of a cell stopped, as plain facts: which adapter call raised
    (``member``; ``None`` when the adapter's or the harness's own code did), where (``raised_in``:
    ``framework``, ``adapter`` or ``harness``; ``raised_at``: ``path:line in function``) and what
    kind of stop it was (``kind``: ``layout`` -- the framework did not form the cell's layout;
    ``save-plan`` -- DCP refused the save's global plan; ``adapter`` -- an
    :class:`~conformance.adapter.AdapterError`; ``checkpoint`` -- a load that raised on a checkpoint
    that is not EP-invariant; ``""`` otherwise). The controller's :mod:`conformance.outcome` decides
    the finding from these, nothing else."""

    phase: str
    exception: str
    text: str
    member: str | None = None
    raised_in: str = "harness"
    raised_at: str = ""
    kind: str = ""


@dataclass
class RankVerdict:
    rank: int
    compared: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    mismatch_count: int = 0
    problems: list[Problem] = field(default_factory=list)
    #: legacy cells: the framework's refusal, or why the load was not one.
    refused: str | None = None
    not_refused: str | None = None
    #: a legacy cell whose load raised an error that is not a declared refusal (loud, but no guard).
    load_raised: bool = False
    #: checks that did not apply to this cell, with the reason (e.g. the adapter has no ``step``).
    skipped: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    #: the checkpoint check's findings (from the cell that wrote the checkpoint), for later readers.
    findings: tuple[str, ...] = ()
    #: the truth checkpoint's findings, from the cell that wrote it.
    truth_findings: tuple[str, ...] = ()
    #: this cell wrote its checkpoint (the truth checkpoint) whole and read its findings: a later
    #: reader loads it as it is, even when this cell stopped after (a refused load).
    wrote_save: bool = False
    wrote_truth: bool = False
    #: tensors that differ from the ep=1 truth by no more than a kernel's rounding
    #: (:mod:`conformance.rounding`), and the largest such difference in ulps: no finding, but the
    #: pass line says so.
    rounded_count: int = 0
    rounded_ulps: float = 0.0
    #: the checks that ran to their end on this rank, in order (a failing cell lists those that
    #: passed).
    ran: list[str] = field(default_factory=list)
    #: set when this rank's part of the cell stopped on an exception.
    failure: RankFailure | None = None

    def rounded(self, ulps: float) -> None:
        self.rounded_count += 1
        self.rounded_ulps = max(self.rounded_ulps, ulps)

    def add(self, mismatch: Mismatch) -> None:
        self.mismatch_count += 1
        if len(self.mismatches) < KEEP:
            self.mismatches.append(mismatch)

    def problem(self, check: str, text: str, finding: str = "") -> None:
        self.problems.append(Problem(check, text, finding))

    def done(self, check: str) -> None:
        """``check`` ran to its end on this rank (whatever it found)."""
        if check not in self.ran:
            self.ran.append(check)

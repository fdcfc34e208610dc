"""A cell's report record: the one type that owns the ``cells`` schema of the report
(docs/matrix.md).

Each matrix item builds one :class:`CellRecord` and attaches :meth:`CellRecord.to_dict` to its test
report (:data:`~conformance.report.RECORD`); :mod:`conformance.report` reads the dicts, whether they
come from this process, an xdist worker or a ``pytest-reportlog`` log.  A functions cell's report is
one record per function (:func:`function_record`); its own record is kept only when it has no
per-function records (``n/a``, ``stopped``, ``interrupted``).  What a record's ``status`` and
findings mean, and every word a report shows for them, is :mod:`conformance.outcome`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conformance.outcome import function_findings


@dataclass
class CellRecord:
    """One cell's record; :meth:`to_dict` gives the report's keys, in the report's order."""

    id: str
    suite: str
    adapter: str
    adapter_version: str
    #: the cell's own fields: a checkpoint cell's :meth:`~conformance.matrix.Cell.record`; a
    #: functions cell's ``function``, ``num_experts``, ``ep``, ``mesh``, ``placements``.
    fields: dict[str, Any] = field(default_factory=dict)
    #: how far the cell ran (:data:`conformance.outcome.STATUSES`); what it found is its outcome.
    status: str = ""
    detail: str = ""
    duration_s: float = 0.0
    #: a checkpoint cell that ran: the slowest rank's seconds per phase, whether an earlier cell
    #: wrote its checkpoint, the checks that did not apply and why.
    timings: dict[str, float] | None = None
    shared_save: bool | None = None
    skipped_checks: dict[str, str] | None = None
    #: a ``stopped`` cell: each distinct rank error in full, by rank.
    errors: dict[str, str] | None = None
    #: the environment, once the cell finished: torch's version, the world size and the backend
    #: used.
    environment: dict[str, Any] | None = None
    #: a red cell's findings (:mod:`conformance.findings`), worst first; ``finding`` is the first.
    findings: list[str] | None = None
    #: every problem the cell found, structured (check, finding, rank, layer, expert, tensor, text):
    #: no limit.
    problems: list[dict[str, Any]] | None = None
    #: the cell against the expectations file: expected, expected_reason, expected_by, expectation.
    expectation: dict[str, Any] | None = None
    #: the checks that ran to their end and found nothing (a red cell's too: what still held).
    checks_passed: list[str] | None = None
    #: the deadline of the cell's world call in seconds, and where it came from (``measured``,
    #: ``unmeasured``: :mod:`conformance.deadlines`; ``moe_ep_timeout``, ``pytest-timeout``: the
    #: user's); ``None`` for a cell that asked no world.
    deadline_s: float | None = None
    deadline_from: str | None = None

    @property
    def finding(self) -> str | None:
        return self.findings[0] if self.findings else None

    def finish(self, status: str, detail: str, duration_s: float) -> None:
        self.status, self.detail, self.duration_s = status, detail, round(duration_s, 3)

    def to_dict(self) -> dict[str, Any]:
        found: dict[str, Any] = {"id": self.id, "suite": self.suite, "adapter": self.adapter,
                                 "adapter_version": self.adapter_version, **self.fields}
        for name in ("timings", "shared_save", "skipped_checks", "checks_passed", "errors",
                     "deadline_s", "deadline_from"):
            value = getattr(self, name)
            if value is not None:
                found[name] = value
        found.update(status=self.status, detail=self.detail, duration_s=self.duration_s)
        if self.findings:
            found.update(finding=self.finding, findings=list(self.findings))
        if self.problems:
            found["problems"] = self.problems
        found.update(self.expectation or {})
        return {**found, **(self.environment or {})}


def environment(torch: str, world_size: int, backend: str) -> dict[str, Any]:
    """What every finished record says of where it ran (a report rebuilt from a log has it)."""
    return {"torch": torch, "world_size": world_size, "backend": backend}



def function_record(cell: CellRecord, merged: dict[str, Any], torch: str) -> dict[str, Any]:
    """The report's record of one function of a functions cell, from its ranks' merged record."""
    found = function_findings(merged)
    return {"id": f"{cell.id}::{merged['function']}", "adapter": cell.adapter,
            "adapter_version": cell.adapter_version, "duration_s": 0.0, "torch": torch, **merged,
            **({"finding": found[0], "findings": found} if found else {})}


__all__ = ["CellRecord", "environment", "function_record"]

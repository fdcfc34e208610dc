"""The conformance report: JSON for machines; pictures, Markdown and an HTML page for release pages.

Each matrix cell attaches one record to its test report (``user_properties`` under :data:`RECORD`),
so the records travel with pytest's own reports -- across pytest-xdist workers too -- and the
process that sees every report (the only process, or xdist's controller) writes, into ``DIR``::

    moe-ep-conformance.json      schema_version, adapter, torch, backend (the one used), world_size,
                                 tier and coverage, experts, created, summary (cells per status),
                                 outcomes (cells per outcome), findings, rerun, cells (each with
                                 its status and its outcome)
    moe-ep-conformance-grid-<kind>-<state>.svg
                                 a picture per layer kind and state (and per kind of legacy
                                 cells, and the functions suite): save layouts down, load layouts
                                 across, a square per cell colored by its outcome, linked to its
                                 entry
    moe-ep-conformance.md        the pictures, the findings, the coverage, an entry per red cell
                                 with the command that reruns it, the expectations; last, one
                                 command for every unexpected red cell
    moe-ep-conformance.html      the same, self-contained, the pictures inline

A cell is shown by its *outcome* (:mod:`conformance.outcome`: ``pass``, ``silent``, ``on-disk``,
``refused``, ``error``, ``n/a``, ``interrupted``), which every cell of the JSON holds; its
``status`` says only how far it ran (``pass``, ``fail``, ``stopped``, ``n/a``, ``interrupted``),
so that ``error`` is only ever a finding.

``python -m conformance.report OLD.json NEW.json [--out DIR]`` prints and writes (into DIR, else
beside NEW: ``moe-ep-conformance-diff.md`` and ``.svg``) the cells newly failing, newly passing and
whose finding changed.  Exit status: 0 no cell changed; 1 some did; 2 a file is missing or not a
report. ``python -m conformance.report summary REPORT.json`` prints the report's head for a CI step
summary; ``index ROOT [--docs PAGE]`` the frameworks' status table and its picture; ``--from-log LOG
--out DIR`` rebuilds the report from a ``pytest-reportlog`` log, which survives a ``kill -9`` line
by line.

A run cut short keeps what it found: an interrupted session (Ctrl-C, SIGTERM) writes the cells that
finished, the running one as ``interrupted`` and the ids of the cells not run, under
``"interrupted": true``.  Every file is written to a temporary file and renamed, so a crash during
the write leaves the previous report, never a truncated one.
"""

from __future__ import annotations

import json
import os
import platform
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from conformance.covering import uneven_reach
from conformance.outcome import (
    INTERRUPTED,
    STATUSES,
    finding_counts,
    outcome,
    outcome_counts,
    status_counts,
    status_of,
)
from conformance.report.cells import anchors, grids, square_title
from conformance.report.diff import ReportDiff, compare_reports
from conformance.report.files import (
    HTML_NAME,
    JSON_NAME,
    MD_NAME,
    READS,
    SCHEMA_VERSION,
    TMP_PREFIX,
    UsageProblem,
    grid_name,
    read_report,
    write_atomic,
    write_files,
)
from conformance.report.index import INDEX_END, INDEX_START, index_rows, write_index
from conformance.report.markdown import render_markdown, step_summary, terminal_summary
from conformance.report.page import render_html
from conformance.report.picture import grid_svg
from conformance.report.rerun import reruns

RECORD = "moe_ep_record"
#: every matrix item's outcome for expectations (``{"id", "outcome"}``): what an update run writes.
OUTCOME = "moe_ep_outcome"
#: a cell item's setup report carries the session's final selection (after ``-k``), for
#: ``--from-log``.
SELECTION = "moe_ep_selection"
def expectation_counts(records: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Cells counted by how they stood against the expectations file (only cells judged)."""
    counts = Counter(r["expectation"] for r in records if r.get("expectation"))
    return dict(sorted(counts.items()))


def run_experts(records: Iterable[dict[str, Any]]) -> list[int]:
    """The expert counts a run's checkpoint records show (when the session does not say)."""
    return sorted({int(r["num_experts"]) for r in records
                   if r.get("suite") == "checkpoint" and isinstance(r.get("num_experts"), int)})


def build_report(records: list[dict[str, Any]], *, backend: str, world_size: int,
                 tier: str | None = None, full_cells: int | None = None, interrupted: bool = False,
                 not_run: Iterable[str] = (), rebuilt_from: str | None = None,
                 incomplete: bool | None = None, expectations: dict[str, Any] | None = None,
                 experts: Sequence[int] | None = None,
                 adapter_option: str | None = None) -> dict[str, Any]:
    """The JSON document for ``records``; adapter and torch come from the records themselves.

    ``interrupted``: the session was stopped (Ctrl-C, SIGTERM) before its last cell; ``not_run``
    the selected cells without an outcome; ``rebuilt_from`` the log a report was rebuilt from;
    ``incomplete`` (default: interrupted, or some cells not run) says the report does not hold the
    whole selection.  ``experts`` (``--moe-ep-experts``; default: the records' expert counts) and
    ``adapter_option`` (``--moe-ep-adapter`` as given, "" for an adapter from a hook or the ini
    file; default: the built-in of the records' adapter name) go into each red cell's rerun
    command.
    """
    first = records[0] if records else {}
    cells = sorted((dict(r) for r in records), key=lambda r: r["id"])
    checkpoint = sum(1 for r in cells if r.get("suite") == "checkpoint")
    experts = sorted(set(experts)) if experts else run_experts(cells)
    commands = reruns(cells, tier=tier, world_size=world_size, experts=experts,
                      adapter=adapter_option)
    for cell in cells:
        # a record from an older log says ``error`` for ``stopped``: the report is at this schema
        cell["status"], cell["outcome"] = status_of(cell), outcome(cell)
        if cell["id"] in commands.commands:
            cell["rerun"] = commands.commands[cell["id"]]
    not_run = sorted(not_run)
    judged = ({**expectations, "counts": expectation_counts(cells)} if expectations is not None
              else None)
    return {
        "schema_version": SCHEMA_VERSION,
        "adapter": {"name": first.get("adapter", ""), "version": first.get("adapter_version", "")},
        "torch": first.get("torch", ""),
        "backend": backend,
        "world_size": world_size,
        "tier": tier or "",
        "coverage": {"cells": checkpoint, "full_tier_cells": full_cells,
                     "uneven_classes": uneven_reach(cells)},
        "experts": experts,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "summary": status_counts(cells),
        "outcomes": outcome_counts(cells),
        "findings": finding_counts(cells),
        "expectations": judged,
        "interrupted": interrupted,
        "incomplete": (interrupted or bool(not_run)) if incomplete is None else incomplete,
        "rebuilt_from": rebuilt_from,
        "not_run": not_run,
        "rerun": {"unexpected": commands.unexpected, "without_command": commands.missing},
        "cells": cells,
    }


def not_run(selected: Iterable[str], records: Iterable[dict[str, Any]]) -> list[str]:
    """The selected cells without a record (a functions cell's records: ``ID::function``)."""
    done = {r["id"] for r in records}
    done |= {i.rsplit("::", 1)[0] for i in done}
    return sorted(set(selected) - done)


def report_texts(report: dict[str, Any]) -> dict[str, str]:
    """Every file of ``report`` by name: the JSON, a picture per grid, the Markdown, the page."""
    heading = f"{report['adapter']['name']} {report['adapter']['version']}".strip()
    texts = {JSON_NAME: json.dumps(report, indent=2, sort_keys=False) + "\n"}
    where = anchors(r["id"] for r in report["cells"])
    for grid in grids(report["cells"]):
        texts[grid_name(grid.slug)] = grid_svg(grid, link=lambda r: f"{MD_NAME}#{where[r['id']]}",
                                               title=square_title, heading=heading)
    texts[MD_NAME] = render_markdown(report)
    texts[HTML_NAME] = render_html(report)
    return texts


def write_document(directory: str | os.PathLike[str], report: dict[str, Any]) -> tuple[Path, Path]:
    """``report``'s files in ``directory`` (:func:`report_texts`), each written atomically, every
    text made before the first is written; returns the JSON's and the Markdown's paths."""
    paths = write_files(Path(directory), report_texts(report))
    return paths[JSON_NAME], paths[MD_NAME]


def write_report(directory: str | os.PathLike[str], records: list[dict[str, Any]], *,
                 backend: str, world_size: int, tier: str | None = None,
                 full_cells: int | None = None, interrupted: bool = False,
                 not_run: Iterable[str] = (), expectations: dict[str, Any] | None = None,
                 experts: Sequence[int] | None = None,
                 adapter_option: str | None = None) -> tuple[Path, Path]:
    """The report of ``records`` written into ``directory`` (the options: :func:`build_report`)."""
    report = build_report(records, backend=backend, world_size=world_size, tier=tier,
                          full_cells=full_cells, interrupted=interrupted, not_run=not_run,
                          expectations=expectations, experts=experts,
                          adapter_option=adapter_option)
    return write_document(directory, report)


__all__ = [
    "HTML_NAME", "INDEX_END", "INDEX_START", "INTERRUPTED", "JSON_NAME", "MD_NAME", "OUTCOME",
    "READS", "RECORD", "SCHEMA_VERSION", "SELECTION", "STATUSES", "TMP_PREFIX", "ReportDiff",
    "UsageProblem", "build_report", "compare_reports", "expectation_counts", "index_rows",
    "not_run", "read_report", "render_html", "render_markdown", "step_summary",
    "terminal_summary", "write_atomic", "write_document", "write_index", "write_report",
]

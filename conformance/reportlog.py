"""Rebuild the conformance report from a ``pytest-reportlog`` log: what a ``kill -9`` leaves.

``pytest --report-log=LOG`` writes one JSON line per report as it happens, so a session killed with
no chance to write ``--moe-ep-report`` still leaves every finished cell's record in its call
report's ``user_properties``.  ``python -m conformance.report --from-log LOG --out DIR`` turns those
into the JSON and Markdown report:

- every record of a finished cell (the last one, should a cell appear twice);
- a cell whose setup report is in the log but not its call report was running when the session
  died: status ``interrupted``;
- the selection and the environment come from the first cell's setup report
  (:data:`~conformance.report.SELECTION`), so the cells not run are listed too;
- ``incomplete`` is true when the log has no ``SessionFinish`` line (killed: ``log_ends_early``) or
  the session ended interrupted; a complete log, or one from a pytest-xdist run (the controller writes it), rebuilds
  the report the run itself wrote, give or take ``created``.

A last line cut mid-write is skipped; so is the tail of a cut ``.gz``/``.bz2``/``.xz`` log.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import json
import lzma
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance.report import INTERRUPTED, RECORD, SELECTION, UsageProblem, build_report, not_run, write_document

INTERRUPTED_STATUS = 2  # pytest.ExitCode.INTERRUPTED, without importing pytest here
OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


@dataclass
class LogContents:
    """What a report log says about the matrix."""

    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    started: dict[str, str] = field(default_factory=dict)  # node id -> when it was last seen ("setup")
    called: set[str] = field(default_factory=set)
    environment: dict[str, Any] = field(default_factory=dict)
    exitstatus: int | None = None
    lines: int = 0
    skipped_lines: int = 0


def _lines(path: Path) -> Iterator[str]:
    opener = OPENERS.get(path.suffix)
    try:
        with (opener(path, "rt", encoding="utf-8") if opener else path.open(encoding="utf-8")) as f:  # type: ignore[operator]
            yield from f
    except (EOFError, OSError, lzma.LZMAError) as exc:  # a compressed log cut mid-stream ends here
        if isinstance(exc, FileNotFoundError | IsADirectoryError | PermissionError):
            raise UsageProblem(f"{path}: cannot read it: {exc.strerror or exc}") from exc


def read_log(path: Path) -> LogContents:
    found = LogContents()
    for line in _lines(path):
        found.lines += 1
        try:
            entry = json.loads(line)
        except ValueError:
            found.skipped_lines += 1  # the line a kill cut short
            continue
        if not isinstance(entry, dict):
            found.skipped_lines += 1
            continue
        kind = entry.get("$report_type")
        if kind == "SessionFinish":
            found.exitstatus = entry.get("exitstatus")
        if kind != "TestReport":
            continue
        nodeid, when = entry.get("nodeid", ""), entry.get("when")
        for key, value in entry.get("user_properties") or []:
            if key == SELECTION and not found.environment:
                found.environment = json.loads(value)
            if key == RECORD and when == "call":
                record = json.loads(value)
                found.records[record["id"]] = record
        if when == "setup" and entry.get("outcome") == "passed":
            found.started[nodeid] = when
        elif when == "call":
            found.called.add(nodeid)
    if not found.lines:
        raise UsageProblem(f"{path}: empty, not a pytest-reportlog log")
    if found.lines == found.skipped_lines:
        raise UsageProblem(f"{path}: no JSON line in it; not a pytest-reportlog log")
    return found


def rebuild(path: Path) -> dict[str, Any]:
    """The report document for the log at ``path`` (see the module docstring)."""
    log = read_log(path)
    env = log.environment
    selected = set(env.get("ids") or [])
    if not log.records and not selected:
        raise UsageProblem(f"{path}: holds no moe-ep matrix cell (was the run --moe-ep-matrix or "
                           "--moe-ep-functions?)")
    records = list(log.records.values())
    first = records[0] if records else {}
    killed = log.exitstatus is None
    why = ("running when the log ends: the session was killed during this cell" if killed
           else "running when the session was interrupted")
    for nodeid in sorted(set(log.started) - log.called):
        if selected and nodeid not in selected:
            continue  # not a matrix cell
        if not selected and not nodeid.startswith("moe-ep-matrix::"):
            continue
        records.append({"id": nodeid, "status": INTERRUPTED, "detail": why, "duration_s": 0.0,
                        "adapter": first.get("adapter", ""), "adapter_version": first.get("adapter_version", ""),
                        "torch": first.get("torch", "")})
    interrupted = killed or log.exitstatus == INTERRUPTED_STATUS
    doc = build_report(records, backend=env.get("backend") or first.get("backend", ""),
                        world_size=int(env.get("world_size") or first.get("world_size") or 0),
                        tier=env.get("tier"), full_cells=env.get("full_cells"), interrupted=interrupted,
                        not_run=not_run(selected, records), rebuilt_from=str(path),
                        incomplete=interrupted or bool(not_run(selected, records)))
    doc["log_ends_early"] = killed  # no SessionFinish line: a kill -9, or a crash of pytest itself
    return doc


def rebuild_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.report --from-log",
                                     description="Rebuild moe-ep-conformance.json and .md from a pytest-reportlog "
                                     "log (pytest --report-log=LOG), marked incomplete when the run was cut short.")
    parser.add_argument("--from-log", dest="log", type=Path, required=True, metavar="LOG")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    args = parser.parse_args(argv)
    doc = rebuild(args.log)
    try:
        json_path, md_path = write_document(args.out, doc)
    except OSError as exc:
        raise UsageProblem(f"{args.out}: cannot write the report there: {exc.strerror or exc}") from exc
    state = "incomplete" if doc["incomplete"] else "complete"
    print(f"{json_path} and {md_path.name}: {len(doc['cells'])} cell record(s), {len(doc['not_run'])} not run "
          f"({state}; {', '.join(f'{n} {s}' for s, n in doc['summary'].items())})")
    return 0

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
  the session ended interrupted; a complete log, or one from a pytest-xdist run (the controller
  writes it), rebuilds the report the run itself wrote, give or take ``created``.

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

from conformance.report import (
    INTERRUPTED,
    OUTCOME,
    RECORD,
    SELECTION,
    UsageProblem,
    build_report,
    expectation_counts,
    not_run,
    write_atomic,
    write_document,
)

INTERRUPTED_STATUS = 2  # pytest.ExitCode.INTERRUPTED, without importing pytest here
OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


@dataclass
class LogContents:
    """What a report log says about the matrix."""

    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    # node id -> when it was last seen ("setup")
    started: dict[str, str] = field(default_factory=dict)
    called: set[str] = field(default_factory=set)
    environment: dict[str, Any] = field(default_factory=dict)
    #: each matrix item's outcome for expectations (:data:`~conformance.report.OUTCOME`): id -> pass
    #: or finding.
    outcomes: dict[str, str] = field(default_factory=dict)
    exitstatus: int | None = None
    lines: int = 0
    skipped_lines: int = 0


def _lines(path: Path) -> Iterator[str]:
    opener = OPENERS.get(path.suffix)
    try:
        with (opener(path, "rt", encoding="utf-8")  # type: ignore[operator]
              if opener else path.open(encoding="utf-8")) as f:
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
            if key == OUTCOME and when == "call":
                outcome = json.loads(value)
                found.outcomes[outcome["id"]] = outcome["outcome"]
        if when == "setup" and entry.get("outcome") == "passed":
            found.started[nodeid] = when
        elif when == "call":
            found.called.add(nodeid)
    if not found.lines:
        raise UsageProblem(f"{path}: empty, not a pytest-reportlog log")
    if found.lines == found.skipped_lines:
        raise UsageProblem(f"{path}: no JSON line in it; not a pytest-reportlog log")
    return found


def rebuild(path: Path, log: LogContents | None = None) -> dict[str, Any]:
    """The report document for the log at ``path`` (see the module docstring); ``log``: it, already
    read."""
    log = log or read_log(path)
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
                        "adapter": first.get("adapter", ""),
                        "adapter_version": first.get("adapter_version", ""),
                        "torch": first.get("torch", "")})
    interrupted = killed or log.exitstatus == INTERRUPTED_STATUS
    doc = build_report(records, backend=env.get("backend") or first.get("backend", ""),
                        world_size=int(env.get("world_size") or first.get("world_size") or 0),
                        tier=env.get("tier"), full_cells=env.get("full_cells"),
                       interrupted=interrupted,
                        not_run=not_run(selected, records), rebuilt_from=str(path),
                        incomplete=interrupted or bool(not_run(selected, records)),
                        experts=env.get("experts"), adapter_option=env.get("adapter_option"))
    doc["log_ends_early"] = killed  # no SessionFinish line: a kill -9, or a crash of pytest itself
    return doc


def judge_against(doc: dict[str, Any], outcomes: dict[str, str], path: Path, *,
                  tolerate: tuple[str, ...] = ()) -> list[str]:
    """Judge the log's cells (``outcomes``: id -> pass or finding) against the expectations file at
    ``path``; each cell's record gets its expectation fields, as the run itself would have written
    them.  Returns the lines of the cells that came back other than expected."""
    from conformance.expectations import Baseline, ExpectationsError, read

    try:
        baseline = Baseline(read(path, adapter=doc["adapter"]["name"] or None), tolerate)
    except ExpectationsError as exc:
        raise UsageProblem(str(exc)) from exc
    records = {r["id"]: r for r in doc["cells"]}
    unmet = []
    for cell_id, got in sorted(outcomes.items()):
        judgement = baseline.judge(cell_id, got)
        if cell_id in records:
            records[cell_id].update(judgement.record_fields())
        if not judgement.met:
            unmet.append(f"{cell_id}: {judgement.text}")
    doc["expectations"] = {"file": str(path), "tolerate": list(tolerate), "update": False,
                           "counts": expectation_counts(doc["cells"])}
    return unmet


def rebuild_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.report --from-log",
                                     description="Rebuild moe-ep-conformance.json and .md from a "
                                     "pytest-reportlog log (pytest --report-log=LOG), marked "
                                     "incomplete when the run was cut short; with --expectations, "
                                     "judge its cells against that file (exit 1 when some came "
                                     "back other than expected).")
    parser.add_argument("--from-log", dest="log", type=Path, required=True, metavar="LOG")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    parser.add_argument("--expectations", type=Path, metavar="FILE",
                        help="an expectations file to judge against")
    parser.add_argument("--update-expectations", action="store_true",
                        help="rewrite FILE from the log's outcomes (refused for a log of a run "
                        "that did not finish)")
    parser.add_argument("--tolerate", default="", metavar="FINDINGS",
                        help="as pytest's --moe-ep-tolerate")
    args = parser.parse_args(argv)
    from conformance.expectations import parse_tolerate

    try:
        tolerate = parse_tolerate(args.tolerate)
    except ValueError as exc:
        raise UsageProblem(str(exc)) from exc
    if args.update_expectations and args.expectations is None:
        raise UsageProblem("--update-expectations rewrites the file --expectations FILE names; "
                           "give one")
    log = read_log(args.log)
    doc = rebuild(args.log, log)
    unmet = (judge_against(doc, log.outcomes, args.expectations, tolerate=tolerate)
             if args.expectations and not args.update_expectations else [])
    if args.update_expectations:
        print(update_from_log(doc, log.outcomes, args.expectations))
    try:
        json_path, md_path = write_document(args.out, doc)
    except OSError as exc:
        raise UsageProblem(f"{args.out}: cannot write the report there: "
                           f"{exc.strerror or exc}") from exc
    state = "incomplete" if doc["incomplete"] else "complete"
    print(f"{json_path} and {md_path.name}: {len(doc['cells'])} cell record(s), "
          f"{len(doc['not_run'])} not run "
          f"({state}; {', '.join(f'{n} {o}' for o, n in doc['outcomes'].items())})")
    if unmet:
        print(f"{len(unmet)} cell(s) not as {args.expectations} expects:\n"
              + "\n".join(f"  {u}" for u in unmet))
    return 1 if unmet else 0


def update_from_log(doc: dict[str, Any], outcomes: dict[str, str], path: Path) -> str:
    """Rewrite the expectations file at ``path`` from a complete log's outcomes; a cut-short log
    writes nothing."""
    from conformance.expectations import ExpectationsError, read, updated_text, written_by

    if doc["incomplete"]:
        raise UsageProblem(f"{path}: not updated: the log is of a run that did not finish (an "
                           "interrupted run never rewrites a baseline)")
    name, version = doc["adapter"]["name"], doc["adapter"]["version"]
    try:
        current = read(path, adapter=name or None, missing_ok=True)
    except ExpectationsError as exc:
        raise UsageProblem(str(exc)) from exc
    update = updated_text(current, outcomes, adapter=name, by=written_by(name, version))
    if update.changes or not current.exists:
        write_atomic(path, update.text)
    return update.summary(path)

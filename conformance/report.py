"""The conformance report: JSON for machines, Markdown for release pages, a diff between releases.

Each matrix cell attaches one record to its test report (``user_properties`` under
:data:`RECORD`), so the records travel with pytest's own reports -- across pytest-xdist workers too
-- and the process that sees every report (the only process, or xdist's controller) writes::

    DIR/moe-ep-conformance.json   schema_version, adapter, torch, backend (the one used), world_size,
                                  tier and coverage, created, summary (counts per status), cells
    DIR/moe-ep-conformance.md     one save-layout x load-layout table per (kind, state, fsdp, E), then
                                  one line per failure with its diagnosis, then the environment

``python -m conformance.report OLD.json NEW.json`` prints the cells whose status changed (exit 0:
none changed, 1: some did, 2: a file is missing or not a report).  ``--from-log LOG --out DIR``
rebuilds the report from a ``pytest-reportlog`` log, which survives a ``kill -9`` line by line.

A run cut short keeps what it found: an interrupted session (Ctrl-C, SIGTERM) writes the cells that
finished, the running one as ``interrupted`` and the ids of the cells not run, under
``"interrupted": true``.  Both files are written to a temporary file and renamed, so a crash
during the write leaves the previous report, never a truncated one.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from conformance.findings import ERROR, FINDINGS, MEANING, ON_DISK, SILENT
from conformance.matrix import guarantee, uneven_reach
from pytest_moe_ep.text import shorten
from reference_impl.layout import UNEVEN_CLASSES

SCHEMA_VERSION = 4
READS = (1, 2, 3, SCHEMA_VERSION)
RECORD = "moe_ep_record"
#: every matrix item's outcome for expectations (``{"id", "outcome"}``): what an update run writes.
OUTCOME = "moe_ep_outcome"
#: a cell item's setup report carries the session's final selection (after ``-k``), for ``--from-log``.
SELECTION = "moe_ep_selection"
JSON_NAME = "moe-ep-conformance.json"
MD_NAME = "moe-ep-conformance.md"
STATUSES = ("pass", "fail", "error", "n/a")
#: the cell that was running when the session was interrupted; counted in ``summary`` only when present.
INTERRUPTED = "interrupted"
MARKS = {"pass": "pass", "fail": "**FAIL**", "error": "**ERROR**", "n/a": "n/a", INTERRUPTED: "interrupted"}
LEGEND = "A blank table cell is a (save, load) layout pair this run did not include (tier or -k)."


def plural(count: int, word: str) -> str:
    """``1 error``, ``2 errors``."""
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def counts_line(summary: dict[str, int]) -> str:
    line = (f"{summary['pass']} passed, {summary['fail']} failed, {plural(summary['error'], 'error')}, "
            f"{summary['n/a']} n/a")
    return line + (f", {summary[INTERRUPTED]} interrupted" if summary.get(INTERRUPTED) else "")


def _summary(records: Iterable[dict[str, Any]]) -> dict[str, int]:
    counts = Counter(r["status"] for r in records)
    return {s: counts.get(s, 0) for s in (*STATUSES, *((INTERRUPTED,) if counts.get(INTERRUPTED) else ()))}


def finding_counts(records: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Red cells counted by their finding (the worst one), every finding named."""
    counts = Counter(r.get("finding") or ERROR for r in records if r.get("status") in ("fail", "error"))
    return {f: counts.get(f, 0) for f in FINDINGS}


def expectation_counts(records: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Cells counted by how they stood against the expectations file (only cells that were judged)."""
    counts = Counter(r["expectation"] for r in records if r.get("expectation"))
    return dict(sorted(counts.items()))


def build_report(records: list[dict[str, Any]], *, backend: str, world_size: int, tier: str | None = None,
                 full_cells: int | None = None, interrupted: bool = False, not_run: Iterable[str] = (),
                 rebuilt_from: str | None = None, incomplete: bool | None = None,
                 expectations: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document for ``records``; adapter and torch come from the records themselves.

    ``interrupted``: the session was stopped (Ctrl-C, SIGTERM) before its last cell; ``not_run`` the
    selected cells without an outcome; ``rebuilt_from`` the log a report was rebuilt from;
    ``incomplete`` (default: interrupted, or some cells not run) says the report does not hold the whole
    selection.
    """
    first = records[0] if records else {}
    checkpoint = sum(1 for r in records if r.get("suite") == "checkpoint")
    not_run = sorted(not_run)
    return {
        "schema_version": SCHEMA_VERSION,
        "adapter": {"name": first.get("adapter", ""), "version": first.get("adapter_version", "")},
        "torch": first.get("torch", ""),
        "backend": backend,
        "world_size": world_size,
        "tier": tier or "",
        "coverage": {"cells": checkpoint, "full_tier_cells": full_cells, "uneven_classes": uneven_reach(records)},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "summary": _summary(records),
        "findings": finding_counts(records),
        "expectations": ({**expectations, "counts": expectation_counts(records)} if expectations is not None
                         else None),
        "interrupted": interrupted,
        "incomplete": (interrupted or bool(not_run)) if incomplete is None else incomplete,
        "rebuilt_from": rebuilt_from,
        "not_run": not_run,
        "cells": sorted(records, key=lambda r: r["id"]),
    }


def not_run(selected: Iterable[str], records: Iterable[dict[str, Any]]) -> list[str]:
    """The selected cells without a record (a functions cell's records are named ``ID::function``)."""
    done = {r["id"] for r in records}
    done |= {i.rsplit("::", 1)[0] for i in done}
    return sorted(set(selected) - done)


def coverage_line(tier: str, cells: int, full_cells: int | None, code: str = "`",
                  reach: Mapping[str, list[str]] | None = None) -> str:
    """What a tier's run covered and what its green run means (``code`` quotes the tier's name), and the uneven
    classes its cells reached (:func:`~conformance.matrix.uneven_reach`; the ones it did not are named too)."""
    of = f" of the full tier's {full_cells}" if full_cells else ""
    line = f"Tier {code}{tier}{code}: {cells} checkpoint cells{of}: {guarantee(tier)}."
    if reach is None:
        return line
    reached = [f"{UNEVEN_CLASSES[name]} ({', '.join(where)})" for name, where in reach.items()]
    missed = [UNEVEN_CLASSES[name] for name in UNEVEN_CLASSES if name not in reach]
    return (line + f" Uneven splits reached: {'; '.join(reached) or 'none'}."
            + (f" Not reached: {'; '.join(missed)}." if missed else ""))


def _group_key(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r.get("kind", ""), r.get("state", ""), "fsdp" if r.get("fsdp") else "ep-only", r.get("num_experts", 0))


def _layout(r: dict[str, Any], side: str) -> str:
    return str(r.get(f"{side}_layout") or f"ep{r.get(f'{side}_ep')}")


def _layout_order(name: str) -> tuple[int, str]:
    return (int("".join(ch for ch in name.split(".")[0] if ch.isdigit()) or 0), name)


def checkpoint_tables(records: Iterable[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(title, table)`` per (kind, state, fsdp, E): rows the save layout, columns the load layout."""
    from tabulate import tabulate

    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    legacy: list[dict[str, Any]] = []
    for r in records:
        if r.get("suite") != "checkpoint":
            continue
        (legacy if r.get("legacy") else groups[_group_key(r)]).append(r)
    out = []
    for key in sorted(groups, key=repr):
        cells = groups[key]
        saves = sorted({_layout(r, "save") for r in cells}, key=_layout_order)
        loads = sorted({_layout(r, "load") for r in cells}, key=_layout_order)
        at = {(_layout(r, "save"), _layout(r, "load")): MARKS[r["status"]] for r in cells}
        rows = [[f"save {s}", *(at.get((s, t), "") for t in loads)] for s in saves]
        kind, state, fsdp, experts = key
        title = f"{kind} · {state} · {fsdp} · E={experts}"
        out.append((title, tabulate(rows, headers=["", *(f"load {t}" for t in loads)], tablefmt="github")))
    if legacy:
        legacy.sort(key=lambda r: (r["kind"], _layout_order(_layout(r, "save")), _layout_order(_layout(r, "load"))))
        rows = [[r["kind"], r.get("num_experts", ""), _layout(r, "save"), _layout(r, "load"), MARKS[r["status"]]]
                for r in legacy]
        headers = ["kind", "E", "saved at", "loaded at", "result"]
        out.append(("legacy checkpoint refused", tabulate(rows, headers=headers, tablefmt="github")))
    return out


def functions_table(records: Iterable[dict[str, Any]]) -> str:
    from tabulate import tabulate

    by_function: dict[str, Counter[str]] = defaultdict(Counter)
    for r in records:
        if r.get("suite") == "functions":
            by_function[r["function"]][r["status"]] += 1
    rows = [[f, c["pass"], c["fail"] + c["error"], c["n/a"]] for f, c in sorted(by_function.items())]
    return tabulate(rows, headers=["function", "cells passed", "failed", "n/a"], tablefmt="github") if rows else ""


def render_markdown(report: dict[str, Any]) -> str:
    a = report["adapter"]
    s = report["summary"]
    lines = [f"# MoE expert-parallel checkpoint conformance: {a['name']} {a['version']}".rstrip(), "",
             f"{counts_line(s)} ({report['created']})", ""]
    lines += _incomplete_lines(report)
    lines += [*(f"{line}" for line in lead_lines(report["cells"], code="`", bold="**")), ""]
    coverage = report.get("coverage") or {}
    if report.get("tier"):
        lines += [coverage_line(report["tier"], coverage.get("cells", 0), coverage.get("full_tier_cells"),
                                reach=coverage.get("uneven_classes")), ""]
    tables = checkpoint_tables(report["cells"])
    if tables:
        lines += [LEGEND, ""]
    for title, table in tables:
        lines += [f"### {title}", "", table, ""]
    table = functions_table(report["cells"])
    if table:
        lines += ["### expert-slice functions", "", table, ""]
    failures = sorted((r for r in report["cells"] if r["status"] in ("fail", "error")), key=_worst_first)
    if failures:
        lines += ["## Failures", "", "Worst first; each line leads with the cell's findings: "
                  + "; ".join(f"**{f}**: {MEANING[f]}" for f in FINDINGS) + ".", ""]
        lines += [f"- `{r['id']}`{_expectation_mark(r)}: {r['detail'].splitlines()[0] if r['detail'] else r['status']}"
                  for r in failures]
        lines.append("")
    lines += _expected_lines(report)
    refusals = [r for r in report["cells"] if r.get("legacy") and r["status"] == "pass"]
    if refusals:
        lines += ["", "## Legacy checkpoints refused", ""]
        lines += [f"- `{r['id']}`: {r['detail'].splitlines()[0]}" for r in refusals]
        lines.append("")
    na = Counter(r["detail"] for r in report["cells"] if r["status"] == "n/a")
    if na:
        lines += ["## Not applicable", ""] + [f"- {n} cell(s): {why}" for why, n in na.most_common()] + [""]
    not_run = report.get("not_run") or []
    if not_run:
        lines += ["## Not run", "", f"<details><summary>{len(not_run)} selected cell(s) have no outcome</summary>",
                  "", *(f"- `{cell_id}`" for cell_id in not_run), "", "</details>", ""]
    lines += ["## Environment", "", f"- torch {report['torch']}, backend {report['backend']}, "
              f"world size {report['world_size']}, Python {report['python']}",
              f"- report schema version {report['schema_version']}", ""]
    return "\n".join(lines)


def _worst_first(r: dict[str, Any]) -> tuple[int, str]:
    finding = r.get("finding") or ERROR
    return (FINDINGS.index(finding) if finding in FINDINGS else len(FINDINGS), r["id"])


def lead_lines(records: Iterable[dict[str, Any]], *, code: str = "", bold: str = "") -> list[str]:
    """What a report leads with: how many cells are silent and on-disk, and the first one's line (a loud refusal
    is a limitation; these are what a release page must not hide)."""
    red = sorted((r for r in records if r.get("status") in ("fail", "error")), key=_worst_first)
    counts = finding_counts(red)
    if not red:
        return []
    lines = [f"Findings: {', '.join(f'{n} {f}' for f, n in counts.items())} "
             "(silent: wrong state after a load that reported success; on-disk: the checkpoint is not "
             "EP-invariant; refused: a loud refusal; error: the adapter or the harness)."]
    for finding in (SILENT, ON_DISK):
        first = next((r for r in red if r.get("finding") == finding), None)
        if first is not None:
            line = shorten(first["detail"].splitlines()[0], 300) if first.get("detail") else ""
            lines.append(f"{bold}{counts[finding]} {finding}{bold} cell(s); the first: {code}{first['id']}{code}: "
                         f"{line}")
    return lines


def _expectation_mark(r: dict[str, Any]) -> str:
    state = r.get("expectation")
    if state in ("met", "tolerated"):
        return f" (expected: {r.get('expected_reason') or state})" if state == "met" else " (tolerated)"
    if state == "unmet":
        return f" (**unexpected**: expected {r.get('expected')})"
    return ""


def _expected_lines(report: dict[str, Any]) -> list[str]:
    """How many red cells were expected, and why (the release report's account of its red)."""
    info = report.get("expectations")
    if not info:
        return []
    cells = report["cells"]
    red = [r for r in cells if r.get("status") in ("fail", "error")]
    expected = [r for r in red if r.get("expectation") in ("met", "tolerated")]
    unmet = [r for r in cells if r.get("expectation") == "unmet"]
    source = f"`{info['file']}`" if info.get("file") else "no expectations file"
    tolerated = f", tolerating {', '.join(info['tolerate'])}" if info.get("tolerate") else ""
    lines = ["## Expectations", "", f"{len(expected)} of {len(red)} red cell(s) were expected ({source}"
             f"{tolerated}); {len(unmet)} cell(s) did not come back as expected.", ""]
    reasons = Counter((r.get("finding") or ERROR, r.get("expected_reason") or
                       ("tolerated" if r.get("expectation") == "tolerated" else "")) for r in expected)
    if reasons:
        from tabulate import tabulate

        rows = [[finding, n, why.replace("|", "/")] for (finding, why), n in sorted(
            reasons.items(), key=lambda kv: (FINDINGS.index(kv[0][0]) if kv[0][0] in FINDINGS else 9, -kv[1]))]
        lines += [tabulate(rows, headers=["finding", "cells", "why (the expectations file's reason)"],
                           tablefmt="github"), ""]
    if unmet:
        lines += [f"- `{r['id']}`: expected {r.get('expected')}, got {r.get('finding') or r['status']}"
                  for r in unmet]
        lines.append("")
    return lines


def _incomplete_lines(report: dict[str, Any]) -> list[str]:
    """The warning at the top of a report that does not hold the whole run."""
    lines = []
    if report.get("incomplete"):
        why = ("the run's log ends before the session did" if report.get("log_ends_early")
               else "the run was interrupted" if report.get("interrupted") else "not every selected cell ran")
        running = [r["id"] for r in report["cells"] if r["status"] == INTERRUPTED]
        lines.append(f"**Incomplete: {why}.** {len(report['cells']) - len(running)} cell(s) finished"
                     + (f", {len(running)} interrupted while running" if running else "")
                     + f", {len(report.get('not_run') or [])} not run (listed below).")
    if report.get("rebuilt_from"):
        lines.append(f"Rebuilt from the pytest-reportlog log `{report['rebuilt_from']}`; the environment line "
                     "holds what the log's records say.")
    return [*lines, ""] if lines else []


#: what a cell that needs a look at its table ended as.
NOT_GREEN = ("fail", "error", INTERRUPTED)


def _table_group(r: dict[str, Any]) -> tuple[Any, ...]:
    """The table a checkpoint record is shown in (see :func:`checkpoint_tables`)."""
    return ("legacy",) if r.get("legacy") else _group_key(r)


def kind_state_counts(records: Iterable[dict[str, Any]]) -> str:
    """Checkpoint cells counted by status per kind and state (legacy cells a row of their own)."""
    from tabulate import tabulate

    counts: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for r in records:
        if r.get("suite") == "checkpoint":
            counts[(str(r.get("kind", "")), "legacy" if r.get("legacy") else str(r.get("state", "")))][r["status"]] += 1
    if not counts:
        return ""
    statuses = [*STATUSES, *((INTERRUPTED,) if any(c[INTERRUPTED] for c in counts.values()) else ())]
    rows = [[kind, state, *(c[s] for s in statuses)] for (kind, state), c in sorted(counts.items())]
    return tabulate(rows, headers=["kind", "state", *statuses], tablefmt="github")


def terminal_summary(records: list[dict[str, Any]], *, verbose: bool = False, tier: str | None = None,
                     full_cells: int | None = None) -> str:
    """The terminal summary: counts per kind and state, the tier's coverage, the tables that hold a cell that
    failed, erred or was interrupted -- every table with ``verbose`` -- and the counts.  The Markdown report
    always has every table."""
    parts = []
    lead = lead_lines(records)
    if lead:
        parts.append("\n".join(lead))
    counts = kind_state_counts(records)
    if counts:
        parts.append(f"checkpoint cells by kind and state\n{counts}")
    checkpoint = [r for r in records if r.get("suite") == "checkpoint"]
    if tier:
        parts.append(coverage_line(tier, len(checkpoint), full_cells, code="", reach=uneven_reach(checkpoint)))
    wanted = {_table_group(r) for r in checkpoint if r["status"] in NOT_GREEN}
    tables = checkpoint_tables([r for r in checkpoint if verbose or _table_group(r) in wanted])
    hidden = len(checkpoint_tables(checkpoint)) - len(tables)
    if tables:
        parts.append(LEGEND)
    parts += [f"{title}\n{table}" for title, table in tables]
    functions = [r for r in records if r.get("suite") == "functions"]
    if functions:
        if verbose or any(r["status"] in NOT_GREEN for r in functions):
            parts.append(f"expert-slice functions\n{functions_table(functions)}")
        else:
            parts.append(f"expert-slice functions: {counts_line(_summary(functions))}")
    line = ", ".join(f"{n} {s}" for s, n in _summary(records).items())
    if hidden:
        line += f" ({plural(hidden, 'more table')} of save x load layouts with -v; the Markdown report has them all)"
    parts.append(line)
    return "\n\n".join(parts)


TMP_PREFIX = ".moe-ep-conformance-"


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds either its old content or all of ``text``: a temporary file, fsync'ed, then renamed."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{TMP_PREFIX}{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # what open() would have made, not mkstemp's 0600
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _remove_stale_temporaries(out: Path) -> None:
    """What a writer killed mid-write left: only this module writes such names, one writer per directory."""
    for stale in out.glob(f"{TMP_PREFIX}*.tmp"):
        with contextlib.suppress(OSError):
            stale.unlink()


def write_document(directory: str | os.PathLike[str], report: dict[str, Any]) -> tuple[Path, Path]:
    """``report`` as JSON and Markdown in ``directory``, each written atomically."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(out)
    json_path, md_path = out / JSON_NAME, out / MD_NAME
    texts = json.dumps(report, indent=2, sort_keys=False) + "\n", render_markdown(report)  # both, before writing
    write_atomic(json_path, texts[0])
    write_atomic(md_path, texts[1])
    return json_path, md_path


def write_report(directory: str | os.PathLike[str], records: list[dict[str, Any]], *, backend: str,
                 world_size: int, tier: str | None = None, full_cells: int | None = None, interrupted: bool = False,
                 not_run: Iterable[str] = (), expectations: dict[str, Any] | None = None) -> tuple[Path, Path]:
    report = build_report(records, backend=backend, world_size=world_size, tier=tier, full_cells=full_cells,
                          interrupted=interrupted, not_run=not_run, expectations=expectations)
    return write_document(directory, report)


@dataclass(frozen=True)
class ReportDiff:
    """Cells whose status changed, and cells present in only one report (deselected with ``-k``, say)."""

    changed: list[str]
    only_old: list[str]
    only_new: list[str]
    unchanged: int

    def lines(self) -> list[str]:
        out = list(self.changed)
        if self.only_old:
            out += [f"only in the old report ({len(self.only_old)}):", *(f"  {c}" for c in self.only_old)]
        if self.only_new:
            out += [f"only in the new report ({len(self.only_new)}):", *(f"  {c}" for c in self.only_new)]
        out.append(f"{len(self.changed)} changed, {self.unchanged} unchanged, {len(self.only_old)} only in the old "
                   f"report, {len(self.only_new)} only in the new report")
        return out


def _status(cell: dict[str, Any]) -> str:
    """A cell's status with its finding (``fail (silent)``): a refusal that became silent loss is a change."""
    return f"{cell['status']} ({cell['finding']})" if cell.get("finding") else str(cell["status"])


def compare_reports(old: dict[str, Any], new: dict[str, Any]) -> ReportDiff:
    before = {c["id"]: c for c in old.get("cells", [])}
    after = {c["id"]: c for c in new.get("cells", [])}
    changed = []
    for cell_id in sorted(before.keys() & after.keys()):
        was, now = _status(before[cell_id]), _status(after[cell_id])
        if was != now:
            detail = after[cell_id].get("detail", "")
            changed.append(f"{cell_id}: {was} -> {now}" + (f"  ({detail.splitlines()[0]})" if detail else ""))
    return ReportDiff(changed, sorted(before.keys() - after.keys()), sorted(after.keys() - before.keys()),
                      len(before.keys() & after.keys()) - len(changed))


def diff_reports(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per cell whose status changed (cells in one report only are :func:`compare_reports`')."""
    return compare_reports(old, new).changed


INDEX_START, INDEX_END = "<!-- framework status: generated by ci/conformance.sh -->", "<!-- /framework status -->"


def index_rows(root: Path) -> list[list[str]]:
    """One row per report directory under ``root``: adapter, version, tier, counts, first failure."""
    rows = []
    for path in sorted(root.glob(f"*/{JSON_NAME}")):
        doc = json.loads(path.read_text())
        s = doc["summary"]
        # A silently wrong value ("fail") says more than a loud refusal ("error"): show it first.
        red = sorted((c for c in doc["cells"] if c["status"] in ("fail", "error")), key=_worst_first)
        first = red[0] if red else None
        diagnosis = shorten(first["detail"].splitlines()[0], 160).replace("|", "/") if first else ""
        name = doc["adapter"]["name"] or path.parent.name
        counts = doc.get("findings") or finding_counts(doc["cells"])
        rows.append([f"{name} (`{path.parent.name}/`)", doc["adapter"]["version"], doc.get("tier") or "-",
                     str(s["pass"]), *(str(counts.get(f, 0)) for f in FINDINGS), str(s["n/a"]),
                     f"`{first['id'].split('::', 1)[-1]}`: {diagnosis}" if first else ""])
    return rows


def write_index(root: Path, readme: Path | None = None) -> str:
    """``root/index.md`` over every report under ``root``; also the README's marked block when given."""
    from tabulate import tabulate

    rows = index_rows(root)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    docs = [json.loads(p.read_text()) for p in sorted(root.glob(f"*/{JSON_NAME}"))]
    env = f"torch {docs[0]['torch']}, {docs[0]['backend']} backend, world size {docs[0]['world_size']}" if docs else ""
    table = tabulate(rows, headers=["adapter", "version", "tier", "passed", *FINDINGS, "n/a", "worst first finding"],
                     tablefmt="github")
    text = f"Conformance matrix, {stamp} ({env}):\n\n{table}\n"
    write_atomic(root / "index.md", f"# MoE expert-parallel checkpoint conformance\n\n{text}")
    if readme is not None:
        current = readme.read_text()
        if INDEX_START not in current or INDEX_END not in current:
            raise SystemExit(f"{readme} lacks the markers {INDEX_START} ... {INDEX_END}")
        head, rest = current.split(INDEX_START, 1)
        tail = rest.split(INDEX_END, 1)[1]
        readme.write_text(f"{head}{INDEX_START}\n{text}{INDEX_END}{tail}")
    return text


class UsageProblem(Exception):
    """A report file that cannot be read: exit status 2 with one line, never a traceback."""


def read_report(path: Path) -> dict[str, Any]:
    """A report file, checked: :class:`UsageProblem` when it is missing or not a report this module reads."""
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise UsageProblem(f"{path}: cannot read it: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise UsageProblem(f"{path}: not a JSON report: {exc}") from exc
    if not isinstance(doc, dict) or "cells" not in doc:
        raise UsageProblem(f"{path}: not a moe-ep conformance report (no 'cells')")
    if doc.get("schema_version") not in READS:
        raise UsageProblem(f"{path}: schema_version {doc.get('schema_version')!r}, this tool reads "
                           f"{', '.join(map(str, READS))}")
    return doc


if __name__ == "__main__":  # ``python -m conformance.report``: the command line lives in conformance.report_cli
    from conformance.report_cli import main

    sys.exit(main())

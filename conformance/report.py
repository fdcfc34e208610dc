"""The conformance report: JSON for machines, Markdown for release pages, a diff between releases.

Each matrix cell attaches one record to its test report (``user_properties`` under
:data:`RECORD`), so the records travel with pytest's own reports -- across pytest-xdist workers too
-- and the process that sees every report (the only process, or xdist's controller) writes::

    DIR/moe-ep-conformance.json   schema_version, adapter, torch, backend (the one used), world_size,
                                  tier and coverage, created, summary (counts per status), cells
    DIR/moe-ep-conformance.md     one save-layout x load-layout table per (kind, state, fsdp, E), then
                                  one line per failure with its diagnosis, then the environment

``python -m conformance.report OLD.json NEW.json`` prints the cells whose status changed (exit 0:
none changed, 1: some did, 2: a file is missing or not a report).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pytest_moe_ep.text import shorten

SCHEMA_VERSION = 2
RECORD = "moe_ep_record"
JSON_NAME = "moe-ep-conformance.json"
MD_NAME = "moe-ep-conformance.md"
STATUSES = ("pass", "fail", "error", "n/a")
MARKS = {"pass": "pass", "fail": "**FAIL**", "error": "**ERROR**", "n/a": "n/a"}
LEGEND = "A blank table cell is a (save, load) layout pair this run did not include (tier or -k)."


def plural(count: int, word: str) -> str:
    """``1 error``, ``2 errors``."""
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def counts_line(summary: dict[str, int]) -> str:
    return (f"{summary['pass']} passed, {summary['fail']} failed, {plural(summary['error'], 'error')}, "
            f"{summary['n/a']} n/a")


def build_report(records: list[dict[str, Any]], *, backend: str, world_size: int, tier: str | None = None,
                 full_cells: int | None = None) -> dict[str, Any]:
    """The JSON document for ``records``; adapter and torch come from the records themselves."""
    first = records[0] if records else {}
    counts = Counter(r["status"] for r in records)
    checkpoint = sum(1 for r in records if r.get("suite") == "checkpoint")
    return {
        "schema_version": SCHEMA_VERSION,
        "adapter": {"name": first.get("adapter", ""), "version": first.get("adapter_version", "")},
        "torch": first.get("torch", ""),
        "backend": backend,
        "world_size": world_size,
        "tier": tier or "",
        "coverage": {"cells": checkpoint, "full_tier_cells": full_cells},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "summary": {s: counts.get(s, 0) for s in STATUSES},
        "cells": sorted(records, key=lambda r: r["id"]),
    }


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
    coverage = report.get("coverage") or {}
    if report.get("tier"):
        of = f" of the full tier's {coverage['full_tier_cells']}" if coverage.get("full_tier_cells") else ""
        lines += [f"Tier `{report['tier']}`: {coverage.get('cells', 0)} checkpoint cells{of}.", ""]
    tables = checkpoint_tables(report["cells"])
    if tables:
        lines += [LEGEND, ""]
    for title, table in tables:
        lines += [f"### {title}", "", table, ""]
    table = functions_table(report["cells"])
    if table:
        lines += ["### expert-slice functions", "", table, ""]
    failures = [r for r in report["cells"] if r["status"] in ("fail", "error")]
    if failures:
        lines += ["## Failures", ""]
        lines += [f"- `{r['id']}`: {r['detail'].splitlines()[0] if r['detail'] else r['status']}" for r in failures]
    refusals = [r for r in report["cells"] if r.get("legacy") and r["status"] == "pass"]
    if refusals:
        lines += ["", "## Legacy checkpoints refused", ""]
        lines += [f"- `{r['id']}`: {r['detail'].splitlines()[0]}" for r in refusals]
        lines.append("")
    na = Counter(r["detail"] for r in report["cells"] if r["status"] == "n/a")
    if na:
        lines += ["## Not applicable", ""] + [f"- {n} cell(s): {why}" for why, n in na.most_common()] + [""]
    lines += ["## Environment", "", f"- torch {report['torch']}, backend {report['backend']}, "
              f"world size {report['world_size']}, Python {report['python']}",
              f"- report schema version {report['schema_version']}", ""]
    return "\n".join(lines)


def compact_matrix(records: list[dict[str, Any]]) -> str:
    """The terminal summary: the same tables, without the Markdown around them."""
    parts = [f"{title}\n{table}" for title, table in checkpoint_tables(records)]
    table = functions_table(records)
    if table:
        parts.append(f"expert-slice functions\n{table}")
    counts = Counter(r["status"] for r in records)
    parts.append(", ".join(f"{counts.get(s, 0)} {s}" for s in STATUSES))
    if parts[:-1]:
        parts.insert(0, LEGEND)
    return "\n\n".join(parts)


def write_report(directory: str | os.PathLike[str], records: list[dict[str, Any]], *, backend: str,
                 world_size: int, tier: str | None = None, full_cells: int | None = None) -> tuple[Path, Path]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(records, backend=backend, world_size=world_size, tier=tier, full_cells=full_cells)
    json_path, md_path = out / JSON_NAME, out / MD_NAME
    json_path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    md_path.write_text(render_markdown(report))
    return json_path, md_path


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


def compare_reports(old: dict[str, Any], new: dict[str, Any]) -> ReportDiff:
    before = {c["id"]: c for c in old.get("cells", [])}
    after = {c["id"]: c for c in new.get("cells", [])}
    changed = []
    for cell_id in sorted(before.keys() & after.keys()):
        was, now = before[cell_id]["status"], after[cell_id]["status"]
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
    """One row per report directory under ``root``: adapter, version, counts, first failure."""
    rows = []
    for path in sorted(root.glob(f"*/{JSON_NAME}")):
        doc = json.loads(path.read_text())
        s = doc["summary"]
        # A silently wrong value ("fail") says more than a loud refusal ("error"): show it first.
        first = next((c for status in ("fail", "error") for c in doc["cells"] if c["status"] == status), None)
        diagnosis = shorten(first["detail"].splitlines()[0], 160).replace("|", "/") if first else ""
        name = doc["adapter"]["name"] or path.parent.name
        rows.append([f"{name} (`{path.parent.name}/`)", doc["adapter"]["version"], str(s["pass"]),
                     str(s["fail"] + s["error"]), str(s["n/a"]),
                     f"`{first['id'].split('::', 1)[-1]}`: {diagnosis}" if first else ""])
    return rows


def write_index(root: Path, readme: Path | None = None) -> str:
    """``root/index.md`` over every report under ``root``; also the README's marked block when given."""
    from tabulate import tabulate

    rows = index_rows(root)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    docs = [json.loads(p.read_text()) for p in sorted(root.glob(f"*/{JSON_NAME}"))]
    env = f"torch {docs[0]['torch']}, {docs[0]['backend']} backend, world size {docs[0]['world_size']}" if docs else ""
    table = tabulate(rows, headers=["adapter", "version", "passed", "failed", "n/a", "first failure"],
                     tablefmt="github")
    text = f"Conformance matrix, {stamp} ({env}):\n\n{table}\n"
    (root / "index.md").write_text(f"# MoE expert-parallel checkpoint conformance\n\n{text}")
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


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise UsageProblem(f"{path}: cannot read it: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise UsageProblem(f"{path}: not a JSON report: {exc}") from exc
    if not isinstance(doc, dict) or "cells" not in doc:
        raise UsageProblem(f"{path}: not a moe-ep conformance report (no 'cells')")
    if doc.get("schema_version") not in (1, SCHEMA_VERSION):
        raise UsageProblem(f"{path}: schema_version {doc.get('schema_version')!r}, this tool reads 1 and "
                           f"{SCHEMA_VERSION}")
    return doc


def main(argv: list[str] | None = None) -> int:
    """``OLD NEW``: exit 0 when no cell changed status, 1 when some did, 2 on bad input."""
    if argv is None:
        argv = sys.argv[1:]
    try:
        if argv[:1] == ["index"]:
            parser = argparse.ArgumentParser(prog="python -m conformance.report index",
                                             description="Write ROOT/index.md over the reports in ROOT's subfolders.")
            parser.add_argument("root", type=Path)
            parser.add_argument("--readme", type=Path, help="also replace the README's framework-status block")
            found = parser.parse_args(argv[1:])
            print(write_index(found.root, found.readme))
            return 0
        parser = argparse.ArgumentParser(prog="python -m conformance.report",
                                         description="Print the cells whose status changed between two reports "
                                         "(or: python -m conformance.report index ROOT [--readme README.md]). "
                                         "Exit 0: none changed; 1: some changed; 2: bad input.")
        parser.add_argument("old", type=Path)
        parser.add_argument("new", type=Path)
        args = parser.parse_args(argv)
        result = compare_reports(_read(args.old), _read(args.new))
    except UsageProblem as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(result.lines()))
    return 1 if result.changed else 0


if __name__ == "__main__":
    sys.exit(main())

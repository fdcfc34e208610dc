"""The conformance report: JSON for machines, Markdown for release pages, a diff between releases.

Each matrix cell attaches one record to its test report (``user_properties`` under
:data:`RECORD`), so the records travel with pytest's own reports -- across pytest-xdist workers too
-- and the process that sees every report (the only process, or xdist's controller) writes::

    DIR/moe-ep-conformance.json   schema_version, adapter, torch, backend, world_size, created,
                                  summary (counts per status), cells (one record per cell)
    DIR/moe-ep-conformance.md     one save_ep x load_ep table per (kind, state, fsdp, E), then one
                                  line per failure with its diagnosis, then the environment

``python -m pytest_moe_ep.report OLD.json NEW.json`` prints the cells whose status changed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
RECORD = "moe_ep_record"
JSON_NAME = "moe-ep-conformance.json"
MD_NAME = "moe-ep-conformance.md"
STATUSES = ("pass", "fail", "error", "n/a")
MARKS = {"pass": "pass", "fail": "**FAIL**", "error": "**ERROR**", "n/a": "n/a"}


def build_report(records: list[dict[str, Any]], *, backend: str, world_size: int) -> dict[str, Any]:
    """The JSON document for ``records``; adapter and torch come from the records themselves."""
    first = records[0] if records else {}
    counts = Counter(r["status"] for r in records)
    return {
        "schema_version": SCHEMA_VERSION,
        "adapter": {"name": first.get("adapter", ""), "version": first.get("adapter_version", "")},
        "torch": first.get("torch", ""),
        "backend": backend,
        "world_size": world_size,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "summary": {s: counts.get(s, 0) for s in STATUSES},
        "cells": sorted(records, key=lambda r: r["id"]),
    }


def _group_key(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r.get("kind", ""), r.get("state", ""), "fsdp" if r.get("fsdp") else "ep-only", r.get("num_experts", 0))


def checkpoint_tables(records: Iterable[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(title, table)`` per (kind, state, fsdp, E): rows save_ep, columns load_ep."""
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
        saves = sorted({r["save_ep"] for r in cells})
        loads = sorted({r["load_ep"] for r in cells})
        at = {(r["save_ep"], r["load_ep"]): MARKS[r["status"]] for r in cells}
        rows = [[f"save ep={s}", *(at.get((s, t), "") for t in loads)] for s in saves]
        kind, state, fsdp, experts = key
        title = f"{kind} · {state} · {fsdp} · E={experts}"
        out.append((title, tabulate(rows, headers=["", *(f"load ep={t}" for t in loads)], tablefmt="github")))
    if legacy:
        rows = [[r["kind"], f"ep={r['save_ep']}", f"ep={r['load_ep']}", MARKS[r["status"]]] for r in legacy]
        out.append(("legacy checkpoint refused", tabulate(rows, headers=["kind", "saved at", "loaded at", "result"],
                                                          tablefmt="github")))
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
             f"{s['pass']} passed, {s['fail']} failed, {s['error']} errors, {s['n/a']} n/a "
             f"({report['created']})", ""]
    for title, table in checkpoint_tables(report["cells"]):
        lines += [f"### {title}", "", table, ""]
    table = functions_table(report["cells"])
    if table:
        lines += ["### expert-slice functions", "", table, ""]
    failures = [r for r in report["cells"] if r["status"] in ("fail", "error")]
    if failures:
        lines += ["## Failures", ""]
        lines += [f"- `{r['id']}`: {r['detail'].splitlines()[0] if r['detail'] else r['status']}" for r in failures]
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
    return "\n\n".join(parts)


def write_report(directory: str | os.PathLike[str], records: list[dict[str, Any]], *, backend: str,
                 world_size: int) -> tuple[Path, Path]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(records, backend=backend, world_size=world_size)
    json_path, md_path = out / JSON_NAME, out / MD_NAME
    json_path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    md_path.write_text(render_markdown(report))
    return json_path, md_path


def diff_reports(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per cell whose status changed, appeared or disappeared."""
    before = {c["id"]: c for c in old.get("cells", [])}
    after = {c["id"]: c for c in new.get("cells", [])}
    lines = []
    for cell_id in sorted(before.keys() | after.keys()):
        was = before.get(cell_id, {}).get("status", "absent")
        now = after.get(cell_id, {}).get("status", "absent")
        if was != now:
            detail = after.get(cell_id, {}).get("detail", "")
            lines.append(f"{cell_id}: {was} -> {now}" + (f"  ({detail.splitlines()[0]})" if detail else ""))
    return lines


INDEX_START, INDEX_END = "<!-- framework status: generated by ci/conformance.sh -->", "<!-- /framework status -->"


def index_rows(root: Path) -> list[list[str]]:
    """One row per report directory under ``root``: adapter, version, counts, first failure."""
    rows = []
    for path in sorted(root.glob(f"*/{JSON_NAME}")):
        doc = json.loads(path.read_text())
        s = doc["summary"]
        # A silently wrong value ("fail") says more than a loud refusal ("error"): show it first.
        first = next((c for status in ("fail", "error") for c in doc["cells"] if c["status"] == status), None)
        diagnosis = first["detail"].splitlines()[0][:160].replace("|", "/") if first else ""
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


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["index"]:
        parser = argparse.ArgumentParser(prog="python -m pytest_moe_ep.report index",
                                         description="Write ROOT/index.md over the reports in ROOT's subfolders.")
        parser.add_argument("root", type=Path)
        parser.add_argument("--readme", type=Path, help="also replace the README's framework-status block")
        found = parser.parse_args(argv[1:])
        print(write_index(found.root, found.readme))
        return 0
    parser = argparse.ArgumentParser(prog="python -m pytest_moe_ep.report",
                                     description="Print the cells whose status changed between two reports "
                                     "(or: python -m pytest_moe_ep.report index ROOT [--readme README.md]).")
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    args = parser.parse_args(argv)
    old, new = (json.loads(p.read_text()) for p in (args.old, args.new))
    for doc, path in ((old, args.old), (new, args.new)):
        if doc.get("schema_version") != SCHEMA_VERSION:
            print(f"{path}: schema_version {doc.get('schema_version')!r}, this tool reads {SCHEMA_VERSION}",
                  file=sys.stderr)
            return 2
    lines = diff_reports(old, new)
    print("\n".join(lines) if lines else "no cell changed status")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())

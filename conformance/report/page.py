"""The report as one self-contained HTML page: what the Markdown says, with the pictures inline.

``moe-ep-conformance.html`` beside the Markdown.
No network and no script: the CSS and the SVGs are in the page, and every square links to its cell's
entry on the page (``#cell-...``), red cells and the others alike, so a page saved from a release
opens anywhere.  The entries, their anchors, the lead and the coverage are
:mod:`conformance.report.cells`' (the Markdown's too).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from html import escape
from typing import Any

from conformance.findings import FINDINGS, MEANING
from conformance.outcome import NA, is_red, outcome
from conformance.report.cells import (
    anchors,
    counts_line,
    coverage_items,
    expectation_note,
    expectations_summary,
    first_line,
    grids,
    lead_lines,
    red_cells,
    square_title,
)
from conformance.report.picture import COLORS, grid_svg

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto;
       max-width: 72rem; padding: 0 1rem; color: #1a1a1a; line-height: 1.45; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.2rem; margin-top: 2rem; }
figure { display: inline-block; vertical-align: top; margin: 0.5rem 1rem 0.5rem 0; max-width: 100%;
         overflow-x: auto; }
figure svg { display: block; }
code, pre { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 0.85rem; }
pre { background: #f4f4f4; padding: 0.5rem; overflow-x: auto; white-space: pre-wrap;
      user-select: all; }
li.cell { margin: 0.4rem 0; padding-left: 0.5rem; border-left: 0.4rem solid #cccccc;
          list-style: none; }
li.cell:target { background: #fff5cc; }
.outcome { font-weight: bold; } .warning { font-weight: bold; color: #8a3b00; }
"""


def _list(items: list[tuple[str, list[str]]]) -> str:
    """Items, each with its sub-items, as a nested HTML list."""
    found = []
    for item, subs in items:
        inner = "".join(f"<li>{escape(s)}</li>" for s in subs)
        found.append(f"<li>{escape(item)}" + (f"<ul>{inner}</ul>" if inner else "") + "</li>")
    return f"<ul>{''.join(found)}</ul>"


def _entry(r: Mapping[str, Any], anchor: str) -> str:
    """A cell's entry: its outcome, id, expectation, first line (a red one's rerun command too)."""
    found = outcome(r)
    color = COLORS.get(found, COLORS["error"])
    rerun = f"<pre>{escape(r['rerun'])}</pre>" if r.get("rerun") else ""
    return (f'<li class="cell" id="{anchor}" style="border-left-color: {color}">'
            f'<span class="outcome">{escape(found)}</span> <code>{escape(str(r["id"]))}</code>'
            f"{escape(expectation_note(r))}: {escape(first_line(r))}{rerun}</li>")


def render_html(report: Mapping[str, Any]) -> str:
    """The whole page for ``report`` (a document :func:`conformance.report.build_report` made)."""
    a, cells = report["adapter"], report["cells"]
    where = anchors(r["id"] for r in cells)
    name = f"{a['name']} {a['version']}".strip()
    heading = f"MoE expert-parallel checkpoint conformance: {name}"
    created = escape(str(report["created"]))
    body = [f"<h1>{escape(heading)}</h1>",
            f"<p>{escape(counts_line(cells))} ({len(cells)} cells; {created})</p>"]
    if report.get("incomplete"):
        body.append(f'<p class="warning">Incomplete: {len(report.get("not_run") or [])} selected '
                    "cell(s) did not run (listed below).</p>")
    for grid in grids(cells):
        svg = grid_svg(grid, link=lambda r: f"#{where[r['id']]}", title=square_title)
        body.append(f'<figure id="grid-{grid.slug}">{svg}</figure>')
    lead = lead_lines(cells)
    body += [f"<p>{escape(line)}</p>" for line in lead]
    coverage = coverage_items(report, code="")
    if coverage:
        body += ["<h2>Coverage</h2>", _list(coverage)]
    expected = expectations_summary(report, code="")
    body += [f"<p>{escape(expected)}</p>"] if expected else []
    red = red_cells(cells)
    if red:
        meaning = "; ".join(f"{f}: {MEANING[f]}" for f in FINDINGS)
        body += ["<h2>Red cells</h2>", f"<p>Worst first. {escape(meaning)}.</p>",
                 "<ol>", *(_entry(r, where[r["id"]]) for r in red), "</ol>"]
    na = Counter(str(r.get("detail") or "") for r in cells if outcome(r) == NA)
    if na:
        body += ["<h2>Not applicable</h2>", "<ul>",
                 *(f"<li>{n} cell(s): {escape(why)}</li>" for why, n in na.most_common()), "</ul>"]
    others = [r for r in cells if not is_red(r)]
    if others:
        body += ["<h2>Other cells</h2>", f"<details><summary>{len(others)} cell(s) not red: "
                 f"{escape(counts_line(others))}</summary><ol>",
                 *(_entry(r, where[r["id"]]) for r in others), "</ol></details>"]
    not_run = report.get("not_run") or []
    if not_run:
        body += ["<h2>Not run</h2>", "<ul>",
                 *(f"<li><code>{escape(i)}</code></li>" for i in not_run), "</ul>"]
    environment = (f"torch {report['torch']}, backend {report['backend']}, world size "
                   f"{report['world_size']}, Python {report['python']}; report schema version "
                   f"{report['schema_version']}")
    body += ["<h2>Environment</h2>", f"<p>{escape(environment)}</p>"]
    commands = (report.get("rerun") or {}).get("unexpected") or []
    if commands:
        body += ["<h2>Rerun</h2>", "<p>Every unexpected red cell, in one run:</p>",
                 *(f"<pre>{escape(c)}</pre>" for c in commands)]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{escape(heading)}</title><style>{STYLE}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


__all__ = ["render_html"]

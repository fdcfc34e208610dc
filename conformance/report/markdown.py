"""The report as text: the Markdown beside the pictures, the GitHub step summary, the terminal.

The Markdown leads with the pictures (one SVG per grid, beside it), then the findings, the tier's
coverage, one entry per red cell (its anchor, first line and rerun command), the expectations, and
ends with the command that reruns every unexpected red cell.  Where an image cannot be shown (a step
summary, a release body) the grids are tables of text squares: a colored square per outcome, and the
finding's letter in each red one (lower case when the expectations file expected it).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from conformance.findings import ERROR, FINDINGS, MEANING, ON_DISK, PASS, REFUSED, SILENT
from conformance.outcome import (
    INTERRUPTED,
    NA,
    OUTCOMES,
    is_expected,
    is_red,
    is_unmet,
    outcome,
    status_of,
)
from conformance.report.cells import (
    Grid,
    anchors,
    cell_kind,
    counts_line,
    coverage_items,
    expectation_note,
    expectations_summary,
    first_line,
    grid_label,
    grids,
    layout_order,
    lead_lines,
    red_cells,
)
from conformance.report.files import grid_name
from conformance.report.picture import LETTERS

Record = Mapping[str, Any]
EMOJI = {PASS: "🟩", SILENT: "🟥", ON_DISK: "🟧", REFUSED: "🟦", ERROR: "🟪", NA: "⬜",
         INTERRUPTED: "🟨"}
LEGEND = "A blank table cell is a (save, load) layout pair this run did not include (tier or -k)."
#: the step summary lists this many red cells' commands, then says how many more the report has.
SUMMARY_CELLS = 20


def expectation_mark(r: Record) -> str:
    """`` (expected: why)``, `` (tolerated)`` or `` (**unexpected**: expected X)`` after an id."""
    return expectation_note(r, bold="**")


def text_square(r: Record) -> str:
    """A cell as text: its outcome's colored square, and the finding's letter in a red one (lower
    case when expected)."""
    found = outcome(r)
    letter = LETTERS.get(found, "")
    return EMOJI.get(found, EMOJI[ERROR]) + (letter.lower() if is_expected(r) else letter)


def text_grid(grid: Grid) -> list[str]:
    """A grid as a Markdown table of text squares: a row per panel and save layout, loads across."""
    columns = list(dict.fromkeys(c for p in grid.panels for c in p.columns))
    if grid.axes == ("save", "load"):
        columns.sort(key=layout_order)
    rows = [[f"{p.title} · {grid.axes[0]} {row}",
             *(text_square(p.at[(row, c)]) if (row, c) in p.at else "" for c in columns)]
            for p in grid.panels for row in grid.rows if any(k[0] == row for k in p.at)]
    head = ["", *(f"{grid.axes[1]} {c}" for c in columns)]
    return [f"**{grid.title}**", "", _table(head, rows), ""]


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    from tabulate import tabulate

    return str(tabulate(rows, headers=list(head), tablefmt="github"))


def text_legend() -> str:
    squares = " ".join(f"{EMOJI[o]}{LETTERS.get(o, '')} {o}" for o in OUTCOMES)
    return f"{squares}; a lower-case letter: red as the expectations file expects."


def incomplete_lines(report: Mapping[str, Any]) -> list[str]:
    """The warning at the top of a report that does not hold the whole run."""
    lines = []
    if report.get("incomplete"):
        why = ("the run's log ends before the session did" if report.get("log_ends_early")
               else "the run was interrupted" if report.get("interrupted")
               else "not every selected cell ran")
        running = [r["id"] for r in report["cells"] if status_of(r) == INTERRUPTED]
        lines.append(f"**Incomplete: {why}.** {len(report['cells']) - len(running)} cell(s) "
                     "finished" + (f", {len(running)} interrupted while running" if running else "")
                     + f", {len(report.get('not_run') or [])} not run (listed below).")
    if report.get("rebuilt_from"):
        lines.append(f"Rebuilt from the pytest-reportlog log `{report['rebuilt_from']}`; the "
                     "environment line holds what the log's records say.")
    return [*lines, ""] if lines else []


def _rank(finding: str) -> int:
    return FINDINGS.index(finding) if finding in FINDINGS else len(FINDINGS)


def _expectations(report: Mapping[str, Any]) -> list[str]:
    """How many red cells were expected, and why (the release report's account of its red)."""
    line = expectations_summary(report)
    if not line:
        return []
    cells = report["cells"]
    lines = ["## Expectations", "", line, ""]
    reasons = Counter((outcome(r), _reason(r)) for r in cells if is_expected(r))
    if reasons:
        rows = [[finding, n, why.replace("|", "/")] for (finding, why), n in
                sorted(reasons.items(), key=lambda kv: (_rank(kv[0][0]), -kv[1]))]
        lines += [_table(["finding", "cells", "why (the expectations file's reason)"], rows), ""]
    unmet = [r for r in cells if is_unmet(r)]
    lines += [f"- `{r['id']}`: expected {r.get('expected')}, got {outcome(r)}" for r in unmet]
    return [*lines, ""] if unmet else lines


def _reason(r: Record) -> str:
    """Why an expected red cell was expected: the file's reason, else how it came to be."""
    state = r.get("expectation")
    if state == "updated":
        return "written by this run (--moe-ep-update-expectations)"
    return str(r.get("expected_reason") or ("tolerated" if state == "tolerated" else ""))


def picture_lines(report: Mapping[str, Any]) -> list[str]:
    """The pictures as Markdown images (relative paths: GitHub shows the files beside it)."""
    lines = []
    for grid in grids(report["cells"]):
        lines += [f"![{grid_label(grid)}]({grid_name(grid.slug)})", ""]
    if lines:
        lines += ["Each square is a cell (save layout down, load layout across); its tooltip names "
                  "it and it links to the cell's entry below. " + text_legend(), ""]
    return lines


def red_entry(r: Record, anchor: str) -> list[str]:
    """A red cell's entry: its anchor, id, expectation and first line, then its rerun command."""
    lines = [f'- <a id="{anchor}"></a>`{r["id"]}`{expectation_mark(r)}: {first_line(r)}']
    if r.get("rerun"):
        lines.append(f"  `{r['rerun']}`")
    return lines


def _coverage(report: Mapping[str, Any]) -> list[str]:
    coverage = coverage_items(report)
    if not coverage:
        return []
    lines = ["## Coverage", ""]
    for item, subitems in coverage:
        lines += [f"- {item}", *(f"  - {s}" for s in subitems)]
    return [*lines, ""]


def _cells(report: Mapping[str, Any]) -> list[str]:
    """The red cells' entries, the n/a reasons, the other cells' entries, the cells not run."""
    cells = report["cells"]
    where = anchors(r["id"] for r in cells)
    lines = []
    red = red_cells(cells)
    if red:
        meaning = "; ".join(f"**{f}**: {MEANING[f]}" for f in FINDINGS)
        lines += ["## Red cells", "", f"Worst first; each line leads with the cell's findings: "
                  f"{meaning}. Each carries the command that reruns it alone.", ""]
        for r in red:
            lines += red_entry(r, where[r["id"]])
        lines.append("")
    lines += _expectations(report)
    na = Counter(str(r.get("detail") or "") for r in cells if outcome(r) == NA)
    if na:
        lines += ["## Not applicable", "",
                  *(f"- {n} cell(s): {why}" for why, n in na.most_common()), ""]
    others = [r for r in cells if not is_red(r)]
    if others:
        lines += ["## Other cells", "", f"<details><summary>{len(others)} cell(s) not red: "
                  f"{counts_line(others)}</summary>", ""]
        lines += [f'- <a id="{where[r["id"]]}"></a>`{r["id"]}`: {outcome(r)}: '
                  f"{first_line(r, 300)}" for r in others]
        lines += ["", "</details>", ""]
    not_run = report.get("not_run") or []
    if not_run:
        lines += ["## Not run", "", f"<details><summary>{len(not_run)} selected cell(s) have no "
                  "outcome</summary>", "", *(f"- `{i}`" for i in not_run), "", "</details>", ""]
    return lines


def render_markdown(report: Mapping[str, Any]) -> str:
    """The Markdown report: the pictures first, then the findings, the coverage, the cells."""
    a, cells = report["adapter"], report["cells"]
    tier = f", tier {report['tier']}" if report.get("tier") else ""
    lines = [f"# MoE expert-parallel checkpoint conformance: {a['name']} {a['version']}".rstrip(),
             "", f"{counts_line(cells)} ({len(cells)} cells{tier}; {report['created']})", ""]
    lines += incomplete_lines(report)
    lines += picture_lines(report)
    lines += [*lead_lines(cells, code="`", bold="**"), ""]
    lines += _coverage(report)
    lines += _cells(report)
    picture = grids(cells)
    if picture:
        lines += ["<details><summary>The grids as text</summary>", ""]
        for grid in picture:
            lines += text_grid(grid)
        lines += ["</details>", ""]
    lines += ["## Environment", "", f"- torch {report['torch']}, backend {report['backend']}, "
              f"world size {report['world_size']}, Python {report['python']}",
              f"- report schema version {report['schema_version']}", ""]
    lines += rerun_lines(report)
    return "\n".join(lines)


def rerun_lines(report: Mapping[str, Any], heading: str = "##") -> list[str]:
    """The report's last section: one command for every red cell that was not expected."""
    red = [r for r in report["cells"] if is_red(r)]
    if not red:
        return []
    commands = (report.get("rerun") or {}).get("unexpected") or []
    if not commands:
        return [f"{heading} Rerun", "", "Every red cell was expected: nothing to rerun.", ""]
    unexpected = sum(not is_expected(r) for r in red)
    return [f"{heading} Rerun", "", f"Every unexpected red cell ({unexpected}), in one run:", "",
            "```bash", *commands, "```", ""]


def step_summary(report: Mapping[str, Any], limit: int = SUMMARY_CELLS) -> str:
    """The report's head for ``$GITHUB_STEP_SUMMARY``: counts, findings, the grids as text squares,
    the red cells' rerun commands (the first ``limit``) and the command for every unexpected one."""
    a, cells = report["adapter"], report["cells"]
    lines = [f"## MoE expert-parallel checkpoint conformance: {a['name']} {a['version']}".rstrip(),
             "", f"{counts_line(cells)} ({len(cells)} cells)", ""]
    lines += incomplete_lines(report)
    lines += [*lead_lines(cells, code="`", bold="**"), ""]
    line = expectations_summary(report)
    lines += [line, ""] if line else []
    picture = grids(cells)
    if picture:
        lines += [text_legend(), ""]
        for grid in picture:
            lines += text_grid(grid)
    red = red_cells(cells)
    if red:
        lines += ["### Red cells", ""]
        for r in red[:limit]:
            lines += [f"- `{r['id']}`{expectation_mark(r)}: {first_line(r, 200)}"]
            lines += [f"  `{r['rerun']}`"] if r.get("rerun") else []
        if len(red) > limit:
            lines.append(f"- ... and {len(red) - limit} more: the report lists them all")
        lines.append("")
    lines += rerun_lines(report, "###")
    return "\n".join(lines)


# -- the terminal ---------------------------------------------------------------------------
def plural(count: int, word: str) -> str:
    """``1 error``, ``2 errors``."""
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def kind_state_counts(records: Iterable[Record]) -> str:
    """Checkpoint cells counted by outcome per kind and state (legacy cells a row of their own)."""
    counts: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for r in records:
        if r.get("suite") == "checkpoint":
            state = "legacy" if r.get("legacy") else str(r.get("state", ""))
            counts[(cell_kind(r), state)][outcome(r)] += 1
    if not counts:
        return ""
    shown = [o for o in OUTCOMES if o != INTERRUPTED or any(c[o] for c in counts.values())]
    rows = [[kind, state, *(c[o] for o in shown)] for (kind, state), c in sorted(counts.items())]
    return _table(["kind", "state", *shown], rows)


def outcome_tables(grid: Grid) -> list[tuple[str, str]]:
    """Each panel of ``grid`` as a text table of outcome words, with its title."""
    found = []
    for panel in grid.panels:
        rows = [[f"{grid.axes[0]} {row}", *(outcome(panel.at[(row, c)]) if (row, c) in panel.at
                                            else "" for c in panel.columns)]
                for row in grid.rows if any(k[0] == row for k in panel.at)]
        head = ["", *(f"{grid.axes[1]} {c}" for c in panel.columns)]
        found.append((f"{grid.title} · {panel.title}", _table(head, rows)))
    return found


def functions_table(records: Iterable[Record]) -> str:
    """The functions suite's records counted by outcome per function."""
    by_function: dict[str, Counter[str]] = defaultdict(Counter)
    for r in records:
        by_function[str(r.get("function", "*"))][outcome(r)] += 1
    shown = [o for o in OUTCOMES if o == PASS or any(c[o] for c in by_function.values())]
    rows = [[f, *(c[o] for o in shown)] for f, c in sorted(by_function.items())]
    return _table(["function", *shown], rows)


def _not_green(records: Iterable[Record]) -> bool:
    """Whether a table is worth showing: a cell in it is red or was interrupted."""
    return any(outcome(r) not in (PASS, NA) for r in records)


def terminal_summary(records: list[dict[str, Any]], *, verbose: bool = False,
                     tier: str | None = None, full_cells: int | None = None) -> str:
    """The terminal summary: the findings, counts per kind and state, the tier's coverage (a line
    per item: the terminal is short), the tables that hold a cell that is not green -- every table
    with ``verbose`` -- and the counts by outcome."""
    from conformance.covering import uneven_reach

    parts = []
    lead = lead_lines(records)
    if lead:
        parts.append("\n".join(lead))
    counts = kind_state_counts(records)
    if counts:
        parts.append(f"checkpoint cells by kind and state\n{counts}")
    checkpoint = [r for r in records if r.get("suite") == "checkpoint"]
    if tier:
        report = {"tier": tier, "coverage": {"cells": len(checkpoint),
                                             "full_tier_cells": full_cells,
                                             "uneven_classes": uneven_reach(checkpoint)}}
        parts.append("\n".join(f"- {item} {'; '.join(subitems)}".rstrip()
                               for item, subitems in coverage_items(report, code="")))
    tables, hidden = [], 0
    for grid in grids(checkpoint):
        for (title, table), panel in zip(outcome_tables(grid), grid.panels, strict=True):
            if verbose or _not_green(panel.at.values()):
                tables.append(f"{title}\n{table}")
            else:
                hidden += 1
    if tables:
        parts.append(LEGEND)
    parts += tables
    functions = [r for r in records if r.get("suite") == "functions"]
    if functions:
        if verbose or _not_green(functions):
            parts.append(f"expert-slice functions\n{functions_table(functions)}")
        else:
            parts.append(f"expert-slice functions: {counts_line(functions)}")
    line = counts_line(records)
    if hidden:
        line += f" ({plural(hidden, 'more table')} with -v; the report's pictures have them all)"
    parts.append(line)
    return "\n\n".join(parts)


__all__ = ["EMOJI", "LEGEND", "expectation_mark", "functions_table", "kind_state_counts", "plural",
           "render_markdown", "step_summary", "terminal_summary", "text_grid", "text_square"]

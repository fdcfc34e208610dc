"""What every rendering of a report says of its cells: anchors, grids, first lines, lead, coverage.

The Markdown, the HTML page, the SVG pictures, the step summary and the terminal all show the same
cells the same way, so the rules live here once: a cell's *anchor* (the id its entry carries and its
square links to), the *grid* it is drawn in (one per layer kind and state: save layouts down, load
layouts across, one panel per FSDP mode and expert count), the order red cells are listed in (worst
first) and the line each one leads with.  Outcomes, what is red, what is expected and their counts
are :mod:`conformance.outcome`'s, asked here and never re-derived.  This module reads report records
(dicts) and imports nothing of the report package, which imports it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from conformance.covering import guarantee
from conformance.findings import FINDINGS, ON_DISK, SILENT
from conformance.outcome import (
    expected_phrase,
    finding_counts,
    is_red,
    is_unmet,
    judged,
    outcome,
    outcome_counts,
)
from pytest_moe_ep.text import shorten
from reference_impl.layout import UNEVEN_CLASSES

Record = Mapping[str, Any]
#: what a report's cell ids start with (the matrix's collector); anchors and titles leave it off.
PREFIX = "moe-ep-matrix::"
#: what the lead says each finding means, in a few words.
IN_SHORT = ("silent: wrong state after a load that reported success; on-disk: the checkpoint is "
            "not EP-invariant; refused: a loud refusal; error: the adapter or the harness")


def short_id(cell_id: str) -> str:
    """The id without the matrix's prefix: ``checkpoint::packed::model::ep-only::ep2->ep4``."""
    return cell_id.removeprefix(PREFIX)


def anchors(ids: Iterable[str]) -> dict[str, str]:
    """Each cell id's anchor (``cell-checkpoint--packed--model--ep-only--ep2-ep4``): letters,
    digits, ``.``, ``_`` and ``-`` only, so GitHub's Markdown, HTML and a URL fragment all keep it;
    unique among ``ids`` (a clash, which no two matrix ids make, gets ``-2``, ``-3`` in id
    order)."""
    found: dict[str, str] = {}
    taken: set[str] = set()
    for cell_id in sorted(set(ids)):
        base = "cell-" + re.sub(r"[^a-z0-9._]+", "-", short_id(cell_id).lower()).strip("-")
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}-{n}"
        taken.add(name)
        found[cell_id] = name
    return found


def first_line(record: Record, limit: int = 0) -> str:
    """The line a cell's entry shows: its diagnosis's first line (its outcome when it has none)."""
    detail = str(record.get("detail") or "").strip()
    line = detail.splitlines()[0] if detail else outcome(record)
    return shorten(line, limit) if limit else line


def expectation_note(record: Record, bold: str = "") -> str:
    """`` (expected: why)``, `` (tolerated)`` or `` (unexpected: expected X)`` after a cell's id."""
    state = record.get("expectation")
    if state == "met":
        return f" (expected: {record.get('expected_reason') or state})"
    if state == "tolerated":
        return " (tolerated)"
    if state == "updated" and is_red(record):
        return " (expected: the expectations file was updated to expect it)"
    if state == "unmet":
        return f" ({bold}unexpected{bold}: expected {record.get('expected')})"
    return ""


def expectations_summary(report: Mapping[str, Any], code: str = "`") -> str:
    """``N of M red cell(s) expected (FILE); K cell(s) did not come back as expected.`` ("" without
    expectations; ``code`` quotes the file's name)."""
    info = report.get("expectations")
    if not info:
        return ""
    cells = report["cells"]
    unmet = sum(is_unmet(r) for r in cells)
    source = f"{code}{info['file']}{code}" if info.get("file") else "no expectations file"
    tolerated = f", tolerating {', '.join(info['tolerate'])}" if info.get("tolerate") else ""
    updated = ", updated by this run" if info.get("update") else ""
    return (f"{expected_phrase(cells)} ({source}{tolerated}{updated}); "
            f"{unmet} cell(s) did not come back as expected.")


def grid_label(grid: Grid) -> str:
    """A picture's name for its alt text and accessible label: ``TITLE: N cells, R red`` and, when
    its cells were judged, ``; E of R red cell(s) expected``."""
    records = grid.records()
    label = f"{grid.title}: {len(records)} cells, {sum(is_red(r) for r in records)} red"
    return f"{label}; {expected_phrase(records)}" if judged(records) else label


def square_title(record: Record) -> str:
    """A square's tooltip: the cell's id and outcome, whether it was expected, its first line."""
    return f"{record['id']}: {outcome(record)}{expectation_note(record)}: {first_line(record, 240)}"


def worst_first(record: Record) -> tuple[int, str]:
    """Red cells' order: silent first, then on-disk, refused, error; by id within each."""
    found = outcome(record)
    return (FINDINGS.index(found) if found in FINDINGS else len(FINDINGS), str(record["id"]))


def red_cells(records: Iterable[Record]) -> list[Record]:
    """The red cells, worst first."""
    return sorted((r for r in records if is_red(r)), key=worst_first)


def counts_line(records: Iterable[Record]) -> str:
    """``15 pass, 0 silent, 41 on-disk, 2 refused, 0 error, 2 n/a``: every cell by its outcome."""
    return ", ".join(f"{n} {o}" for o, n in outcome_counts(records).items())


def lead_lines(records: Iterable[Record], *, code: str = "", bold: str = "") -> list[str]:
    """What a report leads with: the findings counts, and how many cells are silent and on-disk with
    the first one's line (a loud refusal is a limitation; these are what a release page must not
    hide)."""
    red = red_cells(records)
    if not red:
        return []
    counts = finding_counts(red)
    lines = [f"Findings: {', '.join(f'{n} {f}' for f, n in counts.items())} ({IN_SHORT})."]
    for finding in (SILENT, ON_DISK):
        first = next((r for r in red if outcome(r) == finding), None)
        if first is not None:
            lines.append(f"{bold}{counts[finding]} {finding}{bold} cell(s); the first: "
                         f"{code}{first['id']}{code}: {first_line(first, 300)}")
    return lines


def _top_level(text: str, separator: str) -> list[str]:
    """``text`` split at ``separator`` where it is outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and text.startswith(separator, i):
            parts.append(text[start:i])
            start = i + len(separator)
    return [p.strip() for p in [*parts, text[start:]] if p.strip()]


def coverage_items(report: Mapping[str, Any], code: str = "`") -> list[tuple[str, list[str]]]:
    """The tier's coverage as a short list: ``(item, sub-items)`` each (``code`` quotes the tier's
    name).

    What a green run of the tier means (:func:`~conformance.covering.guarantee`), clause by clause;
    which uneven splits its cells reached, each with where, and which they did not (a tier that
    never reaches ``mislabel`` cannot catch a silent mislabel).
    """
    tier = report.get("tier")
    if not tier:
        return []
    coverage = report.get("coverage") or {}
    full = coverage.get("full_tier_cells")
    of = f" of the full tier's {full}" if full else ""
    items = [(f"Tier {code}{tier}{code}: {coverage.get('cells', 0)} checkpoint cells{of}", []),
             ("A green run means:", _top_level(guarantee(str(tier)), "; "))]
    reach = coverage.get("uneven_classes")
    if reach is not None:
        reached = [f"{UNEVEN_CLASSES[name]}: {', '.join(where)}" for name, where in reach.items()]
        missed = [UNEVEN_CLASSES[name] for name in UNEVEN_CLASSES if name not in reach]
        items.append(("Uneven splits reached:" + ("" if reached else " none"), reached))
        if missed:
            items.append(("Not reached:", missed))
    return items


# -- grids ----------------------------------------------------------------------------------------
@dataclass
class Panel:
    """One save x load grid: ``at[(row, column)]`` is the cell drawn there."""

    title: str
    columns: list[str]
    at: dict[tuple[str, str], Record] = field(default_factory=dict)


@dataclass
class Grid:
    """One picture: a layer kind and state (or the legacy cells of a kind, or the functions suite),
    its panels side by side over shared rows.  ``slug`` names its file."""

    slug: str
    title: str
    rows: list[str]
    panels: list[Panel]
    #: what the rows and columns are (``save``/``load``, or ``function``/``cell``).
    axes: tuple[str, str] = ("save", "load")

    def records(self) -> list[Record]:
        return [r for p in self.panels for r in p.at.values()]


def layout_name(record: Record, side: str) -> str:
    """A checkpoint record's layout on ``side`` (``save``/``load``) as the node id names it."""
    return str(record.get(f"{side}_layout") or f"ep{record.get(f'{side}_ep')}")


def layout_order(name: str) -> tuple[int, int, str]:
    """Layouts by pipeline stages, then EP degree, then name: ``ep1, ep2, ep2.etp2, ep2c, ep4,
    pp2.ep1``."""
    stages = int(name[2:name.index(".")]) if name.startswith("pp") and "." in name else 1
    plain = name.split(".", 1)[1] if stages > 1 else name
    digits = "".join(ch for ch in plain.split(".")[0] if ch.isdigit())
    return (stages, int(digits or 0), name)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.replace("->", " to ").lower()).strip("-")


def cell_kind(record: Record) -> str:
    """A checkpoint record's kind as the report groups it: the layer kind, and a fine-tuning cell's
    setup after it (``packed lora+mxfp4``), so its squares never share a grid with the plain
    cells of the same layouts."""
    finetune = record.get("finetune")
    return f"{record.get('kind', '')} {finetune}" if finetune else str(record.get("kind", ""))


def grids(records: Iterable[Record]) -> list[Grid]:
    """The report's pictures: a grid per (kind, state) of the checkpoint cells, one per kind of the
    legacy cells, and one of the functions suite (functions down, its cells across)."""
    groups: dict[tuple[str, str], dict[str, dict[tuple[str, str], Record]]] = defaultdict(
        lambda: defaultdict(dict))
    functions: dict[tuple[str, str], Record] = {}
    for r in records:
        if r.get("suite") == "functions":
            cell = short_id(str(r["id"])).removeprefix("functions::")
            if r.get("function", "*") != "*":
                cell = cell.rsplit("::", 1)[0]
            functions[(str(r.get("function", "*")), cell)] = r
            continue
        if r.get("suite") != "checkpoint" or "kind" not in r:
            continue
        kind = cell_kind(r)
        key = ("legacy", kind) if r.get("legacy") else (kind, str(r.get("state", "")))
        panel = f"E={r.get('num_experts', '?')}" if r.get("legacy") else (
            f"{'fsdp' if r.get('fsdp') else 'ep-only'} · E={r.get('num_experts', '?')}")
        groups[key][panel][(layout_name(r, "save"), layout_name(r, "load"))] = r
    found = []
    for (first, second), panels in sorted(groups.items(), key=lambda kv: (kv[0][0] == "legacy",
                                                                           kv[0])):
        title = f"legacy checkpoints · {second}" if first == "legacy" else f"{first} · {second}"
        slug = _slug(f"legacy {second}" if first == "legacy" else f"{first} {second}")
        rows = sorted({s for at in panels.values() for s, _ in at}, key=layout_order)
        found.append(Grid(slug, title, rows, [
            Panel(name, sorted({t for _, t in at}, key=layout_order), at)
            for name, at in sorted(panels.items(), key=lambda kv: _panel_order(kv[0]))]))
    if functions:
        rows = sorted({f for f, _ in functions})
        columns = list(dict.fromkeys(c for _, c in functions))
        found.append(Grid("functions", "expert-slice functions", rows,
                          [Panel("functions suite", columns, functions)], ("function", "cell")))
    return found


def _panel_order(title: str) -> tuple[int, int]:
    experts = title.rsplit("E=", 1)[-1]
    return (title.startswith("fsdp"), int(experts) if experts.isdigit() else 0)


__all__ = ["Grid", "Panel", "anchors", "cell_kind", "counts_line", "coverage_items",
           "expectation_note", "expectations_summary", "finding_counts", "first_line",
           "grid_label", "grids", "layout_name", "layout_order", "lead_lines", "red_cells",
           "short_id", "square_title", "worst_first"]

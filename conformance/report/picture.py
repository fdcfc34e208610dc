"""The report's pictures, as hand-written SVG: a grid of squares per layer kind and state, the
change between two reports, and the frameworks' status as stacked bars.

Colors are Okabe and Ito's palette (*Color Universal Design*, 2008), chosen to stay apart under
every common color-vision deficiency; every red square also carries its finding's letter (``S``
silent, ``D`` on-disk, ``R`` refused, ``E`` error, ``I`` interrupted), so nothing depends on color
alone.  A red cell the expectations file expected is hatched.  Each square is a link (``<a href>``)
to its cell's entry and holds a ``<title>`` (its tooltip) with the cell's id and outcome.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from html import escape
from typing import Any

from conformance.findings import ERROR, FINDINGS, ON_DISK, PASS, REFUSED, SILENT
from conformance.outcome import INTERRUPTED, NA, OUTCOMES, is_expected, outcome
from conformance.report.cells import Grid, grid_label

Record = Mapping[str, Any]
#: each outcome's fill (Okabe-Ito: bluish green, vermillion, orange, sky blue, reddish purple, grey,
#: yellow) and the letter its square carries.
COLORS = {PASS: "#009E73", SILENT: "#D55E00", ON_DISK: "#E69F00", REFUSED: "#56B4E9",
          ERROR: "#CC79A7", NA: "#D9D9D9", INTERRUPTED: "#F0E442"}
LETTERS = {SILENT: "S", ON_DISK: "D", REFUSED: "R", ERROR: "E", INTERRUPTED: "I"}
SQUARE, GAP, CHAR = 20, 3, 6.7  # px; CHAR: the width of one 11px monospace character
FONT = 'font-family="DejaVu Sans Mono, Menlo, Consolas, monospace"'
Titler = Callable[[Record], str]
Linker = Callable[[Record], str]


def _text(x: float, y: float, text: str, extra: str = "", size: int = 11) -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" {FONT} font-size="{size}"{extra}>{escape(text)}</text>'


def _hatch(prefix: str) -> str:
    """The pattern an expected red square is hatched with (ids are unique per picture: an HTML page
    inlines several)."""
    return (f'<defs><pattern id="{prefix}-expected" width="5" height="5" '
            'patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="2" '
            'height="5" fill="#ffffff" fill-opacity="0.7"/></pattern></defs>')


def svg(width: float, height: float, label: str, body: str) -> str:
    """A whole picture: ``body`` on white, ``label`` its title and accessible name."""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{escape(label)}">'
            f'<title>{escape(label)}</title><rect width="100%" height="100%" fill="#ffffff"/>'
            f"{body}</svg>\n")


def square(x: float, y: float, found: str, *, expected: bool, prefix: str, title: str = "",
           href: str = "", size: int = SQUARE) -> str:
    """One square: filled by ``found``'s color, its letter, hatched when ``expected``; a link when
    ``href``, with ``title`` as its tooltip."""
    parts = [f"<title>{escape(title)}</title>"] if title else []
    parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{size}" height="{size}" rx="2" '
                 f'fill="{COLORS.get(found, COLORS[ERROR])}" stroke="#555555" stroke-width="0.5"/>')
    if expected:
        parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{size}" height="{size}" rx="2" '
                     f'fill="url(#{prefix}-expected)"/>')
    if found in LETTERS:
        parts.append(_text(x + size / 2, y + size / 2 + 4, LETTERS[found],
                           ' text-anchor="middle" font-weight="bold" fill="#000000"'))
    body = "".join(parts)
    if href:
        return f'<a href="{escape(href)}" class="square">{body}</a>'
    return f'<g class="square">{body}</g>'


def legend(x: float, y: float, prefix: str, shown: Sequence[str],
           grid: bool = True) -> tuple[str, float]:
    """A legend row of ``shown`` outcomes and, for a ``grid``, the expected hatching and the blank
    square: its SVG and width."""
    entries = [(o, o, False) for o in shown]
    entries += [(ON_DISK, "hatched: red as expected", True)] if grid else []
    parts, at = [], x
    for found, label, expected in entries:
        parts.append(square(at, y, found, expected=expected, prefix=prefix, size=14))
        parts.append(_text(at + 18, y + 11, label))
        at += 18 + CHAR * len(label) + 14
    if grid:
        parts.append(f'<rect x="{at:.1f}" y="{y:.1f}" width="14" height="14" fill="none" '
                     'stroke="#cccccc"/>')
        parts.append(_text(at + 18, y + 11, "blank: not in this run"))
        at += 18 + CHAR * 22
    return "".join(parts), at - x


def grid_svg(grid: Grid, *, link: Linker, title: Titler, heading: str = "") -> str:
    """``grid`` as an SVG picture: rows (save layouts) down, each panel's columns (load layouts)
    across, one square per cell, a legend below.  ``link`` and ``title`` give each square's link and
    tooltip."""
    body, width, height = grid_drawing(grid, link=link, title=title, heading=heading)
    label = f"{heading}: {grid_label(grid)}" if heading else grid_label(grid)
    return svg(width, height, label, body)


def grid_drawing(grid: Grid, *, link: Linker, title: Titler,
                 heading: str = "") -> tuple[str, float, float]:
    """What :func:`grid_svg` draws, its width and its height (to stack drawings in one picture)."""
    prefix = f"g-{grid.slug}"
    step = SQUARE + GAP
    label_width = CHAR * max((len(f"{grid.axes[0]} {r}") for r in grid.rows), default=4) + 10
    longest = max((len(c) for p in grid.panels for c in p.columns), default=4)
    slant = 0.72 * CHAR * longest + CHAR * 5  # the load layouts' names, at 45 degrees
    title_y = 34 if heading else 16
    panel_y = title_y + 20
    head_y = panel_y + slant
    parts = [_text(8, 16, heading, ' font-weight="bold"', 13)] if heading else []
    parts.append(_text(8, title_y, grid.title, ' font-weight="bold"'))
    x = label_width
    for panel in grid.panels:
        parts.append(_text(x, panel_y, panel.title, ' font-style="italic"'))
        for i, column in enumerate(panel.columns):
            cx, cy = x + i * step + SQUARE / 2 + 3, head_y - 4
            label = f"{grid.axes[1]} {column}" if i == 0 else column
            parts.append(_text(cx, cy, label, f' transform="rotate(-45 {cx:.1f} {cy:.1f})"'))
        for j, row in enumerate(grid.rows):
            for i, column in enumerate(panel.columns):
                sx, sy = x + i * step, head_y + j * step
                record = panel.at.get((row, column))
                if record is None:
                    parts.append(f'<rect x="{sx:.1f}" y="{sy:.1f}" width="{SQUARE}" '
                                 f'height="{SQUARE}" fill="none" stroke="#e6e6e6"/>')
                else:
                    parts.append(square(sx, sy, outcome(record), expected=is_expected(record),
                                        prefix=prefix, title=title(record), href=link(record)))
        x += max(len(panel.columns) * step, CHAR * len(panel.title)) + 24
    for j, row in enumerate(grid.rows):
        parts.append(_text(label_width - 8, head_y + j * step + 14, f"{grid.axes[0]} {row}",
                           ' text-anchor="end"'))
    bottom = head_y + len(grid.rows) * step + 14
    records = grid.records()
    shown = [o for o in OUTCOMES if o != INTERRUPTED or any(outcome(r) == o for r in records)]
    key, key_width = legend(8, bottom, prefix, shown)
    return _hatch(prefix) + "".join(parts) + key, max(x + slant, key_width + 16), bottom + 26


def status_svg(rows: Sequence[tuple[str, Mapping[str, int]]], *, title: str = "") -> str:
    """Frameworks by findings: one stacked bar per ``(name, outcome counts)``, its length the cells
    that ran (n/a left out: said in the label), split pass, silent, on-disk, refused, error."""
    stack = (PASS, *FINDINGS)
    label_width = CHAR * max((len(name) for name, _ in rows), default=8) + 12
    bar, top, parts = 360, 28 if title else 8, []
    if title:
        parts.append(_text(8, 18, title, ' font-weight="bold"', 13))
    for i, (name, counts) in enumerate(rows):
        y = top + i * (SQUARE + 6)
        ran = sum(counts.get(o, 0) for o in stack)
        parts.append(_text(label_width - 8, y + 14, name, ' text-anchor="end"'))
        at = label_width
        for found in stack:
            n = counts.get(found, 0)
            if not n or not ran:
                continue
            width = max(bar * n / ran, 2.0)
            tip = f"{name}: {n} {found} of {ran} cells that ran"
            letter = (_text(at + width / 2, y + 14, LETTERS[found],
                            ' text-anchor="middle" font-weight="bold"')
                      if found in LETTERS and width >= 10 else "")
            parts.append(f'<g class="segment"><title>{escape(tip)}</title><rect x="{at:.1f}" '
                         f'y="{y}" width="{width:.1f}" height="{SQUARE}" fill="{COLORS[found]}" '
                         f'stroke="#555555" stroke-width="0.5"/>{letter}</g>')
            at += width
        told = ", ".join(f"{counts.get(o, 0)} {o}" for o in stack if counts.get(o, 0))
        na = counts.get(NA, 0)
        told = (told or "no cell ran") + (f" ({na} n/a)" if na else "")
        parts.append(_text(label_width + bar + 8, y + 14, told))
    bottom = top + len(rows) * (SQUARE + 6) + 8
    key, key_width = legend(8, bottom, "status", list(stack), grid=False)
    width = max(label_width + bar + 8 + CHAR * 60, key_width + 16)
    return svg(width, bottom + 26, title or "frameworks by findings", "".join(parts) + key)


__all__ = ["COLORS", "LETTERS", "grid_drawing", "grid_svg", "legend", "square", "status_svg", "svg"]

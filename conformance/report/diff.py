"""What changed between two reports: the cells newly failing, newly passing, with a finding changed.

A net count hides a regression behind a fix, so each cell that changed is listed on its own, in
one of:

- *newly failing*: not red before (pass, n/a, interrupted), red now;
- *newly passing*: red before, ``pass`` now;
- *finding changed*: red in both, another finding (a refusal that became silent loss is a change);
- *other changes*: any other change of outcome (pass to n/a, red to n/a, interrupted).

A red cell of an old report without findings (schema 3 and before) compares red to red as unchanged:
its finding is not known.  Cells in one report only (deselected with ``-k``, another tier, another
adapter's capabilities) are listed apart.  The picture shows only the squares that changed, colored
by what they became, each linked to its line of the diff's Markdown.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance.outcome import PASS, is_red, outcome
from conformance.report.cells import anchors, first_line, grids
from conformance.report.files import DIFF_MD_NAME, DIFF_SVG_NAME, write_files
from conformance.report.picture import grid_drawing, svg

Record = Mapping[str, Any]
GROUPS = ("newly failing", "newly passing", "finding changed", "other changes")


@dataclass(frozen=True)
class Change:
    """One cell that changed: its outcome before and now, and both records."""

    id: str
    was: str
    now: str
    old: Record
    new: Record

    def what(self) -> str:
        """``pass -> silent  (the first line of what it says now; of what it said, once it
        passes)``."""
        said = first_line(self.old if self.now == PASS else self.new, 300)
        told = f"  ({said})" if said not in (self.was, self.now) else ""
        return f"{self.was} -> {self.now}{told}"

    def line(self) -> str:
        return f"{self.id}: {self.what()}"


@dataclass
class ReportDiff:
    """The cells that changed, by group (:data:`GROUPS`), and the cells present in one report
    only."""

    groups: dict[str, list[Change]] = field(default_factory=lambda: {g: [] for g in GROUPS})
    only_old: list[str] = field(default_factory=list)
    only_new: list[str] = field(default_factory=list)
    unchanged: int = 0

    @property
    def changed(self) -> list[Change]:
        return [c for g in GROUPS for c in self.groups[g]]

    def counts(self) -> str:
        said = [f"{len(self.groups[g])} {g}" for g in GROUPS]
        return ", ".join([*said, f"{self.unchanged} unchanged",
                          f"{len(self.only_old)} only in the old report",
                          f"{len(self.only_new)} only in the new report"])

    def lines(self) -> list[str]:
        """What the command prints: each group with its cells (the first three always), then the
        counts."""
        out = []
        for group in GROUPS:
            changes = self.groups[group]
            if changes or group != "other changes":
                out += [f"{group} ({len(changes)}):", *(f"  {c.line()}" for c in changes)]
        for title, ids in (("only in the old report", self.only_old),
                           ("only in the new report", self.only_new)):
            if ids:
                out += [f"{title} ({len(ids)}):", *(f"  {i}" for i in ids)]
        return [*out, self.counts()]


def _group(was: Record, now: Record) -> str | None:
    """Which group a cell's change is in (``None``: unchanged)."""
    before, after = outcome(was), outcome(now)
    if before == after:
        return None
    if is_red(was) and is_red(now):
        return "finding changed" if "finding" in was and "finding" in now else None
    if is_red(now):
        return "newly failing"
    if is_red(was) and after == PASS:
        return "newly passing"
    return "other changes"


def compare_reports(old: Mapping[str, Any], new: Mapping[str, Any]) -> ReportDiff:
    """``old`` against ``new`` (report documents), cell by cell."""
    before = {c["id"]: c for c in old.get("cells", [])}
    after = {c["id"]: c for c in new.get("cells", [])}
    found = ReportDiff(only_old=sorted(before.keys() - after.keys()),
                       only_new=sorted(after.keys() - before.keys()))
    for cell_id in sorted(before.keys() & after.keys()):
        group = _group(before[cell_id], after[cell_id])
        if group is None:
            found.unchanged += 1
        else:
            was, now = before[cell_id], after[cell_id]
            found.groups[group].append(Change(cell_id, outcome(was), outcome(now), was, now))
    return found


def diff_markdown(diff: ReportDiff, old: str, new: str, picture: bool) -> str:
    """The diff as Markdown: the picture, then each group's cells (each with an anchor its square
    links to)."""
    where = anchors(c.id for c in diff.changed)
    lines = [f"# What changed: `{old}` -> `{new}`", "", diff.counts() + ".", ""]
    if picture:
        lines += [f"![the cells that changed, colored by what they became]({DIFF_SVG_NAME})", ""]
    for group in GROUPS:
        changes = diff.groups[group]
        if changes or group != "other changes":
            lines += [f"## {group.capitalize()} ({len(changes)})", ""]
            lines += [f'- <a id="{where[c.id]}"></a>`{c.id}`: {c.what()}' for c in changes]
            lines.append("")
    for title, ids in (("Only in the old report", diff.only_old),
                       ("Only in the new report", diff.only_new)):
        if ids:
            lines += [f"## {title} ({len(ids)})", "", "<details><summary>their ids</summary>", "",
                      *(f"- `{i}`" for i in ids), "", "</details>", ""]
    return "\n".join(lines)


def diff_svg(diff: ReportDiff) -> str:
    """The squares that changed, colored by what they became (their tooltips say what they were); ""
    when none did.  One picture: its grids stacked."""
    changes = {c.id: c for c in diff.changed}
    where = anchors(changes)
    drawings = [grid_drawing(g, link=lambda r: f"{DIFF_MD_NAME}#{where[r['id']]}",
                             heading="what changed", title=lambda r: changes[r["id"]].line())
                for g in grids([c.new for c in changes.values()])]
    if not drawings:
        return ""
    body, y = [], 0.0
    for drawing, _, height in drawings:
        body.append(f'<g transform="translate(0 {y:.0f})">{drawing}</g>')
        y += height
    return svg(max(w for _, w, _ in drawings), y, f"what changed: {len(changes)} cells",
               "".join(body))


def write_diff(out: Path, diff: ReportDiff, old: str, new: str) -> list[Path]:
    """The diff's Markdown and picture (when a cell changed) into ``out``."""
    picture = diff_svg(diff)
    texts = {DIFF_MD_NAME: diff_markdown(diff, old, new, bool(picture))}
    if picture:
        texts[DIFF_SVG_NAME] = picture
    return list(write_files(out, texts).values())


__all__ = ["GROUPS", "Change", "ReportDiff", "compare_reports", "diff_markdown", "diff_svg",
           "write_diff"]

"""The release page a framework attaches: the report's pictures, HTML page, rerun commands and diff.

The ``legacy`` adapter's default tier (``pytest --moe-ep-matrix --moe-ep-adapter=legacy``, ~50 s on
2 cores, in this process as ``test_detection`` runs its matrices) is the real report these tests
read; it runs once per module (:func:`legacy_report`) and every test that needs it shares it.  Its
red cells are the negative control of every promise: each must be a square titled with its id and
finding, an entry the square's link reaches, and a command that selects it alone; run on the
reference, the same cells must come back as newly passing.  The HTML page is opened in headless
Chromium (Debian's ``chromium``; without it that test skips saying so).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
from matrix_expectations import run_inline

from conformance.outcome import is_red, outcome
from conformance.report import (
    JSON_NAME,
    MD_NAME,
    build_report,
    compare_reports,
    render_markdown,
    write_report,
)
from conformance.report.cells import anchors
from conformance.report.diff import Change
from conformance.report.files import DIFF_MD_NAME, DIFF_SVG_NAME, HTML_NAME, read_report
from conformance.report.picture import COLORS, LETTERS

pytestmark = pytest.mark.usefixtures("shared_fork_server")
SVG = "{http://www.w3.org/2000/svg}"
GRIDS = "moe-ep-conformance-grid-*.svg"
#: the legacy report, once per module: the first test that needs it runs the matrix.
_RUNS: dict[str, Path] = {}


def legacy_report(pytester: pytest.Pytester, factory: pytest.TempPathFactory) -> Path:
    """The report directory of the legacy adapter's default tier (run on first use)."""
    if "legacy" not in _RUNS:
        out = factory.mktemp("legacy-report")
        result = run_inline(pytester, "--moe-ep-matrix", "--moe-ep-adapter=legacy",
                            f"--moe-ep-report={out}", "-p", "no:cacheprovider")
        assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()[-3000:]
        _RUNS["legacy"] = out
    return _RUNS["legacy"]


def squares(directory: Path) -> dict[str, list[tuple[str, ElementTree.Element]]]:
    """Every linked square of the report's SVG files: its title's cell id -> (href, <a>)."""
    found: dict[str, list[tuple[str, ElementTree.Element]]] = {}
    for path in sorted(directory.glob(GRIDS)):
        for link in ElementTree.parse(path).getroot().iter(f"{SVG}a"):
            title = link.find(f"{SVG}title")
            assert title is not None and title.text, (path.name, ElementTree.tostring(link))
            found.setdefault(title.text.split(": ", 1)[0], []).append((link.get("href", ""), link))
    return found


def test_every_red_cell_is_a_square_titled_with_its_id_and_finding(
        pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory) -> None:
    out = legacy_report(pytester, tmp_path_factory)
    doc = json.loads((out / JSON_NAME).read_text())
    markdown = (out / MD_NAME).read_text()
    # the fused cells: one on-disk, four refused (the old save's gate_up_w is not the fused form);
    # n/a: a legacy save no rank-local save can write, no cross-kind load, no fine-tuning
    assert doc["outcomes"] == {"pass": 15, "silent": 0, "on-disk": 42, "refused": 6, "error": 0,
                               "n/a": 3}
    # how far each ran: a loud refusal stopped the cell; "error" is only ever a finding
    assert doc["summary"]["stopped"] == 48 and "error" not in doc["summary"], doc["summary"]
    found, where = squares(out), anchors(c["id"] for c in doc["cells"])
    assert set(found) == {c["id"] for c in doc["cells"]}  # every cell, red or not, is one square
    for cell in doc["cells"]:
        [(href, link)] = found[cell["id"]]
        title, rect, letter = (link.find(f"{SVG}{tag}") for tag in ("title", "rect", "text"))
        assert title is not None and title.text and rect is not None
        assert title.text.startswith(f"{cell['id']}: {outcome(cell)}"), title.text
        anchor = where[cell["id"]]
        assert href == f"{MD_NAME}#{anchor}" and f'<a id="{anchor}"></a>' in markdown, href
        assert rect.get("fill") == COLORS[outcome(cell)], ElementTree.tostring(link)
        assert (letter.text if letter is not None else None) == LETTERS.get(outcome(cell))
    # The Markdown leads with the pictures (relative paths beside it), then the findings, then the
    # coverage, and it ends with the command for every unexpected red cell.
    images = re.findall(r"!\[[^\]]*\]\((moe-ep-conformance-grid-[\w.-]+\.svg)\)", markdown)
    assert sorted(images) == sorted(p.name for p in out.glob(GRIDS)) and images
    assert markdown.index(images[0]) < markdown.index("Findings: 0 silent, 42 on-disk") \
        < markdown.index("## Coverage") < markdown.index("## Red cells")
    assert "**FAIL**" not in markdown and "**ERROR**" not in markdown
    assert markdown.rstrip().endswith("```") and "## Rerun" in markdown.split("## Environment")[1]


class Page(HTMLParser):
    """What a page links to, the ids it has, its inline SVGs and whatever it would fetch."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()
        self.svgs = 0
        self.fetches: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        given = dict(attrs)
        if given.get("id"):
            self.ids.add(str(given["id"]))
        if tag == "a" and given.get("href"):
            self.links.append(str(given["href"]))
        self.svgs += tag == "svg"
        if tag in ("script", "link", "img", "iframe") or given.get("src"):
            self.fetches.append(f"<{tag} {given}>")


def test_the_html_page_holds_the_pictures_and_every_link_reaches_an_anchor(
        pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Checked by parsing (no browser): self-contained, every square linked to an id on the page."""
    out = legacy_report(pytester, tmp_path_factory)
    doc = json.loads((out / JSON_NAME).read_text())
    page = Page()
    page.feed((out / HTML_NAME).read_text())
    assert not page.fetches, page.fetches  # no script, stylesheet, image or frame: self-contained
    assert page.svgs == len(list(out.glob(GRIDS)))
    assert page.links and {h for h in page.links if h[1:] not in page.ids} == set()
    where = anchors(c["id"] for c in doc["cells"])
    assert {f"#{where[c['id']]}" for c in doc["cells"] if is_red(c)} <= set(page.links)


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("no headless Chromium here (Debian: apt-get install -y chromium; .ci/run "
                    "installs it)")
    return found


def run_chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}"]
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=120)


#: appended to a copy of the page, it writes into the DOM what the browser made of the page (the
#: page itself ships no script).
CHECK = """<script>
const svgs = [...document.querySelectorAll("figure svg")];
const links = [...document.querySelectorAll("a[href^='#']")];
const broken = links.map(a => a.getAttribute("href"))
  .filter(h => !document.getElementById(h.slice(1)));
const drawn = [...document.querySelectorAll("svg a.square rect")].filter(r => {
  const box = r.getBoundingClientRect(); return box.width > 0 && box.height > 0; });
const result = {svgs: svgs.length, links: links.length, broken: broken, drawn: drawn.length,
  empty: svgs.filter(s => s.getBoundingClientRect().width === 0).length};
const pre = document.createElement("pre");
pre.id = "moe-ep-check";
pre.textContent = JSON.stringify(result);
document.body.appendChild(pre);
</script>"""


def test_the_html_page_renders_in_a_real_browser(pytester: pytest.Pytester,
                                                 tmp_path_factory: pytest.TempPathFactory,
                                                 tmp_path: Path) -> None:
    binary = chromium()
    out = legacy_report(pytester, tmp_path_factory)
    doc = json.loads((out / JSON_NAME).read_text())
    page = out / HTML_NAME
    shot = tmp_path / "page.png"
    done = run_chromium(binary, tmp_path / "profile", f"--screenshot={shot}",
                        "--window-size=1200,1400", page.as_uri())
    assert shot.is_file(), done.stderr[-2000:]
    pixels = png_pixels(shot.read_bytes())
    for found in ("on-disk", "pass", "refused"):  # the squares are painted, in their colors
        color = tuple(int(COLORS[found][i:i + 2], 16) for i in (1, 3, 5))
        assert sum(p == color for p in pixels) > 200, (found, color)
    checked = tmp_path / "checked.html"
    checked.write_text(page.read_text().replace("</body>", f"{CHECK}</body>"))
    dom = run_chromium(binary, tmp_path / "profile", "--dump-dom", "--virtual-time-budget=5000",
                       checked.as_uri())
    match = re.search(r'<pre id="moe-ep-check">(.*?)</pre>', dom.stdout)
    assert match, (dom.stdout[-2000:], dom.stderr[-2000:])
    result = json.loads(match.group(1).replace("&quot;", '"'))
    assert result["svgs"] == len(list(out.glob(GRIDS))) and result["empty"] == 0, result
    assert result["broken"] == [] and result["links"] >= len(doc["cells"]), result
    assert result["drawn"] == len(doc["cells"]), result


def png_pixels(data: bytes) -> list[tuple[int, ...]]:
    """The RGB pixels of an 8-bit, non-interlaced RGB or RGBA PNG (what Chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, chunks, header = 8, [], b""
    while at < len(data):
        size = int.from_bytes(data[at:at + 4], "big")
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + size]
        header = body if kind == b"IHDR" else header
        chunks += [body] if kind == b"IDAT" else []
        at += size + 12
    width, height = int.from_bytes(header[0:4], "big"), int.from_bytes(header[4:8], "big")
    depth, color, interlace = header[8], header[9], header[12]
    assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
    channels = 3 if color == 2 else 4
    raw, stride = zlib.decompress(b"".join(chunks)), width * channels
    rows: list[bytearray] = []
    previous = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            line[i] = (line[i] + _predict(kind, left, up, corner)) & 0xFF
        rows.append(line)
        previous = line
    return [tuple(row[x:x + 3]) for row in rows for x in range(0, stride, channels)]


def _predict(kind: int, left: int, up: int, corner: int) -> int:
    """PNG's row filters: none, sub, up, average, Paeth."""
    if kind in (0, 1, 2):
        return (0, left, up)[kind]
    if kind == 3:
        return (left + up) // 2
    estimate = left + up - corner
    near = min((abs(estimate - left), 0, left), (abs(estimate - up), 1, up),
               (abs(estimate - corner), 2, corner))
    return near[2]


def collected(pytester: pytest.Pytester, command: str) -> list[str]:
    """The matrix cells ``command`` (``pytest ...``) collects, run as ``--collect-only`` here."""
    args = shlex.split(command)
    assert args[0] == "pytest", command
    result = run_inline(pytester, *args[1:], "--collect-only", "-q", "-p", "no:cacheprovider")
    return [line for line in result.stdout.lines if line.startswith("moe-ep-matrix::")]


def test_each_rerun_command_selects_exactly_its_cell(
        pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory) -> None:
    out = legacy_report(pytester, tmp_path_factory)
    doc = json.loads((out / JSON_NAME).read_text())
    red = [c for c in doc["cells"] if is_red(c)]
    assert red and all(c.get("rerun") for c in red) and doc["rerun"]["without_command"] == []
    for cell in red:
        assert cell["rerun"].startswith('pytest --moe-ep-matrix --moe-ep-adapter=legacy -k "')
        assert collected(pytester, cell["rerun"]) == [cell["id"]], cell["rerun"]
    [everything] = doc["rerun"]["unexpected"]  # no expectations file: every red cell is unexpected
    assert sorted(collected(pytester, everything)) == sorted(c["id"] for c in red)
    assert (out / MD_NAME).read_text().rstrip().endswith(f"{everything}\n```")


def test_the_legacy_red_cells_are_newly_passing_on_the_reference(
        pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory,
        tmp_path: Path) -> None:
    """The reference over exactly the legacy report's red cells (their command, on the full tier:
    the expressions single a cell out of every tier), then the diff's command line."""
    legacy = legacy_report(pytester, tmp_path_factory)
    doc = json.loads((legacy / JSON_NAME).read_text())
    red = {c["id"]: c for c in doc["cells"] if is_red(c)}
    expression = shlex.split(doc["rerun"]["unexpected"][0])[-1]
    reference = tmp_path / "reference"
    result = run_inline(pytester, "--moe-ep-matrix=full", "--moe-ep-adapter=reference", "-k",
                        expression, f"--moe-ep-report={reference}", "-p", "no:cacheprovider")
    assert result.ret == 0, result.stdout.str()[-3000:]
    assert {c["id"] for c in json.loads((reference / JSON_NAME).read_text())["cells"]} == set(red)
    diff = tmp_path / "diff"
    done = subprocess.run([sys.executable, "-m", "conformance.report", str(legacy / JSON_NAME),
                           str(reference / JSON_NAME), "--out", str(diff)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    at = lines.index(f"newly passing ({len(red)}):")
    assert {line.strip().split(": ", 1)[0] for line in lines[at + 1:at + 1 + len(red)]} == set(red)
    assert "newly failing (0):" in lines and "finding changed (0):" in lines
    assert lines[-2].startswith(f"0 newly failing, {len(red)} newly passing, 0 finding changed")
    text = (diff / DIFF_MD_NAME).read_text()
    assert f"## Newly passing ({len(red)})" in text and f"]({DIFF_SVG_NAME})" in text
    picture = ElementTree.parse(diff / DIFF_SVG_NAME).getroot()
    titles = [t.text or "" for t in picture.iter(f"{SVG}title")]
    for cell_id, cell in red.items():  # only the squares that changed, colored by what they became
        assert any(t.startswith(f"{cell_id}: {outcome(cell)} -> pass") for t in titles), cell_id
    fills = {r.get("fill") for a in picture.iter(f"{SVG}a") for r in a.iter(f"{SVG}rect")
             if r.get("fill", "").startswith("#")}
    assert fills == {COLORS["pass"]} and len(list(picture.iter(f"{SVG}a"))) == len(red), fills


# -- without a world ------------------------------------------------------------------------------
def record(cell_id: str, status: str, finding: str | None = None, **extra: Any) -> dict[str, Any]:
    """A checkpoint record ``ep1->ep2`` of the packed model-only EP-only E=4 cells."""
    save, load = cell_id.split("->")
    found = {"id": f"moe-ep-matrix::checkpoint::packed::model::ep-only::{cell_id}",
             "suite": "checkpoint", "kind": "packed", "state": "model", "fsdp": False,
             "num_experts": 4, "legacy": False, "save_layout": save, "load_layout": load,
             "status": status, "detail": f"{finding}: what happened" if finding else "",
             "adapter": "acme", "adapter_version": "1.0", **extra}
    return {**found, **({"finding": finding, "findings": [finding]} if finding else {})}


def test_a_loud_refusal_is_refused_everywhere_and_the_json_counts_outcomes(tmp_path: Path) -> None:
    records = [record("ep1->ep2", "stopped", "refused"), record("ep2->ep1", "fail", "silent"),
               record("ep1->ep1", "pass"), record("ep2->ep2", "n/a")]
    write_report(tmp_path, records, backend="gloo", world_size=4, tier="default", experts=(4, 5),
                 adapter_option="acme_ckpt:Adapter")
    doc = read_report(tmp_path / JSON_NAME)
    assert doc["schema_version"] == 6
    assert doc["outcomes"] == {"pass": 1, "silent": 1, "on-disk": 0, "refused": 1, "error": 0,
                               "n/a": 1}
    assert doc["summary"] == {"pass": 1, "fail": 1, "stopped": 1, "n/a": 1}
    # every cell holds its outcome; the refused one's status says only that it stopped
    assert {c["id"].rsplit("::", 1)[1]: (c["status"], c["outcome"]) for c in doc["cells"]} == {
        "ep1->ep2": ("stopped", "refused"), "ep2->ep1": ("fail", "silent"),
        "ep1->ep1": ("pass", "pass"), "ep2->ep2": ("n/a", "n/a")}
    markdown = render_markdown(doc)
    assert "1 pass, 1 silent, 0 on-disk, 1 refused, 0 error, 1 n/a" in markdown
    assert "ERROR" not in markdown and "FAIL" not in markdown
    refused = next(c for c in doc["cells"] if c.get("finding") == "refused")
    assert refused["rerun"] == ('pytest --moe-ep-matrix --moe-ep-adapter=acme_ckpt:Adapter -k '
                                '"checkpoint::packed::model::ep-only::ep1- and load_ep2 and '
                                'load_dp_shard2 and load_strided"')
    for old in (5, 4, 3):  # earlier schemas are still read
        path = tmp_path / f"v{old}.json"
        path.write_text(json.dumps({**doc, "schema_version": old}))
        assert read_report(path)["schema_version"] == old


def _short(changes: list[Change]) -> list[str]:
    return [c.line().split("ep-only::")[1] for c in changes]


def test_the_diff_keeps_newly_failing_newly_passing_and_changed_findings_apart(
        tmp_path: Path) -> None:
    # "error": what a record before schema 6 said for "stopped", still read as it
    old = build_report([record("ep1->ep2", "pass"), record("ep2->ep1", "fail", "on-disk"),
                        record("ep1->ep1", "error", "refused"), record("ep2->ep2", "pass"),
                        record("ep1->ep4", "n/a"), record("ep4->ep1", "fail", "silent")],
                       backend="gloo", world_size=4)
    new = build_report([record("ep1->ep2", "fail", "silent"), record("ep2->ep1", "pass"),
                        record("ep1->ep1", "fail", "silent"), record("ep2->ep2", "n/a"),
                        record("ep1->ep4", "error", "refused"),
                        record("ep4->ep1", "fail", "silent")], backend="gloo", world_size=4)
    diff = compare_reports(old, new)
    assert _short(diff.groups["newly failing"]) == [
        "ep1->ep2: pass -> silent  (silent: what happened)",
        "ep1->ep4: n/a -> refused  (refused: what happened)"]
    assert _short(diff.groups["newly passing"]) == [
        "ep2->ep1: on-disk -> pass  (on-disk: what happened)"]
    assert _short(diff.groups["finding changed"]) == [
        "ep1->ep1: refused -> silent  (silent: what happened)"]
    assert _short(diff.groups["other changes"]) == ["ep2->ep2: pass -> n/a"]
    assert diff.unchanged == 1
    # a red cell of an old report without findings (schema 3) is not a changed finding
    older = {**old, "cells": [{k: v for k, v in c.items() if k not in ("finding", "findings")}
                              for c in old["cells"]]}
    assert compare_reports(older, new).groups["finding changed"] == []
    for name, doc in (("old", old), ("new", new)):
        (tmp_path / name).mkdir()
        (tmp_path / name / JSON_NAME).write_text(json.dumps(doc))
    done = subprocess.run([sys.executable, "-m", "conformance.report",
                           str(tmp_path / "old" / JSON_NAME), str(tmp_path / "new" / JSON_NAME)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    prefix = "  moe-ep-matrix::checkpoint::packed::model::ep-only::"
    assert done.stdout.splitlines()[:3] == [
        "newly failing (2):", f"{prefix}ep1->ep2: pass -> silent  (silent: what happened)",
        f"{prefix}ep1->ep4: n/a -> refused  (refused: what happened)"]
    picture = ElementTree.parse(tmp_path / "new" / DIFF_SVG_NAME).getroot()  # written beside NEW
    drawn = {}
    for link in picture.iter(f"{SVG}a"):
        title, rect = link.find(f"{SVG}title"), link.find(f"{SVG}rect")
        assert title is not None and title.text and rect is not None
        drawn[title.text.split(": ", 1)[0].rsplit("::", 1)[1]] = rect.get("fill")
    assert drawn == {"ep1->ep2": COLORS["silent"], "ep1->ep4": COLORS["refused"],
                     "ep2->ep1": COLORS["pass"], "ep1->ep1": COLORS["silent"],
                     "ep2->ep2": COLORS["n/a"]}
    same = subprocess.run([sys.executable, "-m", "conformance.report",
                           str(tmp_path / "new" / JSON_NAME), str(tmp_path / "new" / JSON_NAME),
                           "--out", str(tmp_path / "same")], capture_output=True, text=True,
                          timeout=120)
    assert same.returncode == 0 and not (tmp_path / "same" / DIFF_SVG_NAME).exists(), same.stdout


def test_each_expression_singles_its_cell_out_of_every_cell_by_pytests_own_matcher() -> None:
    """Every cell of the reference's default tier, and of the ``1,2`` tier at 2 ranks, checked with
    pytest's ``-k`` evaluator against every cell of the full product (what any tier holds)."""
    from _pytest.mark.expression import Expression

    from conformance.adapters.reference import ReferenceAdapter
    from conformance.matrix import checkpoint_cells, full_product
    from conformance.report.rerun import checkpoint_universe, k_expression

    for world_size, tier in ((4, "default"), (2, "1,2")):
        universe = checkpoint_universe(world_size, (4, 5))
        everything = {c.node_name: [n.lower() for n in ("moe-ep-matrix", c.node_name,
                                                        *c.keywords())]
                      for c in full_product(world_size, (4, 5))}
        for cell in checkpoint_cells(ReferenceAdapter.capabilities, tier, world_size, (4, 5)):
            expression = k_expression(cell.node_name, universe)
            assert expression is not None and ">" not in expression, cell.node_name
            compiled = Expression.compile(expression)
            chosen = [node for node, names in everything.items()
                      if compiled.evaluate(lambda word, names=names: any(word.lower() in n
                                                                         for n in names))]
            assert chosen == [cell.node_name], (expression, chosen[:5])


def test_the_status_table_gets_a_stacked_bar_per_framework(tmp_path: Path) -> None:
    from conformance.report import INDEX_END, INDEX_START, write_index
    from conformance.report.index import STATUS_SVG

    write_report(tmp_path / "reports" / "acme",
                 [record("ep1->ep2", "fail", "silent"), record("ep1->ep1", "pass"),
                  record("ep2->ep1", "stopped", "refused"), record("ep2->ep2", "n/a")],
                 backend="gloo", world_size=4, tier="full")
    write_report(tmp_path / "reports" / "fixed", [record("ep1->ep2", "pass")], backend="gloo",
                 world_size=4, tier="full")
    page = tmp_path / "docs" / "frameworks.md"
    page.parent.mkdir()
    page.write_text(f"head\n{INDEX_START}\nold\n{INDEX_END}\ntail\n")
    text = write_index(tmp_path / "reports", page)
    assert f"]({STATUS_SVG})" in text and f"]({STATUS_SVG})" in page.read_text()
    for picture in (tmp_path / "reports" / STATUS_SVG, tmp_path / "docs" / STATUS_SVG):
        bars = []
        for group in ElementTree.parse(picture).getroot().iter(f"{SVG}g"):
            title, rect = group.find(f"{SVG}title"), group.find(f"{SVG}rect")
            if group.get("class") == "segment" and title is not None and rect is not None:
                bars.append((title.text, rect.get("fill")))
        assert bars == [("acme: 1 pass of 3 cells that ran", COLORS["pass"]),
                        ("acme: 1 silent of 3 cells that ran", COLORS["silent"]),
                        ("acme: 1 refused of 3 cells that ran", COLORS["refused"]),
                        ("fixed: 1 pass of 1 cells that ran", COLORS["pass"])], bars
        assert "1 pass, 1 silent, 1 refused (1 n/a)" in picture.read_text()


def test_the_step_summary_shows_the_grid_as_text_squares_and_the_rerun_commands(
        tmp_path: Path) -> None:
    write_report(tmp_path, [record("ep1->ep2", "fail", "silent"), record("ep1->ep1", "pass"),
                            record("ep2->ep1", "stopped", "refused", expectation="met",
                                   expected="refused", expected_reason="acme cannot")],
                 backend="gloo", world_size=4, tier="default", experts=(4, 5))
    done = subprocess.run([sys.executable, "-m", "conformance.report", "summary",
                           str(tmp_path / JSON_NAME)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ep-only")}
    # load ep1 and ep2 across; the refused cell was expected: its letter is lower case
    assert rows == {"ep-only · E=4 · save ep1": ["🟩", "🟥S"],
                    "ep-only · E=4 · save ep2": ["🟦r", ""]}, rows
    silent = next(c for c in read_report(tmp_path / JSON_NAME)["cells"]
                  if c.get("finding") == "silent")
    assert f"  `{silent['rerun']}`" in text
    # only the unexpected one is rerun at the end
    assert text.rstrip().endswith(f"{silent['rerun']}\n```")

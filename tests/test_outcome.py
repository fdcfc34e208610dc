"""One verdict: a cell's outcome is built in one place from what its ranks send, whatever ran before
it.

A world's ranks keep state across cells (ground truths, what each save held, what the truth
checkpoint taught: :mod:`conformance.world_state`), and a tier shares one save among its loads.
None of it may decide a verdict, so a red cell run alone, by its node id, must come back exactly as
it did inside its tier: the same status, findings and first line.  One red cell of each finding,
from the seeded bugs and the refusing adapters the detection and findings tests use; each is chosen
among the later cells of its slice, so the tier's run had kept state when it reached it.

And one outcome, shown the same everywhere: how many red cells were expected is counted once
(:func:`conformance.outcome.expected_line`), and the terminal, the Markdown, the HTML page, the step
summary and the pictures all say that count.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
from matrix_expectations import run_inline
from test_findings_and_expectations import FRAMEWORK, REFUSING

from conformance.findings import PASS
from conformance.outcome import (
    FAIL,
    INTERRUPTED,
    NA,
    STOPPED,
    expected_line,
    is_red,
    judged_outcome,
    outcome,
)
from conformance.report.cells import PREFIX

pytestmark = pytest.mark.usefixtures("shared_fork_server")
SVG = "{http://www.w3.org/2000/svg}"
SEEDED = (Path(__file__).parent / "seeded_bugs.py").read_text()
REFUSED_SLICE = "kind_packed and model and not optim and not legacy and not pipeline"

CASES = {
    "silent": ("seeded_bugs:StepNotRestored", "optim and not legacy and ep-only"),
    "on-disk": ("seeded_bugs:PermutedExperts", "not legacy and not fsdp and save_ep2"),
    "refused": ("refusing_adapter:RefusesEp4", REFUSED_SLICE),
    "error": ("refusing_adapter:AdapterBugAtEp4", REFUSED_SLICE),
}


def _report(pytester: pytest.Pytester, name: str, *args: str) -> dict[str, dict[str, Any]]:
    out = pytester.path / name
    run_inline(pytester, "--moe-ep-matrix", "-p", "no:cacheprovider", f"--moe-ep-report={out}",
               *args)
    doc = json.loads((out / "moe-ep-conformance.json").read_text())
    return {cell["id"]: cell for cell in doc["cells"]}


def _verdict(cell: dict[str, Any]) -> tuple[Any, ...]:
    return (cell["status"], outcome(cell), cell.get("findings"), cell["detail"].splitlines()[0])


@pytest.mark.parametrize("finding", list(CASES))
def test_a_red_cell_run_alone_gives_its_tiers_verdict(pytester: pytest.Pytester,
                                                      finding: str) -> None:
    adapter, select = CASES[finding]
    pytester.makepyfile(seeded_bugs=SEEDED, refusing_adapter=REFUSING, refusing_framework=FRAMEWORK)
    tier = _report(pytester, "tier", f"--moe-ep-adapter={adapter}", "-k", select)
    red = [cell_id for cell_id, cell in tier.items() if is_red(cell) and outcome(cell) == finding]
    assert len(red) >= 2, (f"the slice has too few {finding} cells to choose a later one: "
                           f"{sorted(tier)}")
    chosen = red[-1]
    alone = _report(pytester, "alone", f"--moe-ep-adapter={adapter}", chosen)
    assert list(alone) == [chosen]
    assert _verdict(alone[chosen]) == _verdict(tier[chosen])


def _world_error(*verdicts: Any, kind: str = "failed") -> Any:
    from pytest_moe_ep.world.engine import WorldError, WorldTimeout
    from pytest_moe_ep.world.protocol import RankError

    errors = {v.rank: RankError(v.rank, v.failure.exception, f"{v.failure.text} (raised at "
                                f"{v.failure.raised_at})", "", {"verdict": v}) for v in verdicts}
    cls = WorldTimeout if kind == "hang" else WorldError
    return cls("run_cell", len(verdicts), "gloo",
               "failed on rank(s) 0: rank 0 raised BuildFailed: the "
               "framework refused the load side's build", at_fault=sorted(errors), errors=errors)


def _stopped(rank: int, member: str | None, raised_in: str, kind: str = "",
             findings: tuple[str, ...] = ()) -> Any:
    from conformance.checks.verdict import RankFailure, RankVerdict

    verdict = RankVerdict(rank, findings=findings)
    verdict.failure = RankFailure("build", "ValueError",
                                  "the framework refused the load side's build",
                                  member, raised_in, "framework.py:3 in build", kind)
    verdict.ran = ["checkpoint"]
    return verdict


@pytest.mark.parametrize(("member", "raised_in", "kind", "want"), [
    ("build", "framework", "", "refused"),  # the framework's code raised in one of its calls
    ("build", "adapter", "", "error"),  # the adapter's own code: not a finding about the framework
    (None, "framework", "", "error"),  # framework code outside a framework call (the harness asked)
    ("build", "framework", "layout", "error"),  # the layout the adapter declared was not formed
    ("build", "framework", "adapter", "error"),  # an AdapterError
    (None, "harness", "save-plan", "refused"),  # DCP refused the save's global plan
])
def test_a_stopped_rank_is_classified_by_its_facts_alone(member: str | None, raised_in: str,
                                                         kind: str, want: str) -> None:
    from conformance.outcome import error_outcome

    found = error_outcome(_world_error(_stopped(0, member, raised_in, kind)))
    assert found.status == "stopped" and found.findings == [want]
    assert found.detail.startswith(f"{want}: failed on rank(s) 0"), found.detail
    assert found.passed == ["checkpoint"] and found.detail.endswith("before it: checkpoint")


def test_an_on_disk_cell_that_a_build_then_refused_leads_with_the_checkpoint() -> None:
    """Its first sentence is about the finding it leads with, and a problem names where it was
    raised once, in its own field."""
    from conformance.outcome import error_outcome

    disk = "layer 0, key 'model.up_w', experts 2..3: its expert axis has 2 rows, expected 4"
    found = error_outcome(_world_error(_stopped(0, "build", "framework", findings=(disk,))))
    assert found.findings == ["on-disk", "refused"]
    assert found.detail.startswith(f"on-disk, refused: the checkpoint is not EP-invariant: {disk}; "
                                   "then failed on rank(s) 0"), found.detail
    stop = next(p for p in found.problems if p["check"] == "build")
    assert stop["raised_at"] == "framework.py:3 in build" and "raised at" not in stop["text"]
    assert [p["finding"] for p in found.problems if p["check"] == "checkpoint"] == ["on-disk"]


def test_a_hang_is_an_error_whatever_the_ranks_found() -> None:
    from conformance.outcome import error_outcome

    disk = "layer 0, key 'model.up_w': absent"
    found = error_outcome(_world_error(_stopped(0, "build", "framework", findings=(disk,)),
                                       kind="hang"))
    assert found.findings == ["on-disk", "error"]


# -- one count of expected red cells, in every output ----------------------------------------------
#: "N of M red cell(s) expected" as the terminal, the report's sentence and each picture say it.
SAID = re.compile(r"(\d+) of (\d+) red cell\(s\) expected")
#: the report's own sentence (a picture's label is followed by its end, not by the file's name).
SENTENCE = re.compile(r"(\d+) of (\d+) red cell\(s\) expected \(")


def _said(text: str, pattern: re.Pattern[str] = SENTENCE) -> tuple[int, int]:
    [found] = pattern.findall(text)
    return int(found[0]), int(found[1])


def _pictures(directory: Path) -> tuple[int, int, int]:
    """What the report's SVG pictures say, summed over them: expected and red from each one's label,
    and how many squares are hatched (red as expected)."""
    expected = red = hatched = 0
    for path in sorted(directory.glob("moe-ep-conformance-grid-*.svg")):
        root = ElementTree.parse(path).getroot()
        said = SAID.findall(root.get("aria-label", ""))
        e, r = (int(said[0][0]), int(said[0][1])) if said else (0, 0)
        expected, red = expected + e, red + r
        hatched += sum(rect.get("fill", "").endswith("-expected)")
                       for link in root.iter(f"{SVG}a") for rect in link.iter(f"{SVG}rect"))
    return expected, red, hatched


def _every_output(directory: Path, doc: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """``(expected, red)`` as the Markdown, the HTML page, the step summary and the pictures say
    it."""
    from conformance.report import step_summary

    summary = step_summary(doc)
    expected, red, hatched = _pictures(directory)
    return {"markdown": _said((directory / "moe-ep-conformance.md").read_text()),
            "html": _said((directory / "moe-ep-conformance.html").read_text()),
            "step summary": _said(summary),
            "step summary squares": (sum(_lower_case_squares(summary)), red),
            "svg": (expected, red), "svg hatched": (hatched, red)}


def _lower_case_squares(summary: str) -> list[int]:
    """1 per expected red text square of the step summary's grids (its letter is lower case)."""
    return [1 for line in summary.splitlines() if line.startswith("| ")
            for _ in re.findall("[🟥🟧🟦🟪][sdre]", line)]


def test_an_update_run_says_the_same_expected_count_everywhere(pytester: pytest.Pytester) -> None:
    """An update run expects every red cell (``met`` where the file already said so, ``updated``
    where it now does): the terminal, the Markdown, the HTML page, the step summary and the
    pictures all say so, and a loud refusal reads as ``refused`` in the JSON too (its status:
    ``stopped``)."""
    pytester.makepyfile(refusing_adapter=REFUSING, refusing_framework=FRAMEWORK)
    select = REFUSED_SLICE
    first = _report(pytester, "first", "--moe-ep-adapter=refusing_adapter:RefusesEp4", "-k",
                    select)
    refused = sorted(i for i, c in first.items() if outcome(c) == "refused")
    assert len(refused) >= 2, sorted(first)
    baseline = pytester.path / "expect.toml"
    baseline.write_text(f'[[cell]]\nid = "{refused[0]}"\nfinding = "refused"\n'
                        'reason = "acme refuses ep=4"\n')
    out = pytester.path / "update"
    result = run_inline(pytester, "--moe-ep-matrix", "-p", "no:cacheprovider",
                        f"--moe-ep-report={out}", "--moe-ep-adapter=refusing_adapter:RefusesEp4",
                        f"--moe-ep-expectations={baseline}", "--moe-ep-update-expectations",
                        "-k", select)
    assert result.ret == 0, result.stdout.str()[-3000:]
    doc = json.loads((out / "moe-ep-conformance.json").read_text())
    cells = doc["cells"]
    red = [c for c in cells if is_red(c)]
    states = {c["expectation"] for c in red}
    assert states == {"met", "updated"}, states  # both kinds of expected red cell are in the run
    assert expected_line(cells) == (len(red), len(red))
    terminal = _said(result.stdout.str(), SAID)
    assert terminal == (len(red), len(red)), result.stdout.str()[-3000:]
    assert _every_output(out, doc) == {name: terminal for name in (
        "markdown", "html", "step summary", "step summary squares", "svg", "svg hatched")}
    # one vocabulary: the refused cells stopped, and "error" is only ever a finding
    for cell in red:
        assert (cell["status"], cell["outcome"], cell["finding"]) == ("stopped", "refused",
                                                                      "refused"), cell
    assert "error" not in doc["summary"] and doc["summary"]["stopped"] == len(red)
    assert doc["outcomes"]["refused"] == doc["findings"]["refused"] == len(red)
    assert doc["outcomes"]["error"] == 0


def test_every_output_counts_the_same_cells_red_and_expected(tmp_path: Path) -> None:
    """Built from real judgements: met, tolerated, updated (red, and green where the file said red),
    unmet and an interrupted cell, which is not red; every output counts what
    :func:`conformance.outcome.expected_line` counts."""
    from conformance.expectations import Baseline, Expectations, parse
    from conformance.record import CellRecord
    from conformance.report import write_report

    text = "".join(f'[[cell]]\nid = "{PREFIX}{i}"\nfinding = "{f}"\nreason = "known"\n\n'
                   for i, f in (("ep1->ep2", "silent"), ("ep2->ep2", "on-disk"),
                                ("ep1->ep1", "silent")))
    expectations: Expectations = parse(tmp_path / "x.toml", text)
    ran = [("ep1->ep2", FAIL, ["silent"]), ("ep2->ep1", STOPPED, ["refused"]),
           ("ep2->ep2", FAIL, ["silent", "on-disk"]), ("ep4->ep1", STOPPED, ["error"]),
           ("ep1->ep1", PASS, []), ("ep1->ep4", INTERRUPTED, []), ("ep4->ep4", NA, [])]
    records: list[dict[str, Any]] = []
    for update in (False, True):
        baseline = Baseline(expectations, tolerate=("refused",), update=update)
        records = []
        for pair, status, findings in ran:
            save, load = pair.split("->")
            record = CellRecord(f"{PREFIX}{pair}", "checkpoint", "acme", "1.0", fields={
                "kind": "packed", "state": "model", "fsdp": False, "num_experts": 4,
                "legacy": False, "save_layout": save, "load_layout": load})
            record.finish(status, f"{', '.join(findings) or status}: what happened", 1.0)
            record.findings = findings or None
            got = judged_outcome(record.to_dict())
            if got is not None:
                record.expectation = baseline.judge(record.id, got).record_fields()
            records.append(record.to_dict())
        by_state = {r["id"].rsplit("::", 1)[1]: r.get("expectation") for r in records}
        assert by_state == ({"ep1->ep2": "met", "ep2->ep1": "tolerated", "ep2->ep2": "unmet",
                             "ep4->ep1": "unmet", "ep1->ep1": "unmet", "ep1->ep4": None,
                             "ep4->ep4": None} if not update else
                            {"ep1->ep2": "met", "ep2->ep1": "tolerated", "ep2->ep2": "updated",
                             "ep4->ep1": "updated", "ep1->ep1": "updated", "ep1->ep4": None,
                             "ep4->ep4": None}), by_state
        out = tmp_path / f"update-{update}"
        write_report(out, records, backend="gloo", world_size=4, expectations={
            "file": "x.toml", "tolerate": ["refused"], "update": update})
        doc = json.loads((out / "moe-ep-conformance.json").read_text())
        want = (4, 4) if update else (2, 4)
        assert expected_line(doc["cells"]) == want
        assert _every_output(out, doc) == {name: want for name in (
            "markdown", "html", "step summary", "step summary squares", "svg", "svg hatched")}

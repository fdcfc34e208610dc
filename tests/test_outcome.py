"""One verdict: a cell's outcome is built in one place from what its ranks send, whatever ran before
it.

A world's ranks keep state across cells (ground truths, what each save held, what the truth
checkpoint taught: :mod:`conformance.world_state`), and a tier shares one save among its loads.
None of it may decide a verdict, so a red cell run alone, by its node id, must come back exactly as
it did inside its tier: the same status, findings and first line.  One red cell of each finding,
from the seeded bugs and the refusing adapters the detection and findings tests use; each is chosen
among the later cells of its slice, so the tier's run had kept state when it reached it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from matrix_expectations import run_inline
from test_findings_and_expectations import FRAMEWORK, REFUSING

from conformance.outcome import is_red, outcome

pytestmark = pytest.mark.usefixtures("shared_fork_server")
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
    assert found.status == "error" and found.findings == [want]
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

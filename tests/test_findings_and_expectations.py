"""Findings and expectations in real matrix runs: how bad each red cell is, and a framework's CI
gated on a file.

The runs are in this process (``run_inline``: the reference and the legacy adapter, ranks forked
from this session's fork server) over a small slice of the default tier, so each takes seconds; what
needs another process (xdist, the ``--from-log`` command line, exit status 4's one line) runs in a
subprocess.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from matrix_expectations import run_inline

from conformance.expectations import parse

pytestmark = pytest.mark.usefixtures("shared_fork_server")

#: the default tier's unpacked model-only cells: lossy legacy saves at ep > 1, and ep=1 saves that
#: pass. nine cells of the full tier (the same for every adapter; the default tier is each adapter's
#: own covering): the strided plain layouts ep1, ep2, ep4 on either side; legacy's saves at ep=1
#: pass, at ep > 1 they are lossy.
SLICE = ("kind_unpacked and model and not optim and not pipeline and not fsdp and not E5 and not "
         "etp2 and not consecutive")
#: the tier SLICE is of.
SLICE_TIER = "--moe-ep-matrix=full"


def report(out: Path) -> dict[str, Any]:
    return json.loads((out / "moe-ep-conformance.json").read_text())


def run(pytester: pytest.Pytester, *args: str, out: str = "out",
        tier: str = "--moe-ep-matrix") -> tuple[pytest.RunResult, dict[str, Any]]:
    result = run_inline(pytester, tier, "-p", "no:cacheprovider",
                        f"--moe-ep-report={pytester.path / out}", *args)
    return result, report(pytester.path / out)


def test_legacy_baseline_is_written_held_and_shows_what_another_adapter_fixed(
        pytester: pytest.Pytester) -> None:
    baseline = pytester.path / "legacy.toml"
    # 1. the first file, from the run's outcomes: exit 0, one entry per red cell
    result, doc = run(pytester, "--moe-ep-adapter=legacy", f"--moe-ep-expectations={baseline}",
                      "--moe-ep-update-expectations", "-k", SLICE, tier=SLICE_TIER)
    assert result.ret == 0, result.stdout.str()[-3000:]
    red = {c["id"]: c for c in doc["cells"] if c["status"] in ("fail", "stopped")}
    green = [c["id"] for c in doc["cells"] if c["status"] == "pass"]
    assert red and green
    for cell in red.values():  # every red cell has a finding; the legacy save is lossy: on-disk
        assert cell["finding"] == "on-disk" and cell["findings"][0] == "on-disk", cell
        assert cell["detail"].startswith(", ".join(cell["findings"]) + ": "), cell["detail"]
        assert cell["expectation"] == "updated" and cell["problems"], cell
    assert doc["findings"] == {"silent": 0, "on-disk": len(red), "refused": 0, "error": 0}
    # the record keeps every problem (the first line says "and N more"): structured, each with its
    # rank
    most = max(red.values(), key=lambda c: len(c["problems"]))
    assert len(most["problems"]) > 6 and all("check" in p and "text" in p
                                             for p in most["problems"]), most
    written = parse(baseline, baseline.read_text())
    assert {e.id: e.finding for e in written.entries} == {i: "on-disk" for i in red}
    assert all("written by pytest --moe-ep-update-expectations" in e.reason
               for e in written.entries)
    result.stdout.fnmatch_lines([f"expectations: {baseline}: {len(red)} added, 0 changed, 0 "
                                 "removed entries"])

    # 2. the same run against it: its red cells are expected (xfailed with the reason), the session
    #    is green
    baseline.write_text(baseline.read_text().replace("TODO: on-disk",
                                                     "legacy saves local names, see docs", 1))
    result, doc = run(pytester, "--moe-ep-adapter=legacy", f"--moe-ep-expectations={baseline}",
                      "-k", SLICE, "-rx", tier=SLICE_TIER)
    assert result.ret == 0, result.stdout.str()[-3000:]
    result.assert_outcomes(passed=len(green), xfailed=len(red))
    result.stdout.fnmatch_lines(["XFAIL *on-disk as expected (*): on-disk, *"])
    assert doc["expectations"]["counts"] == {"met": len(doc["cells"])}
    md = (pytester.path / "out" / "moe-ep-conformance.md").read_text()
    assert (f"{len(red)} of {len(red)} red cell(s) expected" in md
            and "legacy saves local names, see docs" in md)
    assert f"**{len(red)} on-disk** cell(s); the first: `" in md

    # 3. the reference against legacy's file: the cells the reference gets right now pass, and fail
    #    the session
    result, doc = run(pytester, "--moe-ep-adapter=reference", f"--moe-ep-expectations={baseline}",
                      "-k", SLICE, out="ref", tier=SLICE_TIER)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    named = {c["id"] for c in doc["cells"] if c["id"] in red}  # the same full-tier cells
    assert named and all(c["status"] in ("pass", "n/a") for c in doc["cells"])
    result.assert_outcomes(passed=sum(c["status"] == "pass" for c in doc["cells"]) - len(named),
                           failed=len(named),
                           skipped=sum(c["status"] == "n/a" for c in doc["cells"]))
    result.stdout.fnmatch_lines(["*unexpected: now passes (expected on-disk by *): update the "
                                 "expectations*"])
    assert {c["id"] for c in doc["cells"] if c.get("expectation") == "unmet"} == named

    # 4. legacy against an empty file: every red cell is unexpected
    empty = pytester.path / "empty.toml"
    empty.write_text("# nothing is expected to fail\n")
    result, _ = run(pytester, "--moe-ep-adapter=legacy", f"--moe-ep-expectations={empty}", "-k",
                    SLICE, "-v", out="e", tier=SLICE_TIER)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=len(green), failed=len(red))
    # -v: all of them
    result.stdout.fnmatch_lines([f"every problem of this cell ({len(most['problems'])}):"])
    result.stdout.fnmatch_lines(["*unexpected: worse than expected: expected pass (not in the "
                                 "expectations file), got on-disk*"])

    # 5. an update of a -k slice touches only the cells it ran: the rest of the file stays as it was
    one = sorted(red)[0]
    baseline.write_text(baseline.read_text().replace('finding = "on-disk"', 'finding = "silent"'))
    before = parse(baseline, baseline.read_text())
    ran = "save_ep2 and load_ep2 and " + SLICE
    result, doc = run(pytester, "--moe-ep-adapter=legacy", f"--moe-ep-expectations={baseline}",
                      "--moe-ep-update-expectations", "-k", ran, out="slice", tier=SLICE_TIER)
    assert result.ret == 0
    touched = {c["id"] for c in doc["cells"] if c["status"] in ("fail", "stopped")}
    after = parse(baseline, baseline.read_text())
    assert touched and touched != set(red)
    for entry in after.entries:
        assert entry.finding == ("on-disk" if entry.id in touched else "silent"), entry
    assert len(after.entries) == len(before.entries) and one


def test_an_interrupted_update_never_rewrites_the_baseline(pytester: pytest.Pytester) -> None:
    baseline = pytester.path / "legacy.toml"
    baseline.write_text("# as the team left it\n")
    pytester.makeconftest('''
def pytest_runtest_logfinish(nodeid, location):
    raise KeyboardInterrupt  # Ctrl-C after the first cell
''')
    # a Ctrl-C: its own process
    result = pytester.runpytest_subprocess(SLICE_TIER, "--moe-ep-adapter=legacy",
                                           f"--moe-ep-expectations={baseline}",
                                           "--moe-ep-update-expectations", "-k",
                                           SLICE, "-p", "no:cacheprovider", timeout=600)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines([f"expectations: {baseline}: not updated: the run did not finish "
                                 "*"])
    assert baseline.read_text() == "# as the team left it\n"


@pytest.mark.parametrize(("text", "problem"), [
    ("[[cell]\nid=",
     "not valid TOML: Expected ']]' at the end of an array declaration (at line 1, column 7)"),
    ('[[cell]]\nid = "checkpoint::*"\nfinding = "lost"\n', "unknown finding 'lost'"),
    ('[[cell]]\nid = "checkpoint::nope::*"\nfinding = "silent"\n',
     "names no cell of any tier (world size 4, experts 4,5)"),
    ('[[cell]]\nid = "checkpoint::*"\nfinding = "silent"\nadapter = "megatron"\n',
     "names adapter 'megatron'; this session checks 'reference'"),
])
def test_a_broken_expectations_file_is_a_one_line_usage_error(pytester: pytest.Pytester, text: str,
                                                              problem: str) -> None:
    (pytester.path / "e.toml").write_text(text)
    result = pytester.runpytest_subprocess("--moe-ep-matrix", "--moe-ep-expectations=e.toml", "-p",
                                           "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.stderr.lines if line.strip()]
    assert errors == ["ERROR: pytest-moe-ep: --moe-ep-expectations=e.toml: "
                      f"{errors[0].split(': ', 3)[-1]}"]
    assert problem in errors[0] and "Traceback" not in result.stderr.str()


def test_expectations_without_the_matrix_are_a_usage_error_not_ignored(
        pytester: pytest.Pytester) -> None:
    (pytester.path / "e.toml").write_text("")
    result = pytester.runpytest_subprocess("--moe-ep-expectations=e.toml", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert ("--moe-ep-expectations holds the conformance matrix to a baseline; give --moe-ep-matrix"
            in result.stderr.str())


def test_tolerating_refusals_does_not_tolerate_a_lossy_checkpoint(
        pytester: pytest.Pytester) -> None:
    result, doc = run(pytester, "--moe-ep-adapter=legacy", "--moe-ep-tolerate=refused,error", "-k",
                      SLICE, tier=SLICE_TIER)
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # on-disk is never tolerated wholesale
    assert {c.get("expectation") for c in doc["cells"] if c["status"] != "pass"} == {"unmet"}


REFUSING = '''
from conformance.adapters.reference import ReferenceAdapter
import refusing_framework


class RefusesEp4(ReferenceAdapter):
    """The framework refuses to build at ep=4 with a bare assert; at ep=1 and 2 it is the
    reference."""

    name = "refuses-ep4"

    def build(self, spec, mesh, seed):
        if mesh is not None and spec.layout.ep == 4:
            refusing_framework.build(spec)
        return super().build(spec, mesh, seed)


class AdapterBugAtEp4(ReferenceAdapter):
    """The adapter's own code fails at ep=4: not a finding about the framework."""

    name = "adapter-bug"

    def build(self, spec, mesh, seed):
        if mesh is not None and spec.layout.ep == 4:
            return {}["model"]
        return super().build(spec, mesh, seed)
'''
FRAMEWORK = '''
def build(spec):
    assert spec.num_experts < 0
'''


def run_report_with_refusing_adapter(pytester: pytest.Pytester, cls: str = "RefusesEp4",
                                     *extra: str) -> tuple[pytest.RunResult, dict[str, Any]]:
    pytester.makepyfile(refusing_adapter=REFUSING, refusing_framework=FRAMEWORK)
    return run(pytester, f"--moe-ep-adapter=refusing_adapter:{cls}", "-k",
               "kind_packed and model and not optim "
               "and not legacy and not pipeline and load_ep4", *extra, out=cls)


def test_a_framework_refusal_keeps_its_file_and_line_and_an_adapter_bug_is_an_error(
        pytester: pytest.Pytester) -> None:
    result, doc = run_report_with_refusing_adapter(pytester, "RefusesEp4",
                                                   "--moe-ep-tolerate=refused")
    red = [c for c in doc["cells"] if c["status"] == "stopped"]
    # tolerated: xfailed, and still reported
    assert red and result.ret == 0, result.stdout.str()[-3000:]
    result.assert_outcomes(xfailed=len(red), passed=len(doc["cells"]) - len(red))
    for cell in red:
        assert cell["finding"] == "refused" and cell["expectation"] == "tolerated", cell
        assert cell["detail"].startswith("refused: failed on rank(s) 0, 1, 2, 3: ")
        # a bare assert has no message: its file and line are the message
        assert re.search(r"the framework refused the (save|load) side's build at ep=4",
                         cell["detail"]), cell["detail"]
        assert ("AssertionError: (no message) (raised at refusing_framework.py:2 in build)"
                in cell["detail"]), \
            cell["detail"]
        rank0 = next(p for p in cell["problems"] if p.get("rank") == 0)
        assert (rank0["raised_in"] == "framework"
                and rank0["raised_at"] == "refusing_framework.py:2 in build")
    result, doc = run_report_with_refusing_adapter(pytester, "AdapterBugAtEp4",
                                                   "--moe-ep-tolerate=refused")
    # an adapter's error is not the framework's refusal
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    red = [c for c in doc["cells"] if c["status"] == "stopped"]
    assert red
    for cell in red:
        assert cell["finding"] == "error", cell
        assert re.search(r"the adapter's code failed in the (save|load) side's build at ep=4",
                         cell["detail"])
        assert "KeyError: 'model' (raised at refusing_adapter.py:" in cell["detail"], cell["detail"]
        assert "(an error in the adapter, not a finding about the framework)" in cell["detail"]


def test_a_report_rebuilt_from_a_log_is_judged_against_the_file(pytester: pytest.Pytester) -> None:
    baseline, log = pytester.path / "legacy.toml", pytester.path / "log.jsonl"
    result = pytester.runpytest_subprocess(SLICE_TIER, "--moe-ep-adapter=legacy", "-p",
                                           "no:cacheprovider", f"--report-log={log}", "-k", SLICE,
                                           timeout=600)
    assert result.ret == pytest.ExitCode.TESTS_FAILED

    def rebuild(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "conformance.report", "--from-log", str(log), "--out",
             str(pytester.path / "rebuilt"), *args], capture_output=True, text=True, timeout=120)

    done = rebuild("--expectations", str(baseline), "--update-expectations")
    assert done.returncode == 0, done.stderr
    red = {e.id for e in parse(baseline, baseline.read_text()).entries}
    assert red and f"{baseline}: {len(red)} added" in done.stdout
    done = rebuild("--expectations", str(baseline))
    assert done.returncode == 0, done.stdout + done.stderr
    doc = report(pytester.path / "rebuilt")
    assert {c["id"] for c in doc["cells"] if c.get("expectation") == "met"
            and c["status"] != "pass"} == red
    baseline.write_text("")
    done = rebuild("--expectations", str(baseline))
    assert done.returncode == 1 and f"{len(red)} cell(s) not as {baseline} expects:" in done.stdout


def test_xdist_workers_judge_and_the_controller_updates(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    baseline = pytester.path / "legacy.toml"
    args = ("-p", "no:cacheprovider", "-n", "2", "-p", "xdist", "--moe-ep-matrix=1,2",
            "--moe-ep-adapter=legacy", f"--moe-ep-expectations={baseline}", "-k",
            "kind_unpacked and ep-only and not E5 and not consecutive and not optim")
    result = pytester.runpytest_subprocess(*args, "--moe-ep-update-expectations", timeout=600)
    assert result.ret == 0, result.stdout.str()[-3000:]
    entries = parse(baseline, baseline.read_text()).entries
    assert entries and all(e.finding == "on-disk" for e in entries)
    result = pytester.runpytest_subprocess(*args, timeout=600)
    assert result.ret == 0, result.stdout.str()[-3000:]
    result.assert_outcomes(passed=4 - len(entries), xfailed=len(entries))


def test_under_torchrun_rank_0_writes_the_file_and_every_rank_holds_to_it(pytester: pytest.Pytester,
                                                                            tmp_path: Path) -> None:
    """The in-process engine (pytest on every rank of a torchrun launch): each rank judges the same
    cells alike, the update is rank 0's to write, and a run against the file agrees on exit
    status 0."""
    import os

    baseline = tmp_path / "legacy.toml"
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}

    def launch(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             "-m", "pytest", "-p", "no:cacheprovider", "--moe-ep-timeout=120", "--moe-ep-matrix=2",
             "--moe-ep-world-size=2", "--moe-ep-adapter=legacy",
             f"--moe-ep-expectations={baseline}", "-k",
             "kind_unpacked and model and not optim and ep-only and not E5", *extra],
            cwd=pytester.path, env=env, capture_output=True, text=True, timeout=400)

    first = launch("--moe-ep-update-expectations")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    entries = parse(baseline, baseline.read_text()).entries
    assert entries and {e.finding for e in entries} == {"on-disk"}
    again = launch()
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    # both ranks report the expected cells
    assert again.stdout.count("xfailed") >= 2, again.stdout[-3000:]

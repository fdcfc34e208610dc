"""A run cut short keeps what it found: SIGTERM, kill -9, a crash in the report write, hostile
checkpoint indexes, a full disk.

Every test counts what survived (cells in the report, or rebuilt from the ``pytest-reportlog`` log)
against what the run's own log says finished, and what was left behind (processes of the run, work
directories, temporary report files).  Real runs throughout: a 2-rank gloo world in a pytest
subprocess, real signals, a real tmpfs, real links and FIFOs.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
from test_hygiene import _session_members, _tmp_leftovers

from conformance.report import JSON_NAME, MD_NAME, TMP_PREFIX, write_report

#: four cells at world size 2 (every save ep x load ep in {1, 2}); each runs in a few seconds once
#: the world is up.
FOUR_CELLS = ("--moe-ep-matrix=1,2", "--moe-ep-world-size=2", "--moe-ep-experts=4",
              "-k", "kind_unpacked and not optim and ep-only and not legacy")


# -- helpers -------------------------------------------------------------------------------------
def _log_entries(log: Path) -> list[dict[str, Any]]:
    entries = []
    for line in log.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except ValueError:  # a line cut by kill -9
            continue
    return entries


def _finished(log: Path) -> dict[str, str]:
    """What the log says finished: cell id -> status, read here independently of
    conformance.reportlog."""
    found = {}
    for e in _log_entries(log):
        if e.get("$report_type") == "TestReport" and e["when"] == "call":
            for key, value in e["user_properties"]:
                if key == "moe_ep_record":
                    record = json.loads(value)
                    found[record["id"]] = record["status"]
    return found


def _selected(log: Path) -> list[str]:
    for e in _log_entries(log):
        for key, value in e.get("user_properties") or []:
            if key == "moe_ep_selection":
                return json.loads(value)["ids"]
    return []


def _start(pytester: pytest.Pytester, tmp_path: Path,
           *args: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """pytest on FOUR_CELLS with a report, a report log and JUnit XML, in its own session and
    TMPDIR."""
    out, log, tmpdir = tmp_path / "out", tmp_path / "run.jsonl", tmp_path / "tmp"
    tmpdir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *FOUR_CELLS, *args,
         f"--moe-ep-report={out}", f"--report-log={log}", f"--junitxml={out / 'junit.xml'}"],
        cwd=pytester.path, env={**os.environ, "TMPDIR": str(tmpdir)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, out, log


def _when_one_cell_finished(proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 480
    while not (log.exists() and _finished(log)):
        assert proc.poll() is None and time.monotonic() < deadline, "no cell finished"
        time.sleep(0.05)


def _left_behind(proc: subprocess.Popen[bytes], tmp_path: Path) -> tuple[list[str], list[str]]:
    """Processes of the run still alive (killed here) and work directories left in its TMPDIR."""
    # the ranks' lifeline removes the work directory; a loaded machine is slow
    deadline = time.monotonic() + 60
    while (_session_members(proc.pid)
           or _tmp_leftovers(tmp_path / "tmp")) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _session_members(proc.pid)
    for member in alive:
        os.kill(int(member.split()[0]), signal.SIGKILL)
    return alive, _tmp_leftovers(tmp_path / "tmp")


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 600) -> tuple[int, str]:
    """pytest in its own session; on a timeout every process of that session is killed, not left
    running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0].decode()
    finally:
        for member in _session_members(proc.pid):
            os.kill(int(member.split()[0]), signal.SIGKILL)
        proc.kill()
        proc.wait()
    return proc.returncode, out


def _rebuild(log: Path, out: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "conformance.report", "--from-log", str(log),
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads((out / JSON_NAME).read_text())


def _assert_holds_what_finished(doc: dict[str, Any], finished: dict[str, str],
                                selected: list[str]) -> None:
    """Every finished cell with its status, no more; at most one cell interrupted; the rest listed
    as not run."""
    cells = {c["id"]: c["status"] for c in doc["cells"]}
    running = {i for i, s in cells.items() if s == "interrupted"}
    assert {i: s for i, s in cells.items() if i not in running} == finished
    assert len(running) <= 1 and not running & set(finished)
    assert doc["not_run"] == sorted(set(selected) - set(cells))
    assert doc["interrupted"] is True and doc["incomplete"] is True
    assert doc["summary"]["pass"] == sum(s == "pass" for s in finished.values())


# -- SIGTERM: like Ctrl-C ------------------------------------------------------------------------
def test_sigterm_writes_every_report_with_what_finished(pytester: pytest.Pytester,
                                                        tmp_path: Path) -> None:
    proc, out, log = _start(pytester, tmp_path)
    try:
        _when_one_cell_finished(proc, log)
        proc.send_signal(signal.SIGTERM)
        text = proc.communicate(timeout=300)[0].decode()
    finally:
        alive, left = _left_behind(proc, tmp_path)
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, text
    assert "Terminated: SIGTERM received" in text, text
    finished, selected = _finished(log), _selected(log)
    assert len(selected) == 4 and 1 <= len(finished) < 4, (finished, text)
    doc = json.loads((out / JSON_NAME).read_text())
    _assert_holds_what_finished(doc, finished, selected)
    markdown = (out / MD_NAME).read_text()
    assert "**Incomplete: the run was interrupted.**" in markdown
    assert all(f"- `{i}`" in markdown for i in doc["not_run"])
    junit = ElementTree.parse(out / "junit.xml")
    assert {f"{c.get('classname')}.{c.get('name')}" for c in junit.iter("testcase")
            if c.get("name")} >= {i.replace("::", ".") for i in finished}
    # The log of an interrupted run rebuilds the same cells (the running one says it was running).
    rebuilt = _rebuild(log, tmp_path / "rebuilt")
    assert {c["id"]: c["status"]
            for c in rebuilt["cells"]} == {c["id"]: c["status"] for c in doc["cells"]}
    assert rebuilt["not_run"] == doc["not_run"] and rebuilt["rebuilt_from"] == str(log)
    assert not alive, f"processes of the run alive after it exited: {alive}"
    assert not left, f"work directories left behind: {left}"
    assert not list(out.glob(f"{TMP_PREFIX}*")), "a temporary report file was left behind"


#: SIGTERM in the window between a cell's setup report and its run: in a hook that runs before the
#: other loggers have the report (held until they do), and in the call phase before the cell's
#: runtest.
SIGTERM_AFTER_THE_SETUP = """
import os, signal, time
import pytest

def _stop():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)  # a held signal waits here; the run must not

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report):
    if (report.when == "setup" and report.nodeid.endswith("ep1->ep2")
            and os.environ["WHERE"] == "logreport"):
        _stop()

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    if item.nodeid.endswith("ep1->ep2") and os.environ["WHERE"] == "call":
        _stop()
"""


@pytest.mark.parametrize("where", ["logreport", "call"])
def test_sigterm_after_a_cells_setup_reports_it_interrupted_as_the_log_does(
        pytester: pytest.Pytester, tmp_path: Path, where: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The window CI once hit: the log says the cell started (its setup passed), so the live report
    must too."""
    pytester.makeconftest(SIGTERM_AFTER_THE_SETUP)
    monkeypatch.setenv("WHERE", where)
    proc, out, log = _start(pytester, tmp_path)
    try:
        text = proc.communicate(timeout=300)[0].decode()
    finally:
        alive, _ = _left_behind(proc, tmp_path)
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, text
    doc = json.loads((out / JSON_NAME).read_text())
    cells = {c["id"]: c for c in doc["cells"]}
    [running] = [i for i, c in cells.items() if c["status"] == "interrupted"]
    assert (running.endswith("ep1->ep2")
            and "before its run began" in cells[running]["detail"]), cells
    _assert_holds_what_finished(doc, _finished(log), _selected(log))
    rebuilt = _rebuild(log, tmp_path / "rebuilt")
    assert {c["id"]: c["status"]
            for c in rebuilt["cells"]} == {i: c["status"] for i, c in cells.items()}
    assert not alive, f"processes of the run alive after it exited: {alive}"


SLOW_FINISH = """
import os, time
from pathlib import Path

def pytest_sessionfinish(session):
    Path(os.environ["MARKS"], "finishing").write_text("x")
    time.sleep(60)  # a slow teardown: the second SIGTERM must not wait for it
"""
SLEEPS = """
import os, time
from pathlib import Path

def test_sleeps():
    Path(os.environ["MARKS"], "running").write_text("x")
    time.sleep(60)
"""


def test_a_second_sigterm_stops_at_once(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pytester.makeconftest(SLOW_FINISH)
    pytester.makepyfile(SLEEPS)
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "tmp").mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(pytester.path)],
        cwd=pytester.path, env={**os.environ, "MARKS": str(marks)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for mark in ("running", "finishing"):
            deadline = time.monotonic() + 60
            while not (marks / mark).exists():
                assert proc.poll() is None and time.monotonic() < deadline, f"never {mark}"
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert proc.wait(20) == -signal.SIGTERM
        assert time.monotonic() - started < 10
    finally:
        alive, _ = _left_behind(proc, tmp_path)
    assert not alive


LOGS_REPORTS_LATER = """
import pytest
from _pytest.runner import runtestprotocol

@pytest.hookimpl(tryfirst=True)
# as pytest-rerunfailures does: run unlogged, then log the reports
def pytest_runtest_protocol(item, nextitem):
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in runtestprotocol(item, nextitem=nextitem, log=False):
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True
"""
STOPS_ITSELF = """
import os, signal, time

def test_first():
    pass

def test_stops():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
"""


def test_a_report_made_but_not_logged_does_not_hold_a_sigterm_through_the_next_run(
        pytester: pytest.Pytester, tmp_path: Path) -> None:
    """A plugin that makes reports and logs them later: the hold its report-making starts ends when
    a phase begins."""
    pytester.makeconftest(LOGS_REPORTS_LATER)
    pytester.makepyfile(STOPS_ITSELF)
    started = time.monotonic()
    code, out = _run([str(pytester.path)], pytester.path, timeout=120)
    assert code == pytest.ExitCode.INTERRUPTED, out
    assert time.monotonic() - started < 40, f"the SIGTERM waited for the test's sleep:\n{out}"
    assert "SIGTERM received" in out, out


# -- kill -9: the report log survives, and rebuilds the report -------------------------------------
def test_kill_9_with_a_report_log_rebuilds_every_finished_cell(
        pytester: pytest.Pytester, tmp_path: Path) -> None:
    proc, out, log = _start(pytester, tmp_path)
    try:
        _when_one_cell_finished(proc, log)
        proc.kill()
        proc.wait(30)
    finally:
        alive, left = _left_behind(proc, tmp_path)
    assert not (out / JSON_NAME).exists(), "kill -9 cannot have let pytest write the report"
    finished, selected = _finished(log), _selected(log)
    assert len(selected) == 4 and 1 <= len(finished) < 4, finished
    doc = _rebuild(log, tmp_path / "rebuilt")
    _assert_holds_what_finished(doc, finished, selected)
    running = [c for c in doc["cells"] if c["status"] == "interrupted"]
    assert all("the session was killed during this cell" in c["detail"] for c in running)
    assert (doc["backend"] == "gloo" and doc["world_size"] == 2
            and doc["adapter"]["name"] == "reference")
    assert ("**Incomplete: the run's log ends before the session did.**"
            in (tmp_path / "rebuilt" / MD_NAME).read_text())
    assert not alive, f"processes of the run alive after kill -9: {alive}"
    # The session's reaper removes the work directory even when the kernel killed the ranks with the
    # fork server.  A kill that lands while a world starts can leave multiprocessing's own pymp-*
    # socket directory before the reaper has noted it (seen once in a clean-clone run on a loaded
    # host): a known race, left out here until the reaper notes the directory before it exists.
    ours = [name for name in left if not name.startswith("pymp-")]
    assert not ours, f"kill -9 between cells left the work directory {left}"


# -- a crash while the report is written ---------------------------------------------------------
CRASH_IN_WRITE = """
import os, sys
import conformance.report as report

def die(fd):
    os._exit(9)  # as a kill -9 would: after the temporary file was written, before the rename

os.fsync = die
report.write_report(sys.argv[1], [{"id": "new", "status": "fail", "detail": "x",
                                   "suite": "functions", "function": "f"}],
                    backend="gloo", world_size=2)
"""


def test_a_crash_during_the_report_write_leaves_the_previous_report(tmp_path: Path) -> None:
    out = tmp_path / "report"
    old = [{"id": "old", "status": "pass", "detail": "", "suite": "functions", "function": "f"}]
    write_report(out, old, backend="gloo", world_size=2)
    before = {p.name: p.read_text() for p in out.iterdir()}
    done = subprocess.run([sys.executable, "-c", CRASH_IN_WRITE, str(out)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 9, done.stderr
    assert {p.name: p.read_text() for p in out.iterdir() if p.name in before} == before
    [stale] = [p.name for p in out.iterdir() if p.name not in before]
    assert stale.startswith(TMP_PREFIX), stale
    # The next write removes what the crash left, and replaces both files.
    write_report(out, [{**old[0], "id": "next"}], backend="gloo", world_size=2)
    assert sorted(p.name for p in out.iterdir()) == sorted(before)
    assert [c["id"] for c in json.loads((out / JSON_NAME).read_text())["cells"]] == ["next"]


def test_a_failed_rename_leaves_the_previous_report_and_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "report"
    write_report(out, [], backend="gloo", world_size=2)
    before = {p.name: p.read_text() for p in out.iterdir()}

    def refuse(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError):
        write_report(out, [{"id": "x", "status": "pass", "detail": ""}], backend="gloo",
                     world_size=2)
    assert {p.name: p.read_text() for p in out.iterdir()} == before


# -- inspection reads only the checkpoint --------------------------------------------------------
def _safetensors(path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0\0\0")


def _inspect(path: Path) -> subprocess.CompletedProcess[str]:
    """moe-ep-inspect in a subprocess: opening the FIFO outside would block it, which the timeout
    catches."""
    return subprocess.run([sys.executable, "-m", "conformance.inspect", str(path)],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A FIFO outside the checkpoint: reading it blocks, so an inspection that opens it never
    returns."""
    (tmp_path / "elsewhere").mkdir()
    fifo = tmp_path / "elsewhere" / "secret.safetensors"
    os.mkfifo(fifo)
    return fifo


def test_an_index_naming_a_file_outside_the_checkpoint_is_refused(
        tmp_path: Path, outside: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _safetensors(ckpt / "model-1.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "model-1.safetensors", "stolen": "../elsewhere/secret.safetensors"}}))
    done = _inspect(ckpt)
    assert done.returncode == 2 and done.stdout == "", done
    [line] = done.stderr.splitlines()
    assert "for key 'stolen' as '../elsewhere/secret.safetensors', which resolves to " in line, line
    assert f"{outside}, outside the checkpoint directory {ckpt}" in line, line


@pytest.mark.parametrize("link",
                         ["model-1.safetensors", "model.safetensors.index.json", ".metadata"])
def test_a_link_out_of_the_checkpoint_is_refused(tmp_path: Path, outside: Path, link: str) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    if link != "model-1.safetensors":
        _safetensors(ckpt / "model-1.safetensors")
    (ckpt / link).symlink_to(outside)
    done = _inspect(ckpt)
    assert done.returncode == 2 and done.stdout == "", done
    [line] = done.stderr.splitlines()
    assert (f"{ckpt / link}: resolves to {outside}, outside the checkpoint directory {ckpt}"
            in line), line


def test_a_link_inside_the_checkpoint_is_read(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    (ckpt / "shards").mkdir(parents=True)
    _safetensors(ckpt / "shards" / "real.safetensors")
    (ckpt / "model-1.safetensors").symlink_to("shards/real.safetensors")
    from conformance.inspection import read_checkpoint

    assert set(read_checkpoint(ckpt).entries) == {"w"}


def test_dcp_metadata_naming_a_data_file_outside_is_refused(tmp_path: Path, outside: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = tmp_path / "dcp"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(ckpt), no_dist=True)
    metadata = FileSystemReader(str(ckpt)).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = "../elsewhere/secret.safetensors"
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    done = _inspect(ckpt)
    assert done.returncode == 2, done
    [line] = done.stderr.splitlines()
    assert "for key 'w' as '../elsewhere/secret.safetensors', which resolves to " in line, line
    assert "outside the checkpoint directory" in line, line


# -- a full disk ---------------------------------------------------------------------------------
def test_a_full_disk_is_a_cell_error_naming_directory_space_and_rank(pytester: pytest.Pytester,
                                                                       tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        out, log = tmp_path / "out", tmp_path / "run.jsonl"
        env = {**os.environ, "TMPDIR": str(disk),
               "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
        code, text = _run(["--moe-ep-matrix=1,2", "--moe-ep-world-size=2", "--moe-ep-experts=4",
                           "-k",
                           "kind_unpacked and not optim and ep-only and not legacy and save_ep2",
                           f"--moe-ep-report={out}", f"--report-log={log}"], pytester.path, env)
        left = sorted(p.name for p in disk.iterdir())
    finally:
        if subprocess.run(["umount", str(disk)]).returncode:
            # still busy: detach it, never leave it
            subprocess.run(["umount", "-l", str(disk)], check=True)
    assert code == pytest.ExitCode.TESTS_FAILED, text
    doc = json.loads((out / JSON_NAME).read_text())
    # Both cells loading the ep=2 save ran: the first one's failure did not stop the matrix.
    assert [c["id"].rsplit("::", 1)[1] for c in doc["cells"]] == ["ep2->ep1", "ep2->ep2"], text
    for cell in doc["cells"]:
        assert cell["status"] == "stopped"
        first = cell["detail"].splitlines()[0]
        assert first.startswith("error: save failed: no space left on device (ENOSPC) writing "
                                f"{disk}/"), first
        assert " free of 256.0 KiB; failed on rank(s) " in first, first
    assert left == [], f"left on the full disk after the session: {left}"
    # A complete log rebuilds the report the run wrote.
    rebuilt = _rebuild(log, tmp_path / "rebuilt")
    assert (rebuilt["cells"] == doc["cells"] and rebuilt["incomplete"] is False
            and rebuilt["not_run"] == [])


# -- an xdist run's log ----------------------------------------------------------------------------
def test_the_log_of_a_complete_xdist_run_rebuilds_the_report_it_wrote(pytester: pytest.Pytester,
                                                                        tmp_path: Path) -> None:
    out, log = tmp_path / "out", tmp_path / "run.jsonl"
    code, text = _run(["-n", "1", "--moe-ep-matrix=1,2", "--moe-ep-world-size=2",
                       "--moe-ep-experts=4", "-k",
                       "kind_unpacked and not optim and ep-only and not legacy and save_ep2",
                       f"--moe-ep-report={out}", f"--report-log={log}"], pytester.path)
    assert code == 0, text
    doc = json.loads((out / JSON_NAME).read_text())
    assert len(doc["cells"]) == 2 and doc["not_run"] == [] and doc["interrupted"] is False
    rebuilt = _rebuild(log, tmp_path / "rebuilt")
    assert rebuilt["cells"] == doc["cells"]
    assert (rebuilt["incomplete"], rebuilt["interrupted"], rebuilt["not_run"]) == (False, False, [])
    assert ({k: v for k, v in rebuilt.items() if k not in ("created", "rebuilt_from",
                                                           "log_ends_early")}
            == {k: v for k, v in doc.items() if k not in ("created", "rebuilt_from")})


# -- a failed save's files, and the words for a lost permission ------------------------------------
def test_a_failed_save_is_removed_at_once_and_a_permission_error_is_named(tmp_path: Path) -> None:
    from test_saves import DirEngine, cell

    from conformance.adapters.reference import ReferenceAdapter
    from conformance.saves import Saves, disk_problem
    from pytest_moe_ep.world.engine import RankFailure
    from pytest_moe_ep.world.protocol import RankError

    saves = Saves(DirEngine(tmp_path), ReferenceAdapter())
    readers = [cell(1), cell(4)]
    saves.count_readers(readers)
    plan = saves.plan(readers[0])
    for path in (plan.path, plan.truth_path):
        (Path(path) / "shard").mkdir()
        (Path(path) / "shard" / "__0_0.distcp").write_bytes(b"half a shard")
    error = RankFailure(
        fn="run_cell", world_size=2, backend="gloo", cause="failed on rank(s) 1", at_fault=[1],
        errors={1: RankError(1, "CheckpointException", "rank 1: PermissionError: [Errno 13] "
                             f"Permission denied: '{plan.path}/shard/__0_0.distcp'", "")})
    first = disk_problem(error, plan)
    assert first is not None and first.startswith("save failed: permission denied (EACCES) writing "
                                                  f"{plan.path}: ")
    assert first.endswith("; failed on rank(s) 1") and " free of " in first
    assert disk_problem(RankFailure(fn="f", world_size=2, backend="gloo", cause="x", errors={
        0: RankError(0, "ValueError", "[Errno 2] not a disk problem", "")}), plan) is None
    saves.finished(readers[0], plan, None)  # the world call failed
    assert [list(Path(p).iterdir())
            for p in (plan.path, plan.truth_path)] == [[], []], "the partial save stayed"
    assert saves.plan(readers[1]).save, "the next reader must write the checkpoint again"


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read it: No such file or directory"),
    ("", "empty, not a pytest-reportlog log"),
    ("not json\n", "no JSON line in it; not a pytest-reportlog log"),
    ('{"$report_type": "SessionStart"}\n',
     "holds no moe-ep matrix cell (was the run --moe-ep-matrix or --moe-ep-functions?)"),
], ids=["missing", "empty", "not-json", "no-cells"])
def test_a_log_that_is_not_a_matrix_run_is_one_line_and_exit_2(tmp_path: Path, content: str | None,
                                                                 message: str) -> None:
    log = tmp_path / "run.jsonl"
    if content is not None:
        log.write_text(content)
    done = subprocess.run([sys.executable, "-m", "conformance.report", "--from-log", str(log),
                           "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert (done.returncode == 2
            and done.stderr.splitlines() == [f"error: {log}: {message}"]), done.stderr
    assert not (tmp_path / "out").exists()

"""Nothing of a run reachable from the network, nothing left behind, failures that say what
happened; and source that stays readable.

Real worlds throughout: the listening sockets of a live 4-rank world, a matrix cell that hangs, a
``kill -9`` of a pytest process, the processes of a finished run, folded tracebacks.  The source:
no line past 100 characters, no import cycle among the project's modules.
"""

from __future__ import annotations

import ast
import ipaddress
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Container, Iterator
from pathlib import Path
from xml.etree import ElementTree

import pytest

from pytest_moe_ep.world import RankFailure
from pytest_moe_ep.world.helpers import MP_SOCKET_SUFFIX, SUN_PATH_MAX
from pytest_moe_ep.world.supervisor import Supervisor
from pytest_moe_ep.world.workdir import OWNER, PREFIX, Identity, sweep

N = 4


# -- functions the ranks run ---------------------------------------------------------------------
def rank_pid() -> int:
    return os.getpid()


def same_error_everywhere() -> None:
    raise ValueError("the adapter's save cannot write here")


class Exploit:
    """Unpickling this writes a file: proof that a value read from a store was executed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, ...]]:
        return (open, (self.path, "w"))


def exchange_with_a_forged_value(marker: str) -> str:
    """Rank 1 puts a pickle in the launch's store where its name should be; rank 0 reads every
    rank's name."""
    import torch.distributed as dist

    from pytest_moe_ep.world.torchrun import TorchrunWorld

    world = TorchrunWorld("gloo", 30.0)
    if dist.get_rank() == 1:
        world.store.set("forged/1", pickle.dumps(Exploit(marker)))
    dist.barrier()
    if dist.get_rank() != 0:
        return "rank 1 forged"
    try:
        world._exchange("forged", "name", 5.0)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "read it"


# -- helpers -------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def gpus() -> int:
    """CUDA devices here.  Session-scoped so torch is imported before ``pytester`` snapshots
    sys.modules: a torch first imported inside a pytester test is dropped after it, and a second
    import crashes."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of /proc/net/tcp{,6}: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    flipped = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    found = ipaddress.ip_address(flipped)
    mapped = getattr(found, "ipv4_mapped", None)
    return mapped or found


def _listening() -> dict[int, str]:
    """Listening TCP sockets of this network namespace: inode -> "address:port"."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    hex_addr, port = fields[1].split(":")
                    found[int(fields[9])] = f"{_address(hex_addr)}:{int(port, 16)}"
    return found


def _alive(pid: int) -> bool:
    return Identity.of(pid) is not None


def _session_members(sid: int) -> list[str]:
    """Live processes of session ``sid`` (everything a ``start_new_session`` pytest started), with
    their names."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                text = f.read()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            found.append(f"{entry} {text[text.index('(') + 1:text.rindex(')')]}")
    return found


# -- 13.1: loopback only, no store values executed -------------------------------------------------
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_every_listening_socket_of_a_live_world_is_loopback(moe_ep_engine: Supervisor) -> None:
    ranks = moe_ep_engine.run(rank_pid, world_size=N, backend="gloo")
    processes = _descendants(os.getpid())
    assert set(ranks) <= set(processes)
    listening = _listening()
    mine = {pid: [listening[i] for i in _socket_inodes(pid) if i in listening] for pid in processes}
    assert any(mine[r] for r in ranks), f"no rank listens at all: the check sees nothing ({mine})"
    exposed = {pid: [a for a in addrs if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback]
               for pid, addrs in mine.items()}
    exposed = {pid: addrs for pid, addrs in exposed.items() if addrs}
    assert not exposed, (f"listening beyond loopback (pytest is {os.getpid()}, ranks {ranks}): "
                         f"{exposed}")


@pytest.mark.moe_ep_world(2)
def test_torchrun_exchange_never_executes_a_stored_value(tmp_path: Path) -> None:
    import torch.distributed as dist

    marker = tmp_path / "executed"
    outcome = exchange_with_a_forged_value(str(marker))
    dist.barrier()
    assert not marker.exists(), "a value read from the store was unpickled: it ran code"
    if dist.get_rank() == 0:
        assert "rank 1 published" in outcome and "not JSON" in outcome, outcome


# -- 13.7: leftovers after kill -9 -----------------------------------------------------------------
KILLED_MIDWAY = """
import os, time, pytest

@pytest.mark.moe_ep_world(2)
def test_writes_then_hangs(moe_ep_shared_dir):
    import torch.distributed as dist
    (moe_ep_shared_dir / f"shard{dist.get_rank()}").write_bytes(b"x" * 4096)
    with open(os.path.join(os.environ["PIDS_DIR"], f"rank{dist.get_rank()}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)
"""


def _tmp_leftovers(tmpdir: Path) -> list[str]:
    """The session's work directories, and multiprocessing's (``pymp-*``, the fork server's socket)
    in ``tmpdir``."""
    return sorted(p.name for p in tmpdir.iterdir() if p.name.startswith((PREFIX, "pymp-")))


def test_kill_9_of_pytest_leaves_no_work_directory(pytester: pytest.Pytester,
                                                   tmp_path: Path) -> None:
    pytester.makepyfile(KILLED_MIDWAY)
    tmpdir, pids_dir = tmp_path / "tmp", tmp_path / "pids"
    tmpdir.mkdir()
    pids_dir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(pytester.path)],
        cwd=pytester.path, env={**os.environ, "PIDS_DIR": str(pids_dir), "TMPDIR": str(tmpdir)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(pids_dir.iterdir())) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks never started"
            time.sleep(0.1)
        time.sleep(0.2)
        ranks = [int(p.read_text()) for p in pids_dir.iterdir()]
        assert len([n for n in _tmp_leftovers(tmpdir) if n.startswith(PREFIX)]) == 1, \
            "the session's work directory is not where this test looks"
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 20
        while (any(map(_alive, ranks)) or _tmp_leftovers(tmpdir)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [r for r in ranks if _alive(r)], "ranks outlived their killed pytest"
        assert _tmp_leftovers(tmpdir) == [], "checkpoint shards and rank logs stayed behind"
    finally:
        with_session = _session_members(proc.pid)
        for member in with_session:
            os.kill(int(member.split()[0]), signal.SIGKILL)


def test_sweep_removes_only_leftovers_whose_owner_is_provably_gone(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone_id = Identity.of(gone.pid)
    assert gone_id is not None
    gone.kill()
    gone.wait()
    live = Identity.of(os.getpid())
    assert live is not None
    reused = Identity(os.getpid(), live.start + 1, live.boot)  # this pid, but not this process
    dirs = {}
    for name, owner in (("dead", gone_id), ("live", live), ("reused", reused), ("other-boot", None),
                        ("bare", None)):
        path = tmp_path / f"{PREFIX}{name}"
        (path / "gen0").mkdir(parents=True)
        (path / "gen0" / "rank0.stdout").write_text("log")
        if owner is not None:
            owner.write(str(path / OWNER))
        dirs[name] = path
    (dirs["other-boot"]
     / OWNER).write_text(json.dumps({"pid": os.getpid(), "start": live.start, "boot": "x"}))
    (tmp_path / "unrelated").mkdir()
    # A rank that outlived its dead session (stuck where its lifeline could not run) is stopped
    # first.
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stuck_id = Identity.of(stuck.pid)
    assert stuck_id is not None
    stuck_id.write(str(dirs["dead"] / "gen0" / "rank0.pid"))
    live_rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    live_id = Identity.of(live_rank.pid)
    assert live_id is not None
    live_id.write(str(dirs["live"] / "gen0" / "rank0.pid"))
    removed = sweep(str(tmp_path))
    assert stuck.wait(10) == -signal.SIGKILL
    assert live_rank.poll() is None, "a rank of a live session was stopped"
    live_rank.kill()
    live_rank.wait()
    assert (sorted(Path(p).name for p in removed)
            == sorted(f"{PREFIX}{n}" for n in ("dead", "reused", "other-boot")))
    assert (sorted(p.name for p in tmp_path.iterdir())
            == sorted([f"{PREFIX}live", f"{PREFIX}bare", "unrelated"]))


# -- 13.8: nothing outlives pytest -----------------------------------------------------------------
ONE_WORLD = """
import pytest

@pytest.mark.moe_ep_world(2)
def test_passes():
    import torch.distributed as dist
    dist.barrier()
"""


def _session_to_its_end(pytester: pytest.Pytester,
                        env: dict[str, str] | None = None) -> tuple[int, str, list[str]]:
    """pytest on ``pytester.path`` in its own session: its exit code, its output, and the members of
    its session still alive the moment it exited (killed here, so none outlives the test)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(pytester.path)],
        cwd=pytester.path, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True)
    out = proc.communicate(timeout=300)[0].decode()
    left = _session_members(proc.pid)
    for member in left:
        os.kill(int(member.split()[0]), signal.SIGKILL)
    return proc.returncode, out, left


def test_no_process_of_the_run_outlives_pytest(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(ONE_WORLD)
    code, out, left = _session_to_its_end(pytester)
    assert code == 0, out
    assert not left, f"processes of the run alive after pytest exited: {left}"


RECORD_MP_TEMPDIR = """
import os
from multiprocessing import process

def pytest_unconfigure(config):
    with open(os.environ["MP_TEMPDIR_RECORD"], "w") as f:
        f.write(process.current_process()._config.get("tempdir") or "")
"""


def test_a_tmpdir_too_long_for_a_socket_still_starts_worlds(pytester: pytest.Pytester,
                                                            tmp_path: Path) -> None:
    """The fork server's AF_UNIX address lives under TMPDIR; a long one (a CI workspace, xdist's
    ``popen-gwN``) must not fail every world with ``AF_UNIX path too long``: multiprocessing gets a
    short directory, removed after."""
    pytester.makepyfile(ONE_WORLD)
    pytester.makeconftest(RECORD_MP_TEMPDIR)
    # + /pymp-X{8}/listener-X{8}: > 107
    long_tmp = tmp_path / ("t" * max(1, 100 - len(str(tmp_path))))
    long_tmp.mkdir()
    assert len(str(long_tmp)) >= 100
    record = tmp_path / "mp_tempdir"
    code, out, left = _session_to_its_end(pytester, {"TMPDIR": str(long_tmp),
                                                     "MP_TEMPDIR_RECORD": str(record)})
    assert code == 0, out
    assert not left, f"processes of the run alive after pytest exited: {left}"
    used = record.read_text()
    assert (used and not used.startswith(str(long_tmp))
            and len(used) + MP_SOCKET_SUFFIX <= SUN_PATH_MAX), used
    assert not os.path.exists(used), f"multiprocessing's short directory {used} was left behind"
    assert _tmp_leftovers(long_tmp) == []


# -- 13.9: one traceback per distinct error --------------------------------------------------------
def test_identical_tracebacks_of_other_ranks_are_folded(moe_ep_engine: Supervisor) -> None:
    with pytest.raises(RankFailure) as info:
        moe_ep_engine.run(same_error_everywhere, world_size=N, backend="gloo")
    err = info.value
    assert err.at_fault == [0, 1, 2, 3]
    assert ("ranks 0, 1, 2, 3 raised ValueError: the adapter's save cannot write here"
            in err.headline)
    titles = [title for title, _ in err.sections]
    assert [t for t in titles if t.endswith("traceback")] == ["rank 0 traceback"], titles
    assert "ranks 1, 2, 3: the same error at the same place as rank 0" in titles, titles
    report = err.report()
    assert report.count("in same_error_everywhere") == 1, report
    for r in (1, 2, 3):
        assert f"rank {r} raised ValueError: the adapter's save cannot write here" in report, report


# -- 13.2: a hang inside a matrix cell -------------------------------------------------------------
SLEEPY_SAVE = """
import time
import torch.distributed as dist
from conformance.adapters.reference import ReferenceAdapter

class SleepySave(ReferenceAdapter):
    name = "sleepy-save"

    def save(self, model, optimizer, path):
        if dist.get_rank() == 1:
            time.sleep(3600)
        super().save(model, optimizer, path)
"""


def test_a_hang_in_a_matrix_cell_is_reported_as_one(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(sleepy=SLEEPY_SAVE)
    out = pytester.path / "out"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--moe-ep-matrix=2", "--moe-ep-world-size=2",
        "--moe-ep-adapter=sleepy:SleepySave", "-o", "moe_ep_timeout=6", f"--moe-ep-report={out}",
        "-k", "kind_unpacked and not optim and ep-only and E4", f"--junitxml={out / 'junit.xml'}",
        timeout=300)
    text = result.stdout.str()
    result.assert_outcomes(failed=1)
    expected = ("hung: timed out in a collective waiting for a stuck rank; suspect rank 1 (rank 1 "
                "at ")
    assert expected in text and "in save); rank 0 waiting in a collective" in text, text
    doc = json.loads((out / "moe-ep-conformance.json").read_text())
    [cell] = doc["cells"]
    assert cell["status"] == "stopped"
    # where the ranks were (what they said: pytest_moe_ep.world.activity), then the engine's story:
    # the first save that hangs is the ep=1 truth's
    where = "the ep=1 truth's save() "
    assert (cell["detail"].startswith(f"error: {where}{expected}")
            and "sleepy.py:" in cell["detail"]), cell["detail"]
    assert cell["detail"].endswith("in save); rank 0 waiting in a collective"), cell["detail"]
    markdown = (out / "moe-ep-conformance.md").read_text()
    assert f"`{cell['id']}`: error: {where}{expected}" in markdown
    # 13.9: the backend that ran, "1 error", a legend for blank table cells, the junit property as
    # JSON.
    assert doc["backend"] == "gloo"
    assert "1 error," in markdown and "1 errors" not in markdown and "1 errors" not in text
    assert "A blank table cell is a (save, load) layout pair this run did not include" in text
    prop = ElementTree.parse(out / "junit.xml").find(".//property[@name='moe_ep_record']")
    assert prop is not None and json.loads(prop.get("value", ""))["status"] == "stopped"


# -- 13.3, 13.4, 13.5, 13.9: bad input is a usage error that names what was wrong, before any world
# --
@pytest.mark.parametrize(("args", "message"), [
    (("--moe-ep-matrix", "--moe-ep-report=/proc/forbidden"),
     "--moe-ep-report=/proc/forbidden: cannot write a report"),
    (("--moe-ep-backend=nccl",), "--moe-ep-backend=nccl: this machine has no CUDA GPU"),
    (("--moe-ep-functions=json",), "--moe-ep-functions=json: 'json' lacks 9 of the nine functions"),
    (("--moe-ep-matrix", "--moe-ep-world-size=abc"),
     "--moe-ep-world-size (ini moe_ep_world_size) must be an integer"),
    (("--moe-ep-timeout=soon",),
     "--moe-ep-timeout (ini moe_ep_timeout) must be a number >= 0.001, got 'soon'"),
], ids=["report-dir", "nccl", "functions", "world-size", "timeout"])
def test_bad_options_are_usage_errors_before_any_world(gpus: int, pytester: pytest.Pytester,
                                                        args: tuple[str, ...],
                                                       message: str) -> None:
    if args == ("--moe-ep-backend=nccl",) and gpus:
        pytest.skip("this machine has a GPU: nccl can run")
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    assert message in result.stderr.str(), result.stderr.str()
    assert "Traceback" not in result.stderr.str()


def test_torchrun_shared_dir_must_be_one_rank_0_makes(tmp_path: Path) -> None:
    from pytest_moe_ep.world.torchrun import _checked_shared_dir

    good = tmp_path / "moe-ep-shared-abc"
    good.mkdir(mode=0o700)
    assert _checked_shared_dir("t", str(good)) == good
    loose = tmp_path / "moe-ep-shared-loose"
    loose.mkdir()
    loose.chmod(0o755)
    link = tmp_path / "moe-ep-shared-link"
    link.symlink_to(good)
    for forged in (str(tmp_path), str(loose), str(link), "moe-ep-shared-relative", None, 7):
        with pytest.raises(RuntimeError,
                           match="is not a private moe-ep-shared-\\* directory of this user"):
            _checked_shared_dir("t", forged)


def test_shortened_failure_text_ends_on_a_word() -> None:
    from pytest_moe_ep.world.diagnosis import shorten

    text = " ".join(f"word{i}" for i in range(200))
    short = shorten(text, 100)
    assert len(short) <= 100 and short.endswith("...")
    assert short[:-3].split() == text.split()[:len(short[:-3].split())]


# -- the source itself -----------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
#: the packages whose modules import one another.
PACKAGES = ("conformance", "reference_impl", "pytest_moe_ep")


def _tracked_python() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "*.py"], cwd=ROOT, capture_output=True,
                                check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    return [ROOT / name for name in listed.split("\0") if name and (ROOT / name).exists()]


def test_no_tracked_python_line_is_over_100_characters() -> None:
    """Characters, not bytes; a line ending in a pragma (``# type: ignore``, ``# noqa``) counts too,
    though ruff's E501 lets it pass: the pragma goes on a line that still carries the error."""
    long = [f"{path.relative_to(ROOT)}:{number} ({len(line)})"
            for path in _tracked_python()
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > 100]
    assert not long, f"lines over 100 characters: {', '.join(long)}"


def _imported(node: ast.AST, modules: Container[str]) -> Iterator[str]:
    """Every module that importing ``node``'s module reads names from: imports at module level and
    in class bodies, not in functions (they run later) nor under ``if TYPE_CHECKING:`` (never).
    ``from package import module`` reads the module, not the package's ``__init__``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for other in child.orelse:
                yield from _imported(other, modules)
            continue
        if isinstance(child, ast.Import):
            yield from (alias.name for alias in child.names)
        elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
            for alias in child.names:
                name = f"{child.module}.{alias.name}"
                yield name if name in modules else child.module
        yield from _imported(child, modules)


def _import_graph() -> dict[str, set[str]]:
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def project_module(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    def imports(path: Path) -> set[str]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        return {project_module(name) for name in _imported(tree, modules)} - {""}

    return {module: imports(path) - {module} for module, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in order:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], order[other])
        if low[module] == order[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return found


def test_no_import_cycle_among_the_projects_modules() -> None:
    """A cycle makes a module's import order matter, and whichever half is imported first sees
    the other half-made."""
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)

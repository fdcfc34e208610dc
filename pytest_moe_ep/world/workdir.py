"""A session's private work directory, who owns it, and removing what a dead owner left behind.

Everything a local world writes -- rank logs and stack files, the rendezvous store, every cell's
checkpoints -- lives in one directory ``pytest-moe-ep-*`` in the temp directory, mode 0700.  Its
``owner`` file names the pytest process by pid, start time and boot, and each rank records itself
the same way (``gen*/rank*.pid``): a pid alone may have been reused, all three together prove the
process is gone.  After a ``kill -9`` of pytest, the session's reaper (:func:`start_reaper`, a small
process of its own that only waits for pytest to die) stops the ranks and removes the directory; the
ranks' own lifeline tries the same (:func:`abandon`), and whatever neither could remove, the next
session sweeps (:func:`sweep`).  The reaper is needed because the ranks cannot be relied on to do
it: when pytest dies its fork server dies too, and the kernel may kill the ranks before their
lifeline runs.  Nothing here imports torch, so the reaper runs this file alone, in a bare
interpreter.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

PREFIX = "pytest-moe-ep-"
OWNER = "owner"
#: created by the one rank that removes a dead session's directory.
ABANDONED = "abandoned"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Identity:
    """A process as it cannot be confused with a later one: pid, start time (clock ticks after
    boot), boot."""

    pid: int
    start: int
    boot: str

    @classmethod
    def of(cls, pid: int) -> Identity | None:
        """The identity of a running (not zombie) process; ``None`` when there is none, or no
        ``/proc``."""
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        if fields[0] in ("Z", "X"):
            return None
        return cls(pid, int(fields[19]), _boot_id())

    def alive(self) -> bool:
        return Identity.of(self.pid) == self

    def write(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(self), f)
        os.replace(tmp, path)  # readers see the whole record or none

    @classmethod
    def read(cls, path: str) -> Identity | None:
        try:
            with open(path) as f:
                found = json.load(f)
            return cls(int(found["pid"]), int(found["start"]), str(found["boot"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def record_self(path: str) -> None:
    """Write this process's identity to ``path`` (nothing without ``/proc``: then nobody can prove
    it gone)."""
    me = Identity.of(os.getpid())
    if me is not None:
        me.write(path)


def make_workdir(tmpdir: str | None = None) -> str:
    """A new private work directory owned by this process, after sweeping dead sessions'
    leftovers."""
    sweep(tmpdir)
    path = tempfile.mkdtemp(prefix=PREFIX, dir=tmpdir)  # mode 0700
    record_self(os.path.join(path, OWNER))
    return path


def rank_records(workdir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(workdir), "gen*", "rank*.pid")))


def stop_ranks(workdir: str) -> None:
    """SIGKILL every rank recorded in ``workdir`` that still runs, except this process."""
    for path in rank_records(workdir):
        found = Identity.read(path)
        if found is not None and found.pid != os.getpid() and found.alive():
            with contextlib.suppress(OSError):
                os.kill(found.pid, signal.SIGKILL)


def remove(workdir: str, attempts: int = 3) -> bool:
    """Stop the ranks recorded in ``workdir``, then remove it; ``True`` when it is gone."""
    stop_ranks(workdir)
    for _ in range(attempts):
        shutil.rmtree(workdir, ignore_errors=True)
        if not os.path.exists(workdir):
            return True
        time.sleep(0.05)  # a rank killed a moment ago may still have finished one last write
    return False


def abandon(workdir: str) -> None:
    """What a rank does when it finds its session's pytest gone: remove the session's directory.

    Only when the owner is provably gone, and by one rank alone: every rank notices at once, and
    two that stopped each other first would leave the directory to the next session's sweep.
    """
    owner = Identity.read(os.path.join(workdir, OWNER))
    if owner is None or owner.alive():
        return
    try:
        os.close(os.open(os.path.join(workdir, ABANDONED), os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                         0o600))
    except OSError:  # another rank is removing it, or it is gone
        return
    remove_session(workdir)


def sweep(tmpdir: str | None = None) -> list[str]:
    """Remove this user's session directories in ``tmpdir`` whose owner is provably gone; the
    removed paths.

    A directory without a readable owner record (another version's, or one being created this very
    moment) is left alone.
    """
    base = tmpdir or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            if (not entry.is_dir(follow_symlinks=False)
                or entry.stat(follow_symlinks=False).st_uid != os.getuid()):
                continue
        except OSError:
            continue
        owner = Identity.read(os.path.join(entry.path, OWNER))
        if owner is not None and not owner.alive() and remove(entry.path):
            removed.append(entry.path)
    return removed


def start_reaper(workdir: str) -> subprocess.Popen[bytes]:
    """A process that removes ``workdir`` (stopping its ranks first) once this process dies without
    doing so.

    The owner stops it (:func:`stop_reaper`) after removing the directory itself; if the owner is
    killed, the reaper outlives it by the moment ``remove`` takes, then exits.
    """
    return subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), "--reap",
                             str(os.getpid()), workdir], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)


def stop_reaper(reaper: subprocess.Popen[bytes] | None, timeout_s: float = 5.0) -> None:
    """Stop and reap the reaper (the owner removed the directory itself); killed if it does not
    exit."""
    if reaper is None or reaper.poll() is not None:
        return
    reaper.terminate()
    try:
        reaper.wait(timeout_s)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


def _wait_for_exit(pid: int) -> None:
    """Return once process ``pid`` is gone: a pidfd where the kernel has them, else polling its
    identity."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):
        owner = Identity.of(pid)
        while owner is not None and owner.alive():
            time.sleep(0.2)
        return
    select.select([fd], [], [])
    os.close(fd)


#: in the work directory: other temporary directories the session created (multiprocessing's
#: ``pymp-*``, which holds the fork server's socket), removed with it after a kill -9;
#: multiprocessing removes them at a normal exit.
LEFTOVERS = "leftovers"


def note_leftover(workdir: str, path: str) -> None:
    """Have the reaper remove ``path`` too if the owner dies without cleaning up."""
    with open(os.path.join(workdir, LEFTOVERS), "a") as f:
        f.write(path + "\n")


def _noted_leftovers(workdir: str) -> list[str]:
    """The noted paths that are still this user's ``pymp-*`` directories (nothing else is ever
    removed)."""
    try:
        with open(os.path.join(workdir, LEFTOVERS)) as f:
            paths = [line.strip() for line in f if line.strip()]
    except OSError:
        return []
    return [p for p in paths if os.path.basename(p).startswith("pymp-") and os.path.isdir(p)
            and not os.path.islink(p) and os.stat(p).st_uid == os.getuid()]


def _reap(owner_pid: int, workdir: str) -> None:
    # Ctrl-C reaches the whole foreground process group: it is the owner's to handle, and the
    # owner's shutdown then stops this process.  SIGTERM (the owner's stop_reaper) ends it at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _wait_for_exit(owner_pid)
    if os.path.isdir(workdir):
        remove_session(workdir)


def remove_session(workdir: str) -> None:
    """What is left of a dead owner's session: the work directory (ranks stopped first) and the
    noted leftovers."""
    extra = _noted_leftovers(workdir)
    remove(workdir)
    for path in extra:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__" and sys.argv[1:2] == ["--reap"]:
    _reap(int(sys.argv[2]), sys.argv[3])

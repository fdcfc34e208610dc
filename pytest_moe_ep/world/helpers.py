"""multiprocessing's own helper processes and directory, as the supervisor needs them handled.

The fork server and the resource tracker are multiprocessing's, started once per process and left
by it to exit on their own after pytest; the supervisor stops and reaps the ones it started
(:func:`stop_helper`), so nothing outlives the session.  The fork server's socket lives in
multiprocessing's temporary directory, which a long ``TMPDIR`` makes unusable
(:func:`short_mp_tempdir`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from typing import Any

__all__ = ["HELPER_EXIT_S", "MP_SOCKET_SUFFIX", "SUN_PATH_MAX", "short_mp_tempdir", "stop_helper"]

#: how long shutdown waits for the fork server and resource tracker to exit before killing them.
HELPER_EXIT_S = 10.0
#: how long the fork server may take to notice its pipe closed before it is sent SIGTERM.  It holds
#: no state (its socket is unlinked here), but exiting normally finalizes the torch it preloaded:
#: about 1.5 s.
FORKSERVER_EXIT_S = 0.05
#: the longest path an AF_UNIX socket address may have on Linux (``sun_path`` is 108 bytes with its
#: NUL).
SUN_PATH_MAX = 107
#: what multiprocessing adds to its temporary base for the fork server's socket:
#: ``/pymp-XXXXXXXX/listener-XXXXXXXX`` is 32 characters; a margin for other Python versions' names.
MP_SOCKET_SUFFIX = 40
#: shorter bases for multiprocessing's directory when ``TMPDIR`` is too long for a socket under it.
SHORT_TEMP_BASES = ("/tmp", "/var/tmp", "/dev/shm")


def short_mp_tempdir() -> str | None:
    """Give multiprocessing a temporary directory short enough for the fork server's socket, when
    ``TMPDIR`` is not.

    The fork server listens on an AF_UNIX socket in multiprocessing's ``pymp-*`` directory under
    :func:`tempfile.gettempdir`; under a long ``TMPDIR`` (a CI workspace, pytest-xdist's
    ``popen-gwN`` basetemp) its address passes Linux's 107 characters and every world fails to start
    with ``OSError: AF_UNIX path too long``.  CPython falls back to a short system directory by
    itself since gh-132124 (3.13); this does the same on older ones, before multiprocessing makes
    its own.  Returns the directory made, or ``None`` when ``TMPDIR`` is short enough (or no short
    base is writable: the start's error then names the path).
    """
    from multiprocessing import process, util

    if len(tempfile.gettempdir()) + MP_SOCKET_SUFFIX <= SUN_PATH_MAX:
        return None
    for base in SHORT_TEMP_BASES:
        if len(base) + MP_SOCKET_SUFFIX <= SUN_PATH_MAX and os.access(base, os.W_OK | os.X_OK):
            made = tempfile.mkdtemp(prefix="pymp-", dir=base)
            util.Finalize(None, util._remove_temp_dir,  # type: ignore[attr-defined]
                          args=(shutil.rmtree, made),
                          exitpriority=-100)  # as multiprocessing removes its own at exit
            process.current_process()._config["tempdir"] = made  # type: ignore[attr-defined]
            return made
    return None


def stop_helper(owner: Any, fd_attr: str, pid_attr: str,
                timeout_s: float = HELPER_EXIT_S) -> None:
    """Stop multiprocessing's fork server or resource tracker and reap it, killing it after
    ``timeout_s``.

    Both exit once every holder closed their "alive" pipe (the ranks held it too, so they go first);
    multiprocessing would leave them to exit on their own after pytest.  Resetting the attributes
    lets multiprocessing start them again if something in this process needs them later.
    """
    with owner._lock:
        fd, pid = getattr(owner, fd_attr, None), getattr(owner, pid_attr, None)
        if fd is None or pid is None:
            return
        with contextlib.suppress(OSError):
            os.close(fd)
        setattr(owner, fd_attr, None)
        setattr(owner, pid_attr, None)
        address = getattr(owner, "_forkserver_address", None)
        if address and not str(address).startswith("\0"):
            with contextlib.suppress(OSError):
                os.unlink(address)
        if hasattr(owner, "_forkserver_address"):
            owner._forkserver_address = None
        deadline = time.monotonic() + timeout_s
        term_at = time.monotonic() + FORKSERVER_EXIT_S if address is not None else None
        try:
            while os.waitpid(pid, os.WNOHANG)[0] == 0:
                if term_at is not None and time.monotonic() > term_at:
                    os.kill(pid, signal.SIGTERM)
                    term_at = None
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.01)
        except ChildProcessError:  # already reaped
            pass

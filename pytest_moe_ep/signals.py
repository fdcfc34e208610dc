"""SIGTERM stops a session the way Ctrl-C does, so a cancelled CI job still gets its reports.

A CI timeout or cancel sends SIGTERM, whose default action ends pytest on the spot: no
``pytest_sessionfinish``, so no JUnit XML, no conformance report, no summary, and the world engine's
processes and work directory are left to the next session's sweep.  :class:`TermAsInterrupt` turns
the first SIGTERM into a :class:`Terminated` (a ``KeyboardInterrupt``): the running test ends, the
world is shut down as on Ctrl-C, every report is written with what finished, and pytest exits with
its status for an interrupted session (2).  A SIGTERM while the session is already finishing is
only counted (the reports are being written); a second SIGTERM always stops the process at once.

A first SIGTERM that arrives while a test's report is made and logged (:meth:`TermAsInterrupt.hold`
to :meth:`~TermAsInterrupt.release`) takes effect once every logger has that report, so a
``pytest-reportlog`` log and the conformance report agree on which tests started and finished.

Installed only in the main thread of a process that is not a torchrun rank (torchrun's own SIGTERM
handling owns those, see :mod:`pytest_moe_ep.world.torchrun`).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

import pytest


class Terminated(KeyboardInterrupt):
    """The session received SIGTERM; pytest handles it as it handles Ctrl-C."""


class TermAsInterrupt:
    """The SIGTERM handler of one pytest session: install in ``pytest_configure`` (and register as a
    plugin, for the report hooks that hold a SIGTERM), remove in unconfigure."""

    NAME = "moe-ep-sigterm"

    def __init__(self) -> None:
        self.received = 0
        self.finishing = False
        self.holding = False
        self.pending = False
        self.previous: Any = None
        self.installed = False

    def install(self) -> bool:
        """Installed, or not: signal handlers belong to the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self.previous = signal.signal(signal.SIGTERM, self._handle)
        self.installed = True
        return True

    def uninstall(self) -> None:
        if self.installed and signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM,
                          self.previous if self.previous is not None else signal.SIG_DFL)
        self.installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1
        if self.received > 1:  # the second signal: stop now, as SIGTERM's default action would
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.finishing:
            return
        if self.holding:
            self.pending = True
            return
        self._raise()

    def hold(self) -> None:
        """A report is being made and logged: a first SIGTERM waits for :meth:`release`."""
        self.holding = True

    def release(self) -> None:
        """Every logger has the report: a SIGTERM that waited stops the session now."""
        self.holding = False
        if self.pending and not self.finishing:
            self.pending = False
            self._raise()

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self) -> Any:
        self.hold()
        try:
            return (yield)
        except BaseException:  # no report to log: nothing waits for one
            self.release()
            raise

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_logreport(self) -> Any:
        try:
            return (yield)
        finally:
            self.release()

    # A report made without being logged (a plugin's own ``call_and_report(log=False)``) must not
    # hold a SIGTERM through the next test's run: each phase begins by letting a held one through.
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self) -> None:
        self.release()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self) -> None:
        self.release()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self) -> None:
        self.release()

    def _raise(self) -> None:
        raise Terminated("SIGTERM received: stopping like Ctrl-C (reports are written with the "
                         "finished tests); a second SIGTERM stops at once")

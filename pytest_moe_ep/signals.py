"""SIGTERM stops a session the way Ctrl-C does, so a cancelled CI job still gets its reports.

A CI timeout or cancel sends SIGTERM, whose default action ends pytest on the spot: no
``pytest_sessionfinish``, so no JUnit XML, no conformance report, no summary, and the world engine's
processes and work directory are left to the next session's sweep.  :class:`TermAsInterrupt` turns
the first SIGTERM into a :class:`Terminated` (a ``KeyboardInterrupt``): the running test ends, the
world is shut down as on Ctrl-C, every report is written with what finished, and pytest exits with
its status for an interrupted session (2).  A SIGTERM while the session is already finishing is
only counted (the reports are being written); a second SIGTERM always stops the process at once.

Installed only in the main thread of a process that is not a torchrun rank (torchrun's own SIGTERM
handling owns those, see :mod:`pytest_moe_ep.world.torchrun`).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any


class Terminated(KeyboardInterrupt):
    """The session received SIGTERM; pytest handles it as it handles Ctrl-C."""


class TermAsInterrupt:
    """The SIGTERM handler of one pytest session: install in ``pytest_configure``, remove in unconfigure."""

    def __init__(self) -> None:
        self.received = 0
        self.finishing = False
        self.previous: Any = None
        self.installed = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self.previous = signal.signal(signal.SIGTERM, self._handle)
        self.installed = True

    def uninstall(self) -> None:
        if self.installed and signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, self.previous if self.previous is not None else signal.SIG_DFL)
        self.installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1
        if self.received > 1:  # the second signal: stop now, as SIGTERM's default action would
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.finishing:
            return
        raise Terminated("SIGTERM received: stopping like Ctrl-C (reports are written with the finished "
                         "tests); a second SIGTERM stops at once")

"""The in-process world: pytest itself runs on every rank under ``torchrun``.

This is the multi-node path (``torchrun --nnodes 2 --nproc-per-node 8 -m pytest ...``).  Every
rank runs the same session; a distributed test runs in-process on every rank.  Ranks exchange
what they need through the default process group's *store*, never through collectives, so a test
that fails on one rank can never pair its collectives with another test's:

- before each call, all ranks check they run the same call (sequence number and name);
- after it, every rank publishes its outcome and reads everyone's, so all ranks report the same
  pass/fail naming the ranks at fault;
- at session end, ranks all-agree on the worst exit status behind a bounded barrier.

Everything read from the store is JSON (:mod:`.wire`), never unpickled: the launch's store has no
authentication, and whoever can reach it may forge an outcome but cannot run code on a rank.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import stat
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypedDict, cast

from pytest_moe_ep.world.backend import BackendUnavailable, resolve_backend
from pytest_moe_ep.world.engine import (
    CallResult,
    OutOfStep,
    RankFailure,
    RankOutput,
    Section,
    WorldTimeout,
    collective_timeout_s,
)
from pytest_moe_ep.world.protocol import FunctionRef, RankError, error_fields, function_ref
from pytest_moe_ep.world.wire import dumps, loads

PREFIX = "pytest-moe-ep/"


class _CallFields(TypedDict):
    """The :class:`~pytest_moe_ep.world.engine.WorldError` fields every failure of one call
    shares."""

    fn: str
    world_size: int
    backend: str
    outputs: list[RankOutput]


class TorchrunWorld:
    """The engine when pytest runs under torchrun; implements
    :class:`~pytest_moe_ep.world.engine.Engine`."""

    def __init__(self, backend: str, timeout_s: float) -> None:
        import torch.distributed as dist

        self.timeout_s = timeout_s
        if not dist.is_initialized():
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
            local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
            concrete = resolve_backend(backend, local) if backend != "nccl" else "nccl"
            if concrete == "nccl":
                import torch

                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(concrete,
                                    timeout=timedelta(seconds=collective_timeout_s(timeout_s)))
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.backend = dist.get_backend()
        self.store = dist.PrefixStore(PREFIX, dist.distributed_c10d._get_default_store())
        self.seq = itertools.count(1)
        #: directories this rank made for :meth:`shared_dir`, removed at :meth:`shutdown`.
        self.made: list[str] = []

    def describe(self) -> str:
        return f"inside torchrun: rank {self.rank} of {self.world_size} ({self.backend})"

    # -- store exchange -------------------------------------------------------------------------
    def _exchange(self, key: str, value: Any, timeout_s: float) -> tuple[dict[int, Any], list[int]]:
        """Publish ``value`` under ``key`` and read every rank's; ranks missing at the deadline too.

        ``ValueError`` when a rank's entry is not what :func:`~.wire.dumps` writes.
        """
        # The stub types the value as str; the binding takes bytes, which dumps returns.
        self.store.set(f"{key}/{self.rank}", cast(str, dumps(value)))
        keys = [f"{key}/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + timeout_s
        while True:
            present = [self.store.check([k]) for k in keys]
            if all(present) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        found = {}
        for r, (k, ok) in enumerate(zip(keys, present, strict=True)):
            if ok:
                try:
                    found[r] = loads(self.store.get(k))
                except ValueError as exc:
                    raise ValueError(f"rank {r} published a value under {PREFIX}{k} that is {exc}; "
                                     "is something else writing to this launch's store?") from None
        return found, [r for r, ok in enumerate(present) if not ok]

    # -- the engine contract --------------------------------------------------------------------
    def call(self, fn: FunctionRef, args: Any = (), kwargs: dict[str, Any] | None = None, *,
             world_size: int, backend: str = "auto", timeout: float | None = None) -> CallResult:
        if world_size != self.world_size:
            raise BackendUnavailable(f"needs a {world_size}-rank world; this torchrun launch has "
                                     f"{self.world_size} ranks")
        if backend not in ("auto", self.backend):
            raise BackendUnavailable(f"needs {backend}; this torchrun launch runs {self.backend}")
        timeout_s = timeout or self.timeout_s
        seq = next(self.seq)
        names, missing = self._exchange(f"call{seq}/name", str(fn), timeout_s)
        world = _CallFields(fn=str(fn), world_size=self.world_size,
                            backend=f"torchrun {self.backend}", outputs=self._no_output())
        if missing:
            raise WorldTimeout(cause=f"hung: rank(s) {', '.join(map(str, missing))} never reached "
                               f"call {seq}", at_fault=missing, waiting=sorted(names), **world)
        if len(set(names.values())) != 1:
            listing = "\n".join(f"rank {r}: {n}" for r, n in sorted(names.items()))
            raise OutOfStep(cause=f"ranks are out of step at call {seq}", at_fault=sorted(names),
                            sections=[Section("calls", listing, tuple(sorted(names)))], **world)
        try:
            value, error = fn.resolve()(*args, **(kwargs or {})), None
            dumps(value)
        except Exception as exc:
            value, error = None, RankError(self.rank, type(exc).__qualname__, str(exc),
                                           traceback.format_exc(), error_fields(exc))
        try:
            outcomes, missing = self._exchange(f"call{seq}/outcome", (value, error), timeout_s)
        except ValueError as exc:
            raise RankFailure(cause=f"failed: {exc}", **world) from None
        errors = {r: e for r, (_, e) in outcomes.items() if e is not None}
        sections = [Section(f"rank {r} traceback", e.traceback, (r,))
                    for r, e in sorted(errors.items())]
        if missing:
            raise WorldTimeout(cause=f"hung: passed its {timeout_s:g}s deadline; suspect rank(s) "
                               f"{', '.join(map(str, missing))} (no outcome reported)",
                               at_fault=missing, errors=errors, sections=sections, **world)
        if errors:
            heads = "; ".join(e.headline() for _, e in sorted(errors.items()))
            raise RankFailure(cause=f"failed on rank(s) {', '.join(map(str, sorted(errors)))}: "
                              f"{heads}",
                              at_fault=sorted(errors), errors=errors, sections=sections, **world)
        return CallResult([outcomes[r][0] for r in range(self.world_size)], self._no_output())

    def run(self, fn: Callable[..., Any], *args: Any, world_size: int, backend: str = "auto",
            timeout: float | None = None, **kwargs: Any) -> list[Any]:
        return self.call(function_ref(fn), args, kwargs, world_size=world_size, backend=backend,
                         timeout=timeout).values

    def add_preload(self, modules: Sequence[str]) -> None:
        """Nothing to preload: every rank is this very process."""

    def _no_output(self) -> list[RankOutput]:
        return [RankOutput() for _ in range(self.world_size)]  # each rank's pytest shows its own

    def shared_dir(self, nodeid: str) -> Path:
        """A directory made by rank 0 whose path every rank reads (needs a shared filesystem across
        nodes)."""
        seq = next(self.seq)
        made = tempfile.mkdtemp(prefix="moe-ep-shared-") if self.rank == 0 else None
        if made:
            self.made.append(made)
        paths, _ = self._exchange(f"dir{seq}", made, self.timeout_s)
        if 0 not in paths:
            raise RuntimeError(f"{nodeid}: rank 0 did not share a directory within "
                               f"{self.timeout_s:g}s")
        return _checked_shared_dir(nodeid, paths[0])

    def agree_on_exit(self, status: int) -> int:
        """Every rank ends with the worst status of all; a bounded barrier, never a hang.

        From here on this rank ignores SIGTERM: torchrun stops the ranks still running as soon as
        one exits non-zero, and a rank that agreed on a failing status and is only writing its
        summary must end with that status, not as a rank killed by SIGTERM.  torchrun escalates to
        SIGKILL after its close timeout (30 s), so this cannot keep a rank alive.
        """
        with contextlib.suppress(ValueError):  # not the main thread: nothing to protect
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            statuses, missing = self._exchange("exit", status, min(self.timeout_s, 120.0))
        except ValueError:
            return max(status, 1)
        worst = max([status, *statuses.values()])
        return max(worst, 1) if missing else worst

    def shutdown(self) -> None:
        """Remove the shared directories this rank made; the process group is the launcher's
        business.

        Called after :meth:`agree_on_exit`, whose barrier every rank passed once done with them.
        """
        for path in self.made:
            shutil.rmtree(path, ignore_errors=True)
        self.made.clear()


def _checked_shared_dir(nodeid: str, given: Any) -> Path:
    """The path rank 0 published, if it is what rank 0 makes: one of this user's private
    ``moe-ep-shared-*`` directories.  Whoever can write to the launch's store must not choose where
    checkpoints are written."""
    path = Path(given) if isinstance(given, str) else None
    try:
        info = os.lstat(path) if path is not None and path.is_absolute() else None
    except OSError:
        info = None
    if (path is None or info is None or not path.name.startswith("moe-ep-shared-")
        or not stat.S_ISDIR(info.st_mode)
            or info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077):
        raise RuntimeError(f"{nodeid}: rank 0 shared {given!r}, which is not a private "
                           "moe-ep-shared-* directory of this user (a shared filesystem across "
                           "nodes is needed; is something else writing to this launch's store?)")
    return path

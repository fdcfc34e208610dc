"""The controller side of the world engine: start, reuse, supervise and kill worlds of ranks.

A *world* is N rank processes joined in one default process group.  Worlds are keyed by
``(world_size, backend)``, started lazily and kept for the whole session, so a matrix of hundreds
of calls pays start-up once.  Ranks are forked from a ``forkserver`` that preloaded torch (it
never touches CUDA), so only the first world costs a torch import.  Rendezvous goes through a
``FileStore`` in the session's private work directory (mode 0700), one file per world generation,
and the ranks' gloo (or NCCL) sockets are bound to loopback: a local world opens no port reachable
from the network, and parallel pytest processes cannot collide.

A call that fails -- an exception, a dead rank, a deadline -- kills its world and the next call
gets a fresh one, unless every rank raised in step (:mod:`.health`): a call never inherits a world
not known to be sound.  :meth:`Supervisor.shutdown` returns only once every process the session
started -- ranks, fork server, resource tracker -- is gone, and its work directory with them (see
:mod:`.workdir` for what happens after a ``kill -9``).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from pytest_moe_ep.world import activity
from pytest_moe_ep.world.backend import GpuLease, lease_gpus, resolve_backend
from pytest_moe_ep.world.diagnosis import Observed, describe_exit, diagnose, main_thread_stack
from pytest_moe_ep.world.engine import CallResult, RankOutput, Section, WorldError, WorldStartError
from pytest_moe_ep.world.health import PROBE_TIMEOUT_S, why_replaced
from pytest_moe_ep.world.helpers import short_mp_tempdir, stop_helper
from pytest_moe_ep.world.protocol import Call, FunctionRef, Ready, Result, Stop, function_ref
from pytest_moe_ep.world.rank import STACK_SIGNAL, RankSpec, rank_main
from pytest_moe_ep.world.workdir import (
    make_workdir,
    note_leftover,
    remove,
    start_reaper,
    stop_reaper,
)

#: modules the forkserver imports once, so every rank starts with them loaded.  Only what every
#: world needs: a caller that needs more says so (``add_preload``, ini ``moe_ep_preload``), as the
#: conformance matrix does with :data:`~pytest_moe_ep.world.engine.CHECKPOINT_PRELOAD` (DCP and
#: FSDP2, whose first use imports ``torch._dynamo``: 1-2 s in every rank).
PRELOAD = (
    "torch",
    "torch.distributed",
    "pytest",
    "pytest_moe_ep.world.rank",
    "pytest_moe_ep.world.meshes",
)
START_TIMEOUT_S = 180.0
#: a local world is one host: every socket of its process group stays on the loopback interface.
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
#: how long the other ranks may still report once one rank failed, before they are stopped.
FAILURE_GRACE_S = 2.0


class _Files:
    """Byte offsets into a rank's output and stack files, to read what one call wrote."""

    def __init__(self, paths: Sequence[str | None]) -> None:
        self.paths = paths
        self.offsets = [self._size(p) for p in paths]

    @staticmethod
    def _size(path: str | None) -> int:
        try:
            return os.path.getsize(path) if path else 0
        except OSError:
            return 0

    def read(self, i: int) -> str:
        path = self.paths[i]
        if not path:
            return ""
        try:
            with open(path, "rb") as f:
                f.seek(self.offsets[i])
                return f.read().decode(errors="replace")
        except OSError:
            return ""


@dataclass
class World:
    """One live world: its processes, their pipes, and the files they write."""

    world_size: int
    backend: str
    generation: int
    processes: list[Any] = field(default_factory=list)
    conns: list[Any] = field(default_factory=list)
    specs: list[RankSpec] = field(default_factory=list)
    lease: GpuLease | None = None
    started_s: float = 0.0
    calls: int = 0
    #: failed calls after which the world was kept (:meth:`Supervisor._sound_after`).
    kept: int = 0

    @property
    def alive(self) -> bool:
        return bool(self.processes) and all(p.is_alive() for p in self.processes)

    def kill(self, grace_s: float = 1.0) -> None:
        """Terminate, wait ``grace_s``, kill, and join with a bound.  Never hangs."""
        for p in self.processes:
            if p.is_alive():
                with contextlib.suppress(Exception):
                    p.terminate()
        deadline = time.monotonic() + grace_s
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                with contextlib.suppress(Exception):
                    p.kill()
                p.join(2.0)
        for c in self.conns:
            with contextlib.suppress(Exception):
                c.close()
        if self.lease:
            self.lease.release()
        self.processes, self.conns = [], []

    def stop(self, grace_s: float = 2.0) -> None:
        """Ask the ranks to exit, then make sure they did."""
        for c in self.conns:
            with contextlib.suppress(Exception):
                c.send(Stop())
        deadline = time.monotonic() + grace_s
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill(grace_s=0.5)


class Supervisor:
    """Owns this process's worlds.  Cheap to create: torch is imported at the first world.

    Implements :class:`~pytest_moe_ep.world.engine.Engine`.
    """

    #: the controller is the only process of its launch: it writes the reports.
    rank = 0

    def __init__(self, *, start_method: str = "forkserver", capture: bool = True,
                 pg_timeout_s: float = 270.0, default_timeout_s: float = 300.0,
                 preload: Sequence[str] = (), workdir: str | None = None) -> None:
        self.start_method = start_method
        self.capture = capture
        self.pg_timeout_s = pg_timeout_s
        self.default_timeout_s = default_timeout_s
        self.preload = tuple(PRELOAD) + tuple(preload)
        self._workdir = workdir
        #: removes the work directory if this process is killed before :meth:`shutdown` (see
        #: ``workdir.py``).
        self._reaper: Any = None
        self._mp_tempdir: str | None = None
        self._ctx: Any = None
        #: multiprocessing's fork server and resource tracker, when this supervisor started them.
        self._helpers: list[tuple[Any, str, str]] = []
        self.worlds: dict[tuple[int, str], World] = {}
        self.generations = itertools.count()
        self.call_ids = itertools.count(1)
        self.starts = 0
        atexit.register(self.shutdown)

    # -- plumbing -------------------------------------------------------------------------------
    @property
    def workdir(self) -> str:
        if self._workdir is None:
            self._workdir = make_workdir()
            self._reaper = start_reaper(self._workdir)
        return self._workdir

    def _context(self) -> Any:
        if self._ctx is None:
            import multiprocessing as mp
            from multiprocessing import forkserver, resource_tracker

            helpers: list[tuple[Any, str, str]] = [(resource_tracker._resource_tracker, "_fd",
                                                    "_pid")]
            if self.start_method == "forkserver" and "forkserver" in mp.get_all_start_methods():
                self._ctx = mp.get_context("forkserver")
                self._ctx.set_forkserver_preload(list(self.preload))
                helpers.append((forkserver._forkserver, "_forkserver_alive_fd", "_forkserver_pid"))
            else:
                self._ctx = mp.get_context("spawn")
            # Ours to stop at shutdown only if not running yet: another user of multiprocessing may
            # need them.
            self._helpers = [h for h in reversed(helpers) if getattr(h[0], h[2], 0) is None]
            self._mp_tempdir = _mp_tempdir()
            if self._mp_tempdir is None and self.start_method == "forkserver":
                # noted for the reaper with the fork server's own, after the first start
                short_mp_tempdir()
        return self._ctx

    def add_preload(self, modules: Sequence[str]) -> None:
        """More modules for the fork server to import; only effective before the first world
        starts."""
        if self._ctx is None:
            self.preload += tuple(m for m in modules if m not in self.preload)

    # -- worlds ---------------------------------------------------------------------------------
    def world(self, world_size: int, backend: str = "auto") -> World:
        """The live world for ``(world_size, backend)``, started if there is none."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        concrete = resolve_backend(backend, world_size)
        key = (world_size, concrete)
        found = self.worlds.get(key)
        if found is not None and found.alive:
            return found
        if found is not None:
            found.kill()
        self.worlds[key] = world = self._start(world_size, concrete)
        return world

    def _start(self, world_size: int, backend: str) -> World:
        t0 = time.perf_counter()
        ctx = self._context()
        gen = next(self.generations)
        world = World(world_size, backend, gen)
        if backend == "nccl":
            world.lease = lease_gpus(world_size)
        base = os.path.join(self.workdir, f"gen{gen}")
        os.makedirs(base, exist_ok=True)
        for rank in range(world_size):
            env = dict(LOOPBACK_ENV)
            if world.lease:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, world.lease.devices))
            spec = RankSpec(
                rank=rank, world_size=world_size, backend=backend,
                store_path=os.path.join(base, "store"), workdir=self.workdir,
                record_path=os.path.join(base, f"rank{rank}.pid"), supervisor_pid=os.getpid(),
                stack_path=os.path.join(base, f"rank{rank}.stacks"), pg_timeout_s=self.pg_timeout_s,
                stdout_path=os.path.join(base, f"rank{rank}.stdout") if self.capture else None,
                stderr_path=os.path.join(base, f"rank{rank}.stderr") if self.capture else None,
                cuda_device=rank if backend == "nccl" else None, env=env,
                activity_path=os.path.join(base, f"rank{rank}.activity"),
            )
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=rank_main, args=(spec, child), name=f"moe-ep-rank{rank}")
            proc.start()
            child.close()
            world.processes.append(proc)
            world.conns.append(parent)
            world.specs.append(spec)
        created = _mp_tempdir()
        # our fork server made it: the reaper removes it after a kill -9
        if created and created != self._mp_tempdir:
            note_leftover(self.workdir, created)
            self._mp_tempdir = created
        self._await_ready(world)
        world.started_s = time.perf_counter() - t0
        self.starts += 1
        return world

    def _await_ready(self, world: World) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = set(range(world.world_size))
        problems: list[Section] = []
        while pending and not problems:
            ready = wait([world.conns[r] for r in pending]
                         + [world.processes[r].sentinel for r in pending],
                         timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                problems.append(Section("start-up", f"ranks {sorted(pending)} not ready after "
                                        f"{START_TIMEOUT_S:.0f}s"))
            for r in list(pending):
                if world.conns[r] in ready or world.conns[r].poll():
                    try:
                        msg = world.conns[r].recv()
                    except (EOFError, OSError):
                        msg = None
                    if isinstance(msg, Ready):
                        pending.discard(r)
                        continue
                    if isinstance(msg, Result) and msg.error:
                        problems.append(Section(f"rank {r} traceback", msg.error.traceback, (r,)))
                        continue
                if world.processes[r].sentinel in ready:
                    world.processes[r].join(1.0)
                    problems.append(Section(f"rank {r}", describe_exit(world.processes[r].exitcode),
                                            (r,)))
        if problems:
            outputs = []
            for spec in world.specs:
                files = _Files([spec.stdout_path, spec.stderr_path])
                files.offsets = [0, 0]
                outputs.append(RankOutput(files.read(0), files.read(1)))
            world.kill()
            at_fault = sorted({r for problem in problems for r in problem.ranks})
            first = problems[0]
            raise WorldStartError(fn="start-up", world_size=world.world_size, backend=world.backend,
                                  cause=f"failed to start: {first.title}: "
                                  f"{first.body.strip().splitlines()[-1]}",
                                  at_fault=at_fault, sections=problems, outputs=outputs)

    # -- calls ----------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, world_size: int, backend: str = "auto",
            timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; the per-rank return values in rank order."""
        return self.call(function_ref(fn), args, kwargs, world_size=world_size, backend=backend,
                         timeout=timeout).values

    def call(self, fn: FunctionRef, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
             *, world_size: int, backend: str = "auto", timeout: float | None = None) -> CallResult:
        """Like :meth:`run` with a ready :class:`FunctionRef`; also returns each rank's output."""
        import pickle

        kwargs = dict(kwargs or {})
        try:  # refuse arguments that cannot travel before any process is involved
            pickle.dumps((tuple(args), kwargs))
        except Exception as exc:
            raise TypeError(f"the arguments of {fn} cannot be sent to ranks: {exc}") from exc
        world = self.world(world_size, backend)
        call = Call(next(self.call_ids), fn, tuple(args), kwargs, tuple(sys.path))
        timeout_s = self.default_timeout_s if timeout is None or timeout <= 0 else float(timeout)
        try:
            return self._call(world, call, timeout_s)
        except BaseException as exc:
            why = self._unsound_after(world, exc)
            if isinstance(exc, WorldError):
                exc.kept, exc.replaced_because = not why, why
            if why:
                world.kill()
            raise

    def _unsound_after(self, world: World, exc: BaseException) -> str:
        """Why ``world`` may not serve the next call after its call raised ``exc`` ("" when it
        may: :func:`.health.why_replaced`)."""
        def probe(fn: Callable[[], Any], agree: bool) -> list[Any]:
            call = Call(next(self.call_ids), function_ref(fn), (), {}, tuple(sys.path), agree)
            return self._call(world, call, PROBE_TIMEOUT_S).values

        why = why_replaced(exc, world.world_size, world.backend, world.alive, probe)
        world.kept += not why
        return why

    def _call(self, world: World, call: Call, timeout_s: float) -> CallResult:
        n = world.world_size
        files = [_Files([s.stdout_path, s.stderr_path, s.stack_path]) for s in world.specs]
        results: dict[int, Result] = {}
        dead: dict[int, int | None] = {}
        for r, conn in enumerate(world.conns):
            try:
                conn.send(call)
            except (BrokenPipeError, OSError):
                world.processes[r].join(1.0)
                dead[r] = world.processes[r].exitcode
        world.calls += 1
        started = time.monotonic()
        deadline = started + timeout_s
        failed_at: float | None = time.monotonic() if dead else None
        pending = set(range(n)) - set(dead)
        while pending:
            now = time.monotonic()
            limit = deadline if failed_at is None else min(deadline, failed_at + FAILURE_GRACE_S)
            if now >= limit:
                break
            ready = wait([world.conns[r] for r in pending]
                         + [world.processes[r].sentinel for r in pending], timeout=limit - now)
            for r in list(pending):
                conn, proc = world.conns[r], world.processes[r]
                if conn in ready or (proc.sentinel in ready and conn.poll()):
                    try:
                        results[r] = conn.recv()
                        pending.discard(r)
                        if results[r].error is not None and failed_at is None:
                            failed_at = time.monotonic()
                        continue
                    except (EOFError, OSError):
                        pass
                if proc.sentinel in ready:
                    proc.join(1.0)
                    dead[r] = proc.exitcode
                    pending.discard(r)
                    failed_at = failed_at or time.monotonic()
        outputs = [RankOutput(f.read(0), f.read(1)) for f in files]
        errors = {r: res.error for r, res in results.items() if res.error is not None}
        if not pending and not dead and not errors:
            return CallResult([results[r].value for r in range(n)], outputs)
        stacks = self._collect_stacks(world, sorted(pending), files)
        timed_out = bool(pending) and failed_at is None
        first_failure_s = (failed_at - started) if failed_at is not None else None
        raise self._failure(world, call, timeout_s, results, dead, stacks, outputs, files,
                            timed_out, first_failure_s)

    def _collect_stacks(self, world: World, ranks: list[int],
                        files: list[_Files]) -> dict[int, str]:
        """Signal each rank to dump its stacks, and read them back once the files stop growing."""
        for r in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(world.processes[r].pid, STACK_SIGNAL)
        sizes: dict[int, int] = {}
        stable_since = time.monotonic()
        deadline = time.monotonic() + 3.0
        while ranks and time.monotonic() < deadline:
            now = {r: _Files._size(world.specs[r].stack_path) for r in ranks}
            grown = all(now[r] > files[r].offsets[2] for r in ranks)
            if now != sizes:
                sizes, stable_since = now, time.monotonic()
            elif grown and time.monotonic() - stable_since > 0.2:
                break
            time.sleep(0.05)
        stacks = {}
        for r in ranks:
            with open(world.specs[r].stack_path, errors="replace") as f:
                header = f.readline()
            stacks[r] = main_thread_stack(header, files[r].read(2))
        return stacks

    def _failure(self, world: World, call: Call, timeout_s: float, results: dict[int, Result],
                 dead: dict[int, int | None], stacks: dict[int, str], outputs: list[RankOutput],
                 files: list[_Files], timed_out: bool,
                 first_failure_s: float | None) -> WorldError:
        errors = {r: res.error for r, res in results.items() if res.error is not None}
        # a rank that raised says where it raised; a hung or dead one, where it last said it was
        doing = {r: dict(errors[r].activity) if r in errors
                 else activity.read(world.specs[r].activity_path or "")
                 for r in range(world.world_size) if r not in results or r in errors}
        seen = Observed(str(call.fn), world.world_size, world.backend, timeout_s,
                        returned={r for r, res in results.items() if res.error is None},
                        errors=errors, dead=dead, stacks=stacks, timed_out=timed_out,
                        activity={r: found for r, found in doing.items() if found},
                        collective_timeout_s=self.pg_timeout_s,
                        first_failure_s=first_failure_s)
        return diagnose(seen, outputs, crashes={r: files[r].read(2).strip() for r in dead})

    # -- shutdown -------------------------------------------------------------------------------
    def kill_all(self) -> None:
        for world in self.worlds.values():
            world.kill()
        self.worlds.clear()

    def shutdown(self) -> None:
        """Stop every world, the helpers this supervisor started, and remove the work directory.

        Synchronous and bounded: when it returns, no process of the session is left, so nothing
        outlives pytest.  Safe to call more than once.
        """
        for world in self.worlds.values():
            world.stop()
        self.worlds.clear()
        for owner, fd_attr, pid_attr in self._helpers:
            stop_helper(owner, fd_attr, pid_attr)
        self._helpers = []
        self._ctx = None
        if self._workdir and os.path.isdir(self._workdir):
            remove(self._workdir)
            self._workdir = None
        stop_reaper(self._reaper)
        self._reaper = None

    def describe(self) -> str:
        return f"start={self.start_method}"

    def shared_dir(self, nodeid: str) -> Path:
        """A new directory in this session's work directory: local ranks share the filesystem."""
        return Path(tempfile.mkdtemp(prefix="moe-ep-cell-", dir=self.workdir))

    def agree_on_exit(self, status: int) -> int:
        return status


def _mp_tempdir() -> str | None:
    """multiprocessing's own temporary directory in this process (``pymp-*``), if it made one
    yet."""
    from multiprocessing import process

    # where multiprocessing.util caches it
    found = getattr(process.current_process(), "_config", {}).get("tempdir")
    return found if isinstance(found, str) else None

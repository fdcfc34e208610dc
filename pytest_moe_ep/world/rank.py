"""What runs inside a rank process: join the process group, then run calls until told to stop.

A rank is started by the supervisor (see ``supervisor.py``) from the forkserver, which already
imported torch, so start-up costs a fork and a process-group rendezvous.  It never decides
anything alone: before every call all ranks check they are about to run the same call id, so one
call's collectives can never pair with another's.  A rank watches its supervisor through a
lifeline and exits the moment the supervisor is gone, removing the session's work directory first,
so a killed pytest leaves neither a rank nor its files behind.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import faulthandler
import gc
import importlib.util
import os
import select
import signal
import sys
import threading
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from pytest_moe_ep.world import activity
from pytest_moe_ep.world.protocol import (
    Call,
    FunctionRef,
    RankError,
    Ready,
    Result,
    Stop,
    error_fields,
)
from pytest_moe_ep.world.workdir import abandon, record_self

#: environment a rank must not inherit: they would point the process group at another world.
INHERITED_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                        "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")
#: the signal on which a rank dumps every thread's Python stack into its stack file.
STACK_SIGNAL = signal.SIGUSR1
#: exit status of a rank that saw its supervisor die.
ORPHAN_EXIT = 70
#: a rank's collector thresholds.  A cell allocates millions of short-lived objects; at Python's
#: (700, 10, 10) a rank spent ~0.85 s of the default tier collecting (874 young collections), at
#: these 0.03-0.4 s.  Together with ``gc.freeze()`` of what the fork server preloaded (torch: ~300k
#: objects no collection needs to scan again).
GC_THRESHOLDS = (20_000, 20, 20)


@dataclass(frozen=True)
class RankSpec:
    rank: int
    world_size: int
    backend: str
    #: the world's rendezvous: a FileStore in the session's private work directory, no port.
    store_path: str
    #: the session's work directory, removed by the ranks if the supervisor dies without doing it.
    workdir: str
    #: where this rank records its identity, so a later session can stop it if it outlived its own.
    record_path: str
    supervisor_pid: int
    stack_path: str
    pg_timeout_s: float
    #: files for fd 1 and 2; ``None`` leaves output going to the terminal (pytest ``-s``).
    stdout_path: str | None = None
    stderr_path: str | None = None
    cuda_device: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    #: where the rank keeps what it says it is doing (:mod:`pytest_moe_ep.world.activity`), for
    #: the supervisor to read when a call hangs or the rank dies.
    activity_path: str | None = None


def _lifeline(supervisor_pid: int, workdir: str) -> None:
    """Exit when the supervisor dies, removing the session's work directory: a pidfd watched by a
    thread.

    Under forkserver the parent is the fork server, which outlives every rank (each holds its
    "alive" pipe), so PR_SET_PDEATHSIG is only a backstop for the day it dies first; under spawn the
    parent is the supervisor itself, and PDEATHSIG would kill the rank before it could clean up.
    """
    if os.getppid() != supervisor_pid:
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def orphaned() -> None:
        with contextlib.suppress(BaseException):
            abandon(workdir)
        os._exit(ORPHAN_EXIT)

    try:
        fd = os.pidfd_open(supervisor_pid)
    except ProcessLookupError:
        orphaned()
    except (AttributeError, OSError):  # no pidfd: poll the pid instead
        fd = -1

    def watch() -> None:
        if fd >= 0:
            select.select([fd], [], [])
        else:
            while True:
                try:
                    os.kill(supervisor_pid, 0)
                except ProcessLookupError:
                    break
                threading.Event().wait(0.5)
        orphaned()

    threading.Thread(target=watch, name="moe-ep-lifeline", daemon=True).start()


def _redirect(path: str | None, fd: int) -> None:
    if path is None:
        return
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _import_with_assert_rewriting(ref: FunctionRef) -> None:
    """Import a test module as pytest would, so a failing ``assert`` explains itself on a rank."""
    if ref.module in sys.modules or not ref.rewrite_asserts or not ref.path:
        return
    from _pytest.assertion.rewrite import rewrite_asserts

    with open(ref.path, "rb") as f:
        source = f.read()
    tree = ast.parse(source, filename=ref.path)
    rewrite_asserts(tree, source, ref.path, None)
    code = compile(tree, ref.path, "exec", dont_inherit=True)
    spec = importlib.util.spec_from_file_location(ref.module, ref.path)
    if spec is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[ref.module] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        del sys.modules[ref.module]
        raise


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _message(exc: BaseException) -> str:
    """``str(exc)``, plus each rank's cause when ``exc`` gathers them (DCP's CheckpointException).

    DCP reports a failed save or load as ``CheckpointException ranks:dict_keys([2, 3])``; the
    missing key or shape mismatch that a framework engineer needs is inside ``exc.failures``.
    """
    message = str(exc)
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        causes = []
        for failed_rank, failure in sorted(failures.items()):
            cause = failure[0] if isinstance(failure, tuple) and failure else failure
            causes.append(f"rank {failed_rank}: {type(cause).__name__}: "
                          f"{' '.join(str(cause).split())}")
        message = (f"{type(exc).__name__} on rank(s) {sorted(failures)}: " + "; ".join(causes)
                   + f"\n{message}")
    return message


def _error(rank: int, exc: BaseException, skip_frames: int = 0) -> RankError:
    """``exc`` flattened, its traceback without the engine's own ``skip_frames`` outer frames."""
    tb = exc.__traceback__
    for _ in range(skip_frames):
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return RankError(rank, type(exc).__qualname__, _message(exc), text, error_fields(exc),
                     activity.raised_in(exc))


def _init_process_group(spec: RankSpec) -> Any:
    import torch
    import torch.distributed as dist

    if spec.backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    store = dist.FileStore(spec.store_path, spec.world_size)
    store.set_timeout(timedelta(seconds=spec.pg_timeout_s))
    kwargs: dict[str, Any] = {}
    device = torch.device("cpu")
    if spec.backend == "nccl":
        device = torch.device("cuda", spec.cuda_device or 0)
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(spec.backend, store=store, rank=spec.rank,
                            world_size=spec.world_size,
                            timeout=timedelta(seconds=spec.pg_timeout_s), **kwargs)
    return device


def _agree_on_call(call_id: int, device: Any, world_size: int) -> None:
    """All ranks check they run the same call, so collectives never pair across calls."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([call_id], dtype=torch.int64, device=device)
    seen = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(seen, mine)
    ids = [int(t.item()) for t in seen]
    if len(set(ids)) != 1:
        raise RuntimeError(f"ranks disagree on the call they are running: call ids by rank {ids}")


def rank_main(spec: RankSpec, conn: Any) -> None:
    """Entry point of a rank process; always ends in ``os._exit``."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    record_self(spec.record_path)
    _lifeline(spec.supervisor_pid, spec.workdir)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
    _redirect(spec.stdout_path, 1)
    _redirect(spec.stderr_path, 2)
    stack_file = open(spec.stack_path, "w")  # noqa: SIM115 - lives as long as the process
    stack_file.write(f"main thread 0x{threading.main_thread().ident:016x}\n")
    stack_file.flush()
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True)
    if spec.activity_path:
        activity.attach(spec.activity_path)
    for name in INHERITED_RENDEZVOUS:
        os.environ.pop(name, None)
    os.environ.update(spec.env)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(spec.rank), str(spec.world_size)
    os.environ["LOCAL_RANK"] = str(spec.rank)
    try:
        device = _init_process_group(spec)
    except BaseException as exc:
        conn.send(Result(-1, spec.rank, error=_error(spec.rank, exc)))
        _flush()
        os._exit(1)
    conn.send(Ready(spec.rank, os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if isinstance(msg, Stop):
            break
        assert isinstance(msg, Call), f"rank {spec.rank} got an unknown message {msg!r}"
        result = _run(spec, msg, device)
        try:
            conn.send(result)
        except Exception as exc:
            message = f"the return value of {msg.fn} could not be sent to the supervisor: {exc}"
            conn.send(Result(msg.call_id, spec.rank,
                             error=RankError(spec.rank, type(exc).__qualname__,
                                             message, "")))
    _flush()
    os._exit(0)


def _run(spec: RankSpec, call: Call, device: Any) -> Result:
    activity.reset()
    for entry in reversed(call.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        if call.agree:
            _agree_on_call(call.call_id, device, spec.world_size)
        _import_with_assert_rewriting(call.fn)
        fn = call.fn.resolve()
    except BaseException as exc:
        _flush()
        return Result(call.call_id, spec.rank, error=_error(spec.rank, exc))
    try:
        result = Result(call.call_id, spec.rank, fn(*call.args, **call.kwargs))
    except BaseException as exc:  # every failure goes back, labelled with the rank
        result = Result(call.call_id, spec.rank, error=_error(spec.rank, exc, skip_frames=1))
    _flush()
    return result

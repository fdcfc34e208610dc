"""Choosing a process-group backend and leasing GPUs for NCCL worlds.

``gloo`` runs anywhere on CPU.  ``nccl`` needs one GPU per rank; ``auto`` picks it only when
CUDA is available with enough devices.  Parallel pytest processes on one host (pytest-xdist
workers, several CI jobs) share the GPUs, so an NCCL world leases its devices through file locks
and holds them until it is shut down.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

BACKENDS = ("auto", "gloo", "nccl")


class BackendUnavailable(Exception):
    """The backend cannot run a world of this size here; tests skip with this reason."""


def check_backend_name(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    return backend


#: present wherever the NVIDIA kernel driver is loaded; without it no torch build can see a CUDA
#: device.
NVIDIA_DRIVER = "/proc/driver/nvidia/version"


def cuda_devices() -> int:
    """How many CUDA devices this process sees (0 without CUDA); never initialises a context.

    On a machine without the NVIDIA driver the answer is 0 without importing torch: the controller
    then never imports it (a few seconds of every run, paid before the first world could start).
    """
    import os

    if not os.path.exists(NVIDIA_DRIVER):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, world_size: int) -> str:
    """The concrete backend for ``backend`` at ``world_size``; ``BackendUnavailable`` for NCCL
    without GPUs."""
    check_backend_name(backend)
    if backend == "gloo":
        return "gloo"
    found = cuda_devices()
    if backend == "auto":
        return "nccl" if found >= world_size else "gloo"
    if found < world_size:
        why = "CUDA is not available" if found == 0 else f"only {found} CUDA device(s) visible"
        raise BackendUnavailable(f"nccl needs {world_size} GPUs (one per rank): {why}")
    return "nccl"


@dataclass
class GpuLease:
    """GPUs held through one file lock each, shared by every pytest process on the host."""

    devices: list[int]
    locks: list[Any] = field(default_factory=list)

    def release(self) -> None:
        for lock in self.locks:
            lock.release()
        self.locks.clear()


def lease_gpus(count: int, timeout_s: float = 600.0) -> GpuLease:
    """Take ``count`` free GPUs, waiting up to ``timeout_s`` for other processes to release
    theirs."""
    from filelock import FileLock, Timeout

    total = cuda_devices()
    if total < count:
        raise BackendUnavailable(f"nccl needs {count} GPUs (one per rank): only {total} visible")
    lock_dir = os.path.join(tempfile.gettempdir(), "pytest-moe-ep-gpus")
    os.makedirs(lock_dir, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    while True:
        lease = GpuLease([])
        for device in range(total):
            lock = FileLock(os.path.join(lock_dir, f"gpu{device}.lock"))
            try:
                lock.acquire(timeout=0)
            except Timeout:
                continue
            lease.devices.append(device)
            lease.locks.append(lock)
            if len(lease.devices) == count:
                return lease
        lease.release()  # all or nothing, so two processes never deadlock on half a lease each
        if time.monotonic() > deadline:
            raise TimeoutError(f"could not lease {count} GPUs within {timeout_s:.0f}s: other "
                               "processes hold them")
        time.sleep(0.2)

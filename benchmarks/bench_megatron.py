"""What Megatron-Core's checkpoint path costs on CPU, with and without its spawn Manager.

Megatron's ``dist_checkpointing.save`` hands its writers' results through a module-global queue it
creates, at a process's first save, as a ``multiprocessing`` *spawn* ``Manager``.  The ``megatron``
adapter puts a process-local queue there for its (synchronous, in-process) save.  This script runs,
in a fresh gloo world per variant, two saves of the adapter's model at ep=2 (``SequentialMLP``,
model and Megatron's optimizer) and one load, and prints each rank's timings for both variants, plus
the set-up/tear-down cost of Megatron's parallel state (``initialize_model_parallel`` + destroying
its groups).  Needs megatron-core (``ci/install_megatron.sh``).

    python benchmarks/bench_megatron.py [--world-size 4] [--cycles 10]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

from pytest_moe_ep.world import Supervisor

#: the Manager queue Megatron created in this rank process (the "spawn Manager" variant keeps it).
_MANAGER_QUEUE: list[Any] = []


def save_twice_and_load(variant: str, path: str) -> dict[str, float]:
    """In a rank: build at ep=2, save twice (first and second save of the process), load."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from conformance.adapter import Spec
    from conformance.adapters.megatron import MegatronAdapter
    from pytest_moe_ep.world.meshes import device_mesh

    adapter = MegatronAdapter()
    spec = Spec(kind="unpacked", optimizer_steps=2)
    mesh = device_mesh((1, 2, dist.get_world_size() // 2), ("dp_replicate", "ep", "dp_shard"))
    out: dict[str, float] = {}
    for name in ("first save", "second save"):
        model, optimizer = adapter.build(spec, mesh, 1)
        target = os.path.join(path, name.replace(" ", "_"))
        if dist.get_rank() == 0:
            os.makedirs(target)
        dist.barrier()
        start = time.perf_counter()
        if variant == "megatron's spawn Manager":
            _save_with_megatrons_queue(adapter, model, optimizer, target, filesystem_async)
        else:
            adapter.save(model, optimizer, target)
        out[name] = time.perf_counter() - start
    model, optimizer = adapter.build(spec, mesh, 2)
    start = time.perf_counter()
    adapter.load(model, optimizer, os.path.join(path, "second_save"))
    out["load"] = time.perf_counter() - start
    adapter.end_cell()  # the load keeps Megatron's groups for a forward; a cell's end destroys them
    return out


def _save_with_megatrons_queue(adapter: Any, model: Any, optimizer: Any, path: str,
                               filesystem_async: Any) -> None:
    """The adapter's save, except that the writers' results go through Megatron's own (Manager)
    queue."""
    from megatron.core import dist_checkpointing

    from conformance.adapters.megatron import _sharded_state_dict
    from conformance.adapters.megatron_cpu import megatron_on_cpu, tear_down

    try:
        with megatron_on_cpu():
            filesystem_async._results_queue = _MANAGER_QUEUE[0] if _MANAGER_QUEUE else None
            dist_checkpointing.save(_sharded_state_dict(model, optimizer), path)
            if not _MANAGER_QUEUE:
                _MANAGER_QUEUE.append(filesystem_async._results_queue)
    finally:
        tear_down()


def stop_children() -> int:
    """Terminate this rank's multiprocessing children (Megatron's Manager server): killing the rank
    leaves them."""
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
        child.join(10)
    return len(children)


def set_up_cycles(cycles: int) -> list[float]:
    """``initialize_model_parallel`` at ep 2 then 4, each torn down, ``cycles`` times; seconds per
    set-up."""
    from conformance.adapters.megatron_cpu import set_up, tear_down

    set_up(1)  # imports Megatron on the first call: not part of the figure
    tear_down()
    times = []
    for i in range(cycles):
        start = time.perf_counter()
        set_up(2 if i % 2 == 0 else 4)
        tear_down()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=10)
    args = parser.parse_args()
    n = args.world_size
    load = os.getloadavg()[0]
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, load average {load:.1f}, "
          f"Python {platform.python_version()}, {n} gloo ranks")
    # The ranks import this module by name (they do not run the script): put its folder on their
    # path.
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, here)
    import bench_megatron as this

    sup = Supervisor()
    try:
        for variant in ("megatron's spawn Manager", "process-local queue (the adapter)"):
            with tempfile.TemporaryDirectory() as path:
                found = sup.run(this.save_twice_and_load, variant, path, world_size=n,
                                backend="gloo", timeout=600)
            children = sup.run(this.stop_children, world_size=n, backend="gloo")
            sup.kill_all()  # the next variant's first save is a fresh process's first save
            for key in ("first save", "second save", "load"):
                values = [r[key] for r in found]
                print(f"{variant:38s} {key:12s} max over ranks {max(values):6.2f} s, "
                      f"median {statistics.median(values):6.2f} s")
            print(f"{variant:38s} child processes the ranks had started: {sum(children)}")
        per_rank = sup.run(this.set_up_cycles, args.cycles, world_size=n, backend="gloo",
                           timeout=600)
        times = [t for rank in per_rank for t in rank]
        print("set-up + tear-down of Megatron's parallel state: median "
              f"{statistics.median(times):.3f} s, max {max(times):.3f} s over {args.cycles} cycles")
    finally:
        sup.shutdown()


if __name__ == "__main__":
    main()

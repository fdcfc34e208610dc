"""World start-up and per-call overhead of the world engine, measured on this machine.

Prints: the first world's start-up (fork server start with torch import, then ranks), a later
world's start-up, the overhead of a no-op ``run`` on a live world, and the same no-op done as a
fresh spawn world per call -- with the ratio of the last two taken in this one run.

    python benchmarks/bench_worlds.py [--world-size 4] [--calls 200] [--fresh 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from pytest_moe_ep.world.supervisor import Supervisor


def noop() -> None:
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--fresh", type=int, default=3, help="fresh spawn worlds to time")
    args = parser.parse_args()
    n = args.world_size
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, {n} gloo ranks")

    sup = Supervisor()
    t = time.perf_counter()
    sup.run(noop, world_size=n, backend="gloo")
    first = time.perf_counter() - t
    later = []
    for _ in range(5):
        sup.kill_all()
        time.sleep(0.5)  # let the killed world's teardown finish: measure start-up, not contention
        t = time.perf_counter()
        sup.run(noop, world_size=n, backend="gloo")
        later.append(time.perf_counter() - t)
    per_call = []
    for _ in range(args.calls):
        t = time.perf_counter()
        sup.run(noop, world_size=n, backend="gloo")
        per_call.append(time.perf_counter() - t)
    sup.shutdown()

    fresh = []
    for _ in range(args.fresh):
        spawn = Supervisor(start_method="spawn")
        t = time.perf_counter()
        spawn.run(noop, world_size=n, backend="gloo")
        fresh.append(time.perf_counter() - t)
        spawn.shutdown()

    call_ms = statistics.median(per_call) * 1e3
    fresh_s = statistics.median(fresh)
    print(f"first world start-up (forkserver, torch preloaded): {first:.2f} s")
    print(f"later world start-up (median of 5):                 {statistics.median(later):.3f} s")
    print(f"no-op run on a live world (median of {args.calls}):          {call_ms:.2f} ms")
    print(f"no-op run in a fresh spawn world (median of {args.fresh}):     {fresh_s:.2f} s")
    print(f"ratio fresh-spawn-world / live-world call:          {fresh_s * 1e3 / call_ms:.0f}x")


if __name__ == "__main__":
    # Ranks import functions by module name, and a script's module is __main__ only here.
    import bench_worlds

    bench_worlds.main()

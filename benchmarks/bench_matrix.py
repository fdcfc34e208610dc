"""The default conformance matrix on the reference adapter, timed on this machine.

Prints: the whole ``pytest --moe-ep-matrix`` run (start-up included), the per-cell median, the
raw work of one cell measured alone in a live world (the adapter's builds, DCP save and DCP load,
no harness) and the harness overhead ratio, and the same cells each run in a fresh spawn world with
the ratio to the persistent world -- all from this one run.

    python benchmarks/bench_matrix.py [--fresh 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

CELL = "moe-ep-matrix::checkpoint::unpacked::model+optim::ep-only::ep2->ep4"


def raw_cell_work(path: str) -> dict[str, float]:
    """One cell's adapter work with no harness: build, DCP save, build, DCP load (runs on every rank)."""
    import torch.distributed as dist

    from conformance.adapter import Spec
    from conformance.adapters.reference import ReferenceAdapter
    from conformance.checks import SEED_A, SEED_B, _mesh
    from conformance.matrix import OPTIMIZER_STEPS

    adapter = ReferenceAdapter()
    spec = Spec(kind="unpacked", optimizer_steps=OPTIMIZER_STEPS)
    times: dict[str, float] = {}
    t = time.perf_counter()
    model, optimizer = adapter.build(spec, _mesh(2), SEED_A)
    times["build"] = time.perf_counter() - t
    t = time.perf_counter()
    adapter.save(model, optimizer, path)
    times["save"] = time.perf_counter() - t
    dist.barrier()
    model, optimizer = adapter.build(spec, _mesh(4), SEED_B)
    t = time.perf_counter()
    adapter.load(model, optimizer, path)
    times["load"] = time.perf_counter() - t
    dist.barrier()
    return times


def run_cell_once(path: str) -> Any:
    from conformance.adapter import Spec
    from conformance.adapters.reference import ReferenceAdapter
    from conformance.checks import run_cell
    from conformance.matrix import EVEN_EXPERTS, Cell

    return run_cell(ReferenceAdapter(), Cell("unpacked", "unpacked", "model+optim", False, 2, 4, EVEN_EXPERTS),
                    Spec(), path)


def main() -> None:
    from pytest_moe_ep.world import Supervisor

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fresh", type=int, default=4, help="cells to run in fresh spawn worlds")
    args = parser.parse_args()
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}, "
          "4 gloo ranks, reference adapter")

    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pytest", "--moe-ep-matrix", f"--moe-ep-report={out}", "-q",
                        "-p", "no:cacheprovider"], cwd=out, check=False, stdout=subprocess.DEVNULL)
        total = time.perf_counter() - t
        with open(os.path.join(out, "moe-ep-conformance.json")) as f:
            cells = json.load(f)["cells"]
    ran = [c for c in cells if c["status"] != "n/a"]
    per_cell = statistics.median(c["duration_s"] for c in ran)
    failed = [c["id"] for c in ran if c["status"] != "pass"]
    in_matrix = next(c["duration_s"] for c in cells if c["id"] == CELL)

    live = Supervisor()
    with tempfile.TemporaryDirectory() as d:
        live.run(run_cell_once, os.path.join(d, "warm"), world_size=4, backend="gloo")  # world up, caches warm
        raws = [live.run(raw_cell_work, os.path.join(d, f"raw{i}"), world_size=4, backend="gloo") for i in range(3)]
        alone = []
        for i in range(3):
            t = time.perf_counter()
            live.run(run_cell_once, os.path.join(d, f"cell{i}"), world_size=4, backend="gloo")
            alone.append(time.perf_counter() - t)
    live.shutdown()
    raw_dcp = statistics.median(max(r["save"] for r in rank) + max(r["load"] for r in rank) for rank in raws)
    raw_all = statistics.median(max(r["save"] + r["load"] + 2 * r["build"] for r in rank) for rank in raws)

    fresh = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.fresh):
            spawn = Supervisor(start_method="spawn")
            t = time.perf_counter()
            spawn.run(run_cell_once, os.path.join(d, f"fresh{i}"), world_size=4, backend="gloo")
            fresh.append(time.perf_counter() - t)
            spawn.shutdown()

    print(f"default matrix: {len(cells)} cells ({len(ran)} run, {len(cells) - len(ran)} n/a), "
          f"{len(failed)} not passing")
    print(f"whole run, start-up included:                        {total:.1f} s")
    print(f"per-cell median in the matrix:                       {per_cell * 1e3:.0f} ms")
    print(f"cell {CELL.split('::', 1)[1]}:")
    print(f"  in the matrix {in_matrix * 1e3:.0f} ms; alone in a live world {statistics.median(alone) * 1e3:.0f} ms")
    print(f"  raw DCP save + load alone:                         {raw_dcp * 1e3:.0f} ms")
    print(f"  raw adapter work alone (2 builds + save + load):    {raw_all * 1e3:.0f} ms")
    print(f"  cell / raw adapter work:                           {statistics.median(alone) / raw_all:.2f}x")
    print(f"  cell / raw DCP save+load:                          {statistics.median(alone) / raw_dcp:.2f}x")
    print(f"same cell in a fresh spawn world (median of {args.fresh}):   {statistics.median(fresh):.2f} s")
    ratio = statistics.median(fresh) / statistics.median(alone)
    print(f"fresh spawn world per cell / persistent world:       {ratio:.0f}x")


if __name__ == "__main__":
    import bench_matrix  # ranks import functions by module name; a script's module is __main__ only here

    bench_matrix.main()

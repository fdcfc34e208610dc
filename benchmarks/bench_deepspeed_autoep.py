"""Where a ``deepspeed-autoep`` cell's time goes, on this machine (DeepSpeed 0.19.8, 4 gloo ranks,
CPU).

Prints, each the slowest rank's figure and the median of ``--repeat`` runs in a warm world:
``deepspeed.initialize`` split into AutoEP's conversion and group set-up, the optimizer's
construction and ZeRO's set-up (the engine's own methods, timed by wrapping them in the rank
process); two optimizer steps; ``save_checkpoint``; the universal conversion (``ds_to_universal``,
rank 0); the universal and the native ``load_checkpoint``; reading every tensor through DeepSpeed's
accessors.  Then the first engine of a world whose fork server preloaded the adapter's modules, and
of a fresh spawn world (a new training job), and the whole ``--moe-ep-matrix`` run of each adapter
class.

    python benchmarks/bench_deepspeed_autoep.py [--repeat 3] [--no-matrix]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
MODULE = "conformance.adapters.deepspeed_autoep"
CLASSES = ("DeepSpeedAutoEPAdapter", "DeepSpeedAutoEPZero2Adapter",
           "DeepSpeedAutoEPNoConversionAdapter")
ENGINE_PARTS = ("_configure_expert_parallel", "_configure_optimizer", "_configure_zero_optimizer")


def _timed_engine_parts(times: dict[str, float]) -> None:
    """Wrap the engine's set-up methods so each call adds its duration to ``times`` (this rank
    only)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    for name in ENGINE_PARTS:
        original = getattr(DeepSpeedEngine, name)
        original = getattr(original, "__wrapped__", original)

        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, __original: Any = original, __name: str = name,
                    **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return __original(self, *args, **kwargs)
            finally:
                times[__name] = times.get(__name, 0.0) + time.perf_counter() - t

        setattr(DeepSpeedEngine, name, wrapper)


def phases(path: str) -> dict[str, float]:
    """One ep=2 -> ep=4 model+optimizer round trip, phase by phase (runs on every rank)."""
    import torch.distributed as dist

    from conformance.adapter import Spec
    from conformance.adapters import deepspeed_autoep as autoep
    from conformance.adapters._deepspeed_universal import convert_once
    from conformance.checks import SEED_A, SEED_B
    from conformance.checks.values import canonical
    from conformance.matrix import OPTIMIZER_STEPS

    adapter = autoep.DeepSpeedAutoEPAdapter()
    spec = Spec(kind="packed", optimizer_steps=0)
    times: dict[str, float] = {}
    _timed_engine_parts(times)

    def clock(name: str, fn: Any, *args: Any) -> Any:
        dist.barrier()
        t = time.perf_counter()
        out = fn(*args)
        times[name] = time.perf_counter() - t
        return out

    model, optimizer = clock("deepspeed.initialize (whole)", adapter.build, spec, _mesh(2), SEED_A)
    parts = {name: times.pop(name) for name in ENGINE_PARTS}  # this build's parts only
    for step in range(OPTIMIZER_STEPS):
        clock(f"step {step}", adapter.step, model, optimizer, SEED_A, step)
    clock("save_checkpoint", adapter.save, model, optimizer, path)
    clock("ds_to_universal (rank 0)", convert_once, path)
    model, optimizer = adapter.build(spec, _mesh(4), SEED_B)
    clock("load_checkpoint, universal", adapter.load, model, optimizer, path)
    clock("read tensors (accessors)", lambda: canonical(adapter, model, optimizer, dist.get_rank()))
    model, optimizer = adapter.build(spec, _mesh(2), SEED_B)
    clock("load_checkpoint, native", adapter.load, model, optimizer, path)
    for name in ENGINE_PARTS:
        times.pop(name, None)
    return {**parts, **times}


def first_engine(path: str) -> float:
    """The first engine this world builds (every import and group not yet made)."""
    from conformance.adapter import Spec
    from conformance.adapters import deepspeed_autoep as autoep
    from conformance.checks import SEED_A

    t = time.perf_counter()
    autoep.DeepSpeedAutoEPAdapter().build(Spec(kind="packed"), _mesh(2), SEED_A)
    return time.perf_counter() - t


def _slowest(per_rank: list[dict[str, float]]) -> dict[str, float]:
    return {k: max(r.get(k, 0.0) for r in per_rank) for k in per_rank[0]}


def main() -> None:
    from pytest_moe_ep.world import Supervisor

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-matrix", action="store_true", help="skip the whole-matrix runs")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, load average {load:.1f}, "
          f"Python {platform.python_version()}, 4 gloo ranks, deepspeed-autoep (ZeRO-1, fp32, E=4, "
          "2 layers)")
    from conformance.adapters.deepspeed_autoep import DeepSpeedAutoEPAdapter

    preload = (MODULE, *DeepSpeedAutoEPAdapter.preload)
    with tempfile.TemporaryDirectory() as d:
        warm = Supervisor(preload=preload)
        first_preloaded = max(warm.run(first_engine, os.path.join(d, "w"), world_size=4,
                                       backend="gloo"))
        runs = [_slowest(warm.run(phases, os.path.join(d, f"p{i}"), world_size=4, backend="gloo"))
                for i in range(args.repeat)]
        warm.shutdown()
        # the fork server is one per process: a world without the preload is a spawn world, whose
        # ranks import torch, DeepSpeed and the rest themselves, as a fresh training job does.
        fresh = Supervisor(start_method="spawn")
        t = time.perf_counter()
        first_fresh = max(fresh.run(first_engine, os.path.join(d, "b"), world_size=4,
                                    backend="gloo"))
        fresh_call = time.perf_counter() - t
        fresh.shutdown()
    print(f"warm world, median of {args.repeat} (slowest rank):")
    for name in runs[0]:
        label = f"  of which {name}" if name in ENGINE_PARTS else name
        print(f"  {label:<44} {statistics.median(r[name] for r in runs) * 1e3:8.0f} ms")
    print(f"first engine of a world, adapter preload in the fork server:  {first_preloaded:.2f} s")
    print(f"first engine of a fresh spawn world (ranks import everything): {first_fresh:.2f} s "
          f"({fresh_call:.1f} s with the world's start)")
    if args.no_matrix:
        return
    for cls in CLASSES:
        with tempfile.TemporaryDirectory() as out:
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "pytest", "--moe-ep-matrix",
                            f"--moe-ep-adapter={MODULE}:{cls}", f"--moe-ep-report={out}", "-q",
                            "-p", "no:cacheprovider"], cwd=out, check=False,
                           stdout=subprocess.DEVNULL)
            total = time.perf_counter() - t
            with open(os.path.join(out, "moe-ep-conformance.json")) as f:
                doc = json.load(f)
        ran = [c["duration_s"] for c in doc["cells"] if c["status"] != "n/a"]
        print(f"{doc['adapter']['name']:<28} whole matrix {total:5.1f} s, {len(ran)} cells run, "
              f"per-cell median {statistics.median(ran) * 1e3:.0f} ms, max {max(ran):.1f} s, "
              f"{doc['summary']}")


if __name__ == "__main__":
    # ranks import functions by module name; a script's module is __main__ only here
    import bench_deepspeed_autoep

    bench_deepspeed_autoep.main()


def _mesh(ep: int) -> Any:
    """The 4-rank world's mesh at ``ep`` (consecutive EP groups, as DeepSpeed forms them)."""
    import torch.distributed as dist

    from conformance.layout import ParallelLayout

    return ParallelLayout.for_world(dist.get_world_size(), ep, ep_order="consecutive").build_mesh()

"""The conformance matrix on the reference adapter, timed on this machine, every check on.

Runs ``pytest --moe-ep-matrix`` in fresh subprocesses (start-up included, as CI pays it) and prints,
from this one run:

- the default (covering) tier at world size 4, with one save feeding every load of it, and the same
  cells with every cell writing its own checkpoint (``-o moe_ep_share_saves=false``): the ratio is
  what sharing saves;
- the full tier at world size 4, and the default tier at world size 8;
- per cell: the median wall time, and the harness cost -- the cell's wall time over the time spent
  inside the adapter's own members (build, save, load, step, forward, scalars), from each cell's
  record (``timings.adapter``), and over the rank-side total (what the engine adds).

    python benchmarks/bench_matrix.py [--skip-full] [--skip-8] [--against DIR] [--experts 64,256]
    [--only-experts]
                                      [--select KEYWORDS]

``--experts 64,256`` also runs the default tier at 4 ranks with ``--moe-ep-experts=E`` for each E (a
real model's expert count: OLMoE 64, DeepSeek-V3 256) and prints each as a ratio to the default
``4,6`` tier of the same run (wall, time inside the adapter, and the harness's share) and, kind by
kind, to the same cells at E=4 (an even E covers the same layout pairs at every count; the 4,6
tier's uneven E=6 makes it pick other cells); ``--only-experts`` runs just that sweep.  ``--select``
passes ``-k`` to every run (``--select kind_packed``: the packed-kind cells alone).

``--against DIR`` also runs the default tier of another checkout (``git worktree add DIR <commit>``)
right after this one's and prints the ratio: on a shared machine whose speed drifts between days,
that ratio is the figure to compare with a target set on another day.

Targets (2-core CI machine): default@4 <= 20 s, full@4 <= 120 s, default@8 <= 60 s.  And: the
default tier at E=64 at most 2x the E=4,6 tier's wall, at E=256 at most 4x, cell / adapter at most
1.15x at every E. And: the packed-kind cells at E=256 at most 1.5x the same cells' time at E=4 (the
sweep prints each kind's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


#: ``-k`` for every run (``--select``): e.g. ``kind_packed`` times the packed-kind cells alone.
SELECT: list[str] = []


def run_matrix(tier: str, world_size: int, *extra: str, root: Path = ROOT) -> dict[str, Any]:
    """One ``pytest --moe-ep-matrix`` subprocess (of the checkout at ``root``): its wall time and
    report's cells."""
    with tempfile.TemporaryDirectory(prefix="bench-matrix-") as out:
        args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                f"--moe-ep-matrix={tier}", f"--moe-ep-world-size={world_size}",
                f"--moe-ep-report={out}", *SELECT, *extra]
        t0 = time.perf_counter()
        proc = subprocess.run(args, cwd=out, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(root)})
        wall = time.perf_counter() - t0
        report = Path(out) / "moe-ep-conformance.json"
        if not report.exists():
            raise SystemExit(f"pytest {' '.join(args[3:])} wrote no report:\n{proc.stdout[-3000:]}"
                             f"{proc.stderr[-3000:]}")
        doc = json.loads(report.read_text())
    cells = [c for c in doc["cells"] if c["status"] != "n/a"]
    return {"wall": wall, "cells": cells, "summary": doc["summary"], "exit": proc.returncode}


def starter(found: dict[str, Any]) -> str | None:
    """The id of the cell that started the world: the one whose wall time exceeds its ranks' own
    time the most (the report lists cells in the matrix's order, not the order they ran in, and an
    expensive cell may be the longest)."""
    cells = found["cells"]
    if not cells:
        return None
    return str(max(cells,
                   key=lambda c: c["duration_s"] - c.get("timings", {}).get("total", 0.0))["id"])


def harness(found: dict[str, Any]) -> tuple[float, float]:
    """``(cells' wall time, time inside the adapter)`` of a run, the world-starting cell left
    out."""
    first = starter(found)
    cells = [c for c in found["cells"] if c["id"] != first] or found["cells"]
    return (sum(c["duration_s"] for c in cells),
            sum(c.get("timings", {}).get("adapter", 0.0) for c in cells))


def sweep(counts: list[int], base: dict[str, Any]) -> None:
    """The default tier at 4 ranks at each expert count, as ratios to ``base`` (the 4,6 tier of this
    run), and cell for cell to the tier at E=4 (the same layouts: an even E picks the same cells at
    every count)."""
    base_cells, base_adapter = harness(base)
    even = run_matrix("default", 4, "--moe-ep-experts=4")
    print(describe("default tier, 4 ranks, E=4", even))
    for count in counts:
        found = run_matrix("default", 4, f"--moe-ep-experts={count}")
        cells, adapter = harness(found)
        target = {64: 2.0, 256: 4.0}.get(count)
        ratio = found["wall"] / base["wall"]
        verdict = ("" if target is None
                   else f"  target <= {target:g}x: {'met' if ratio <= target else 'MISSED'}")
        print(describe(f"default tier, 4 ranks, E={count}", found))
        print(f"{'':<34} / E=4,6: wall {ratio:.2f}x, cells {cells / base_cells:.2f}x, inside the "
              f"adapter {adapter / base_adapter:.2f}x, outside it "
              f"{(cells - adapter) / (base_cells - base_adapter):.2f}x{verdict}")
        print(f"{'':<34} {breakdown(found)}")
        print(f"{'':<34} {by_kind(found, even, count)}")


def same_cell(cell_id: str) -> str:
    """A cell's id without its expert count (``...::E256::ep2->ep4`` and ``...::ep2->ep4`` name one
    layout pair)."""
    return re.sub(r"::E\d+::", "::", cell_id)


def kind_sums(found: dict[str, Any], keep: set[str]) -> dict[str, tuple[float, int]]:
    """The summed wall time and count of each kind's non-legacy cells among ``keep`` (ids from
    :func:`same_cell`)."""
    sums: dict[str, tuple[float, int]] = {}
    for cell in found["cells"]:
        if not cell["legacy"] and same_cell(cell["id"]) in keep:
            total, count = sums.get(cell["kind"], (0.0, 0))
            sums[cell["kind"]] = (total + cell["duration_s"], count + 1)
    return dict(sorted(sums.items()))


def by_kind(found: dict[str, Any], even: dict[str, Any], count: int) -> str:
    """Each kind's cells at ``count`` experts over the same cells at E=4, the cell of either run
    that started the world left out (target: packed-kind cells at E=256 at most 1.5x their E=4
    time)."""
    ids = [{same_cell(c["id"]) for c in run["cells"]} for run in (found, even)]
    starters = {same_cell(first) for first in (starter(found), starter(even)) if first is not None}
    keep = (ids[0] & ids[1]) - starters
    here, there = kind_sums(found, keep), kind_sums(even, keep)
    parts = [f"{kind} {here[kind][0] / here[kind][1]:.3f} s ({here[kind][0] / there[kind][0]:.2f}x)"
             for kind in here if kind in there]
    unmatched = len(ids[0] ^ ids[1])
    target = f" ({unmatched} cells in one run only)" if unmatched else ""
    if count == 256 and "packed" in here and "packed" in there:
        ratio = here["packed"][0] / there["packed"][0]
        target += f"; packed-kind target <= 1.5x: {'met' if ratio <= 1.5 else 'MISSED'}"
    return "mean cell by kind / the same cells at E=4: " + ", ".join(parts) + target


def breakdown(found: dict[str, Any]) -> str:
    """Where the cells' time went, summed over them from their records: the adapter's builds, saves
    and loads (``timings``), the checkpoint inspection, and everything else (the checks and the
    engine)."""
    sums = {name: sum(c.get("timings", {}).get(name, 0.0) for c in found["cells"])
            for name in ("build", "save", "load", "inspect", "adapter", "total")}
    wall = sum(c["duration_s"] for c in found["cells"])
    return (f"sum over cells: {wall:.1f} s; inside the adapter {sums['adapter']:.1f} s (save-side "
            f"builds {sums['build']:.1f} s, saves {sums['save']:.1f} s, loads {sums['load']:.1f} "
            f"s), inspection {sums['inspect']:.1f} s, the rest "
            f"{wall - sums['adapter'] - sums['inspect']:.1f} s")


def describe(name: str, found: dict[str, Any], target: float | None = None) -> str:
    """One line: wall time (start-up included), cells, median cell, and the harness's share of a
    cell.

    The harness cost leaves out the cell that started the world (the wall time has it):
    ``cell / adapter`` is the cells' wall time over the time inside the adapter's own members, and
    ``engine`` the median time a cell spends outside the ranks (the call, pickling, agreement).
    """
    first = starter(found)
    cells = [c for c in found["cells"] if c["id"] != first] or found["cells"]
    durations = [c["duration_s"] for c in cells]
    adapter = sum(c.get("timings", {}).get("adapter", 0.0) for c in cells)
    engine = statistics.median(c["duration_s"] - c.get("timings", {}).get("total", 0.0)
                               for c in cells)
    verdict = ("" if target is None
               else f"  target <= {target:g} s: {'met' if found['wall'] <= target else 'MISSED'}")
    return (f"{name:<34} {found['wall']:6.1f} s {len(found['cells']):5d} cells  median cell "
            f"{statistics.median(durations):.3f} s  cell / adapter {sum(durations) / adapter:.2f}x "
            f" engine {engine * 1000:.0f} ms  {found['summary']}{verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-full", action="store_true", help="skip the full tier (minutes)")
    parser.add_argument("--skip-8", action="store_true", help="skip world size 8")
    parser.add_argument("--against", type=Path,
                        help="another checkout whose default tier to time in the same run")
    parser.add_argument("--experts", default="",
                        help="expert counts to sweep the default tier at, e.g. 64,256")
    parser.add_argument("--only-experts", action="store_true",
                        help="run only the default tier and the E sweep")
    parser.add_argument("--select", default="",
                        help="a -k expression for every run, e.g. kind_packed")
    args = parser.parse_args()
    if args.select:
        SELECT[:] = ["-k", args.select]
    counts = [int(part) for part in args.experts.split(",") if part.strip()]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, load average {os.getloadavg()[0]:.1f}")
    shared = run_matrix("default", 4)
    print(describe("default tier, 4 ranks", shared, 20))
    if counts:
        print(f"{'':<34} {breakdown(shared)}")
        sweep(counts, shared)
    if args.only_experts:
        return
    if args.against:
        other = run_matrix("default", 4, root=args.against.resolve())
        print(describe(f"default tier, 4 ranks, {args.against}", other))
        print(f"{'':<34} this checkout / {args.against}: {shared['wall'] / other['wall']:.2f}x "
              f"wall, {len(shared['cells'])} / {len(other['cells'])} cells")
    unshared = run_matrix("default", 4, "-o", "moe_ep_share_saves=false")
    print(describe("default tier, 4 ranks, no sharing", unshared))
    reused = sum(c.get("shared_save", False) for c in shared["cells"])
    print(f"{'':<34} one save per checkpoint is {unshared['wall'] / shared['wall']:.2f}x faster "
          f"than one per cell ({reused} of {len(shared['cells'])} cells reused a save)")
    if not args.skip_full:
        print(describe("full tier, 4 ranks", run_matrix("full", 4), 120))
    if not args.skip_8:
        print(describe("default tier, 8 ranks", run_matrix("default", 8), 60))


if __name__ == "__main__":
    main()

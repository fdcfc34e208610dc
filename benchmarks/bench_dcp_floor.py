"""The reference's save + load against the floor of its checkpoint form: a bare ``dcp.save`` +
``dcp.load``.

Whatever a checkpoint form costs inside DCP (a pickle, a plan entry and a read per item) no
implementation of that form can avoid; what the reference adds on top -- ``ExpertLayout`` both ways,
the ``check_saved_experts`` guard, ``get_*_state_dict`` / ``set_optimizer_state_dict`` -- is its
own.  In a real 4-rank gloo world (loopback only) this builds the reference model at ``--ep`` with
AdamW state, then, alternating, ``--repeats`` times each:

- **reference**: ``reference_impl.checkpoint.save`` then ``load`` into the same model and optimizer;
- **bare DCP**: ``dcp.save`` then ``dcp.load`` of the very state dict the reference hands DCP
  (``to_global``'s result, made once, outside the timing): the floor of that form.

for each form: the per-expert form (unpacked layers, and packed ones with ``per_expert=True``) and
the packed form (packed layers' own).  Prints the median of each on the slowest rank, their ratio
(the target: at most 1.15x for the per-expert form), and the DCP items a checkpoint of the form
holds.

    python benchmarks/bench_dcp_floor.py [--experts 4,64,256] [--ep 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

WORLD = 4
#: (label, layer kind, per_expert): the forms measured.
FORMS = (("per-expert, unpacked", "unpacked", False), ("per-expert, packed", "packed", True),
         ("packed", "packed", False))


def build(kind: str, experts: int, ep: int) -> tuple[Any, Any]:
    from conformance.layout import ParallelLayout
    from reference_impl.moe import MoEConfig, apply_expert_parallel, build_model

    config = MoEConfig(num_experts=experts, dim=16, hidden=32,  # Spec's sizes
                       kind=kind)  # type: ignore[arg-type]
    model = build_model(config, 2, seed=0)
    apply_expert_parallel(model, ParallelLayout.for_world(WORLD, ep).build_mesh())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    return model, optimizer


def timed(fn: Any, *args: Any, **kwargs: Any) -> float:
    """``fn(*args, **kwargs)`` on every rank at once; the slowest rank's seconds (a collective step
    takes that)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    elapsed = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def reference_round(model: Any, optimizer: Any, path: str, per_expert: bool) -> None:
    from reference_impl import checkpoint

    checkpoint.save(model, optimizer, path, per_expert=per_expert)
    checkpoint.load(model, optimizer, path)


def bare_round(state: dict[str, Any], path: str) -> None:
    dcp.save(state, checkpoint_id=path)
    dcp.load(state, checkpoint_id=path)


def measure(experts: int, label: str, kind: str, per_expert: bool, args: argparse.Namespace,
            out: str) -> None:
    """One form at one E: ``--repeats`` rounds of each, alternating; rank 0 prints the medians."""
    from reference_impl import checkpoint

    model, optimizer = build(kind, experts, args.ep)
    state = checkpoint.state_dict(model, optimizer)
    layout = checkpoint.save_layout(model, per_expert=per_expert)  # the very translation save makes
    if layout is not None:
        state = layout.to_global(state)
    ref_path, bare_path = (os.path.join(out, f"{name}-{experts}-{kind}-{per_expert}")
                           for name in ("ref", "bare"))
    reference, bare = [], []
    for _ in range(args.repeats):
        reference.append(timed(reference_round, model, optimizer, ref_path, per_expert))
        bare.append(timed(bare_round, state, bare_path))
    if dist.get_rank() == 0:
        items = len(dcp.FileSystemReader(ref_path).read_metadata().state_dict_metadata)
        ref_s, bare_s = statistics.median(reference), statistics.median(bare)
        print(f"E={experts:<4} {label:<22} {items:6d} items | reference {ref_s * 1e3:8.1f} ms | "
              f"bare DCP {bare_s * 1e3:8.1f} ms | {ref_s / bare_s:.2f}x", flush=True)


def rank_main(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    # DCP's notes on each save's storage plan, four ranks' worth each
    warnings.simplefilter("ignore", UserWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        for experts in args.experts:
            for label, kind, per_expert in FORMS:
                measure(experts, label, kind, per_expert, args, out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", default="4,64,256", help="expert counts, e.g. 4,64,256")
    parser.add_argument("--ep", type=int, default=4,
                        help="the EP degree of the 4-rank world (1, 2 or 4)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    args.experts = [int(e) for e in args.experts.split(",") if e.strip()]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, torch {torch.__version__}, load average "
          f"{os.getloadavg()[0]:.1f}; {WORLD} gloo ranks at ep={args.ep}, 2 layers, model + AdamW; "
          f"medians of {args.repeats}, slowest rank")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="bench-dcp-floor-") as out:
        mp.spawn(rank_main, args=(port, args, out), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()

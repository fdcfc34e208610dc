"""ExpertLayout.to_global + to_local on a DeepSeek-V3-sized layout: time, Python memory, tensor
bytes.

DeepSeek-V3 has 58 MoE layers of 256 routed experts (and a shared expert).  This builds that layout
with tiny tensors (the sizes of the weights do not matter to a translation that must never touch
their data), splits it for EP rank 0 of ``--ep`` ranks, takes AdamW state after one step, and times
the translation both ways for each kind into each checkpoint form: the unpacked kind into the
per-expert form (what it saves), the packed kind into the packed form (what it saves) and into the
per-expert form (``per_expert=True``, or a per-expert checkpoint loaded into packed layers), and the
unpacked kind into the packed form (a packed checkpoint loaded into unpacked layers: the one
translation that copies, its experts stacked into one tensor per weight and moment).  The ``--ep``
ranks are a fake process group: rank 0 alone, with no peers, which is all DTensor construction
needs.

Prints, per form: the number of state-dict entries, wall time (best of ``--repeats``), the
tracemalloc peak of Python allocations during one round, and the bytes of tensor storage that exist
in the translated dict but not in the input (must be 0: everything is the original tensor or a view
of it; for the stacked case, what the copy costs, against the rank's expert tensors' own bytes).

    python benchmarks/bench_layout.py [--ep 8] [--layers 58] [--experts 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from reference_impl.checkpoint import state_dict
from reference_impl.expert_layout import expert_layout, moe_layers
from reference_impl.moe import MoEConfig, apply_expert_parallel, build_model


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested state dict (a DTensor's local tensor stands for it)."""
    if isinstance(obj, torch.Tensor):
        yield obj.to_local() if isinstance(obj, DTensor) else obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors(value)


def storages(obj: Any) -> dict[int, int]:
    """Distinct storages under ``obj``: data pointer -> bytes."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors(obj)}


def optimizer_tensors(state: dict[str, Any], param: torch.Tensor) -> Iterator[torch.Tensor]:
    """The moments of ``param`` in a rank's state dict (found by storage: the state dict names
    them)."""
    ptr = param.untyped_storage().data_ptr()
    names = [k for k, v in state["model"].items() if v.untyped_storage().data_ptr() == ptr]
    for name in names:
        for v in state["optimizer"]["state"].get(name, {}).values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                yield v


def build(kind: str, args: argparse.Namespace, mesh: Any) -> tuple[Any, dict[str, Any]]:
    config = MoEConfig(num_experts=args.experts, dim=8, hidden=4,
                       kind=kind, top_k=8)  # type: ignore[arg-type]
    with torch.device("meta"):  # no init of 58 x 256 experts; rank 0's share gets real memory below
        model = build_model(config, args.layers, seed=0)
    apply_expert_parallel(model, mesh)
    model.to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p)
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    optimizer.step()
    return model, state_dict(model, optimizer)


def measure(kind: str, form: str, args: argparse.Namespace, mesh: Any) -> None:
    """``kind``'s layers translated into checkpoint form ``form`` ("per-expert" or "packed") and
    back."""
    model, state = build(kind, args, mesh)
    stacked = kind == "unpacked" and form == "packed"
    packed_form = {name for name, _ in moe_layers(model)} if form == "packed" else set()
    n_model, n_optim = len(state["model"]), len(state["optimizer"]["state"])
    before = storages(state)
    times_layout, times_global, times_local = [], [], []
    for _ in range(args.repeats):
        gc.collect()
        t = time.perf_counter()
        layout = expert_layout(model, packed_form)
        assert layout is not None
        t0 = time.perf_counter()
        times_layout.append(t0 - t)
        out = layout.to_global(state)
        t1 = time.perf_counter()
        back = layout.to_local(out)
        t2 = time.perf_counter()
        times_global.append(t1 - t0)
        times_local.append(t2 - t1)
    new_bytes = sum(n for ptr, n in storages(out).items() if ptr not in before)
    new_bytes += sum(n for ptr, n in storages(back).items() if ptr not in before)

    layout = expert_layout(model, packed_form)
    assert layout is not None
    gc.collect()
    tracemalloc.start()
    out = layout.to_global(state)
    back = layout.to_local(out)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    total_storage = sum(before.values())
    layout_ms, global_ms, local_ms = (min(t) * 1e3
                                      for t in (times_layout, times_global, times_local))
    label = f"{kind} -> {form} form{' (stacked)' if stacked else ''}"
    if stacked:
        experts = sum(t.untyped_storage().nbytes() for _, moe in moe_layers(model)
                      for p in moe.expert_parameters()
                      for t in (p, *(v for v in optimizer_tensors(state, p))))
        print(f"{label}: stacks {new_bytes / 2**20:.1f} MiB ({new_bytes / max(experts, 1):.2f}x "
              f"the rank's expert weights and moments, {experts / 2**20:.1f} MiB), copied in by "
              "to_global and back by to_local")
    print(f"{label:>8}: {n_model} model + {n_optim} optimizer entries, {total_storage / 2**20:.1f} "
          f"MiB of tensors | expert_layout {layout_ms:.1f} ms | to_global {global_ms:.1f} ms + "
          f"to_local {local_ms:.1f} ms = {global_ms + local_ms:.1f} ms | Python peak "
          f"{peak / 2**20:.2f} MiB | new tensor storage {new_bytes} B")
    if new_bytes and not stacked:
        raise SystemExit(f"{kind}: the translation allocated {new_bytes} bytes of tensor storage")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--layers", type=int, default=58)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.ep)
    mesh = init_device_mesh("cpu", (args.ep,), mesh_dim_names=("ep",))
    print(f"{args.layers} MoE layers x {args.experts} experts, EP rank 0 of {args.ep} "
          f"({-(-args.experts // args.ep)} local experts per layer), torch {torch.__version__}")
    try:
        for kind, form in (("unpacked", "per-expert"), ("packed", "packed"),
                           ("packed", "per-expert"), ("unpacked", "packed")):
            measure(kind, form, args, mesh)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

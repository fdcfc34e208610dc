"""The calls a functions-suite cell makes: the same arguments, built once per rank, for both
modules.

Inputs are real DTensors made by ``distribute_tensor`` on the cell's mesh (DTensor itself decides
which rows a rank holds), plain tensors whose every element names its position, and meshes; bad
inputs (wrong E, ``Partial``, a shard of another dim on the expert dim, the tempting "first E % k
ranks get one more" split) are there so that a function that quietly accepts them disagrees with the
reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from conformance.functions.cells import FunctionsCell
from conformance.functions.outcomes import Outcome, outcome, storage_of

__all__ = ["INNER", "Case", "expert_cases", "mesh_cases"]

#: trailing dims of every grouped weight; Shard(2) of 6 over 4 ranks is uneven (2, 2, 2, 0) on
#: purpose.
INNER = (4, 6)


@dataclass
class Case:
    """One call to make on both modules: arguments, how to describe them, and what outputs must
    alias."""

    function: str
    args: tuple[Any, ...]
    inputs: str
    num_experts: int | None
    source: Any = None  # the tensor whose local storage returned tensors must share

    def run(self, fn: Callable[..., Any]) -> Outcome:
        return outcome(fn, self.args, None if self.source is None else storage_of(self.source))


def full(num_experts: int) -> Any:
    """A grouped weight whose every element names its position, so a misplaced row cannot pass."""
    import torch

    return torch.arange(num_experts * math.prod(INNER),
                        dtype=torch.float32).reshape(num_experts, *INNER)


def first_ranks_extra(num_experts: int, num_ranks: int, rank: int) -> tuple[int, int]:
    """The tempting split (first E % k ranks get one more); used to build DTensors the rule
    refuses."""
    base, extra = divmod(num_experts, num_ranks)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def expert_mesh_dim(names: tuple[str, ...], placements: Sequence[Any]) -> int | None:
    """The mesh dim that partitions experts (``ep``, else the first Shard(0)): where a bad placement
    goes."""
    from torch.distributed.tensor import Shard

    if "ep" in names:
        return names.index("ep")
    return next((i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0), None)


def mesh_cases(cell: FunctionsCell, mesh: Any) -> list[Case]:
    """get_submesh does not depend on E: its cases run once per cell (num_experts None)."""
    names = cell.names
    calls: list[tuple[Any, str]] = [((n,), f"({n!r},)") for n in names]
    if len(names) > 1:
        calls.append((names, repr(names)))
    calls += [
        (names[0], repr(names[0])),
        (("no_such_dim",), "('no_such_dim',)"),
        ((names[0], names[0]), repr((names[0], names[0]))),
        ((), "()"),
    ]
    return [Case("get_submesh", (mesh, dims), f"get_submesh(mesh, {text})", None)
            for dims, text in calls]


def expert_cases(cell: FunctionsCell, mesh: Any, placements: list[Any],
                 num_experts: int) -> list[Case]:
    """Every E-dependent call of one cell, built once and shared by both modules."""
    import torch
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    from reference_impl.layout import expert_range

    E, names, coord = num_experts, cell.names, mesh.get_coordinate()
    t = full(E)
    w = distribute_tensor(t, mesh, placements, src_data_rank=None)
    w_text = f"w = distribute_tensor(arange{(E, *INNER)}, mesh, {cell.placements})"
    partial = DTensor.from_local(full(E), mesh, [Partial()] * mesh.ndim)
    partial_text = "w = DTensor.from_local(arange, mesh, Partial() on every dim)"
    cases: list[Case] = []

    def add(function: str, args: tuple[Any, ...], call: str, where: str = "",
            source: Any = None) -> None:
        cases.append(Case(function, args, f"{function}({call})" + (f"; {where}" if where else ""),
                          E, source))

    # A DTensor built from the tempting split: valid only where both splits agree.
    one_dim_rows = cell.shape == (cell.k,) and placements[0] == Shard(0)
    if one_dim_rows:
        lo, hi = first_ranks_extra(E, cell.k, coord[0])
        other = DTensor.from_local(t[lo:hi], mesh, [Shard(0)], shape=t.shape, stride=t.stride())
        other_text = (f"w = DTensor.from_local(arange[{lo}:{hi}], mesh, [Shard(0)], "
                      f"shape={tuple(t.shape)})")
    expert_dim = expert_mesh_dim(names, placements)
    if expert_dim is not None:
        bad_placements = list(placements)
        bad_placements[expert_dim] = Shard(1)
        bad = distribute_tensor(t, mesh, bad_placements, src_data_rank=None)
        bad_text = f"w = distribute_tensor(arange, mesh, {tuple(bad_placements)})"

    add("is_dtensor", (w,), "w", w_text)
    add("is_dtensor", (t,), "torch.arange(...)")
    add("_get_expert_mesh_dim_index", (w,), "w", w_text)
    add("_get_expert_mesh_dim_index", (t,), "plain tensor")

    for fn in ("get_expert_slice_for_rank", "split_experts_weights_dtensor_aware"):
        add(fn, (w, E), f"w, {E}", w_text, w)
        add(fn, (t, E), f"t, {E}", "t = arange (plain tensor)", t)
        add(fn, (w, E + 1), f"w, {E + 1}", w_text)
        add(fn, (w, 0), "w, 0", w_text)
        add(fn, (partial, E), f"w, {E}", partial_text)
        add(fn, ([0.0] * E, E), f"[0.0] * {E}, {E}")
        if one_dim_rows:
            add(fn, (other, E), f"w, {E}", other_text, other)

    fn = "validate_dtensor_expert_sharding"
    add(fn, (w, E, "w"), f"w, {E}, 'w'", w_text)
    add(fn, (t, E, "w"), f"t, {E}, 'w'", "t = arange (plain tensor)")
    add(fn, (t, E + 1, "w"), f"t, {E + 1}, 'w'", "t = arange (plain tensor)")
    add(fn, (w, E + 1, "w"), f"w, {E + 1}, 'w'", w_text)
    add(fn, (w, 0, "w"), "w, 0, 'w'", w_text)
    add(fn, (partial, E, "w"), f"w, {E}, 'w'", partial_text)
    if expert_dim is not None:
        add(fn, (bad, E, "w"), f"w, {E}, 'w'", bad_text)
    if one_dim_rows:
        add(fn, (other, E, "w"), f"w, {E}, 'w'", other_text)

    # create_dtensor_from_local: this rank's experts by the rule (then its ep_shard part of dim 1).
    local = w.to_local()
    if "ep" in names:
        ep = names.index("ep")
        lo, hi = expert_range(E, mesh.size(ep), coord[ep])
        local = t[lo:hi]
        if "ep_shard" in names:
            d = names.index("ep_shard")
            a, b = expert_range(INNER[0], mesh.size(d), coord[d])
            local = local[:, a:b]
    local = local.clone()  # its own storage, so a copy cannot pass for a view of ``t``
    fn = "create_dtensor_from_local"
    add(fn, (local, mesh), "local, mesh", f"local = {tuple(local.shape)} rows by expert_range",
        local)
    add(fn, (t, None), "t, None", "t = arange (plain tensor)", t)
    add(fn, (w, mesh), "w, mesh", w_text)
    if cell.names == ("ep",):
        lo, hi = first_ranks_extra(E, cell.k, coord[0])
        other_local = t[lo:hi].clone()
        add(fn, (other_local, mesh), "local, mesh", f"local = arange[{lo}:{hi}] (the other split)",
            other_local)
        add(fn, (torch.zeros(0, *INNER), mesh), "torch.zeros(0, 4, 6), mesh")

    fn = "get_expert_range_for_rank_from_mesh"
    add(fn, (mesh, E), f"mesh, {E}")
    add(fn, (None, E), f"None, {E}")
    add(fn, (mesh, 0), "mesh, 0")

    fn = "should_load_expert_for_rank"
    for expert in (*range(E), E, -1):
        add(fn, (expert, mesh, E), f"{expert}, mesh, {E}")
    add(fn, (0, None, E), f"0, None, {E}")
    add(fn, (0, mesh, 0), "0, mesh, 0")
    return cases

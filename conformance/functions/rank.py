"""What a functions-suite cell does on each rank: call the adapter's and the reference's functions on
the same real DTensors and meshes, and compare the outcomes for meaning.

The controller side is :mod:`conformance.functions.merge`; the grid is :mod:`conformance.functions.cells`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from conformance.functions.cells import (
    FUNCTIONS,
    NUM_EXPERTS,
    REFERENCE,
    FunctionsCell,
    load_functions,
    parse_placements,
)
from pytest_moe_ep.text import shorten

__all__ = ["SHOWN", "check_functions"]

#: trailing dims of every grouped weight; Shard(2) of 6 over 4 ranks is uneven (2, 2, 2, 0) on purpose.
INNER = (4, 6)
#: disagreements kept per record; the count says how many there were.
SHOWN = 5
#: longest expected/got text in a record.
TEXT_LIMIT = 200


# ----------------------------------------------------------------------- comparing outcomes


@dataclass(eq=False)
class TensorValue:
    """What matters about a returned tensor: where it sits in the global tensor, its values, aliasing."""

    dtensor: bool
    shape: tuple[int, ...]
    placements: tuple[str, ...]
    mesh_dims: tuple[str, ...] | None
    local: Any  # torch.Tensor, cloned so a later call cannot change it
    aliases: bool | None  # None: the case names no input to alias

    def agrees(self, other: TensorValue) -> bool:
        import torch

        return (
            (self.dtensor, self.shape, self.placements, self.mesh_dims) ==
            (other.dtensor, other.shape, other.placements, other.mesh_dims)
            and (self.aliases is None or other.aliases is None or self.aliases == other.aliases)
            and self.local.dtype == other.local.dtype
            and torch.equal(self.local, other.local)
        )

    def __repr__(self) -> str:
        local = self.local
        values = f"first={local.flatten()[0].item():g} sum={local.sum().item():g}" if local.numel() else "empty"
        storage = "" if self.aliases is None else (", view" if self.aliases else ", copy")
        if self.dtensor:
            return (f"DTensor(shape={self.shape}, {self.placements}, mesh={self.mesh_dims}, "
                    f"local={tuple(local.shape)} {values}{storage})")
        return f"Tensor({tuple(local.shape)} {values}{storage})"


@dataclass(frozen=True)
class MeshValue:
    """A device mesh by what a caller can observe: dim names, shape and which global ranks it spans."""

    names: tuple[str, ...] | None
    shape: tuple[int, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Outcome:
    """A call's result: the error family it raised, or the summary of what it returned."""

    error: str | None
    value: Any
    text: str


def storage_of(tensor: Any) -> int | None:
    """The data pointer of a tensor's (or DTensor's local) storage, the identity aliasing is about."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.untyped_storage().data_ptr() if isinstance(tensor, torch.Tensor) else None


def summarize(value: Any, source: int | None) -> Any:
    """``value`` with tensors and meshes replaced by comparable summaries; ``source`` is the input's storage."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        from torch.distributed.tensor import Replicate

        local = value.to_local()
        mesh = value.device_mesh
        # A size-1 dim that replicates changes nothing a caller can observe: (Replicate(), Shard(0)) over
        # (dp_replicate=1, etp=2) is Shard(0) over etp.
        keep = [i for i, n in enumerate(mesh.shape) if n > 1 or not isinstance(value.placements[i], Replicate)]
        names = tuple(mesh.mesh_dim_names[i] for i in keep) if mesh.mesh_dim_names else None
        return TensorValue(True, tuple(value.shape), tuple(repr(value.placements[i]) for i in keep), names,
                           local.detach().clone(), None if source is None else storage_of(local) == source)
    if isinstance(value, torch.Tensor):
        return TensorValue(False, tuple(value.shape), (), None, value.detach().clone(),
                           None if source is None else storage_of(value) == source)
    if isinstance(value, DeviceMesh):
        return MeshValue(value.mesh_dim_names, tuple(value.shape), tuple(value.mesh.flatten().tolist()))
    if isinstance(value, (tuple, list)):
        items = [summarize(v, source) for v in value]
        return items if isinstance(value, list) else tuple(items)  # torch.Size, namedtuples: plain tuples
    return value


def same(expected: Any, got: Any) -> bool:
    """Semantic equality of summaries: sequences elementwise (tuple or list alike), tensors by meaning."""
    if isinstance(expected, TensorValue) or isinstance(got, TensorValue):
        return isinstance(expected, TensorValue) and isinstance(got, TensorValue) and expected.agrees(got)
    sequences = (tuple, list)
    if isinstance(expected, sequences) or isinstance(got, sequences):
        return (isinstance(expected, sequences) and isinstance(got, sequences) and len(expected) == len(got)
                and all(map(same, expected, got)))
    try:
        return bool(expected == got)
    except Exception:  # an odd object whose == raises is not the same as anything
        return False


def short(text: str, limit: int = TEXT_LIMIT) -> str:
    """One line of at most ``limit`` characters, cut at a word, for reports and JSON."""
    return shorten(str(text), limit)


def error_family(exc: BaseException) -> str:
    """What the comparison sees of an error: ValueError, TypeError, or the class name of anything else."""
    for family in (ValueError, TypeError):
        if isinstance(exc, family):
            return family.__name__
    return type(exc).__name__


def outcome(fn: Callable[..., Any], args: tuple[Any, ...], source: int | None) -> Outcome:
    try:
        value = fn(*args)
    except Exception as exc:
        return Outcome(error_family(exc), None, short(f"raises {type(exc).__name__}: {exc}"))
    summary = summarize(value, source)
    return Outcome(None, summary, short(f"returns {summary!r}"))


def agree(expected: Outcome, got: Outcome) -> bool:
    if expected.error is not None or got.error is not None:
        return expected.error == got.error
    return same(expected.value, got.value)


# ---------------------------------------------------------------------------- the cases


@dataclass
class Case:
    """One call to make on both modules: arguments, how to describe them, and what outputs must alias."""

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

    return torch.arange(num_experts * math.prod(INNER), dtype=torch.float32).reshape(num_experts, *INNER)


def first_ranks_extra(num_experts: int, num_ranks: int, rank: int) -> tuple[int, int]:
    """The tempting split (first E % k ranks get one more); used to build DTensors the rule refuses."""
    base, extra = divmod(num_experts, num_ranks)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def expert_mesh_dim(names: tuple[str, ...], placements: Sequence[Any]) -> int | None:
    """The mesh dim that partitions experts (``ep``, else the first Shard(0)): where a bad placement goes."""
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
    return [Case("get_submesh", (mesh, dims), f"get_submesh(mesh, {text})", None) for dims, text in calls]


def expert_cases(cell: FunctionsCell, mesh: Any, placements: list[Any], num_experts: int) -> list[Case]:
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

    def add(function: str, args: tuple[Any, ...], call: str, where: str = "", source: Any = None) -> None:
        cases.append(Case(function, args, f"{function}({call})" + (f"; {where}" if where else ""), E, source))

    # A DTensor built from the tempting split: valid only where both splits agree.
    one_dim_rows = cell.shape == (cell.k,) and placements[0] == Shard(0)
    if one_dim_rows:
        lo, hi = first_ranks_extra(E, cell.k, coord[0])
        other = DTensor.from_local(t[lo:hi], mesh, [Shard(0)], shape=t.shape, stride=t.stride())
        other_text = f"w = DTensor.from_local(arange[{lo}:{hi}], mesh, [Shard(0)], shape={tuple(t.shape)})"
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
    add(fn, (local, mesh), "local, mesh", f"local = {tuple(local.shape)} rows by expert_range", local)
    add(fn, (t, None), "t, None", "t = arange (plain tensor)", t)
    add(fn, (w, mesh), "w, mesh", w_text)
    if cell.names == ("ep",):
        lo, hi = first_ranks_extra(E, cell.k, coord[0])
        other_local = t[lo:hi].clone()
        add(fn, (other_local, mesh), "local, mesh", f"local = arange[{lo}:{hi}] (the other split)", other_local)
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


@dataclass
class Tally:
    """One function's disagreements on this rank."""

    shown: list[dict[str, Any]] = field(default_factory=list)
    count: int = 0
    failed_num_experts: set[int] = field(default_factory=set)
    missing: str = ""

    def add(self, disagreement: dict[str, Any]) -> None:
        self.count += 1
        if disagreement["E"] is not None:
            self.failed_num_experts.add(disagreement["E"])
        if len(self.shown) < SHOWN:
            self.shown.append(disagreement)


def describe(d: dict[str, Any]) -> str:
    """The one-line story of a disagreement: every input needed to reproduce it."""
    return short(f"rank {d['rank']} E={d['E']} k={d['k']} mesh={d['mesh']} {d['placements']}: {d['inputs']}: "
                 f"expected {d['expected']}; got {d['got']}", 3 * TEXT_LIMIT)


def check_functions(module: str, cell: FunctionsCell, num_experts: Sequence[int] = NUM_EXPERTS) -> list[dict]:
    """Runs on every rank of a ``cell.world_size`` world: compare ``module`` with the reference here.

    Returns this rank's nine records (see the module docstring); a function the adapter lacks is one
    failure of that function.  All ranks make the same calls in the same order, so collective
    functions line up as long as the adapter under test is itself consistent across ranks.
    """
    import torch.distributed as dist

    from pytest_moe_ep.world.meshes import device_mesh

    rank = dist.get_rank()
    reference = load_functions(REFERENCE)
    tallies = {name: Tally() for name in FUNCTIONS}
    try:
        adapter = load_functions(module)
    except Exception as exc:  # every function is then missing, the same way on every rank
        adapter = None
        for tally in tallies.values():
            tally.missing = short(f"missing: cannot load {module!r}: {type(exc).__name__}: {exc}")
    pairs: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}
    for name in FUNCTIONS:
        found = getattr(adapter, name, None) if adapter is not None else None
        if callable(found):
            pairs[name] = (getattr(reference, name), found)
        elif not tallies[name].missing:
            why = f" ({name} is a {type(found).__name__}, not callable)" if found is not None else ""
            tallies[name].missing = f"missing: {module!r} has no function {name!r}{why}"

    common = {"k": cell.k, "mesh": cell.mesh, "placements": cell.placements, "rank": rank}

    def compare(cases: list[Case]) -> None:
        for case in cases:
            if case.function not in pairs:
                continue
            ref_fn, impl_fn = pairs[case.function]
            expected, got = case.run(ref_fn), case.run(impl_fn)
            if not agree(expected, got):
                tallies[case.function].add({"function": case.function, "E": case.num_experts, **common,
                                            "inputs": short(case.inputs, 2 * TEXT_LIMIT),
                                            "expected": expected.text, "got": got.text})

    mesh = device_mesh(cell.shape, cell.names, cell.ranks)
    placements = parse_placements(cell.placements)
    if len(placements) != len(cell.shape):
        raise ValueError(f"{cell}: {len(placements)} placements for a {len(cell.shape)}-dim mesh")
    compare(mesh_cases(cell, mesh))
    for E in num_experts:
        compare(expert_cases(cell, mesh, placements, E))

    records = []
    for name, tally in tallies.items():
        if tally.missing:
            missing = {"function": name, "E": None, **common, "inputs": "", "expected": "a callable",
                       "got": tally.missing}
            tally.shown, tally.count = [missing], 1
            detail = short(f"{name}: rank {rank}: {tally.missing}", 3 * TEXT_LIMIT)
        else:
            detail = short(f"{name}: {describe(tally.shown[0])}", 3 * TEXT_LIMIT) if tally.count else ""
        records.append({
            "suite": "functions", "function": name, "num_experts": list(num_experts), "ep": cell.k,
            "mesh": cell.mesh, "placements": cell.placements, "status": "fail" if tally.count else "pass",
            "detail": detail, "disagreements": tally.shown, "count": tally.count,
            "failed_num_experts": sorted(tally.failed_num_experts), "ranks": [rank] if tally.count else [],
        })
    return records


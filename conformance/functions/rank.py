"""What a functions-suite cell does on each rank: call the adapter's and the reference's functions
on the same real DTensors and meshes, and compare the outcomes for meaning.

The calls are :mod:`conformance.functions.cases`, the comparison
:mod:`conformance.functions.outcomes`; the controller side is :mod:`conformance.functions.merge`;
the grid is :mod:`conformance.functions.cells`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from conformance.functions.cases import Case, expert_cases, mesh_cases
from conformance.functions.cells import (
    FUNCTIONS,
    NUM_EXPERTS,
    REFERENCE,
    FunctionsCell,
    load_functions,
    parse_placements,
)
from conformance.functions.outcomes import TEXT_LIMIT, TensorValue, agree, same, short

# TEXT_LIMIT, TensorValue and same are re-exported for callers of the module before it was split.
__all__ = ["SHOWN", "TEXT_LIMIT", "TensorValue", "check_functions", "same"]

#: disagreements kept per record; the count says how many there were.
SHOWN = 5


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
    return short(f"rank {d['rank']} E={d['E']} k={d['k']} mesh={d['mesh']} {d['placements']}: "
                 f"{d['inputs']}: expected {d['expected']}; got {d['got']}", 3 * TEXT_LIMIT)


def check_functions(module: str, cell: FunctionsCell,
                    num_experts: Sequence[int] = NUM_EXPERTS) -> list[dict]:
    """Runs on every rank of a ``cell.world_size`` world: compare ``module`` with the reference
    here.

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
            why = (f" ({name} is a {type(found).__name__}, not callable)" if found is not None
                   else "")
            tallies[name].missing = f"missing: {module!r} has no function {name!r}{why}"

    common = {"k": cell.k, "mesh": cell.mesh, "placements": cell.placements, "rank": rank}

    def compare(cases: list[Case]) -> None:
        for case in cases:
            if case.function not in pairs:
                continue
            ref_fn, impl_fn = pairs[case.function]
            expected, got = case.run(ref_fn), case.run(impl_fn)
            if not agree(expected, got):
                tallies[case.function].add({"function": case.function, "E": case.num_experts,
                                            **common, "inputs": short(case.inputs, 2 * TEXT_LIMIT),
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
            missing = {"function": name, "E": None, **common, "inputs": "",
                       "expected": "a callable", "got": tally.missing}
            tally.shown, tally.count = [missing], 1
            detail = short(f"{name}: rank {rank}: {tally.missing}", 3 * TEXT_LIMIT)
        else:
            detail = short(f"{name}: {describe(tally.shown[0])}",
                           3 * TEXT_LIMIT) if tally.count else ""
        records.append({
            "suite": "functions", "function": name, "num_experts": list(num_experts), "ep": cell.k,
            "mesh": cell.mesh, "placements": cell.placements, "status": "fail" if tally.count
            else "pass", "detail": detail, "disagreements": tally.shown, "count": tally.count,
            "failed_num_experts": sorted(tally.failed_num_experts),
            "ranks": [rank] if tally.count else [],
        })
    return records

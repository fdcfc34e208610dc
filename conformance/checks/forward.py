"""The ``forward`` check: the framework's own forward after the load equals the ground truth's.

On the suite's batch, each named output (the model's, and each MoE layer's own where the adapter
gives them) within a tolerance of its own scale
(:func:`~conformance.checks.truth.forward_tolerance`: EP sums the experts' parts in another order).
Without ``forward`` the check is skipped with the reason; a ``forward`` that raises
:class:`~conformance.adapter.NotApplicable` skips it with the adapter's.
"""

from __future__ import annotations

from typing import Any

from conformance.adapter import FORWARD_OUTPUT, NotApplicable
from conformance.checks.context import CheckContext, TimedAdapter, required
from conformance.checks.truth import (
    Truth,
    batch_for,
    forward_outputs,
    forward_rtol_atol,
    forward_tolerance,
)
from conformance.checks.verdict import RankVerdict


def _outside(name: str, got: Any, want: Any, scale: float = 1.0) -> str:
    """Why output ``name`` leaves the tolerance (times ``scale``; "" when it does not): its worst
    element, expected vs got."""
    import torch

    where = "" if name == FORWARD_OUTPUT else f" in output {name!r}"
    if got.shape != want.shape:
        return f"the forward{where} gives shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    tolerance = forward_tolerance(want).flatten() * scale
    rtol, atol = (scale * t for t in forward_rtol_atol(want.dtype))
    diff = (got.double() - want.double()).abs().flatten()
    outside = ~(diff <= tolerance)  # NaN is outside
    if not outside.any():
        return ""
    # the largest |diff| outside
    worst = int(torch.where(outside, diff.nan_to_num(float("inf")), -1.0).argmax())
    element = [int(i) for i in torch.unravel_index(torch.tensor(worst), want.shape)]
    expected, found = want.flatten()[worst].item(), got.flatten()[worst].item()
    return (f"the forward after the load differs from the ground truth's{where}: element {element} "
            f"expected {expected:.7g}, got {found:.7g} (|diff| {diff[worst].item():.3g}"
            f" > tolerance {tolerance[worst].item():.3g} = rtol {rtol:g} x |expected| + atol "
            f"{atol:g} x max|expected| {want.double().abs().max().item():.3g}; "
            f"{int(outside.sum())} of {outside.numel()} elements outside)")


def forward_problems(got: dict[str, Any], want: dict[str, Any], scale: float = 1.0) -> list[str]:
    """Where the forward's outputs (by name, :func:`~conformance.checks.truth.forward_outputs`)
    leave the tolerance (:func:`~conformance.checks.truth.forward_tolerance`, times ``scale``): one
    line, the first such output in detail and the names of any others; empty when all match."""
    if list(got) != list(want):
        return [f"the forward gives outputs {list(got)}, expected {list(want)}"]
    found = [(name, line) for name in got
             if (line := _outside(name, got[name], want[name], scale))]
    if not found:
        return []
    others = (f"; also outside: {', '.join(repr(name) for name, _ in found[1:])}" if len(found) > 1
              else "")
    return [found[0][1] + others]


def check_forward(adapter: TimedAdapter, model: Any, spec: Any, truth: Truth, rank: int,
                  verdict: RankVerdict) -> None:
    """A collective when the framework's forward is (EP all-to-all or all-reduce)."""
    if not adapter.members.has("forward") or truth.output is None:
        verdict.skipped["forward"] = (truth.output_not_applicable
                                      or "the adapter has no forward(model, batch)")
        return
    try:
        result = adapter.forward(model, batch_for(spec))
    except NotApplicable as exc:
        verdict.skipped["forward"] = f"the framework's forward cannot run in this cell: {exc}"
        return
    for line in forward_problems(forward_outputs(result, type(adapter).__name__), truth.output):
        verdict.problem("forward", f"rank {rank}: {line}")


def run(ctx: CheckContext) -> None:
    """The loaded model's forward, after ``resume``'s step where there is one: the truth's output is
    the one after the extra step."""
    check_forward(ctx.adapter, ctx.model, ctx.load_spec, required(ctx.truth, "the ground truth"),
                  ctx.rank, ctx.verdict)

"""Resumed training equals uninterrupted training: scalars, the forward, and one more step.

The load side was built with the run's configuration but seed B and one more optimizer step than the save, so a
load that leaves the step count, a schedule's position (and so its lr) or any moment alone changes what comes next
(a constant lr is configuration, the same on both sides: not restoring it is no bug):

- ``scalars``: the adapter's optimizer scalars (step counts, each group's lr, betas, weight decay,
  eps) and the training state's beyond the optimizer (an LR scheduler's ``state_dict``) equal the truth's;
- ``forward``: the framework's own forward on the suite's batch equals the truth's, each named output (the
  model's, and each MoE layer's own where the adapter gives them) within a tolerance of its own scale
  (:func:`~conformance.checks.truth.forward_tolerance`: EP sums the experts' parts in another order);
- ``resume``: one more step with the next step index's synthetic gradients gives every tensor of
  the truth after the same step, bit for bit or within a kernel's rounding (:mod:`conformance.rounding`: a fused
  optimizer steps a shard differently from the whole tensor).

Each needs an optional adapter member (``scalars``, ``forward``, ``step``); without it the check is
skipped with the reason, which the report shows.  A ``forward`` that raises
:class:`~conformance.adapter.NotApplicable` (the framework cannot run its forward in this cell) skips the
check with the adapter's reason.
"""

from __future__ import annotations

from typing import Any

from conformance.adapter import FORWARD_OUTPUT, NotApplicable
from conformance.checks.truth import (
    SEED_A,
    Truth,
    batch_for,
    forward_outputs,
    forward_rtol_atol,
    forward_tolerance,
)
from conformance.checks.values import Held, canonical, compare
from conformance.checks.verdict import Mismatch, RankVerdict
from conformance.inspection.keys import field_of
from conformance.members import Built
from conformance.scalars import all_scalars


def _scalar_lines(got: dict[str, Any], want: dict[str, Any], when: str) -> list[str]:
    """Where ``got`` differs from ``want``.  A name on one side only whose field (:func:`field_of`) the other side
    holds under other names only is that field re-keyed (a dict of schedulers under EP for the truth's one
    scheduler): it agrees when both sides hold the same set of values for it, and is named as re-keyed otherwise.
    A name only ``got`` has, whose field the truth holds with the same value under another name, is structure that
    grew with EP (a scheduler for the experts beside the truth's for the rest), not state; a name only ``want`` has
    is missing unless re-keyed (a lost param group is never excused by another group's equal lr)."""
    only_got = [n for n in got if n not in want]
    only_want = [n for n in want if n not in got]
    moved = {field_of(n) for n in only_got} & {field_of(n) for n in only_want}
    lines = []
    for name in sorted(set(got) & set(want)):
        if got[name] != want[name]:
            lines.append(f"optimizer scalar {name!r} = {got[name]!r} {when}, expected {want[name]!r}")
    for name in sorted(n for n in only_want if field_of(n) not in moved):
        lines.append(f"optimizer scalar {name!r} is missing {when} (expected {want[name]!r})")
    # field -> the truth's values of it: an extra name with one of them is structure, not state
    held: dict[tuple[str, str], set[str]] = {}
    for name, value in want.items():
        held.setdefault(field_of(name), set()).add(repr(value))
    for name in sorted(n for n in only_got if field_of(n) not in moved):
        if repr(got[name]) not in held.get(field_of(name), set()):
            lines.append(f"optimizer scalar {name!r} = {got[name]!r} {when} is not in the ground truth")
    for field in sorted(moved):
        mine = sorted(n for n in only_got if field_of(n) == field)
        theirs = sorted(n for n in only_want if field_of(n) == field)
        values, expected = sorted({repr(got[n]) for n in mine}), sorted({repr(want[n]) for n in theirs})
        if values != expected:
            lines.append(f"optimizer scalar {theirs[0]!r}{f' (and {len(theirs) - 1} more)' if len(theirs) > 1 else ''}"
                         f" is re-keyed {when} as {mine[0]!r}{f' and {len(mine) - 1} more' if len(mine) > 1 else ''}"
                         f": values {', '.join(values)}, expected {', '.join(expected)}")
    return lines


def check_scalars(adapter: Any, b: Built, optimizer: Any, truth: Truth, rank: int, verdict: RankVerdict) -> None:
    if optimizer is None or truth.scalars is None:
        if optimizer is not None:
            verdict.skipped["scalars"] = "the adapter has no scalars(model, optimizer) and build returned no state"
        return
    for line in _scalar_lines(all_scalars(adapter, b, optimizer) or {}, truth.scalars, "after the load"):
        verdict.problem("scalars", f"rank {rank}: {line}")


def _outside(name: str, got: Any, want: Any) -> str:
    """Why output ``name`` leaves the tolerance ("" when it does not): its worst element, expected vs got."""
    import torch

    where = "" if name == FORWARD_OUTPUT else f" in output {name!r}"
    if got.shape != want.shape:
        return f"the forward{where} gives shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    tolerance = forward_tolerance(want).flatten()
    rtol, atol = forward_rtol_atol(want.dtype)
    diff = (got.double() - want.double()).abs().flatten()
    outside = ~(diff <= tolerance)  # NaN is outside
    if not outside.any():
        return ""
    worst = int(torch.where(outside, diff.nan_to_num(float("inf")), -1.0).argmax())  # the largest |diff| outside
    element = [int(i) for i in torch.unravel_index(torch.tensor(worst), want.shape)]
    expected, found = want.flatten()[worst].item(), got.flatten()[worst].item()
    return (f"the forward after the load differs from the ground truth's{where}: element {element} expected "
            f"{expected:.7g}, got {found:.7g} (|diff| {diff[worst].item():.3g}"
            f" > tolerance {tolerance[worst].item():.3g} = rtol {rtol:g} x |expected| + atol {atol:g}"
            f" x max|expected| {want.double().abs().max().item():.3g}; {int(outside.sum())} of {outside.numel()} "
            "elements outside)")


def forward_problems(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Where the forward's outputs (by name, :func:`~conformance.checks.truth.forward_outputs`) leave the tolerance
    (:func:`~conformance.checks.truth.forward_tolerance`): one line, the first such output in detail and the names
    of any others; empty when all match."""
    if list(got) != list(want):
        return [f"the forward gives outputs {list(got)}, expected {list(want)}"]
    found = [(name, line) for name in got if (line := _outside(name, got[name], want[name]))]
    if not found:
        return []
    others = f"; also outside: {', '.join(repr(name) for name, _ in found[1:])}" if len(found) > 1 else ""
    return [found[0][1] + others]


def check_forward(adapter: Any, model: Any, spec: Any, truth: Truth, rank: int, verdict: RankVerdict) -> None:
    """A collective when the framework's forward is (EP all-to-all or all-reduce)."""
    if not adapter.members.has("forward") or truth.output is None:
        verdict.skipped["forward"] = truth.output_not_applicable or "the adapter has no forward(model, batch)"
        return
    try:
        result = adapter.forward(model, batch_for(spec))
    except NotApplicable as exc:
        verdict.skipped["forward"] = f"the framework's forward cannot run in this cell: {exc}"
        return
    for line in forward_problems(forward_outputs(result, type(adapter).__name__), truth.output):
        verdict.problem("forward", f"rank {rank}: {line}")


def check_next_step(adapter: Any, b: Built, optimizer: Any, spec: Any, truth: Truth, before: Held, rank: int,
                    verdict: RankVerdict) -> None:
    """One more step (a collective under FSDP2), then every tensor against the truth's next state."""
    if optimizer is None:
        return
    if not adapter.members.has("step") or truth.next_state is None:
        verdict.skipped["resume"] = "the adapter has no step(model, optimizer, seed, step)"
        return
    adapter.step(b.model, optimizer, SEED_A, spec.optimizer_steps, **b.extra)
    after = canonical(adapter, b.model, optimizer, rank, copy=False)
    resumed = RankVerdict(rank)
    compare(rank, after, truth.next_state, before, resumed)
    for m in resumed.mismatches:
        verdict.add(Mismatch(m.rank, m.layer, m.expert, m.name, f"after one more step: {m.problem}", "resume"))
    verdict.mismatch_count += resumed.mismatch_count - len(resumed.mismatches)
    verdict.rounded_count += resumed.rounded_count
    verdict.rounded_ulps = max(verdict.rounded_ulps, resumed.rounded_ulps)
    if truth.next_scalars is not None:
        for line in _scalar_lines(all_scalars(adapter, b, optimizer) or {}, truth.next_scalars,
                                  "after one more step"):
            verdict.problem("resume", f"rank {rank}: {line}")

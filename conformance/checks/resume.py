"""Resumed training equals uninterrupted training: scalars, the forward, and one more step.

The load side was built with seed B, one more optimizer step than the save and another learning
rate, so a load that leaves the step count, the lr or any moment alone changes what comes next:

- ``scalars``: the adapter's optimizer scalars (step counts, each group's lr, betas, weight decay,
  eps) and the training state's beyond the optimizer (an LR scheduler's ``state_dict``) equal the truth's;
- ``forward``: the framework's own forward on the suite's batch equals the truth's output (within
  :data:`~conformance.checks.truth.FORWARD_RTOL`: EP sums the experts' parts in another order);
- ``resume``: one more step with the next step index's synthetic gradients gives every tensor of
  the truth after the same step, bit for bit.

Each needs an optional adapter member (``scalars``, ``forward``, ``step``); without it the check is
skipped with the reason, which the report shows.  A ``forward`` that raises
:class:`~conformance.adapter.NotApplicable` (the framework cannot run its forward in this cell) skips the
check with the adapter's reason.
"""

from __future__ import annotations

from typing import Any

from conformance.adapter import Built, NotApplicable, state_scalars
from conformance.checks.truth import FORWARD_ATOL, FORWARD_RTOL, SEED_A, Truth, batch_for
from conformance.checks.values import Held, canonical, compare
from conformance.checks.verdict import Mismatch, RankVerdict


def _scalar_lines(got: dict[str, Any], want: dict[str, Any], when: str) -> list[str]:
    lines = []
    for name in sorted(set(got) | set(want)):
        if name not in got:
            lines.append(f"optimizer scalar {name!r} is missing {when} (expected {want[name]!r})")
        elif name not in want:
            lines.append(f"optimizer scalar {name!r} = {got[name]!r} {when} is not in the ground truth")
        elif got[name] != want[name]:
            lines.append(f"optimizer scalar {name!r} = {got[name]!r} {when}, expected {want[name]!r}")
    return lines


def all_scalars(adapter: Any, b: Built, optimizer: Any) -> dict[str, Any] | None:
    """The adapter's ``scalars`` and the training state's (:func:`~conformance.adapter.state_scalars`); ``None``
    when there are neither."""
    found = dict(adapter.scalars(b.model, optimizer, **b.extra)) if adapter.members.scalars else None
    extra = state_scalars(b.state)
    if extra:
        found = {**(found or {}), **extra}
    return found


def check_scalars(adapter: Any, b: Built, optimizer: Any, truth: Truth, rank: int, verdict: RankVerdict) -> None:
    if optimizer is None or truth.scalars is None:
        if optimizer is not None:
            verdict.skipped["scalars"] = "the adapter has no scalars(model, optimizer) and build returned no state"
        return
    for line in _scalar_lines(all_scalars(adapter, b, optimizer) or {}, truth.scalars, "after the load"):
        verdict.problem("scalars", f"rank {rank}: {line}")


def check_forward(adapter: Any, model: Any, spec: Any, truth: Truth, rank: int, verdict: RankVerdict) -> None:
    """A collective when the framework's forward is (EP all-to-all or all-reduce)."""
    import torch

    if not adapter.members.forward or truth.output is None:
        verdict.skipped["forward"] = truth.output_not_applicable or "the adapter has no forward(model, batch)"
        return
    try:
        out = adapter.forward(model, batch_for(spec)).detach().cpu()
    except NotApplicable as exc:
        verdict.skipped["forward"] = f"the framework's forward cannot run in this cell: {exc}"
        return
    want = truth.output
    if out.shape != want.shape:
        verdict.problem("forward", f"rank {rank}: the forward gives shape {tuple(out.shape)}, expected "
                        f"{tuple(want.shape)}")
    elif not torch.allclose(out.double(), want.double(), rtol=FORWARD_RTOL, atol=FORWARD_ATOL):
        diff = (out.double() - want.double()).abs().max().item()
        verdict.problem("forward", f"rank {rank}: the forward after the load differs from the ground truth's "
                        f"(max abs diff {diff:.3g}, tolerance rtol={FORWARD_RTOL:g} atol={FORWARD_ATOL:g})")


def check_next_step(adapter: Any, b: Built, optimizer: Any, spec: Any, truth: Truth, before: Held, rank: int,
                    verdict: RankVerdict) -> None:
    """One more step (a collective under FSDP2), then every tensor against the truth's next state."""
    if optimizer is None:
        return
    if not adapter.members.step or truth.next_state is None:
        verdict.skipped["resume"] = "the adapter has no step(model, optimizer, seed, step)"
        return
    adapter.step(b.model, optimizer, SEED_A, spec.optimizer_steps, **b.extra)
    after = canonical(adapter, b.model, optimizer, rank)
    resumed = RankVerdict(rank)
    compare(rank, after, truth.next_state, before, resumed)
    for m in resumed.mismatches:
        verdict.add(Mismatch(m.rank, m.layer, m.expert, m.name, f"after one more step: {m.problem}", "resume"))
    verdict.mismatch_count += resumed.mismatch_count - len(resumed.mismatches)
    if truth.next_scalars is not None:
        for line in _scalar_lines(all_scalars(adapter, b, optimizer) or {}, truth.next_scalars,
                                  "after one more step"):
            verdict.problem("resume", f"rank {rank}: {line}")

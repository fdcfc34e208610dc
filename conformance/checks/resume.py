"""The ``resume`` check: resumed training equals uninterrupted training.

One more step after the load, with the next step index's synthetic gradients, gives every tensor of
the truth after the same step, bit for bit or within a kernel's rounding
(:mod:`conformance.rounding`: a fused optimizer steps a shard differently from the whole tensor),
and the truth's scalars after it. The load side ran one step more than the save, so a moment or a
step count left alone shows here. Without ``step`` the check is skipped with the reason.
"""

from __future__ import annotations

from typing import Any

from conformance.checks.context import CheckContext, TimedAdapter, required
from conformance.checks.scalars import scalar_lines
from conformance.checks.truth import SEED_A, Truth
from conformance.checks.values import Held, canonical, compare
from conformance.checks.verdict import Mismatch, RankVerdict
from conformance.members import Built
from conformance.scalars import all_scalars


def check_next_step(adapter: TimedAdapter, b: Built, optimizer: Any, spec: Any, truth: Truth,
                    before: Held, rank: int, verdict: RankVerdict) -> None:
    """One more step (a collective under FSDP2), then every tensor against the truth's next
    state."""
    if optimizer is None:
        return
    if not adapter.members.has("step") or truth.next_tensors is None:
        verdict.skipped["resume"] = "the adapter has no step(model, optimizer, seed, step)"
        return
    adapter.step(b.model, optimizer, SEED_A, spec.optimizer_steps, **b.extra)
    after = canonical(adapter, b.model, optimizer, rank, copy=False)
    resumed = RankVerdict(rank)
    compare(rank, after, truth.next_tensors, before, resumed)
    for m in resumed.mismatches:
        verdict.add(Mismatch(m.rank, m.layer, m.expert, m.name, f"after one more step: {m.problem}",
                             "resume"))
    verdict.mismatch_count += resumed.mismatch_count - len(resumed.mismatches)
    verdict.rounded_count += resumed.rounded_count
    verdict.rounded_ulps = max(verdict.rounded_ulps, resumed.rounded_ulps)
    if truth.next_scalars is not None:
        for line in scalar_lines(all_scalars(adapter, b, optimizer) or {}, truth.next_scalars,
                                  "after one more step"):
            verdict.problem("resume", f"rank {rank}: {line}")


def run(ctx: CheckContext) -> None:
    """One more step on the loaded model: after the checks that read the loaded state, since it
    changes it."""
    check_next_step(ctx.adapter, required(ctx.built, "the load side's build"), ctx.optimizer,
                    ctx.load_spec, required(ctx.truth, "the ground truth"),
                    required(ctx.before, "the state before the load"), ctx.rank, ctx.verdict)

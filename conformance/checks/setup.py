"""The ``setup`` check: the experiment itself is sound -- a load that does nothing cannot pass.

The load side is built with seed B (and one more optimizer step) so that every tensor the load must
write differs from the ground truth (seed A) before the load; a build whose tensors already equal
the truth would let a load that writes nothing pass every later check.  An adapter that yields a
tensor twice is named here too (:func:`conformance.checks.values.canonical`).

A model the spec asks to have no shared expert (:attr:`~conformance.adapter.Capabilities.
shared_expert` ``False``: a Qwen3-MoE family) must hold none: a build that ignored the spec would
test another model than the report names.  Which tensors are a shared expert's is read from their
names here -- the one place a name decides anything, and only about the experiment: the other
direction (a family with one) is not checked, since not every framework names its shared expert so
(DeepSpeed's residual MoE calls it ``mlp``).

Its finding is ``error``: what it finds is wrong with the adapter or the harness, not with the
framework's checkpoint.  It is a check all the same -- a row of the table, reported under its own
name -- so that a cell that cannot tell a working load from a missing one says so instead of
passing; a passing cell does not list it (it is no promise about the framework).
"""

from __future__ import annotations

from conformance.checks.context import CheckContext, required
from conformance.checks.held import settle
from conformance.checks.truth import SEED_A, SEED_B
from conformance.checks.values import equal, expected

__all__ = ["run"]


def run(ctx: CheckContext) -> None:
    """The load side's state before the load against the ground truth: blocks at once, the rest one
    by one."""
    before = required(ctx.before, "the state before the load")
    if not ctx.load_spec.shared_expert:
        shared = sorted(str(k[2]) for k in before if k[1] is None and "shared" in str(k[2]).lower())
        if shared:
            ctx.verdict.problem(
                "setup", f"rank {ctx.rank}: the adapter declares no shared expert "
                f"(capabilities.shared_expert=False) and the spec asks for none, but the build "
                f"holds {len(shared)} shared-expert tensor(s), e.g. {shared[0]!r}: build() must "
                "honour spec.shared_expert")
    truth = required(ctx.truth, "the ground truth").tensors
    settled, _, rest = settle(before, truth)
    same = {*settled, *(k for k in rest if equal(before[k][0], expected(truth, k, before[k][1])))}
    # an empty shard equals anything: FSDP2 leaves a rank none of a tensor with fewer rows than
    # ranks (a LoRA A of rank 2 over dp_shard=4), and such a rank has nothing a load must write
    same = {k for k in same if _held_any(before[k][0])}
    experts_unchanged = sorted((k for k in same if k[1] is not None), key=repr)
    if before and (experts_unchanged or len(same) == len(before)):
        ctx.verdict.problem(
            "setup", f"rank {ctx.rank}: the build with seed {SEED_B} already equals the ground "
            f"truth (seed {SEED_A}) for {len(experts_unchanged) or len(before)} tensor(s), e.g. "
            f"{(experts_unchanged or list(before))[0]}: a load that does nothing would pass; "
            "build() must derive every expert's values from its seed")


def _held_any(tensor: object) -> bool:
    """Whether this rank holds any element of ``tensor`` (anything but a tensor: assumed so)."""
    numel = getattr(tensor, "numel", None)
    return not callable(numel) or bool(numel())

"""The ``scalars`` check: the optimizer's scalars and the training state's come back.

The load side was built with the run's configuration but seed B and one more optimizer step than the
save, so a load that leaves the step count or a schedule's position (and so its lr) alone shows here
(a constant lr is configuration, the same on both sides: not restoring it is no bug).  Compared: the
adapter's ``scalars`` (step counts, each group's lr, betas, weight decay, eps) and the training
state's beyond the optimizer (an LR scheduler's ``state_dict``), read by :mod:`conformance.scalars`.
Without ``scalars`` and without training state the check is skipped with the reason.
"""

from __future__ import annotations

from typing import Any

from conformance.checks.context import CheckContext, TimedAdapter, required
from conformance.checks.truth import Truth
from conformance.checks.verdict import RankVerdict
from conformance.inspection.keys import field_of
from conformance.members import Built
from conformance.scalars import all_scalars


def scalar_lines(got: dict[str, Any], want: dict[str, Any], when: str) -> list[str]:
    """Where ``got`` differs from ``want``.  A name on one side only whose field (:func:`field_of`)
    the other side holds under other names only is that field re-keyed (a dict of schedulers under
    EP for the truth's one scheduler): it agrees when both sides hold the same set of values for it,
    and is named as re-keyed otherwise. A name only ``got`` has, whose field the truth holds with
    the same value under another name, is structure that grew with EP (a scheduler for the experts
    beside the truth's for the rest), not state; a name only ``want`` has is missing unless re-keyed
    (a lost param group is never excused by another group's equal lr)."""
    only_got = [n for n in got if n not in want]
    only_want = [n for n in want if n not in got]
    moved = {field_of(n) for n in only_got} & {field_of(n) for n in only_want}
    lines = []
    for name in sorted(set(got) & set(want)):
        if got[name] != want[name]:
            lines.append(f"optimizer scalar {name!r} = {got[name]!r} {when}, expected "
                         f"{want[name]!r}")
    for name in sorted(n for n in only_want if field_of(n) not in moved):
        lines.append(f"optimizer scalar {name!r} is missing {when} (expected {want[name]!r})")
    # field -> the truth's values of it: an extra name with one of them is structure, not state
    held: dict[tuple[str, str], set[str]] = {}
    for name, value in want.items():
        held.setdefault(field_of(name), set()).add(repr(value))
    for name in sorted(n for n in only_got if field_of(n) not in moved):
        if repr(got[name]) not in held.get(field_of(name), set()):
            lines.append(f"optimizer scalar {name!r} = {got[name]!r} {when} is not in the ground "
                         "truth")
    for field in sorted(moved):
        mine = sorted(n for n in only_got if field_of(n) == field)
        theirs = sorted(n for n in only_want if field_of(n) == field)
        values, expected = (sorted({repr(got[n]) for n in mine}),
                            sorted({repr(want[n]) for n in theirs}))
        if values != expected:
            lines.append("optimizer scalar "
                         f"{theirs[0]!r}"
                         f"{f' (and {len(theirs) - 1} more)' if len(theirs) > 1 else ''}"
                         f" is re-keyed {when} as "
                         f"{mine[0]!r}{f' and {len(mine) - 1} more' if len(mine) > 1 else ''}"
                         f": values {', '.join(values)}, expected {', '.join(expected)}")
    return lines


def check_scalars(adapter: TimedAdapter, b: Built, optimizer: Any, truth: Truth, rank: int,
                  verdict: RankVerdict) -> None:
    if optimizer is None or truth.scalars is None:
        if optimizer is not None:
            verdict.skipped["scalars"] = ("the adapter has no scalars(model, optimizer) and build "
                                          "returned no state")
        return
    for line in scalar_lines(all_scalars(adapter, b, optimizer) or {}, truth.scalars,
                             "after the load"):
        verdict.problem("scalars", f"rank {rank}: {line}")


def run(ctx: CheckContext) -> None:
    check_scalars(ctx.adapter, required(ctx.built, "the load side's build"), ctx.optimizer,
                  required(ctx.truth, "the ground truth"), ctx.rank, ctx.verdict)

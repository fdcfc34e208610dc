"""A legacy cell's check (``refusal``): the framework refuses a lossy checkpoint instead of loading
it.

The legacy save (``save_legacy``, the framework's own old save) holds each EP rank's experts under
local names, so a load at another layout gives ranks other experts' values.  The cell passes only on
a real refusal: the framework's guard ``check_saved`` raising before the load, or the load raising
one of the adapter's declared ``refusal_errors``.  Any other error is not a refusal (a crash is no
guard), and a load that succeeds is the silent corruption the cell exists to catch.
"""

from __future__ import annotations

import time
from typing import Any

from conformance.checks.blame import load_errors, one_line
from conformance.checks.context import CheckContext, TimedAdapter, required
from conformance.checks.values import canonical, compare
from conformance.checks.verdict import RankVerdict
from conformance.members import Built


def load_legacy(adapter: TimedAdapter, b: Built, optimizer: Any, path: str,
                verdict: RankVerdict) -> bool:
    """Try to load the legacy checkpoint at ``path``; ``True`` only when it loaded (not refused: the
    values show the damage), with ``verdict.refused`` or ``verdict.not_refused`` saying which."""
    members = adapter.members
    if members.has("check_saved"):
        try:
            adapter.check_saved(b.model, path)
        # the framework's own guard refused before loading: that is the point
        except load_errors() as exc:
            verdict.refused = f"refused by check_saved: {one_line(exc)}"
            return False
    refusals = members.value("refusal_errors")
    try:
        adapter.load(b.model, optimizer, path, **b.extra)
    except load_errors() as exc:
        if refusals and isinstance(exc, refusals):
            verdict.refused = f"refused by the load: {one_line(exc)}"
        else:
            declared = ", ".join(t.__name__ for t in refusals) or "none declared"
            verdict.not_refused = (f"not refused: the load failed with {one_line(exc)} (the "
                                   f"adapter's refusal errors: {declared})")
            verdict.load_raised = True
        return False
    verdict.not_refused = "not refused: the load of a legacy checkpoint succeeded"
    return True


def run(ctx: CheckContext) -> None:
    """A legacy cell's load: decided by the refusal; a load that succeeded shows its damage in the
    values (the later checks' collectives may not pair after a lossy load: the cell ends here)."""
    b = required(ctx.built, "the load side's build")
    started = time.perf_counter()
    if load_legacy(ctx.adapter, b, ctx.saved_optimizer, ctx.plan.path, ctx.verdict):
        ctx.verdict.timings["load"] = time.perf_counter() - started
        got = canonical(ctx.adapter, b.model, ctx.optimizer, ctx.rank, ctx.verdict, copy=False)
        compare(ctx.rank, got, required(ctx.truth, "the ground truth").tensors,
                required(ctx.before, "the state before the load"), ctx.verdict)

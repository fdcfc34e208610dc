"""The ``hf_import`` check: the ep=1 Hugging Face export, loaded by the framework's own import at
every layout, gives the ep=1 state.

In every model-only cell, on the load side: the ep=1 export loaded at the cell's load layout into a
model built with another seed gives the ep=1 state, every expert and the bias included; a tensor
left at its initial value is named so (``silent``).  An import that raises is named as
``import_hf``'s (``refused``), after any problem of the export it read, and the DCP checks stand.
Where it runs and the ep=1 export it reads: :mod:`conformance.checks.hf`.
"""

from __future__ import annotations

from collections.abc import Callable

from conformance.checks.context import CheckContext, TimedAdapter, required
from conformance.checks.hf import IMPORT, called, why_no_truth
from conformance.checks.missing import check_replicas
from conformance.checks.truth import Truth
from conformance.checks.values import canonical, compare
from conformance.checks.verdict import RankVerdict
from conformance.matrix import Cell
from conformance.members import Built
from conformance.saves import export_dir

__all__ = ["check_import", "run"]


def run(ctx: CheckContext) -> None:
    """Last in the cell: the load side's model is dropped before the import's own build."""
    truth = required(ctx.truth, "the ground truth")
    assert ctx.plan.truth_path is not None, "asked only where the truth checkpoint is written"
    ctx.release()
    check_import(ctx.adapter, ctx.cell, ctx.rebuild, ctx.plan.truth_path, truth, ctx.rank,
                 ctx.verdict)


def check_import(adapter: TimedAdapter, cell: Cell, build: Callable[[], Built], truth_path: str,
                 truth: Truth, rank: int, verdict: RankVerdict) -> None:
    """The ep=1 export loaded into ``build()`` (the load side's build, another seed) against the
    ground truth; every difference a ``hf_import`` mismatch, a tensor the import left alone named
    so."""
    source = export_dir(truth_path)
    why = why_no_truth(source)
    if why:
        verdict.skipped[IMPORT] = why
        return
    b = build()
    before = canonical(adapter, b.model, None, rank)
    not_here, refused = called(adapter, "import_hf", lambda: adapter.import_hf(b.model, source),
                          f"importing the ep=1 export at {cell.load.describe()}")
    if not_here is not None:
        verdict.skipped[IMPORT] = f"the framework cannot import in this cell: {not_here}"
        return
    if refused is not None:
        verdict.problem(IMPORT, refused[1], refused[0])
        return
    got = canonical(adapter, b.model, None, rank, copy=False)
    found = RankVerdict(rank)
    compare(rank, got, truth.tensors, before, found)
    check_replicas(rank, got, truth.tensors, cell.load, cell.fsdp, found)
    for mismatch in found.mismatches:
        mismatch.check = IMPORT
        mismatch.problem = f"after the import of the ep=1 Hugging Face export: {mismatch.problem}"
        verdict.add(mismatch)
    for problem in found.problems:
        verdict.problem(IMPORT, f"after the ep=1 export's import: {problem.text}")

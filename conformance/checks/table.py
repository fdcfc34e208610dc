"""The checks, one row each: the one list of what the matrix promises and where each promise is
checked.

The cell runner (:mod:`conformance.checks.cell`) loops over :data:`TABLE` at each stage of a cell;
the controller reads the same rows for what the words and the findings need -- each check's
finding (:data:`CHECK_FINDING`), the promises in the order a failure lists them
(:data:`CHECKS`), the checks a passing cell names (:func:`checks_run`).  A check is its module's
``run(ctx)`` and its row here; nothing else lists check names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from conformance.checks import (
    checkpoint,
    forward,
    hf,
    hf_export,
    hf_import,
    layout,
    missing,
    refusal,
    resume,
    scalars,
    setup,
    values,
)
from conformance.checks.context import CheckContext, Stage
from conformance.checks.verdict import RankVerdict
from conformance.findings import ERROR, ON_DISK, SILENT
from conformance.matrix import Cell

__all__ = ["CHECKS", "CHECK_FINDING", "LISTED", "TABLE", "WHERE_RUN", "Check", "checks_run"]


def every_cell(cell: Cell) -> bool:
    """Any cell: what the experiment itself needs holds in a legacy cell too."""
    return True


def not_legacy(cell: Cell) -> bool:
    """The cells whose checkpoint promises EP-invariance: a legacy file is lossy by design, and
    only its refusal is checked."""
    return not cell.legacy


def legacy(cell: Cell) -> bool:
    """Legacy cells: the framework's old, lossy save, which a load must refuse."""
    return cell.legacy


def with_optimizer(cell: Cell) -> bool:
    """``model+optim`` cells: where the optimizer's state is saved and loaded."""
    return not cell.legacy and cell.state == "model+optim"


def model_only(cell: Cell) -> bool:
    """``model`` cells: where a Hugging Face export (weights only) is the whole state."""
    return not cell.legacy and cell.state == "model"


@dataclass(frozen=True)
class Check:
    """One check: what the report calls it, what its problems are evidence of, what it promises,
    when and where it runs, and the code that runs it."""

    #: as the report prints it (``[values] ...``, ``checks: ...``), and its module's name.
    name: str
    #: the finding its problems are evidence of (:mod:`conformance.findings`).
    finding: str
    #: what a cell that passes it was promised (the matrix's promise, one line).
    promise: str
    #: when in the cell it runs (:data:`conformance.checks.context.STAGES`).
    stage: Stage
    #: ``run(ctx)``: its problems go to ``ctx.verdict``; a reason in ``ctx.verdict.skipped[name]``
    #: when it could not check (then it is not listed as run).
    run: Callable[[CheckContext], None]
    #: the cells it runs in, known from the cell alone (the controller asks this too).
    cells: Callable[[Cell], bool] = not_legacy
    #: for a check that also depends on the adapter, asked on the rank once the cell is known:
    #: ``None`` it runs, ``""`` it is not asked (nothing to say), else why it cannot (listed as
    #: skipped when the cell ends).  Such a check is named in a passing cell only where it ran.
    asked: Callable[[CheckContext], str | None] | None = None
    #: a passing cell names it among the checks it kept (``checks: ...``): a promise about the
    #: framework's checkpoint, not about the experiment or a legacy file.
    listed: bool = True


#: every check, in the order a cell's failure lists their problems (and within a stage, the order
#: they run in: ``forward`` after ``resume``, since the truth's output is after the extra step).
TABLE: tuple[Check, ...] = (
    Check("checkpoint", ON_DISK, "the checkpoint is EP-invariant (same keys, shapes, dtypes and "
          "values as the ep=1 save)", "written", checkpoint.run),
    Check("values", SILENT, "every tensor equals what the checkpoint holds after the load, and "
          "that the ep=1 ground truth", "loaded", values.run),
    Check("missing", SILENT, "nothing the ground truth holds goes missing in the load", "loaded",
          missing.run),
    Check("scalars", SILENT, "optimizer scalars (step, lr, betas, ...) come back", "loaded",
          scalars.run, with_optimizer),
    Check("resume", SILENT, "the next training step equals uninterrupted training", "loaded",
          resume.run, with_optimizer),
    Check("forward", SILENT, "the loaded model's forward equals the ground truth's", "loaded",
          forward.run),
    Check("hf_export", ON_DISK, "the Hugging Face export at every layout is the ep=1 export, "
          "complete for its model class, and computes the framework's forward", "saved",
          hf_export.run, model_only, hf.asked),
    Check("hf_import", SILENT, "the ep=1 Hugging Face export loaded at every layout gives the ep=1 "
          "state", "loaded", hf_import.run, model_only, hf.asked),
    Check("layout", ERROR, "each rank holds the experts the cell's layout gives its EP rank, and "
          "its pipeline stage's layers", "built", layout.run, every_cell, listed=False),
    Check("setup", ERROR, "the experiment itself is sound", "loading", setup.run, every_cell,
          listed=False),
    Check("refusal", ON_DISK, "a lossy legacy checkpoint is refused", "loading", refusal.run,
          legacy, listed=False),
)

#: each check's promise, in the table's order.
CHECKS: dict[str, str] = {c.name: c.promise for c in TABLE}
#: the checks a passing cell lists as run ("checks: ..."), in that order: the promises a green cell
#: kept.
LISTED: tuple[str, ...] = tuple(c.name for c in TABLE if c.listed)
#: checks listed only where a rank ran them: whether they are asked depends on the adapter.
WHERE_RUN: tuple[str, ...] = tuple(c.name for c in TABLE if c.asked is not None)
#: the finding each check's problem is evidence of.
CHECK_FINDING: dict[str, str] = {c.name: c.finding for c in TABLE}


def checks_run(cell: Cell, verdicts: Iterable[RankVerdict],
               skipped: Mapping[str, str]) -> list[str]:
    """The checks a passing ``cell`` names as kept, in :data:`LISTED`'s order: those of its cells
    that were not ``skipped``, and of the ones asked by the adapter, those a rank ran."""
    ran = {name for v in verdicts for name in v.ran}
    return [c.name for c in TABLE if c.listed and c.cells(cell) and c.name not in skipped
            and (c.asked is None or c.name in ran)]

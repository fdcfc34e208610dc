"""What a check is given: the cell's experiment as far as it has got (:class:`CheckContext`), and
the adapter as the checks call it (:class:`TimedAdapter`).

A check reads the context and writes only to ``ctx.verdict``; the cell runner
(:mod:`conformance.checks.cell`) fills the context in as the experiment goes, so a check sees the
same objects its neighbours do and none of them rebuilds or re-reads what the cell already holds.
Which fields are set depends on the check's stage (:data:`STAGES`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from conformance.adapter import Spec
from conformance.layout import ParallelLayout
from conformance.matrix import Cell
from conformance.members import Built, Members
from conformance.saves import CellPlan

if TYPE_CHECKING:
    from conformance.checks.held import Held
    from conformance.checks.saved import Saved
    from conformance.checks.truth import Truth
    from conformance.checks.verdict import RankVerdict

__all__ = ["STAGES", "CheckContext", "Stage", "TimedAdapter", "required", "saved_optimizer"]

#: when in a cell a check runs, in the order a cell reaches them:
#:
#: - ``built``: right after each side's build (``ctx.side`` says which; the save side's only in the
#:   cell that writes the save), before anything else reads the model;
#: - ``saved``: in the cell that writes the save, right after it, the save side's model still built;
#: - ``written``: the checkpoint on disk (and inspected), before the load side is built;
#: - ``loading``: the load side built, its state before the load read (``ctx.before``), not loaded;
#: - ``loaded``: after a load that returned (``ctx.got``: what it gave).
Stage = Literal["built", "saved", "written", "loading", "loaded"]
STAGES: tuple[Stage, ...] = ("built", "saved", "written", "loading", "loaded")

T = TypeVar("T")


class TimedAdapter(Protocol):
    """The cell's adapter as every check gets it: each framework call
    (:func:`conformance.adapter.framework_calls`) timed and remembered if it raises, and ``members``
    -- what the controller resolved of the adapter (which optional members it has, its
    capabilities) -- beside them, so no check probes the adapter for a member itself.  Any other
    attribute is the adapter's own."""

    members: Members

    def raised_from(self, exc: BaseException) -> str | None:
        """The framework call ``exc`` (or what it wraps) came out of, if any."""

    def __getattr__(self, name: str) -> Any: ...


def required(value: T | None, what: str) -> T:
    """``value``, which the check's stage guarantees is set (a check in the wrong stage fails
    here, naming what it lacked)."""
    if value is None:
        raise RuntimeError(f"a check read {what} before the cell had it: wrong stage in the table")
    return value


def saved_optimizer(adapter: TimedAdapter, b: Built, optim: bool) -> Any:
    """The optimizer ``save``/``load`` get: the state's, or in model-only cells the step-0 one if
    the framework's checkpoint always holds one (``capabilities.model_saves_optimizer``), else
    ``None``."""
    return b.optimizer if optim or adapter.members.capabilities.model_saves_optimizer else None


@dataclass
class CheckContext:
    """One cell on one rank, as the checks read it."""

    adapter: TimedAdapter
    cell: Cell
    plan: CellPlan
    save_spec: Spec
    load_spec: Spec
    rank: int
    verdict: RankVerdict
    #: whether the Hugging Face checks run in this cell, decided once per cell
    #: (:func:`conformance.checks.hf.applies`): ``None`` they do, ``""`` not asked, else why not.
    hf: str | None
    #: the load side built again (its spec, layout and seed): for a check that needs a model of its
    #: own to load into.
    rebuild: Callable[[], Built]
    #: the side whose build :attr:`built` is: ``"save"`` or ``"load"``.
    side: str = "save"
    built: Built | None = None
    #: the ground truth of the load side's spec (the ep=1 model with seed A).
    truth: Truth | None = None
    #: the load side's state before the load (seed B, one more step).
    before: Held | None = None
    #: the load side's state after the load; not a copy: read it before the framework runs again.
    got: Held | None = None
    #: the save side's state as the checkpoint holds it, where this world kept it.
    kept: Saved | None = None
    #: the ground truth of the save side's spec, on rank 0 where :attr:`kept` is set.
    saved_truth: Mapping[Any, Any] | None = None

    @property
    def optim(self) -> bool:
        """The cell checks the optimizer's state too (``model+optim``)."""
        return self.cell.state == "model+optim"

    @property
    def spec(self) -> Spec:
        """The spec of :attr:`side`."""
        return self.save_spec if self.side == "save" else self.load_spec

    @property
    def layout(self) -> ParallelLayout:
        """The layout of :attr:`side`."""
        return self.cell.save if self.side == "save" else self.cell.load

    @property
    def model(self) -> Any:
        return required(self.built, "the built model").model

    @property
    def optimizer(self) -> Any:
        """The build's optimizer in a ``model+optim`` cell, else ``None``: what the checks read."""
        return required(self.built, "the built model").optimizer if self.optim else None

    @property
    def saved_optimizer(self) -> Any:
        """The optimizer ``save``/``load`` of :attr:`built` get (:func:`saved_optimizer`)."""
        return saved_optimizer(self.adapter, required(self.built, "the built model"), self.optim)

    def release(self) -> None:
        """Drop the load side's model and what was read of it: a check that builds a model of its
        own frees the memory first."""
        self.built = self.got = None

"""One pytest Item per matrix cell, run through the world engine (controller side).

Node ids read like ``moe-ep-matrix::checkpoint::unpacked::model+optim::fsdp::ep2->ep4``, so ``-k``,
``-x``, ``--junitxml``, pytest-timeout and pytest-xdist work on cells as on any test.  Every cell
runs in the session's persistent world; a cell that stops keeps it when every rank raised in step
(a refused load), else gets a fresh one (:mod:`pytest_moe_ep.world.health`), and the rest of the
matrix runs on.  Each cell attaches its report record (a :class:`~conformance.record.CellRecord`).
The session hands every item a :class:`CellContext` when it collects them: what a cell needs of the
session, so an item never looks the session up (and this module never imports it).  A cell stopped
by Ctrl-C or SIGTERM hands its record, status ``interrupted``, to the context's ``interrupted``
list: pytest makes no report for it.  A save that fails for want of disk space or permission stops
the cell with the finding ``error``, whose first line says where, how much space was free and on
which rank (:func:`conformance.saves.disk_problem`).  Each cell's deadline is the session's
(:mod:`conformance.deadlines`), unless the user chose one; a save that failed or hung is met once
(:meth:`conformance.saves.Saves.failure`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from conformance.adapter import Spec, installed_version
from conformance.checks import RankVerdict
from conformance.deadlines import Deadlines
from conformance.expectations import Baseline, Judgement
from conformance.findings import headline
from conformance.matrix import Cell
from conformance.members import Members
from conformance.outcome import (
    FAIL,
    INTERRUPTED,
    NA,
    STOPPED,
    CellOutcome,
    checkpoint_outcome,
    error_outcome,
    functions_outcome,
    harness_outcome,
    judged_outcome,
    not_tried_again,
    rank_verdicts,
)
from conformance.record import CellRecord, environment, function_record
from conformance.report import OUTCOME, RECORD
from conformance.saves import Saves, disk_problem
from pytest_moe_ep.distributed import call_on_world, timeout_source
from pytest_moe_ep.settings import DISTRIBUTED_ATTR, SETTINGS
from pytest_moe_ep.text import first_line
from pytest_moe_ep.world.engine import WorldError
from pytest_moe_ep.world.protocol import FunctionRef

RUN_CELL = FunctionRef("conformance.checks.cell", "run_cell")
CHECK_FUNCTIONS = FunctionRef("conformance.functions.rank", "check_functions")


@dataclass
class CellContext:
    """What every cell item needs of its session, handed to it at collection."""

    world_size: int
    #: the backend the cells run on (``auto`` resolved), asked for when the first record is
    #: finished.
    backend_used: Callable[[], str]
    #: checkpoint cells: the shared saves, what ``check_adapter`` resolved, ``--moe-ep-expert-key``.
    saves: Saves | None = None
    members: Members | None = None
    expert_keys: tuple[str, ...] = ()
    #: the record of a cell stopped by Ctrl-C or SIGTERM (pytest makes no report for it).
    interrupted: list[dict[str, Any]] = field(default_factory=list)
    #: the last cell whose setup report passed: a SIGTERM can land after it and before its run
    #: begins.
    running: MatrixItem | None = None
    #: the session's expectations (``None``: every red cell fails the session, as without a file).
    baseline: Baseline | None = None
    #: what the session measured of its cells, and the next one's deadline (``None``: the usual
    #: deadline of a call, as under torchrun).
    deadlines: Deadlines | None = None


class CellFailed(Exception):
    """A cell's checks found differences; the message is the whole diagnosis."""


class CellError(Exception):
    """A cell could not run to its checks: the engine's structured failure, shown as the cell's
    story."""

    def __init__(self, error: WorldError, lead: str = "") -> None:
        super().__init__(error.cause)
        self.error, self.lead = error, lead


def _torch_version() -> str:
    """The torch the ranks run (this interpreter's), from its metadata: the controller need not
    import torch."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:  # a source tree on sys.path
        import torch

        return str(torch.__version__)  # a str subclass that execnet (xdist) cannot send


class MatrixCollector(pytest.Collector):
    """The parent of every cell: node ids start with ``moe-ep-matrix::``."""

    def collect(self) -> list[Any]:
        return []


class MatrixItem(pytest.Item):
    """Common machinery: records, n/a skips, failure display."""

    def __init__(self, *, context: CellContext, suite: str, adapter: str, adapter_version: str,
                 fields: dict[str, Any], na: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        setattr(self, DISTRIBUTED_ATTR, True)
        self.context = context
        self.record = CellRecord(self.nodeid, suite, adapter, adapter_version, fields)
        self.na = na
        #: what the machine got wrong (a full disk): the cell is an ``error``, whatever the ranks
        #: raised.
        self.environment_problem = ""

    def interrupt_if_unfinished(self, reported: bool = False) -> None:
        """The session was interrupted after this cell's setup passed: if its run had not begun,
        or had ended but its report was never made (``reported``: the signal landed between the
        run and the report), its record is ``interrupted`` too, as the ``--from-log`` rebuild of
        the same run says (the log has its setup, not its call)."""
        if not self.record.status:
            self._interrupted("interrupted before its run began", time.perf_counter())
        elif not reported:
            self._interrupted("interrupted before its report was made", time.perf_counter())

    def _interrupted(self, detail: str, started: float) -> None:
        self._finish(INTERRUPTED, detail, started)
        self.context.interrupted.append(self.record.to_dict())

    def _finish(self, status: str, detail: str, started: float) -> Judgement | None:
        self.record.finish(status, detail, time.perf_counter() - started)
        judgement = self._judge()
        self._attach()
        return judgement

    def _judge(self) -> Judgement | None:
        """The finished cell against the session's expectations (``None`` without any, or for
        n/a)."""
        got = judged_outcome({"status": self.record.status, "finding": self.record.finding})
        baseline = self.context.baseline
        if got is None:
            return None
        self.user_properties.append((OUTCOME, json.dumps({"id": self.nodeid, "outcome": got})))
        if baseline is None:
            return None
        judgement = baseline.judge(self.nodeid, got)
        self.record.expectation = judgement.record_fields()
        return judgement

    def _attach(self) -> None:
        """The record, with where it ran, on the item's reports."""
        self.record.environment = environment(_torch_version(), self.world_size,
                                              self.context.backend_used())
        self.user_properties.append((RECORD, json.dumps(self.record.to_dict())))

    def runtest(self) -> None:
        started = time.perf_counter()
        if self.na:
            self._finish(NA, self.na, started)
            pytest.skip(f"n/a: {self.na}")
        try:
            found = self.check()
        except pytest.skip.Exception as exc:
            self._finish(NA, str(exc.msg), started)
            raise
        except WorldError as exc:  # the cause alone: the node id already names the call
            found = error_outcome(exc, self.environment_problem)
            judgement = self._conclude(found, started)
            self._settle(judgement, CellError(exc, headline(found.findings)))
            return
        # Ctrl-C, or SIGTERM (pytest_moe_ep.signals): no report follows
        except KeyboardInterrupt as exc:
            self._interrupted(f"interrupted while running: {type(exc).__name__}: "
                              f"{exc}".rstrip(": "), started)
            raise
        except BaseException as exc:  # the harness's own failure in this process
            text = f"{type(exc).__name__}: {exc}".splitlines()[0]
            judgement = self._conclude(harness_outcome(text), started)
            if judgement is not None and judgement.met:
                self._settle(judgement, exc)
            raise
        judgement = self._conclude(found, started)
        self._settle(judgement,
                     CellFailed(found.detail) if found.status in (FAIL, STOPPED) else None)

    def _conclude(self, found: CellOutcome, started: float) -> Judgement | None:
        """The record of a cell that ran: its outcome, then its judgement against the
        expectations."""
        record = self.record
        record.findings = found.findings or None
        record.problems = found.problems or None
        record.errors = found.errors
        record.checks_passed = found.passed
        return self._finish(found.status, found.detail, started)

    def _settle(self, judgement: Judgement | None, failure: BaseException | None) -> None:
        """End the item as its outcome and expectation say: a met red cell is xfailed with the
        expectation's reason; an unmet expectation fails, leading with what was expected and what
        came back."""
        if judgement is None or judgement.met:
            if failure is None:  # green, or (an update run) green where the file said red
                return
            if judgement is None:  # no expectations: red fails, as it always did
                raise failure
            pytest.xfail(f"{judgement.text}: {first_line(self.record.detail)}")
        if isinstance(failure, CellError):
            failure.lead = f"unexpected: {judgement.text}\n{failure.lead}"
            raise failure
        raise CellFailed(f"unexpected: {judgement.text}\n{self.record.detail}")

    def check(self) -> CellOutcome:
        raise NotImplementedError

    def deadline(self) -> float:
        """This cell's deadline, noted in its record: the session's (:mod:`conformance.deadlines`)
        unless the user gave ``moe_ep_timeout``, never longer than the call would get otherwise
        (pytest-timeout's value for the cell, else ``moe_ep_timeout``'s)."""
        seconds, source = timeout_source(self)
        deadlines = self.context.deadlines
        if deadlines is not None and not self.config.stash[SETTINGS].timeout_given:
            derived, how = deadlines.next()
            if derived < seconds:
                seconds, source = derived, how
        self.record.deadline_s, self.record.deadline_from = round(seconds, 3), source
        return seconds

    def measured(self, verdicts: list[RankVerdict]) -> None:
        """The slowest rank's seconds in a cell that did not hang, for the next cells' deadline."""
        totals = [v.timings.get("total", 0.0) for v in verdicts]
        if self.context.deadlines is not None and totals:
            self.context.deadlines.measured(max(totals))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, CellFailed):
            return self._with_problems(str(excinfo.value))
        if isinstance(excinfo.value, CellError):
            return self._with_problems(f"{excinfo.value.lead} "
                                       f"{excinfo.value.error.report()}".lstrip())
        return super().repr_failure(excinfo)

    def _with_problems(self, text: str) -> str:
        """With ``-v``, every problem the record holds after the shortened diagnosis."""
        problems = self.record.problems or []
        if self.config.get_verbosity() < 1 or not problems:
            return text
        lines = [f"  [{p.get('finding', '')}] [{p.get('check', '')}] {p.get('text', '')}"
                 + (f" (raised at {p['raised_at']})" if p.get("raised_at") else "")
                 for p in problems]
        return "\n".join([text, f"every problem of this cell ({len(problems)}):", *lines])

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, self.nodeid

    @property
    def world_size(self) -> int:
        return self.context.world_size

    @property
    def backend(self) -> str:
        return self.config.stash[SETTINGS].backend


class CheckpointCellItem(MatrixItem):
    def __init__(self, *, cell: Cell, adapter: Any, base: Spec, **kwargs: Any) -> None:
        super().__init__(suite="checkpoint", adapter=adapter.name,
                         adapter_version=str(adapter.version),
                         fields=cell.record(), na=cell.na, **kwargs)
        self.cell, self.adapter, self.base = cell, adapter, base
        self.extra_keyword_matches.update(cell.keywords())

    def check(self) -> CellOutcome:
        saves, members = self.context.saves, self.context.members
        assert saves is not None and members is not None, ("checkpoint cells come with the "
                                                           "session's saves")
        failed = saves.failure(self.cell)
        if failed is not None:  # met once: the world is not asked again
            saves.passed_over(self.cell)
            return not_tried_again(*failed)
        plan = saves.plan(self.cell, self.context.expert_keys)
        # rank 0's verdict, as far as the cell got: what it wrote whole is not written again
        reached: RankVerdict | None = None
        stopped: WorldError | None = None
        try:
            result = call_on_world(self, RUN_CELL,
                                   (self.adapter, self.cell, self.base, plan, members), {},
                                   world_size=self.world_size, backend=self.backend,
                                   timeout=self.deadline())
            reached = result.values[0]
        except WorldError as exc:  # measured before finished() removes the partial save
            reached = rank_verdicts(exc).get(0)
            if exc.kind != "hang":
                self.measured(list(rank_verdicts(exc).values()))
            problem = disk_problem(exc, plan)
            if problem:
                exc.cause = f"{problem}\n{exc.cause}"
                self.environment_problem = problem
            else:
                stopped = exc
            raise
        finally:
            saves.finished(self.cell, plan, reached, stopped, self.nodeid)
        verdicts: list[RankVerdict] = result.values
        self.measured(verdicts)
        phases = [k for k in ("build", "save", "inspect", "load", "adapter", "total")
                  if any(k in v.timings for v in verdicts)]
        self.record.timings = {k: round(max(v.timings.get(k, 0.0) for v in verdicts), 4)
                               for k in phases}
        self.record.shared_save = not plan.save
        self.record.skipped_checks = dict(sorted({k: v for r in verdicts
                                                  for k, v in r.skipped.items()}.items()))
        return checkpoint_outcome(self.cell, verdicts,
                                  f"{self.adapter.name} {self.adapter.version}")


class FunctionsCellItem(MatrixItem):
    def __init__(self, *, cell: Any, module: str, na: str = "", **kwargs: Any) -> None:
        fields = {"function": "*", "num_experts": [], "ep": cell.k, "mesh": cell.mesh,
                  "placements": cell.placements}
        super().__init__(suite="functions", adapter=module,
                         adapter_version=installed_version(module), fields=fields, na=na, **kwargs)
        self.cell, self.module = cell, module
        #: one report record per function, attached once the cell is judged (they carry its
        #: expectation).
        self.function_records: list[dict[str, Any]] = []

    def check(self) -> CellOutcome:
        from conformance.functions.merge import merge_rank_records

        result = call_on_world(self, CHECK_FUNCTIONS, (self.module, self.cell), {},
                               world_size=self.cell.world_size, backend=self.backend,
                               timeout=self.deadline())
        records = merge_rank_records(result.values)
        self.function_records = [function_record(self.record, r, _torch_version()) for r in records]
        self.record.fields["num_experts"] = sorted({e for r in records
                                                    for e in r.get("num_experts", [])})
        return functions_outcome(self.cell, records)

    def _finish(self, status: str, detail: str, started: float) -> Judgement | None:
        # The per-function records carry the report; the item's own record is dropped from it.
        self.record.finish(status, detail, time.perf_counter() - started)
        judgement = self._judge()
        # one record per function; the item's own record summarises them
        for r in self.function_records:
            self.user_properties.append((RECORD,
                                         json.dumps({**r, **(self.record.expectation or {})})))
        if status in (NA, STOPPED, INTERRUPTED):
            self._attach()
        return judgement


def collect_items(parent: pytest.Collector, context: CellContext, *, adapter: Any,
                  cells: list[Cell],
                  functions: Any, functions_cells: list[Any]) -> Iterator[MatrixItem]:
    """Checkpoint cells for ``adapter``, then functions cells for ``functions`` (a module and why it
    is n/a)."""
    if adapter is not None:
        caps = context.members.capabilities if context.members is not None else None
        base = Spec(shared_expert=caps.shared_expert if caps is not None else True)
        # the loads of one save run one after another
        for cell in sorted(cells, key=lambda cell: cell.save_key):
            yield CheckpointCellItem.from_parent(parent, name=cell.node_name, context=context,
                                                 cell=cell, adapter=adapter, base=base)
    if functions is not None:
        for fcell in functions_cells:
            yield FunctionsCellItem.from_parent(parent, name=fcell.node_name, context=context,
                                                cell=fcell,
                                                module=functions.module, na=functions.na)

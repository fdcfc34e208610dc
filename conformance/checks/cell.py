"""One checkpoint cell on one rank: save (or reuse a save), load, and run every check.

:func:`run_cell` runs on each rank of the world (the controller's :mod:`conformance.items` asks the
engine).  The experiment is here; the checks are the rows of :data:`~.table.TABLE`, each run at its
stage (:data:`~.context.STAGES`) in the cells it is for, timed (``timings[name]``) and marked done
unless it said why it skipped.  In order:

1. the truth checkpoint: the ep=1 save of the save side's model, written once per spec and shared
   (with the ep=1 Hugging Face export where the cell's HF checks run);
2. the save side at its layout with seed A -- unless an earlier cell already wrote this checkpoint
   (one save feeds every load of it): ``built`` checks, the save, ``saved`` checks;
3. ``written`` checks: the checkpoint on disk (the cell that wrote it inspects it);
4. the load side at its layout with the run's own configuration but another state -- seed B and one
   more optimizer step (its step count, moments and a schedule's position differ): ``built`` checks,
   then ``loading`` checks, which make sure it differs from the truth (otherwise a load that does
   nothing would pass) and, in a legacy cell, load it: a legacy cell ends there.  The
   configuration (the learning rate among it) is the save's, as in a real resume: a schedule that
   closes over its configuration (``min_lr / init_lr``) must not read as state the load failed to
   restore;
5. the load; one that raises names the checkpoint's problems in expert terms before the framework's
   own message;
6. ``loaded`` checks, then the reasons of the checks the adapter could not run here.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any

import conformance.checks.checkpoint as checkpoint
import conformance.checks.hf as hf
import conformance.checks.load_plan as load_plan
import conformance.checks.save_plan as save_plan
import conformance.checks.saved as saved
from conformance.adapter import AdapterError, Spec, framework_calls
from conformance.checks.blame import (
    LoadFailed,
    load_errors,
    load_failed,
    located,
    original,
    raised_where,
)
from conformance.checks.context import (
    CheckContext,
    Stage,
    TimedAdapter,
    required,
    saved_optimizer,
)
from conformance.checks.layout import LayoutMismatch
from conformance.checks.table import TABLE
from conformance.checks.truth import SEED_A, SEED_B, ground_truth
from conformance.checks.values import canonical
from conformance.checks.verdict import VERDICT, RankFailure, RankVerdict
from conformance.layout import ParallelLayout
from conformance.matrix import Cell
from conformance.members import Built, Members, built
from conformance.saves import CellPlan
from conformance.world_state import world_state
from pytest_moe_ep.text import first_line
from pytest_moe_ep.world.activity import activity
from pytest_moe_ep.world.protocol import FIELDS_ATTR, StructuredError, error_fields

__all__ = ["LOAD_EXTRA_STEPS", "BuildFailed", "CellPlan", "load_errors", "run_cell"]

#: the load side's optimizer runs this many steps more than the save's: its state (step count,
#: moments, a schedule's position and so its lr) differs, while its configuration is the run's own.
LOAD_EXTRA_STEPS = 1


class _Timed:
    """The adapter as the checks see it (:class:`~.context.TimedAdapter`).  Its framework calls
    (:func:`conformance.adapter.framework_calls`) are timed (``timings["adapter"]``), so the report
    can tell the framework's own work from the harness's, and the call an exception came out of is
    remembered beside it (:meth:`raised_from`), a fact the controller's outcome reads.  ``members``
    is what the controller resolved of the adapter."""

    def __init__(self, adapter: Any, timings: dict[str, float], members: Members) -> None:
        self.__wrapped__, self._timings, self.members = adapter, timings, members
        self._raised: list[tuple[BaseException, str]] = []

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.__wrapped__, name)
        if name not in framework_calls() or not callable(found):
            return found

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                with activity(call=name):  # what a rank that hangs or dies here was doing
                    return found(*args, **kwargs)
            except BaseException as exc:
                if not any(seen is exc for seen, _ in self._raised):  # the innermost call keeps it
                    self._raised.append((exc, name))
                raise
            finally:
                self._timings["adapter"] = (self._timings.get("adapter", 0.0)
                                            + time.perf_counter() - t0)
        return timed

    def raised_from(self, exc: BaseException) -> str | None:
        """The framework call that raised ``exc`` or what it wraps (``raise ... from``)."""
        seen: BaseException | None = exc
        for _ in range(8):
            if seen is None:
                break
            member = next((name for raised, name in self._raised if raised is seen), None)
            if member is not None:
                return member
            seen = seen.__cause__
        return None


class BuildFailed(Exception):
    """The cell's model could not be built: the framework refused (its own message, file and line),
    or the adapter's code failed (not a finding about the framework)."""


def _build(adapter: TimedAdapter, spec: Spec, mesh: Any, seed: int, side: str) -> Built:
    """``adapter.build`` as a :class:`Built`; its failure becomes :class:`BuildFailed`, worded by
    where it raised."""
    where = f"the {side} side's build at {spec.layout.describe() if spec.layout else 'ep=1'}"
    what = f"(E={spec.num_experts}, {spec.kind}{', FSDP' if spec.fsdp else ''})"
    try:
        result = adapter.build(spec, mesh, seed)
    except load_errors() as exc:
        raised_in, _ = raised_where(exc, adapter)
        if raised_in == "framework":
            raise BuildFailed(f"the framework refused {where} {what}: "
                              f"{located(exc, adapter)}") from exc
        raise BuildFailed(f"the adapter's code failed in {where} {what}: {located(exc, adapter)} "
                          f"(an error in the {raised_in}, not a finding about the "
                          "framework)") from exc
    try:
        return built(result, f"{type(adapter).__name__}.build")
    except AdapterError as exc:
        raise BuildFailed(str(exc)) from exc


def _check(ctx: CheckContext, stage: Stage) -> None:
    """Run the table's checks of ``stage`` that this cell runs and the adapter is asked for, in the
    table's order; each is timed, and done unless it said why it skipped."""
    verdict = ctx.verdict
    for check in TABLE:
        if check.stage != stage or not check.cells(ctx.cell):
            continue
        if check.asked is not None and check.asked(ctx) is not None:
            continue
        started = time.perf_counter()
        with activity(check=check.name):
            check.run(ctx)
        # a check that runs after each build (``layout``) adds up
        verdict.timings[check.name] = (verdict.timings.get(check.name, 0.0)
                                       + time.perf_counter() - started)
        if check.name not in verdict.skipped:
            verdict.done(check.name)


def _not_asked(ctx: CheckContext) -> None:
    """The checks of this cell that the adapter could not run here, with why: said once the cell's
    checks have run, so that a cell that stops early says what stopped it instead."""
    for check in TABLE:
        why = check.asked(ctx) if check.asked is not None and check.cells(ctx.cell) else None
        if why:
            ctx.verdict.skipped[check.name] = why


def _save_truth(ctx: CheckContext) -> tuple[str, ...]:
    """Write the truth checkpoint (and the ep=1 Hugging Face export, where the cell checks one);
    rank 0 learns its expert keys from its content and checks that they hold the model's own
    tensors."""
    import torch.distributed as dist

    adapter, plan, spec, rank = ctx.adapter, ctx.plan, ctx.save_spec, ctx.rank
    assert plan.truth_path is not None
    layout = ParallelLayout.for_world(dist.get_world_size(), 1)
    b = _build(adapter, replace(spec, fsdp=False, layout=layout), layout.build_mesh(), SEED_A,
               "truth")
    adapter.save(b.model, saved_optimizer(adapter, b, ctx.optim), plan.truth_path, **b.extra)
    if ctx.hf is None:
        hf.export_truth(adapter, b.model, plan.truth_path)
    transient = checkpoint.non_persistent_buffers(b.model)
    del b
    dist.barrier()
    found: list[Any] = [()]
    if rank == 0:
        declared = checkpoint.declared_patterns(adapter, plan.expert_keys)
        truth = ground_truth(adapter, spec, rank).tensors
        found[0] = (*checkpoint.truth_findings(adapter, plan.truth_path, truth, declared),
                    *checkpoint.transient_findings(adapter, plan.truth_path, transient))
    dist.broadcast_object_list(found, src=0)
    return tuple(found[0])


def _save(ctx: CheckContext) -> None:
    """Build the save side, keep what the checkpoint will hold, write it, and run the checks of its
    build and of the save."""
    import torch.distributed as dist

    adapter, cell, plan, verdict = ctx.adapter, ctx.cell, ctx.plan, ctx.verdict
    started = time.perf_counter()
    ctx.side = "save"
    ctx.built = b = _build(adapter, ctx.save_spec, cell.save.build_mesh(), SEED_A, "save")
    _check(ctx, "built")
    # what the checkpoint will hold, on every rank: the reference a load must give back
    if not cell.legacy:
        # first: its build (once a spec) runs the framework
        truth = ground_truth(adapter, ctx.save_spec, ctx.rank).tensors
        # not copied: gather packs it into buffers of its own before the framework runs again
        held = canonical(adapter, b.model, ctx.optimizer, ctx.rank, verdict, copy=False)
        saved.keep(plan.path, saved.gather(held, truth, cell.save.describe()))
        del held, truth
    built_at = time.perf_counter()
    with save_plan.recorded() as offered:
        try:
            if cell.legacy:  # the framework's own old save: called as it always was
                adapter.save_legacy(b.model, ctx.saved_optimizer, plan.path)
            else:
                adapter.save(b.model, ctx.saved_optimizer, plan.path, **b.extra)
        # DCP refused the global plan: say where in expert terms, on every rank
        except load_errors() as exc:
            save_plan.explain(exc, offered)
            raise
    del b
    verdict.timings.update(build=built_at - started, save=time.perf_counter() - built_at)
    _check(ctx, "saved")
    ctx.built = None
    dist.barrier()


def run_cell(adapter: Any, cell: Cell, base: Spec, plan: CellPlan, members: Members) -> RankVerdict:
    """The whole experiment of ``cell`` on this rank; its verdict goes back to the controller.

    When the cell stops on an exception, the exception still propagates (the engine must see every
    rank that failed, and replace the world), carrying this rank's verdict -- what it found so far
    and a :class:`RankFailure` of why it stopped -- in the engine's structured channel.
    """
    import torch.distributed as dist

    started = time.perf_counter()
    world_state().begin(plan.session)
    verdict = RankVerdict(dist.get_rank())
    timed = _Timed(adapter, verdict.timings, members)
    try:
        try:
            _run(timed, cell, base, plan, verdict)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            verdict.failure = _failure(exc, timed)
            ended = _end_cell(adapter, members)
            if ended is not None:  # the cell's own failure is the one to report; this one beside it
                verdict.problem("end_cell", ended)
            carried = _carrying(exc, verdict)
            if carried is exc:
                raise
            raise carried from exc
        ended = _end_cell(adapter, members)
        if ended is not None:  # an adapter error, classified as any other (the findings kept)
            error = AdapterError(f"the cell's checks ran, then {ended}")
            verdict.failure = RankFailure("end_cell", "AdapterError", str(error), None, "adapter",
                                          "", "adapter")
            raise _carrying(error, verdict)
        return verdict
    finally:
        verdict.timings["total"] = time.perf_counter() - started


def _carrying(exc: BaseException, verdict: RankVerdict) -> BaseException:
    """``exc`` with ``verdict`` in the engine's structured channel (:data:`FIELDS_ATTR`)."""
    # a type that takes no attributes keeps none
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exc, FIELDS_ATTR, {**error_fields(exc), VERDICT: verdict})
        return exc
    carrier = StructuredError(f"{type(exc).__name__}: {exc}", fields={VERDICT: verdict})
    carrier.__cause__ = exc
    return carrier


def _end_cell(adapter: Any, members: Members) -> str | None:
    """The adapter's ``end_cell()`` when it has one; what it raised, in words (None when it did
    not)."""
    if not members.has("end_cell"):
        return None
    try:
        adapter.end_cell()
    except Exception as exc:
        return f"end_cell() raised {type(exc).__name__}: {exc}"
    return None


def _failure(exc: BaseException, adapter: _Timed) -> RankFailure:
    """The facts of why this rank stopped; the controller decides what they make the cell."""
    raised_in, raised_at = raised_where(exc, adapter)
    member = adapter.raised_from(exc)
    first = original(exc)
    if isinstance(exc, LayoutMismatch):
        kind = "layout"
    elif isinstance(exc, save_plan.SaveRefused):
        kind = "save-plan"
    elif isinstance(exc, AdapterError) or isinstance(first, AdapterError):
        kind = "adapter"
    elif isinstance(exc, LoadFailed) and exc.side == "checkpoint":
        kind = "checkpoint"
    else:
        kind = ""
    if isinstance(exc, BuildFailed):
        phase = "build"
    elif isinstance(exc, LoadFailed):
        phase = "load"
    else:
        phase = member or "harness"
    return RankFailure(phase, type(first).__name__, first_line(str(exc)), member, raised_in,
                       raised_at or "", kind)


def _run(adapter: TimedAdapter, cell: Cell, base: Spec, plan: CellPlan,
         verdict: RankVerdict) -> None:
    save_spec, load_spec = cell.spec(base, "save"), cell.spec(base, "load")
    optim = cell.state == "model+optim"
    side_b = replace(load_spec,
                     optimizer_steps=load_spec.optimizer_steps + LOAD_EXTRA_STEPS if optim else 0)
    ctx = CheckContext(adapter, cell, plan, save_spec, load_spec, verdict.rank, verdict,
                       hf.applies(adapter, cell),
                       lambda: _build(adapter, side_b, cell.load.build_mesh(), SEED_B, "load"))
    verdict.truth_findings = plan.truth_findings
    # each side says so (pytest_moe_ep.world.activity): a cell that hangs or dies names it, and a
    # truth or a save that failed is not tried again (conformance.saves)
    if plan.save_truth and plan.truth_path:
        with activity(side="truth"):
            verdict.truth_findings = _save_truth(ctx)
        verdict.wrote_truth = True
    with activity(side="save" if plan.save else "load"):
        if plan.save:
            _save(ctx)
        else:
            verdict.findings = plan.findings
            if verdict.rank == 0:  # what the export beside the save had, as its writer found it
                for finding, text in plan.export_problems:
                    verdict.problem(hf.EXPORT, text, finding)
        _check(ctx, "written")
    verdict.wrote_save = plan.save
    with activity(side="load"):
        _load_side(ctx)


def _load_side(ctx: CheckContext) -> None:
    """Steps 4-6 of the module docstring: the load side built, loaded and checked."""
    adapter, cell, plan, verdict = ctx.adapter, ctx.cell, ctx.plan, ctx.verdict
    save_spec, load_spec = ctx.save_spec, ctx.load_spec
    ctx.truth = ground_truth(adapter, load_spec, ctx.rank)
    ctx.side, ctx.built = "load", ctx.rebuild()
    _check(ctx, "built")
    ctx.before = canonical(adapter, ctx.model, ctx.optimizer, ctx.rank, verdict)
    _check(ctx, "loading")
    if cell.legacy:  # the refusal check loaded it, or was refused
        return
    _load(ctx)
    ctx.kept = saved.kept(plan.path)
    if ctx.kept is not None and ctx.rank == 0:
        ctx.saved_truth = ground_truth(adapter, save_spec, ctx.rank).tensors
    # not copied: read by the checks before anything (the next step, a truth's build) runs the
    # framework again
    ctx.got = canonical(adapter, ctx.model, ctx.optimizer, ctx.rank, verdict, copy=False)
    _check(ctx, "loaded")
    _not_asked(ctx)


def _load(ctx: CheckContext) -> None:
    """The load; one that raises is read with what the cell knows of the checkpoint
    (:class:`_Evidence`)."""
    b, verdict = required(ctx.built, "the load side's build"), ctx.verdict
    evidence = _Evidence((*verdict.findings, *verdict.truth_findings),
                         verdict.skipped.get("checkpoint", ""), ctx.cell, ctx.plan, ctx.adapter)
    started = time.perf_counter()
    try:
        with load_plan.recorded():  # what the load asked for travels with what it raises
            ctx.adapter.load(b.model, ctx.saved_optimizer, ctx.plan.path, **b.extra)
    except load_errors() as exc:
        raise evidence.failure(exc, ctx.rank) from exc
    verdict.timings["load"] = time.perf_counter() - started


@dataclass(frozen=True)
class _Evidence:
    """What the cell knows when a load raises: the checkpoint check's findings, or why it did not
    run."""

    findings: tuple[str, ...]
    checked: str
    cell: Cell
    plan: CellPlan
    adapter: TimedAdapter

    def failure(self, exc: BaseException, rank: int) -> LoadFailed:
        """No new work here (every rank must raise at once): the expert keys rank 0 learned and
        sent, if any."""
        known = checkpoint.known(self.plan.truth_path) if self.plan.truth_path else None
        patterns = known.patterns if known is not None else checkpoint.declared_patterns(
            self.adapter, self.plan.expert_keys)
        return load_failed(exc, findings=self.findings, checked=self.checked, layout=self.cell.load,
                           num_experts=self.cell.num_experts, patterns=patterns, rank=rank,
                           adapter=self.adapter)

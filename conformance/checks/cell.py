"""One checkpoint cell on one rank: save (or reuse a save), load, and run every check.

:func:`run_cell` runs on each rank of the world (the controller's :mod:`conformance.items` asks the
engine).  In order:

1. the truth checkpoint: the ep=1 save of the save side's model, written once per spec and shared;
2. the save side at its layout with seed A -- unless an earlier cell already wrote this checkpoint
   (one save feeds every load of it); the cell that writes it also inspects it (``checkpoint``);
3. the load side at its layout with the run's own configuration but another state -- seed B and one
   more optimizer step (its step count, moments and a schedule's position differ) -- and a check
   that it differs from the truth: otherwise a load that does nothing would pass.  The configuration
   (the learning rate among it) is the save's, as in a real resume: a schedule that closes over its
   configuration (``min_lr / init_lr``) must not read as state the load failed to restore;
4. the load; a legacy cell passes only on a real refusal (:mod:`.refusal`), and a load that raises
   elsewhere names the checkpoint's problems in expert terms before the framework's own message;
5. ``values``, ``missing`` (per replica group), ``scalars``, ``forward`` and ``resume``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any

import conformance.checks.checkpoint as checkpoint
import conformance.checks.forward as forward
import conformance.checks.hf as hf
import conformance.checks.load_plan as load_plan
import conformance.checks.missing as missing
import conformance.checks.refusal as refusal
import conformance.checks.resume as resume
import conformance.checks.save_plan as save_plan
import conformance.checks.saved as saved
import conformance.checks.scalars as scalars_check
from conformance.adapter import AdapterError, Spec, framework_calls
from conformance.checks.blame import (
    LoadFailed,
    load_errors,
    load_failed,
    located,
    original,
    raised_where,
)
from conformance.checks.held import settle
from conformance.checks.layout import LayoutMismatch, check_layout
from conformance.checks.truth import SEED_A, SEED_B, ground_truth
from conformance.checks.values import canonical, compare, equal, expected
from conformance.checks.verdict import VERDICT, RankFailure, RankVerdict
from conformance.layout import ParallelLayout
from conformance.matrix import Cell
from conformance.members import Built, Members, built
from conformance.saves import CellPlan
from conformance.world_state import world_state
from pytest_moe_ep.text import first_line
from pytest_moe_ep.world.protocol import FIELDS_ATTR, StructuredError, error_fields

__all__ = ["LOAD_EXTRA_STEPS", "BuildFailed", "CellPlan", "load_errors", "run_cell"]

#: the load side's optimizer runs this many steps more than the save's: its state (step count,
#: moments, a schedule's position and so its lr) differs, while its configuration is the run's own.
LOAD_EXTRA_STEPS = 1


class _Timed:
    """The adapter as the checks see it.  Its framework calls
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


def _build(adapter: Any, spec: Spec, mesh: Any, seed: int, side: str) -> Built:
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


def _saved_optimizer(adapter: Any, b: Built, optim: bool) -> Any:
    """The optimizer ``save``/``load`` get: the state's, or in model-only cells the step-0 one if
    the framework's checkpoint always holds one (``capabilities.model_saves_optimizer``), else
    ``None``."""
    return b.optimizer if optim or adapter.members.capabilities.model_saves_optimizer else None


def _truth_state(adapter: Any, spec: Spec, rank: int) -> Any:
    return lambda: ground_truth(adapter, spec, rank).tensors


def _save_truth(adapter: Any, cell: Cell, spec: Spec, plan: CellPlan,
                rank: int) -> tuple[str, ...]:
    """Write the truth checkpoint (and the ep=1 Hugging Face export, where the cell checks one);
    rank 0 learns its expert keys from its content and checks that they hold the model's own
    tensors."""
    import torch.distributed as dist

    assert plan.truth_path is not None
    layout = ParallelLayout.for_world(dist.get_world_size(), 1)
    b = _build(adapter, replace(spec, fsdp=False, layout=layout), layout.build_mesh(), SEED_A,
               "truth")
    optim = cell.state == "model+optim"
    adapter.save(b.model, _saved_optimizer(adapter, b, optim), plan.truth_path, **b.extra)
    if hf.applies(adapter, cell) is None:
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


def _save(adapter: Any, cell: Cell, spec: Spec, plan: CellPlan,
          verdict: RankVerdict) -> tuple[str, ...]:
    """Write the cell's checkpoint and inspect it on rank 0; every rank gets the findings."""
    import torch.distributed as dist

    optim = cell.state == "model+optim"
    t0 = time.perf_counter()
    b = _build(adapter, spec, cell.save.build_mesh(), SEED_A, "save")
    check_layout(adapter, b.model, b.optimizer if optim else None, cell.save, cell.num_experts,
                 "save", spec.num_layers)
    # what the checkpoint will hold, on every rank: the reference a load must give back
    if not cell.legacy:
        # first: its build (once a spec) runs the framework
        truth = ground_truth(adapter, spec, dist.get_rank()).tensors
        # not copied: gather packs it into buffers of its own before the framework runs again
        held = canonical(adapter, b.model, b.optimizer if optim else None, dist.get_rank(), verdict,
                         copy=False)
        saved.keep(plan.path, saved.gather(held, truth, cell.save.describe()))
        del held, truth
    t1 = time.perf_counter()
    with save_plan.recorded() as offered:
        try:
            if cell.legacy:  # the framework's own old save: called as it always was
                adapter.save_legacy(b.model, _saved_optimizer(adapter, b, optim), plan.path)
            else:
                adapter.save(b.model, _saved_optimizer(adapter, b, optim), plan.path, **b.extra)
        # DCP refused the global plan: say where in expert terms, on every rank
        except load_errors() as exc:
            save_plan.explain(exc, offered)
            raise
    verdict.timings.update(build=t1 - t0, save=time.perf_counter() - t1)
    if hf.applies(adapter, cell) is None and plan.truth_path:
        t2 = time.perf_counter()
        hf.check_export(adapter, cell, spec, b.model, plan.path, plan.truth_path,
                        lambda: ground_truth(adapter, spec, dist.get_rank()), dist.get_rank(),
                        verdict)
        verdict.timings["hf_export"] = time.perf_counter() - t2
    del b
    dist.barrier()
    found: list[Any] = [()]
    if dist.get_rank() == 0 and plan.truth_path and not cell.legacy:
        t2 = time.perf_counter()
        known = checkpoint.knowledge(adapter, plan.truth_path, _truth_state(adapter, spec, 0),
                                   checkpoint.declared_patterns(adapter, plan.expert_keys))
        found[0] = tuple(checkpoint.checkpoint_findings(adapter, plan.path, plan.truth_path,
                                                        cell.num_experts, known.patterns))
        verdict.timings["inspect"] = time.perf_counter() - t2
    dist.broadcast_object_list(found, src=0)
    return tuple(found[0])


def _share_knowledge(adapter: Any, plan: CellPlan, spec: Spec, rank: int) -> checkpoint.Knowledge:
    """What rank 0 knows of the truth checkpoint's expert keys (learned now if this process has not
    yet), on every rank: a load that raises is then read with the same keys everywhere, with no new
    work while ranks raise."""
    import torch.distributed as dist

    assert plan.truth_path is not None
    sent: list[Any] = [None]
    if rank == 0:
        sent[0] = checkpoint.knowledge(adapter, plan.truth_path, _truth_state(adapter, spec, rank),
                                     checkpoint.declared_patterns(adapter, plan.expert_keys))
    dist.broadcast_object_list(sent, src=0)
    if rank != 0:
        checkpoint.remember(plan.truth_path, sent[0])
    return sent[0]


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
            _run(timed, cell, base, plan, verdict.rank, verdict)
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


def _run(adapter: Any, cell: Cell, base: Spec, plan: CellPlan, rank: int,
         verdict: RankVerdict) -> RankVerdict:
    optim = cell.state == "model+optim"
    save_spec, load_spec = cell.spec(base, "save"), cell.spec(base, "load")
    truth_findings = plan.truth_findings
    if plan.save_truth and plan.truth_path:
        truth_findings = _save_truth(adapter, cell, save_spec, plan, rank)
    verdict.truth_findings = truth_findings
    findings = _save(adapter, cell, save_spec, plan, verdict) if plan.save else plan.findings
    verdict.findings = findings
    if rank == 0:
        for finding in (*truth_findings, *findings):
            verdict.problem("checkpoint", f"checkpoint: {finding}")
    checked = ""
    if not plan.truth_path and not cell.legacy:
        checked = verdict.skipped["checkpoint"] = adapter.members.unreadable()
    elif plan.truth_path:
        known = _share_knowledge(adapter, plan, save_spec, rank)
        if rank == 0 and known.note:
            verdict.skipped["checkpoint attribution"] = known.note
        if not cell.legacy:
            verdict.done("checkpoint")

    truth = ground_truth(adapter, load_spec, rank)
    side_b = replace(load_spec,
                     optimizer_steps=load_spec.optimizer_steps + LOAD_EXTRA_STEPS if optim else 0)
    b = _build(adapter, side_b, cell.load.build_mesh(), SEED_B, "load")
    model, optimizer = b.model, b.optimizer if optim else None
    check_layout(adapter, model, optimizer, cell.load, cell.num_experts, "load",
                 load_spec.num_layers)
    before = canonical(adapter, model, optimizer, rank, verdict)
    settled, _, rest = settle(before, truth.tensors)  # blocks at once; the rest one by one
    same = {*settled,
            *(k for k in rest if equal(before[k][0], expected(truth.tensors, k, before[k][1])))}
    experts_unchanged = sorted((k for k in same if k[1] is not None), key=repr)
    if before and (experts_unchanged or len(same) == len(before)):
        verdict.problem("setup", f"rank {rank}: the build with seed {SEED_B} already equals the "
                        f"ground truth (seed {SEED_A}) for {len(experts_unchanged) or len(before)} "
                        f"tensor(s), e.g. {(experts_unchanged or list(before))[0]}: a load that "
                        "does nothing would pass; build() must derive every expert's values from "
                        "its seed")

    t3 = time.perf_counter()
    if cell.legacy:  # decided by the refusal; a load that succeeded shows its damage in the values
        if refusal.load_legacy(adapter, b, _saved_optimizer(adapter, b, optim), plan.path, verdict):
            verdict.timings["load"] = time.perf_counter() - t3
            got = canonical(adapter, model, optimizer, rank, verdict, copy=False)
            compare(rank, got, truth.tensors, before, verdict)
        return verdict  # the later checks' collectives may not pair after a lossy load
    evidence = _Evidence((*findings, *truth_findings), checked, cell, plan, adapter, save_spec)
    try:
        with load_plan.recorded():  # what the load asked for travels with what it raises
            adapter.load(b.model, _saved_optimizer(adapter, b, optim), plan.path, **b.extra)
    except load_errors() as exc:
        raise evidence.failure(exc, rank) from exc
    verdict.timings["load"] = time.perf_counter() - t3
    held = saved.kept(plan.path)
    saved_truth = ground_truth(adapter, save_spec,
                               rank).tensors if held is not None and rank == 0 else None
    # not copied: read by the checks below before anything (the next step, a truth's build) runs the
    # framework again
    got = canonical(adapter, model, optimizer, rank, verdict, copy=False)
    if held is None:
        verdict.skipped["values against the checkpoint"] = (
            "the save side's state was not kept in this world (started after the save): the load "
            "was compared with the ep=1 truth within a kernel's rounding")
    elif saved_truth is not None:
        saved.check_against_truth(held, saved_truth, verdict)
    compare(rank, got, truth.tensors, before, verdict, held.tensors if held is not None else None)
    verdict.done("values")
    missing.check_replicas(rank, got, truth.tensors, cell.load, cell.fsdp, verdict)
    verdict.done("missing")
    if optim:
        scalars_check.check_scalars(adapter, b, optimizer, truth, rank, verdict)
        _done_unless_skipped(verdict, "scalars")
    resume.check_next_step(adapter, b, optimizer, load_spec, truth, before, rank, verdict)
    if optim:
        _done_unless_skipped(verdict, "resume")
    forward.check_forward(adapter, model, load_spec, truth, rank, verdict)  # last, as the truth's
    _done_unless_skipped(verdict, "forward")
    why_not = hf.applies(adapter, cell)
    if why_not is None and plan.truth_path:
        del b, model, got
        t4 = time.perf_counter()
        hf.check_import(adapter, cell,
                        lambda: _build(adapter, side_b, cell.load.build_mesh(), SEED_B, "load"),
                        plan.truth_path, truth, rank, verdict)
        verdict.timings["hf_import"] = time.perf_counter() - t4
    elif why_not:
        verdict.skipped.update(dict.fromkeys((hf.EXPORT, hf.IMPORT), why_not))
    return verdict


def _done_unless_skipped(verdict: RankVerdict, check: str) -> None:
    if check not in verdict.skipped:
        verdict.done(check)


@dataclass(frozen=True)
class _Evidence:
    """What the cell knows when a load raises: the checkpoint check's findings, or why it did not
    run."""

    findings: tuple[str, ...]
    checked: str
    cell: Cell
    plan: CellPlan
    adapter: Any
    spec: Spec

    def failure(self, exc: BaseException, rank: int) -> LoadFailed:
        """No new work here (every rank must raise at once): the expert keys rank 0 learned and
        sent, if any."""
        known = checkpoint.known(self.plan.truth_path) if self.plan.truth_path else None
        patterns = known.patterns if known is not None else checkpoint.declared_patterns(
            self.adapter, self.plan.expert_keys)
        return load_failed(exc, findings=self.findings, checked=self.checked, layout=self.cell.load,
                           num_experts=self.cell.num_experts, patterns=patterns, rank=rank,
                           adapter=self.adapter)

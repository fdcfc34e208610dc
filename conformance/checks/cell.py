"""One checkpoint cell on one rank: save (or reuse a save), load, and run every check.

:func:`run_cell` runs on each rank of the world (the controller's :mod:`conformance.items` asks the
engine).  In order:

1. the truth checkpoint: the ep=1 save of the save side's model, written once per spec and shared;
2. the save side at its layout with seed A -- unless an earlier cell already wrote this checkpoint
   (one save feeds every load of it); the cell that writes it also inspects it (``checkpoint``);
3. the load side at its layout with the run's own configuration but another state -- seed B and one more
   optimizer step (its step count, moments and a schedule's position differ) -- and a check that it differs
   from the truth: otherwise a load that does nothing would pass.  The configuration (the learning rate among
   it) is the save's, as in a real resume: a schedule that closes over its configuration (``min_lr / init_lr``)
   must not read as state the load failed to restore;
4. the load; a legacy cell passes only on a real refusal (:mod:`.refusal`), and a load that raises
   elsewhere names the checkpoint's problems in expert terms before the framework's own message;
5. ``values``, ``missing`` (per replica group), ``scalars``, ``forward`` and ``resume``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any

from conformance import findings as F
from conformance.adapter import AdapterError, Built, Spec, built
from conformance.checks import artifact, completeness, load_plan, refusal, resume, save_plan, saved
from conformance.checks.blame import LoadFailed, load_errors, load_failed, located, original, raised_where
from conformance.checks.held import settle
from conformance.checks.layout import LayoutMismatch, check_layout
from conformance.checks.truth import SEED_A, SEED_B, ground_truth
from conformance.checks.values import canonical, compare, equal, expected
from conformance.checks.verdict import RankVerdict
from conformance.layout import ParallelLayout
from conformance.matrix import Cell
from conformance.members import Members
from conformance.saves import CellPlan
from pytest_moe_ep.world.protocol import FIELDS_ATTR, StructuredError, error_fields

__all__ = ["LOAD_EXTRA_STEPS", "BuildFailed", "CellPlan", "load_errors", "run_cell"]

#: the load side's optimizer runs this many steps more than the save's: its state (step count, moments, a
#: schedule's position and so its lr) differs, while its configuration is the run's own.
LOAD_EXTRA_STEPS = 1


class _Timed:
    """The adapter as the checks see it: the time spent in its members added up (``timings["adapter"]``), so
    the report can tell the framework's own work from the harness's, and ``members``, what the controller's
    :func:`~conformance.members.check_adapter` resolved of it."""

    MEMBERS = frozenset({"build", "save", "save_legacy", "load", "check_saved", "step", "scalars", "forward"})

    def __init__(self, adapter: Any, timings: dict[str, float], members: Members) -> None:
        self.__wrapped__, self._timings, self.members = adapter, timings, members

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.__wrapped__, name)
        if name not in self.MEMBERS or not callable(found):
            return found

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return found(*args, **kwargs)
            except BaseException as exc:
                _annotate(exc, MEMBER_ATTR, name)  # which of the adapter's calls raised it: see failure_fields
                raise
            finally:
                self._timings["adapter"] = self._timings.get("adapter", 0.0) + time.perf_counter() - t0
        return timed


#: the attribute :class:`_Timed` sets on an exception an adapter member raised: the member's name.
MEMBER_ATTR = "moe_ep_member"
#: the adapter's calls whose loud failure in the framework's code is a refusal (``refused``); elsewhere a
#: framework's exception is still the adapter's or the harness's failure to run the cell (``error``).
FRAMEWORK_CALLS = frozenset({"build", "save", "save_legacy", "load", "check_saved", "step", "scalars", "forward"})


def _annotate(exc: BaseException, attr: str, value: Any) -> None:
    """Set ``attr`` on ``exc`` unless an inner call set it first (some exception types take no attributes)."""
    if getattr(exc, attr, None) is None:
        with contextlib.suppress(AttributeError, TypeError):
            setattr(exc, attr, value)


class BuildFailed(StructuredError):
    """The cell's model could not be built: the framework refused (``refused``: its own message, file and line),
    or the adapter's code failed (``error``: not a finding about the framework)."""


def _build(adapter: Any, spec: Spec, mesh: Any, seed: int, side: str) -> Built:
    """``adapter.build`` as a :class:`Built`; its failure becomes :class:`BuildFailed`, told by where it raised."""
    where = f"the {side} side's build at {spec.layout.describe() if spec.layout else 'ep=1'}"
    what = f"(E={spec.num_experts}, {spec.kind}{', FSDP' if spec.fsdp else ''})"
    try:
        result = adapter.build(spec, mesh, seed)
    except load_errors() as exc:
        raised_in, raised_at = raised_where(exc, adapter)
        fields = {"phase": "build", "side": side, "raised_in": raised_in, "raised_at": raised_at}
        if raised_in == "framework":
            raise BuildFailed(f"the framework refused {where} {what}: {located(exc, adapter)}", fields=fields) from exc
        raise BuildFailed(f"the adapter's code failed in {where} {what}: {located(exc, adapter)} (an error in the "
                          f"{raised_in}, not a finding about the framework)", fields=fields) from exc
    try:
        return built(result, f"{type(adapter).__name__}.build")
    except AdapterError as exc:
        raise BuildFailed(str(exc), fields={"phase": "build", "side": side, "raised_in": "adapter",
                                            "raised_at": ""}) from None


def _saved_optimizer(adapter: Any, b: Built, optim: bool) -> Any:
    """The optimizer ``save``/``load`` get: the state's, or in model-only cells the step-0 one if the framework's
    checkpoint always holds one (``capabilities.model_saves_optimizer``), else ``None``."""
    return b.optimizer if optim or adapter.members.capabilities.model_saves_optimizer else None


def _truth_state(adapter: Any, spec: Spec, rank: int) -> Any:
    return lambda: ground_truth(adapter, spec, rank).state


def _save_truth(adapter: Any, spec: Spec, optim: bool, plan: CellPlan, rank: int) -> tuple[str, ...]:
    """Write the truth checkpoint; rank 0 learns its expert keys from its content and checks that they hold the
    model's own tensors."""
    import torch.distributed as dist

    assert plan.truth_path is not None
    layout = ParallelLayout.for_world(dist.get_world_size(), 1)
    b = _build(adapter, replace(spec, fsdp=False, layout=layout), layout.build_mesh(), SEED_A, "truth")
    adapter.save(b.model, _saved_optimizer(adapter, b, optim), plan.truth_path, **b.extra)
    del b
    dist.barrier()
    found: list[Any] = [()]
    if rank == 0:
        declared = artifact.declared_patterns(adapter, plan.expert_keys)
        found[0] = tuple(artifact.truth_findings(adapter, plan.truth_path, ground_truth(adapter, spec, rank).state,
                                                 declared))
    dist.broadcast_object_list(found, src=0)
    return tuple(found[0])


def _save(adapter: Any, cell: Cell, spec: Spec, plan: CellPlan, verdict: RankVerdict) -> tuple[str, ...]:
    """Write the cell's checkpoint and inspect it on rank 0; every rank gets the findings."""
    import torch.distributed as dist

    optim = cell.state == "model+optim"
    t0 = time.perf_counter()
    b = _build(adapter, spec, cell.save.build_mesh(), SEED_A, "save")
    check_layout(adapter, b.model, b.optimizer if optim else None, cell.save, cell.num_experts, "save",
                 spec.num_layers)
    if not cell.legacy:  # what the checkpoint will hold, on every rank: the reference a load must give back
        truth = ground_truth(adapter, spec, dist.get_rank()).state  # first: its build (once a spec) runs the framework
        # not copied: gather packs it into buffers of its own before the framework runs again
        held = canonical(adapter, b.model, b.optimizer if optim else None, dist.get_rank(), verdict, copy=False)
        saved.keep(plan.path, saved.gather(held, truth, cell.save.describe()))
        del held, truth
    t1 = time.perf_counter()
    with save_plan.recorded() as offered:
        try:
            if cell.legacy:  # the framework's own old save: called as it always was
                adapter.save_legacy(b.model, _saved_optimizer(adapter, b, optim), plan.path)
            else:
                adapter.save(b.model, _saved_optimizer(adapter, b, optim), plan.path, **b.extra)
        except load_errors() as exc:  # DCP refused the global plan: say where in expert terms, on every rank
            save_plan.explain(exc, offered)
            raise
    verdict.timings.update(build=t1 - t0, save=time.perf_counter() - t1)
    del b
    dist.barrier()
    found: list[Any] = [()]
    if dist.get_rank() == 0 and plan.truth_path and not cell.legacy:
        t2 = time.perf_counter()
        known = artifact.knowledge(adapter, plan.truth_path, _truth_state(adapter, spec, 0),
                                   artifact.declared_patterns(adapter, plan.expert_keys))
        found[0] = tuple(artifact.checkpoint_findings(adapter, plan.path, plan.truth_path, cell.num_experts,
                                                      known.patterns))
        verdict.timings["inspect"] = time.perf_counter() - t2
    dist.broadcast_object_list(found, src=0)
    return tuple(found[0])


def _share_knowledge(adapter: Any, plan: CellPlan, spec: Spec, rank: int) -> artifact.Knowledge:
    """What rank 0 knows of the truth checkpoint's expert keys (learned now if this process has not yet), on every
    rank: a load that raises is then read with the same keys everywhere, with no new work while ranks raise."""
    import torch.distributed as dist

    assert plan.truth_path is not None
    sent: list[Any] = [None]
    if rank == 0:
        sent[0] = artifact.knowledge(adapter, plan.truth_path, _truth_state(adapter, spec, rank),
                                     artifact.declared_patterns(adapter, plan.expert_keys))
    dist.broadcast_object_list(sent, src=0)
    if rank != 0:
        artifact.remember(plan.truth_path, sent[0])
    return sent[0]


def run_cell(adapter: Any, cell: Cell, base: Spec, plan: CellPlan, members: Members) -> RankVerdict:
    """The whole experiment of ``cell`` on this rank; its verdict goes back to the controller."""
    import torch.distributed as dist

    started = time.perf_counter()
    rank = dist.get_rank()
    verdict = RankVerdict(rank)
    try:
        found = _run(_Timed(adapter, verdict.timings, members), cell, base, plan, rank, verdict)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if not isinstance(exc, KeyboardInterrupt | SystemExit):
            with contextlib.suppress(AttributeError, TypeError):  # a type that takes no attributes keeps none
                setattr(exc, FIELDS_ATTR, {**error_fields(exc), **failure_fields(exc, adapter, verdict)})
        ended = _end_cell(adapter, members)
        if ended is not None:  # the cell's own failure is the one to report; the end's is a problem beside it
            with contextlib.suppress(AttributeError, TypeError):
                fields = error_fields(exc)
                fields["problems"] = [*fields.get("problems", []), {"check": "end_cell", "text": ended}]
                setattr(exc, FIELDS_ATTR, fields)
        raise
    else:
        ended = _end_cell(adapter, members)
        if ended is not None:  # an adapter error, classified as any other (the verdict's findings kept)
            error = AdapterError(f"the cell's checks ran, then {ended}")
            setattr(error, FIELDS_ATTR, {**failure_fields(error, adapter, verdict), "phase": "end_cell"})
            raise error
        return found
    finally:
        verdict.timings["total"] = time.perf_counter() - started


def _end_cell(adapter: Any, members: Members) -> str | None:
    """The adapter's ``end_cell()`` when it has one; what it raised, in words (None when it did not)."""
    if not members.end_cell:
        return None
    try:
        adapter.end_cell()
    except Exception as exc:
        return f"end_cell() raised {type(exc).__name__}: {exc}"
    return None


def _member(exc: BaseException) -> str | None:
    """The adapter member whose call raised ``exc`` or what it wraps (``raise ... from``): the first on the chain."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            break
        if getattr(seen, MEMBER_ATTR, None):
            return str(getattr(seen, MEMBER_ATTR))
        seen = seen.__cause__
    return None


def failure_fields(exc: BaseException, adapter: Any, verdict: RankVerdict) -> dict[str, Any]:
    """What a cell that raised on this rank found (:mod:`conformance.findings`), as plain data for the controller:
    ``on-disk`` when the checkpoint check had found the save not EP-invariant (whatever raised next); ``refused``
    when the framework's code raised in one of its calls (build, save, load, a step or forward after the load);
    ``error`` when the adapter's or the harness's code did, or the framework did not form the cell's layout."""
    given = error_fields(exc)
    raised_in, raised_at = given.get("raised_in"), given.get("raised_at")
    if raised_in is None:
        raised_in, raised_at = raised_where(exc, adapter)
    member = _member(exc)
    found: list[str] = []
    if verdict.findings or verdict.truth_findings or (isinstance(exc, LoadFailed) and exc.side == "checkpoint"):
        found.append(F.ON_DISK)
    refused = isinstance(exc, save_plan.SaveRefused) or (raised_in == "framework" and member in FRAMEWORK_CALLS)
    found.append(F.REFUSED if refused and not isinstance(exc, (LayoutMismatch, AdapterError)) else F.ERROR)
    phase = given.get("phase") or ("load" if isinstance(exc, LoadFailed) else member or "harness")
    problems = [{"check": "checkpoint", "text": f"checkpoint: {finding}"}
                for finding in (*verdict.truth_findings, *verdict.findings)]
    return {"findings": F.ordered(found), "phase": phase, "raised_in": raised_in, "raised_at": raised_at or "",
            "exception": type(original(exc)).__name__, "problems": problems}


def _run(adapter: Any, cell: Cell, base: Spec, plan: CellPlan, rank: int, verdict: RankVerdict) -> RankVerdict:
    optim = cell.state == "model+optim"
    save_spec, load_spec = cell.spec(base, "save"), cell.spec(base, "load")
    truth_findings = plan.truth_findings
    if plan.save_truth and plan.truth_path:
        truth_findings = _save_truth(adapter, save_spec, optim, plan, rank)
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

    truth = ground_truth(adapter, load_spec, rank)
    side_b = replace(load_spec, optimizer_steps=load_spec.optimizer_steps + LOAD_EXTRA_STEPS if optim else 0)
    b = _build(adapter, side_b, cell.load.build_mesh(), SEED_B, "load")
    model, optimizer = b.model, b.optimizer if optim else None
    check_layout(adapter, model, optimizer, cell.load, cell.num_experts, "load", load_spec.num_layers)
    before = canonical(adapter, model, optimizer, rank, verdict)
    settled, _, rest = settle(before, truth.state)  # blocks at once; the rest one by one
    same = {*settled, *(k for k in rest if equal(before[k][0], expected(truth.state, k, before[k][1])))}
    experts_unchanged = sorted((k for k in same if k[1] is not None), key=repr)
    if before and (experts_unchanged or len(same) == len(before)):
        verdict.problem("setup", f"rank {rank}: the build with seed {SEED_B} already equals the ground truth (seed "
                        f"{SEED_A}) for {len(experts_unchanged) or len(before)} tensor(s), e.g. "
                        f"{(experts_unchanged or list(before))[0]}: a load that does nothing would pass; build() "
                        "must derive every expert's values from its seed")

    t3 = time.perf_counter()
    if cell.legacy:  # decided by the refusal; a load that succeeded shows its damage in the values
        if refusal.load_legacy(adapter, b, _saved_optimizer(adapter, b, optim), plan.path, verdict):
            verdict.timings["load"] = time.perf_counter() - t3
            compare(rank, canonical(adapter, model, optimizer, rank, verdict, copy=False), truth.state, before, verdict)
        return verdict  # the later checks' collectives may not pair after a lossy load
    evidence = _Evidence((*findings, *truth_findings), checked, cell, plan, adapter, save_spec)
    try:
        with load_plan.recorded():  # what the load asked for travels with what it raises
            adapter.load(b.model, _saved_optimizer(adapter, b, optim), plan.path, **b.extra)
    except load_errors() as exc:
        raise evidence.failure(exc, rank) from exc
    verdict.timings["load"] = time.perf_counter() - t3
    held = saved.kept(plan.path)
    saved_truth = ground_truth(adapter, save_spec, rank).state if held is not None and rank == 0 else None
    # not copied: read by the checks below before anything (the next step, a truth's build) runs the framework again
    got = canonical(adapter, model, optimizer, rank, verdict, copy=False)
    if held is None:
        verdict.skipped["values against the checkpoint"] = (
            "the save side's state was not kept in this world (started after the save): the load was compared with "
            "the ep=1 truth within a kernel's rounding")
    elif saved_truth is not None:
        saved.check_against_truth(held, saved_truth, verdict)
    compare(rank, got, truth.state, before, verdict, held.state if held is not None else None)
    completeness.check_replicas(rank, got, truth.state, cell.load, cell.fsdp, verdict)
    resume.check_scalars(adapter, b, optimizer, truth, rank, verdict)
    resume.check_next_step(adapter, b, optimizer, load_spec, truth, before, rank, verdict)
    resume.check_forward(adapter, model, load_spec, truth, rank, verdict)  # last, as the truth's
    return verdict


@dataclass(frozen=True)
class _Evidence:
    """What the cell knows when a load raises: the checkpoint check's findings, or why it did not run."""

    findings: tuple[str, ...]
    checked: str
    cell: Cell
    plan: CellPlan
    adapter: Any
    spec: Spec

    def failure(self, exc: BaseException, rank: int) -> LoadFailed:
        """No new work here (every rank must raise at once): the expert keys rank 0 learned and sent, if any."""
        known = artifact.known(self.plan.truth_path) if self.plan.truth_path else None
        patterns = known.patterns if known is not None else artifact.declared_patterns(self.adapter,
                                                                                       self.plan.expert_keys)
        return load_failed(exc, findings=self.findings, checked=self.checked, layout=self.cell.load,
                           num_experts=self.cell.num_experts, patterns=patterns, rank=rank, adapter=self.adapter)

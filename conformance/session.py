"""The matrix session: a plugin object registered only when the matrix or the functions suite is
asked for.

:mod:`conformance.plugin` registers one :class:`MatrixSession` in ``pytest_configure``; its hooks
add the cells to the collection, collect every cell's record from the test reports (xdist's
controller sees all of them) and write the report.  Everything the session needs is resolved and
checked in :meth:`MatrixSession.from_config`, before any world starts: a bad adapter, tier,
functions module, world size, expert count or report directory is a usage error (exit 4), not a
crash after the run.

A session cut short still writes its report: on Ctrl-C or SIGTERM (see :mod:`pytest_moe_ep.signals`)
``pytest_sessionfinish`` runs with the cells that finished, the running cell's ``interrupted``
record and the selected cells that have no outcome.  The first cell's setup report carries the
selection (:data:`~conformance.report.SELECTION`), so ``python -m conformance.report --from-log``
can tell the cells not run from a ``pytest-reportlog`` log after a ``kill -9``.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest

from conformance.adapter import HF_MEMBERS
from conformance.deadlines import deadlines_for
from conformance.report import (
    MD_NAME,
    OUTCOME,
    RECORD,
    SELECTION,
    not_run,
    terminal_summary,
    write_report,
)
from pytest_moe_ep.settings import ENGINE, SETTINGS, number, setting
from pytest_moe_ep.world.engine import CHECKPOINT_PRELOAD

#: what the HF checks import on every rank (about 1.3 s each): imported once, by the fork server,
#: when they will run.
HF_PRELOAD = ["transformers", "transformers.modeling_utils"]

if TYPE_CHECKING:
    from conformance.expectations import Baseline
    from conformance.items import CellContext
    from conformance.members import Members

MATRIX = "moe-ep-matrix"


def _usage(message: str) -> pytest.UsageError:
    return pytest.UsageError(f"pytest-moe-ep: {message}")


def _adapter(config: pytest.Config) -> tuple[Any, Members, str]:
    """The checkpoint adapter (command line, else the hook, else the ini value, else ``reference``),
    what :func:`~conformance.members.check_adapter` resolved of it, and the ``--moe-ep-adapter``
    value that names it ("" when the hook gave it): what a rerun command passes."""
    from conformance.adapter import AdapterError
    from conformance.members import check_adapter, load_adapter

    given = config.getoption("moe_ep_adapter")
    adapter = None if given else config.hook.pytest_moe_ep_adapter(config=config)
    try:
        if adapter is not None:
            origin = f"from the pytest_moe_ep_adapter hook ({type(adapter).__qualname__})"
        else:
            given = given or config.getini("moe_ep_adapter") or "reference"
            origin = repr(given)
            adapter = load_adapter(given)
        members = check_adapter(adapter, origin)
    except AdapterError as exc:
        raise _usage(str(exc)) from exc
    return adapter, members, "" if origin.startswith("from the") else str(given)


@dataclass(frozen=True)
class Tier:
    """``--moe-ep-matrix``'s value, parsed once (a bad one is a usage error before any world
    starts)."""

    #: as given on the command line (``default``, ``full``, ``1,2,4``, or empty: ``default``).
    given: str
    #: ``default``, ``full`` or ``eps``.
    name: str
    #: the EP degrees of an ``eps`` tier (``None`` for the named tiers).
    eps: list[int] | None = None

    @property
    def reported(self) -> str:
        """The report's name for it: the EP degrees as given, else ``default`` or ``full``."""
        return self.given if self.name == "eps" else self.name


def _tier(given: str | None, world_size: int) -> Tier | None:
    from conformance.matrix import MatrixError, parse_tier

    if given is None:
        return None
    try:
        return Tier(given, *parse_tier(given, world_size))
    except MatrixError as exc:
        raise _usage(str(exc)) from exc


@dataclass(frozen=True)
class FunctionsTarget:
    """The module the functions suite checks, and why its cells are n/a (its framework is not
    installed)."""

    module: str
    na: str = ""


def _functions(given: str | None) -> FunctionsTarget | None:
    """Resolve ``--moe-ep-functions``; a module that lacks any of the nine functions is refused up
    front."""
    from conformance.adapters import builtin_name, functions_builtins
    from conformance.functions.cells import REFERENCE, load_functions, missing_functions

    if not given:
        return None
    builtins = functions_builtins()
    given = builtin_name(given) if builtin_name(given) in builtins else given
    module = builtins.get(given, given)
    name = module.split(":")[0]
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        if given in builtins:
            return FunctionsTarget(module, f"{name.split('.')[0]} is not installed (the suite "
                                   f"would check {name})")
        raise _usage(f"--moe-ep-functions={given}: cannot find module {name!r}")
    try:
        target = load_functions(module)
    except Exception as exc:  # whatever importing it raised is the user's to see
        raise _usage(f"--moe-ep-functions={given}: cannot import {module!r}: {type(exc).__name__}: "
                     f"{exc}") from exc
    missing = missing_functions(target)
    if missing:
        raise _usage(f"--moe-ep-functions={given}: {module!r} lacks {len(missing)} of the nine "
                     f"functions of {REFERENCE}: {', '.join(missing)}")
    return FunctionsTarget(module)


def _report_dir(given: str | None) -> Path | None:
    """The report directory, created and proven writable now rather than after the whole matrix
    ran."""
    if not given:
        return None
    path = Path(given)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".moe-ep-write-check-"):
            pass
    except OSError as exc:
        raise _usage(f"--moe-ep-report={given}: cannot write a report there: "
                     f"{exc.strerror or exc}") from exc
    return path


def _named(config: pytest.Config) -> list[str]:
    """Cells named on the command line by node id: taken out of pytest's own arguments (no file
    holds them; ``>`` in an id cannot be written in ``-k``) and selected at collection."""
    named = [arg for arg in config.args if arg == MATRIX or arg.startswith(f"{MATRIX}::")]
    if named:
        config.args[:] = [arg for arg in config.args if arg not in named]
    return named


def _names(name: str, nodeid: str) -> bool:
    """Whether the command line's ``name`` selects ``nodeid``: the id itself, or a prefix of it that
    ends where one of its parts does."""
    return nodeid == name or nodeid.startswith(f"{name}::")


def _expert_keys(config: pytest.Config) -> tuple[str, ...]:
    """``--moe-ep-expert-key`` regexes, each compiled now so a bad one is a usage error before any
    world starts."""
    from conformance.inspection import pattern

    given = tuple(config.getoption("moe_ep_expert_key", None) or ())
    for regex in given:
        try:
            pattern(regex)
        except ValueError as exc:
            raise _usage(f"--moe-ep-expert-key: {exc}") from exc
    return given


def _experts(config: pytest.Config) -> tuple[int, ...]:
    raw = str(setting(config, "experts"))
    try:
        found = tuple(sorted({int(part) for part in raw.split(",") if part.strip()}))
    except ValueError:
        found = ()
    if not found or found[0] < 1:
        raise _usage("--moe-ep-experts (ini moe_ep_experts) takes expert counts >= 1 such as 4,5 "
                     f"or 6; got {raw!r}")
    return found


def _universe(members: Members | None, world_size: int,
              num_experts: tuple[int, ...]) -> tuple[list[str], str]:
    """Every cell id of every tier at this world size and these expert counts (n/a cells too), for
    checking an expectations file's ids and patterns, and the note that says for which."""
    from conformance.functions.cells import functions_cells
    from conformance.layout import EP_ORDERS
    from conformance.matrix import ep_tier, full_product

    cells = list(full_product(world_size, num_experts))
    divisors = [ep for ep in range(1, world_size + 1) if world_size % ep == 0]
    for order in EP_ORDERS:
        cells += ep_tier(world_size, divisors, num_experts, order)
    # an adapter without MTP layers runs the cells with stages without them (ids without ``mtp``)
    cells += [replace(c, mtp=False) for c in cells if c.mtp]
    ids = {f"{MATRIX}::{c.node_name}" for c in cells} | {f"{MATRIX}::{c.node_name}"
                                                         for c in functions_cells()}
    note = f" (world size {world_size}, experts {','.join(map(str, num_experts))})"
    return sorted(ids), note


def _baseline(config: pytest.Config, adapter: Any, members: Members | None, world_size: int,
              num_experts: tuple[int, ...]) -> Baseline | None:
    """``--moe-ep-expectations``, ``--moe-ep-update-expectations`` and ``--moe-ep-tolerate``, read
    and checked now: a file that does not parse, names an unknown finding, another adapter or no
    cell is a usage error."""
    from conformance.expectations import (
        Baseline,
        Expectations,
        ExpectationsError,
        parse_tolerate,
        read,
    )

    given = setting(config, "expectations")
    update = bool(config.getoption("moe_ep_update_expectations", False))
    try:
        tolerate = parse_tolerate(setting(config, "tolerate"))
    except ValueError as exc:
        raise _usage(str(exc)) from exc
    if update and not given:
        raise _usage("--moe-ep-update-expectations rewrites the file --moe-ep-expectations=FILE "
                     "names; give one")
    if not given:
        return Baseline(Expectations(Path("")), tolerate) if tolerate else None
    universe, note = _universe(members, world_size, num_experts)
    name = getattr(adapter, "name", None) if adapter is not None else None
    try:
        found = read(given, adapter=name, universe=universe, universe_note=note, missing_ok=update)
    except ExpectationsError as exc:
        raise _usage(f"--moe-ep-expectations={exc}") from exc
    return Baseline(found, tolerate, update)


@dataclass(eq=False)  # hashed by identity: pluggy keeps plugins in sets (a conftest's hook subset)
class MatrixSession:
    """The matrix's hooks for one pytest session; see the module docstring."""

    config: pytest.Config
    world_size: int
    tier: Tier | None
    adapter: Any
    #: what ``check_adapter`` resolved of ``adapter`` (``None`` without one).
    members: Members | None
    functions: FunctionsTarget | None
    report_dir: Path | None
    num_experts: tuple[int, ...]
    records: list[dict[str, Any]] = field(default_factory=list)
    #: ``--moe-ep-expert-key`` regexes (the adapter's own ``expert_keys`` travel with the adapter).
    expert_keys: tuple[str, ...] = ()
    #: what the items get of the session, made when they are collected (its ``interrupted`` list:
    #: the running cell's record when the session was interrupted, for which pytest makes no
    #: report).
    context: CellContext | None = None
    #: node ids of the final selection's cells (after ``-k``); under xdist, what the workers
    #: collected.
    selected: list[str] = field(default_factory=list)
    selection_sent: bool = False
    #: the expectations (file, tolerated findings, update run), ``None`` without any.
    baseline: Baseline | None = None
    #: cells named on the command line by node id (or an id's prefix): only those run.
    named: list[str] = field(default_factory=list)
    #: the ``--moe-ep-adapter`` value that names the adapter ("" when the hook gave it): rerun
    #: commands say it.
    adapter_option: str = ""
    #: every matrix item's outcome for expectations (id -> pass or finding), from the test reports.
    outcomes: dict[str, str] = field(default_factory=dict)
    #: what the update run said of the file, for the terminal summary.
    update_note: str = ""
    _backend_used: str | None = None

    NAME = "moe-ep-matrix-session"

    @classmethod
    def from_config(cls, config: pytest.Config) -> MatrixSession:
        world_size = number(config, "world_size", int, 1)
        given = config.getoption("moe_ep_matrix")
        adapter, members, option = _adapter(config) if given is not None else (None, None, "")
        experts = _experts(config)
        return cls(config, world_size, _tier(given, world_size), adapter, members,
                   _functions(config.getoption("moe_ep_functions")),
                   _report_dir(config.getoption("moe_ep_report")),
                   experts, expert_keys=_expert_keys(config),
                   baseline=_baseline(config, adapter, members, world_size, experts),
                   named=_named(config), adapter_option=option)

    @property
    def interrupted(self) -> list[dict[str, Any]]:
        return self.context.interrupted if self.context is not None else []

    # -- collection -------------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_ignore_collect(self, collection_path: Path, config: pytest.Config) -> bool | None:
        """With no test paths on the command line (or only cells' node ids), the matrix is the whole
        run."""
        if config.args_source != pytest.Config.ArgsSource.ARGS or (self.named and not config.args):
            return True
        return None

    def pytest_report_header(self, config: pytest.Config) -> str:
        return (f"moe-ep matrix: world_size={self.world_size} "
                f"experts={','.join(map(str, self.num_experts))}")

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        from conformance.functions.cells import functions_cells
        from conformance.items import CellContext, MatrixCollector, collect_items
        from conformance.matrix import MatrixError, checkpoint_cells
        from conformance.saves import Saves

        engine = config.stash[ENGINE]
        context = self.context = CellContext(self.world_size, self.backend_used,
                                             expert_keys=self.expert_keys, baseline=self.baseline,
                                             deadlines=deadlines_for(engine))
        cells = []
        if self.adapter is not None and self.members is not None and self.tier is not None:
            try:
                cells = checkpoint_cells(
                    self.members.capabilities, (self.tier.name, self.tier.eps), self.world_size,
                    self.num_experts, has_legacy=self.members.has("save_legacy"))
            except MatrixError as exc:
                raise _usage(str(exc)) from exc
            context.saves = Saves(engine, self.adapter,
                                  share=bool(config.getini("moe_ep_share_saves")),
                                  members=self.members)
            context.members = self.members
        modules = [*CHECKPOINT_PRELOAD, "conformance.checks", "conformance.inspection",
                   "reference_impl.checkpoint", "conformance.functions.rank"]
        if self.adapter is not None and self.members is not None:
            modules += [type(self.adapter).__module__, *self.members.value("preload")]
            if (all(self.members.has(m) for m in HF_MEMBERS)
                    and importlib.util.find_spec("transformers") is not None):
                modules += HF_PRELOAD
        engine.add_preload(modules)
        collector = MatrixCollector.from_parent(session, name=MATRIX, nodeid=MATRIX)
        fcells = functions_cells() if self.functions is not None else []
        cell_items = list(collect_items(collector, context, adapter=self.adapter, cells=cells,
                                        functions=self.functions, functions_cells=fcells))
        cell_items = self._only_named(cell_items, config)
        # Report the cells as collected, so "collected N items" and -k's counts include them.
        # CollectReport only reads its result list: a list of items is one of items and collectors
        result = cast("list[pytest.Item | pytest.Collector]", cell_items)
        config.hook.pytest_collectreport(
            report=pytest.CollectReport(collector.nodeid, "passed", None, result))
        items.extend(cell_items)

    def _only_named(self, found: list[Any], config: pytest.Config) -> list[Any]:
        """The cells the command line named by node id (all of them when it named none); a name that
        selects no cell is a usage error, as pytest's own for a test that does not exist."""
        if not self.named:
            return found
        kept = [item for item in found if any(_names(name, item.nodeid) for name in self.named)]
        unknown = [name for name in self.named if not any(_names(name, i.nodeid) for i in found)]
        if unknown:
            raise _usage(f"no cell of this matrix has the node id {unknown[0]!r} (the ids are "
                         "listed by --collect-only -q)")
        config.hook.pytest_deselected(items=[item for item in found if item not in kept])
        return kept

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """The final selection (after ``-k``): how many cells read each checkpoint."""
        from conformance.items import CheckpointCellItem, MatrixItem

        if self.context is not None and self.context.saves is not None:
            self.context.saves.count_readers([i.cell for i in session.items
                                              if isinstance(i, CheckpointCellItem)])
        self.selected = [i.nodeid for i in session.items if isinstance(i, MatrixItem)]

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        """xdist's controller collects nothing itself: the selection is what its workers
        collected."""
        if not self.selected:
            self.selected = [i for i in ids if i.startswith(f"{MATRIX}::")]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        """The first cell's setup report carries the selection and the environment, for
        ``--from-log``; a cell whose setup passed is the running one (``--from-log`` says so too:
        the report and the log are made and logged with a SIGTERM held, see
        :mod:`pytest_moe_ep.signals`)."""
        from conformance.items import MatrixItem

        outcome = yield
        if (call.when == "setup" and call.excinfo is None and self.context is not None
            and isinstance(item, MatrixItem)):
            self.context.running = item
        if (call.when != "setup" or self.selection_sent or not self.selected
            or item.nodeid not in self.selected):
            return
        self.selection_sent = True
        report = outcome.get_result()
        report.user_properties = [*report.user_properties,
                                  (SELECTION, json.dumps(self._environment()))]

    # -- records and the report -------------------------------------------------------------------
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":  # every phase's report repeats the item's user_properties
            # RECORD and OUTCOME values are the JSON strings this plugin put there (pytest types
            # them object)
            self.records.extend(json.loads(cast(str, v)) for k, v in report.user_properties
                                if k == RECORD)
            for key, value in report.user_properties:
                if key == OUTCOME:
                    found = json.loads(cast(str, value))
                    self.outcomes[found["id"]] = found["outcome"]

    def _writes_report(self) -> bool:
        if hasattr(self.config, "workerinput"):  # an xdist worker: the controller writes
            return False
        return self.config.stash[ENGINE].rank == 0  # under torchrun, rank 0 alone

    def backend_used(self) -> str:
        """The backend the cells ran on, not the one asked for (``auto`` resolves to gloo or
        nccl)."""
        from pytest_moe_ep.world.backend import BackendUnavailable, resolve_backend

        if self._backend_used is None:
            asked = self.config.stash[SETTINGS].backend
            try:
                self._backend_used = resolve_backend(asked, self.world_size)
            except BackendUnavailable:
                self._backend_used = asked
        return self._backend_used

    def _environment(self) -> dict[str, Any]:
        """What the report says besides the cells: backend, world size, tier and coverage, the
        selection, and what a rerun command needs (the expert counts, the adapter as the command
        line names it)."""
        from conformance.matrix import full_size

        return {"backend": self.backend_used(), "world_size": self.world_size,
                "tier": self.tier.reported if self.tier is not None else None,
                "full_cells": full_size(self.world_size, self.num_experts) if self.tier is not None
                else None, "ids": self.selected, "experts": list(self.num_experts),
                "adapter_option": self.adapter_option}

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        running = self.context.running if self.context is not None else None
        if exitstatus == pytest.ExitCode.INTERRUPTED and running is not None:
            running.interrupt_if_unfinished(
                reported=any(r.get("id") == running.nodeid for r in self.records))
        if self.report_dir is not None and self._writes_report():
            env = self._environment()
            records = self.records + self.interrupted
            write_report(
                self.report_dir, records, backend=env["backend"], world_size=self.world_size,
                experts=env["experts"], adapter_option=env["adapter_option"], tier=env["tier"],
                full_cells=env["full_cells"], interrupted=exitstatus == pytest.ExitCode.INTERRUPTED,
                not_run=not_run(self.selected, records), expectations=self._expectations_summary())
        if self.baseline is not None and self.baseline.update and self._writes_report():
            self._update_expectations(exitstatus)

    def _expectations_summary(self) -> dict[str, Any] | None:
        if self.baseline is None:
            return None
        return {"file": str(self.baseline.file.path) if self.baseline.file.exists
                or self.baseline.update else None,
                "tolerate": list(self.baseline.tolerate), "update": self.baseline.update}

    def _expectations_line(self, records: list[dict[str, Any]]) -> str:
        """How the run stood against the expectations: red cells expected, cells not as expected."""
        from conformance.outcome import expected_line

        assert self.baseline is not None
        expected, red = expected_line(records)
        unmet = [r["id"] for r in records if r.get("expectation") == "unmet"]
        source = str(self.baseline.file.path) if self.baseline.file.exists else "no file"
        tolerating = (f", tolerating {','.join(self.baseline.tolerate)}" if self.baseline.tolerate
                      else "")
        line = (f"expectations ({source}{tolerating}): {expected} of {red} red cell(s) expected, "
                f"{len(unmet)} cell(s) not as expected")
        return line + (f"; the first: {unmet[0]}" if unmet else "")

    def _update_expectations(self, exitstatus: int) -> None:
        """Rewrite the expectations file from the cells that ran, atomically, and only after a
        finished run."""
        from conformance.expectations import updated_text, written_by
        from conformance.report import write_atomic

        assert self.baseline is not None
        path = self.baseline.file.path
        missing = not_run(self.selected, self.records + self.interrupted)
        if exitstatus == pytest.ExitCode.INTERRUPTED or self.interrupted or missing:
            self.update_note = (f"{path}: not updated: the run did not finish ({len(missing)} "
                                "selected cell(s) without an outcome); the file is as it was")
            return
        name = getattr(self.adapter, "name", "") or (self.functions.module if self.functions
                                                     else "")
        version = str(getattr(self.adapter, "version", "")) if self.adapter is not None else ""
        update = updated_text(self.baseline.file, self.outcomes, adapter=name,
                              by=written_by(name, version))
        if update.changes or not self.baseline.file.exists:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, update.text)
        self.update_note = update.summary(path)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        records = self.records + self.interrupted
        if records and self._writes_report():
            env = self._environment()
            terminalreporter.section("moe-ep conformance matrix")
            terminalreporter.write_line(
                terminal_summary(records, verbose=self.config.get_verbosity() > 0,
                                 tier=env["tier"], full_cells=env["full_cells"]))
            missing = not_run(self.selected, records)
            if missing:
                terminalreporter.write_line(f"{len(missing)} selected cell(s) not run: the report "
                                            "lists them")
            if self.baseline is not None:
                terminalreporter.write_line(self._expectations_line(records))
            if self.update_note:
                terminalreporter.write_line(f"expectations: {self.update_note}")
            if self.report_dir is not None:
                terminalreporter.write_line(f"report: {self.report_dir / MD_NAME} (and .json)")


__all__ = ["MATRIX", "FunctionsTarget", "MatrixSession"]

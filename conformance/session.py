"""The matrix session: a plugin object registered only when the matrix or the functions suite is asked for.

:mod:`conformance.plugin` registers one :class:`MatrixSession` in ``pytest_configure``; its hooks add
the cells to the collection, collect every cell's record from the test reports (xdist's controller
sees all of them) and write the report.  Everything the session needs is resolved and checked in
:meth:`MatrixSession.from_config`, before any world starts: a bad adapter, functions module, world
size, expert count or report directory is a usage error (exit 4), not a crash after the run.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conformance.report import RECORD, compact_matrix, write_report
from pytest_moe_ep.settings import ENGINE, SETTINGS, number, setting

MATRIX = "moe-ep-matrix"


def _usage(message: str) -> pytest.UsageError:
    return pytest.UsageError(f"pytest-moe-ep: {message}")


def _adapter(config: pytest.Config) -> Any:
    """The checkpoint adapter: command line, else the hook, else the ini value, else ``reference``."""
    from conformance.adapter import AdapterError, check_adapter, load_adapter

    given = config.getoption("moe_ep_adapter")
    adapter = None if given else config.hook.pytest_moe_ep_adapter(config=config)
    try:
        if adapter is not None:
            origin = f"from the pytest_moe_ep_adapter hook ({type(adapter).__qualname__})"
        else:
            given = given or config.getini("moe_ep_adapter") or "reference"
            origin = repr(given)
            adapter = load_adapter(given)
        check_adapter(adapter, origin)
    except AdapterError as exc:
        raise _usage(str(exc)) from exc
    return adapter


@dataclass(frozen=True)
class FunctionsTarget:
    """The module the functions suite checks, and why its cells are n/a (its framework is not installed)."""

    module: str
    na: str = ""


def _functions(given: str | None) -> FunctionsTarget | None:
    """Resolve ``--moe-ep-functions``; a module that lacks any of the nine functions is refused up front."""
    from conformance.adapters import functions_builtins
    from conformance.functions.cells import REFERENCE, load_functions, missing_functions

    if not given:
        return None
    builtins = functions_builtins()
    module = builtins.get(given, given)
    name = module.split(":")[0]
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        if given in builtins:
            return FunctionsTarget(module, f"{name.split('.')[0]} is not installed (the suite would check {name})")
        raise _usage(f"--moe-ep-functions={given}: cannot find module {name!r}")
    try:
        target = load_functions(module)
    except Exception as exc:  # whatever importing it raised is the user's to see
        raise _usage(f"--moe-ep-functions={given}: cannot import {module!r}: {type(exc).__name__}: {exc}") from exc
    missing = missing_functions(target)
    if missing:
        raise _usage(f"--moe-ep-functions={given}: {module!r} lacks {len(missing)} of the nine functions of "
                     f"{REFERENCE}: {', '.join(missing)}")
    return FunctionsTarget(module)


def _report_dir(given: str | None) -> Path | None:
    """The report directory, created and proven writable now rather than after the whole matrix ran."""
    if not given:
        return None
    path = Path(given)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".moe-ep-write-check-"):
            pass
    except OSError as exc:
        raise _usage(f"--moe-ep-report={given}: cannot write a report there: {exc.strerror or exc}") from exc
    return path


def _expert_keys(config: pytest.Config) -> tuple[str, ...]:
    """``--moe-ep-expert-key`` regexes, each compiled now so a bad one is a usage error before any world starts."""
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
        raise _usage(f"--moe-ep-experts (ini moe_ep_experts) takes expert counts >= 1 such as 4,6 or 5; got {raw!r}")
    return found


@dataclass
class MatrixSession:
    """The matrix's hooks for one pytest session; see the module docstring."""

    config: pytest.Config
    world_size: int
    tier: str | None
    adapter: Any
    functions: FunctionsTarget | None
    report_dir: Path | None
    num_experts: tuple[int, ...]
    records: list[dict[str, Any]] = field(default_factory=list)
    saves: Any = None
    #: ``--moe-ep-expert-key`` regexes (the adapter's own ``expert_keys`` travel with the adapter).
    expert_keys: tuple[str, ...] = ()

    NAME = "moe-ep-matrix-session"

    @classmethod
    def from_config(cls, config: pytest.Config) -> MatrixSession:
        world_size = number(config, "world_size", int, 1)
        tier = config.getoption("moe_ep_matrix")
        adapter = _adapter(config) if tier is not None else None
        return cls(config, world_size, tier, adapter, _functions(config.getoption("moe_ep_functions")),
                   _report_dir(config.getoption("moe_ep_report")), _experts(config), expert_keys=_expert_keys(config))

    # -- collection -------------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_ignore_collect(self, collection_path: Path, config: pytest.Config) -> bool | None:
        """With no test paths on the command line, the matrix is the whole run."""
        return True if config.args_source != pytest.Config.ArgsSource.ARGS else None

    def pytest_report_header(self, config: pytest.Config) -> str:
        return f"moe-ep matrix: world_size={self.world_size} experts={','.join(map(str, self.num_experts))}"

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        from conformance.adapter import capabilities_of
        from conformance.functions.cells import functions_cells
        from conformance.items import MatrixCollector, collect_items
        from conformance.matrix import MatrixError, checkpoint_cells

        cells = []
        if self.adapter is not None:
            try:
                cells = checkpoint_cells(capabilities_of(self.adapter), self.tier, self.world_size,
                                         self.num_experts, has_legacy=callable(getattr(self.adapter, "save_legacy",
                                                                                       None)))
            except MatrixError as exc:
                raise _usage(str(exc)) from exc
        engine = config.stash[ENGINE]
        modules = ["conformance.checks", "conformance.inspection", "reference_impl.checkpoint",
                   "conformance.functions.rank"]
        if self.adapter is not None:
            modules += [type(self.adapter).__module__, *getattr(self.adapter, "preload", ())]
        engine.add_preload(modules)
        collector = MatrixCollector.from_parent(session, name=MATRIX, nodeid=MATRIX)
        fcells = functions_cells() if self.functions is not None else []
        cell_items = list(collect_items(collector, adapter=self.adapter, cells=cells, functions=self.functions,
                                        functions_cells=fcells))
        if self.adapter is not None:
            from conformance.saves import Saves

            self.saves = Saves(engine, self.adapter, share=bool(config.getini("moe_ep_share_saves")))
        # Report the cells as collected, so "collected N items" and -k's counts include them.
        config.hook.pytest_collectreport(report=pytest.CollectReport(collector.nodeid, "passed", None, cell_items))
        items.extend(cell_items)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """The final selection (after ``-k``): how many cells read each checkpoint."""
        from conformance.items import CheckpointCellItem

        if self.saves is not None:
            self.saves.count_readers([i.cell for i in session.items if isinstance(i, CheckpointCellItem)])

    # -- records and the report -------------------------------------------------------------------
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":  # every phase's report repeats the item's user_properties
            self.records.extend(json.loads(v) for k, v in report.user_properties if k == RECORD)

    def _writes_report(self) -> bool:
        if hasattr(self.config, "workerinput"):  # an xdist worker: the controller writes
            return False
        return self.config.stash[ENGINE].rank == 0  # under torchrun, rank 0 alone

    def _backend(self) -> str:
        """The backend the cells ran on, not the one asked for (``auto`` resolves to gloo or nccl)."""
        from pytest_moe_ep.world.backend import BackendUnavailable, resolve_backend

        asked = self.config.stash[SETTINGS].backend
        try:
            return resolve_backend(asked, self.world_size)
        except BackendUnavailable:
            return asked

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.report_dir is not None and self._writes_report():
            from conformance.matrix import full_size, parse_tier

            tier = parse_tier(self.tier, self.world_size)[0] if self.tier is not None else None
            write_report(self.report_dir, self.records, backend=self._backend(), world_size=self.world_size,
                         tier=self.tier if tier == "eps" else tier,
                         full_cells=full_size(self.world_size, self.num_experts) if tier else None)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.records and self._writes_report():
            terminalreporter.section("moe-ep conformance matrix")
            terminalreporter.write_line(compact_matrix(self.records))
            if self.report_dir is not None:
                terminalreporter.write_line(f"report: {self.report_dir / 'moe-ep-conformance.md'} (and .json)")


__all__ = ["MATRIX", "FunctionsTarget", "MatrixSession"]

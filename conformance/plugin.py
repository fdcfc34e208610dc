"""The conformance matrix's pytest face (``pytest11`` entry ``moe_ep_matrix``); never imports torch.

``pytest --moe-ep-matrix`` adds one item per cell (see :mod:`conformance.items`) and, when no
test paths are given, collects nothing else.  The adapter comes from ``--moe-ep-adapter``, else the
``pytest_moe_ep_adapter`` hook (a framework's conftest.py), else the ini value ``moe_ep_adapter``,
else the built-in ``reference``.  The options themselves are registered with all others in
:mod:`pytest_moe_ep.settings`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from pytest_moe_ep.distributed import ENGINE, SETTINGS
from pytest_moe_ep.report import RECORD, compact_matrix, write_report

MATRIX = "moe-ep-matrix"
#: built-in functions adapters: name -> module exposing the nine expert-slice functions.
FUNCTIONS_BUILTINS = {
    "reference": "reference_impl.state_dict_utils",
    "nemo_automodel": "nemo_automodel.components.moe.state_dict_utils",
    "balanced": "conformance.adapters.balanced_functions",
}
RECORDS = pytest.StashKey[list]()


def _requested(config: pytest.Config) -> bool:
    return config.getoption("moe_ep_matrix", None) is not None or bool(config.getoption("moe_ep_functions", None))


def pytest_configure(config: pytest.Config) -> None:
    config.stash[RECORDS] = []


@pytest.hookimpl(tryfirst=True)
def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With the matrix and no test paths on the command line, the matrix is the whole run."""
    if _requested(config) and config.args_source != pytest.Config.ArgsSource.ARGS:
        return True
    return None


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
        raise pytest.UsageError(f"pytest-moe-ep: {exc}") from exc
    return adapter


def _functions(config: pytest.Config) -> tuple[str, str, list[Any]] | None:
    from conformance.functions_suite import functions_cells

    given = config.getoption("moe_ep_functions")
    if not given:
        return None
    module = FUNCTIONS_BUILTINS.get(given, given)
    name = module.split(":")[0]
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    na = ""
    if spec is None:
        if given in FUNCTIONS_BUILTINS:
            na = f"{name.split('.')[0]} is not installed (the suite would check {name})"
        else:
            raise pytest.UsageError(f"pytest-moe-ep: --moe-ep-functions={given}: cannot find module {name!r}")
    return module, na, functions_cells()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _requested(config):
        return
    from conformance.adapter import Spec, capabilities_of
    from conformance.items import collect_items
    from conformance.matrix import checkpoint_cells, parse_eps

    settings = config.stash[SETTINGS]
    adapter = cells = None
    if config.getoption("moe_ep_matrix") is not None:
        try:
            eps = parse_eps(config.getoption("moe_ep_matrix"), settings.world_size)
        except ValueError as exc:
            raise pytest.UsageError(f"pytest-moe-ep: {exc}") from exc
        adapter = _adapter(config)
        cells = checkpoint_cells(capabilities_of(adapter), eps,
                                 has_legacy=callable(getattr(adapter, "save_legacy", None)))
    functions = _functions(config)
    engine = config.stash[ENGINE]
    if hasattr(engine, "add_preload"):
        modules = ["conformance.checks", "reference_impl.checkpoint", "conformance.functions_suite"]
        if adapter is not None:
            modules += [type(adapter).__module__, *getattr(adapter, "preload", ())]
        engine.add_preload(modules)
    collector = MatrixCollector.from_parent(session, name=MATRIX, nodeid=MATRIX)
    cell_items = list(collect_items(collector, adapter=adapter, cells=cells or [], base=Spec(), functions=functions))
    # Report the cells as collected, so "collected N items" and -k's counts include them.
    config.hook.pytest_collectreport(report=pytest.CollectReport(collector.nodeid, "passed", None, cell_items))
    items.extend(cell_items)


class MatrixCollector(pytest.Collector):
    """The parent of every cell: node ids start with ``moe-ep-matrix::``."""

    def collect(self) -> list[Any]:
        return []


class _Records:
    """Collects every cell's record from the test reports this process sees (xdist's controller sees all)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":  # every phase's report repeats the item's user_properties
            self.config.stash[RECORDS].extend(v for k, v in report.user_properties if k == RECORD)


def _writes_report(config: pytest.Config) -> bool:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller writes
        return False
    engine = config.stash.get(ENGINE, None)
    return getattr(engine, "rank", 0) == 0  # under torchrun, rank 0 alone


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    if _requested(session.config):
        session.config.pluginmanager.register(_Records(session.config), "moe-ep-records")


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    directory = config.getoption("moe_ep_report", None)
    records = config.stash.get(RECORDS, [])
    if directory and _requested(config) and _writes_report(config):
        settings = config.stash[SETTINGS]
        write_report(directory, records, backend=settings.backend, world_size=settings.world_size)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    records = config.stash.get(RECORDS, [])
    if records and _writes_report(config):
        terminalreporter.section("moe-ep conformance matrix")
        terminalreporter.write_line(compact_matrix(records))
        directory = config.getoption("moe_ep_report", None)
        if directory:
            terminalreporter.write_line(f"report: {Path(directory) / 'moe-ep-conformance.md'} (and .json)")

"""Running a ``moe_ep_world``-marked test function on every rank.

The pytest process resolves the test's fixtures and parametrize values, pickles them, and asks the
session's :class:`~pytest_moe_ep.world.engine.Engine` to run the function on every rank.  Fixture
values therefore must pickle: parametrize values, ``tmp_path``, ``moe_ep_shared_dir`` and plain-data
fixtures work; fixtures that act on the pytest process itself (``capsys``, ``monkeypatch``,
``request``, ...) cannot, and are refused by name.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from pytest_moe_ep.settings import DISTRIBUTED_ATTR, ENGINE, SETTINGS, TIMEOUT, WorldMarker
from pytest_moe_ep.world.backend import BackendUnavailable
from pytest_moe_ep.world.engine import CallResult, Engine, RankOutput, WorldError
from pytest_moe_ep.world.protocol import FunctionRef

#: pytest's fixtures that act on the pytest process itself: a copy in a rank would do nothing
#: useful.
PROCESS_BOUND_FIXTURES = frozenset({
    "request", "pytestconfig", "monkeypatch", "capsys", "capsysbinary", "capfd", "capfdbinary",
    "caplog", "recwarn", "record_property", "record_xml_attribute", "record_testsuite_property",
    "pytester", "testdir", "subtests",
})


def is_distributed(item: pytest.Item) -> bool:
    return WorldMarker.from_item(item) is not None or bool(getattr(item, DISTRIBUTED_ATTR, False))


def engine_of(config: pytest.Config) -> Engine:
    return config.stash[ENGINE]


def call_timeout(item: pytest.Item, explicit: float | None = None) -> float:
    """The deadline of ``item``'s call: the marker's, else pytest-timeout's, else
    ``moe_ep_timeout``."""
    if explicit:
        return float(explicit)
    found = item.stash.get(TIMEOUT, 0.0)
    return found if found and found > 0 else item.config.stash[SETTINGS].timeout_s


def timeout_source(item: pytest.Item) -> tuple[float, str]:
    """:func:`call_timeout` of ``item`` without an explicit one, and where it came from:
    ``pytest-timeout``, ``moe_ep_timeout`` (given on the command line, in the ini file or with
    ``-o``) or ``default`` (``moe_ep_timeout``'s default)."""
    found = item.stash.get(TIMEOUT, 0.0)
    if found and found > 0:
        return found, "pytest-timeout"
    settings = item.config.stash[SETTINGS]
    return settings.timeout_s, "moe_ep_timeout" if settings.timeout_given else "default"


def attach_outputs(item: pytest.Item, outputs: list[RankOutput]) -> None:
    """Each rank's output as its own report section, shown on failure like pytest's capture."""
    for rank, out in enumerate(outputs):
        if out.stdout:
            item.add_report_section("call", f"rank {rank} stdout", out.stdout)
        if out.stderr:
            item.add_report_section("call", f"rank {rank} stderr", out.stderr)


def call_on_world(item: pytest.Item, fn: FunctionRef, args: tuple[Any, ...], kwargs: dict[str, Any],
                  *, world_size: int, backend: str, timeout: float | None = None) -> CallResult:
    """Run ``fn`` through the session's engine; skip on a missing backend or a skip on every rank.

    A failure raises the engine's :class:`WorldError` with each rank's output attached to ``item``;
    the caller decides how to show it.
    """
    try:
        result = engine_of(item.config).call(fn, args, kwargs, world_size=world_size,
                                             backend=backend, timeout=call_timeout(item, timeout))
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    except WorldError as exc:
        attach_outputs(item, exc.outputs)
        reason = exc.skipped_everywhere  # pytest.skip() on every rank skips the test
        if reason is not None:
            pytest.skip(reason)
        raise
    attach_outputs(item, result.outputs)
    return result


def run_marked_test(item: pytest.Function, marker: WorldMarker) -> None:
    kwargs = {name: item.funcargs[name] for name in item._fixtureinfo.argnames}
    for name, value in kwargs.items():
        why = "it acts on the pytest process itself" if name in PROCESS_BOUND_FIXTURES else None
        if why is None:
            try:
                pickle.dumps(value)
            except Exception as exc:
                why = (f"its value ({type(value).__qualname__}) cannot be sent to rank processes "
                       f"({exc})")
        if why:
            pytest.fail(f"fixture {name!r} cannot be used in a {marker.world_size}-rank test: "
                        f"{why}. Fixtures that work inside ranks: parametrize values, tmp_path, "
                        "moe_ep_shared_dir and fixtures returning plain data.", pytrace=False)
    fn = FunctionRef(item.module.__name__, item.obj.__qualname__, str(item.path),
                     rewrite_asserts=True)
    try:
        call_on_world(item, fn, (), kwargs, world_size=marker.world_size, backend=marker.backend,
                      timeout=marker.timeout)
    except WorldError as exc:
        failure = exc.report()
    else:
        return
    pytest.fail(failure, pytrace=False)  # outside the except block: one report, not a chain

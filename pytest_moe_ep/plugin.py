"""pytest-moe-ep's entry module (``pytest11``): the world engine's options, marker, fixtures and
hooks.

pytest loads this module in every session of every user, so it stays light: it never imports
torch, and an engine is created only in ``pytest_configure`` (torch is imported the first time a
world is actually needed).  The conformance matrix is another plugin, :mod:`conformance.plugin`.

- ``@pytest.mark.moe_ep_world(n, backend="auto", timeout=None)`` runs a test on every rank.
- ``moe_ep_shared_dir`` is one directory every rank of a test sees.
- ``moe_ep_engine`` is the session's engine, for ``engine.run(fn, *args, world_size=n)``.
- Deadlines: the marker's ``timeout``, else pytest-timeout's value (its timer is handed to the
  engine instead of SIGALRM), else ``moe_ep_timeout``.
- SIGTERM ends the session like Ctrl-C (:mod:`pytest_moe_ep.signals`): reports are still written.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_moe_ep.distributed import engine_of, is_distributed, run_marked_test
from pytest_moe_ep.settings import (
    ENGINE,
    SETTINGS,
    TIMEOUT,
    WORLD_MARKER_HELP,
    Settings,
    WorldMarker,
    add_options,
)
from pytest_moe_ep.signals import TermAsInterrupt

SIGTERM_HANDLER = pytest.StashKey[TermAsInterrupt]()


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def under_torchrun() -> bool:
    """pytest itself was launched by torchrun, or a default process group already exists."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return True
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _check_explicit_backend(settings: Settings) -> None:
    """An explicitly asked-for backend that cannot run here is a usage error, not a green run that
    checked nothing."""
    if settings.backend != "nccl":
        return
    from pytest_moe_ep.world.backend import cuda_devices

    if cuda_devices() == 0:
        raise pytest.UsageError("--moe-ep-backend=nccl: this machine has no CUDA GPU, so no NCCL "
                                "world can run; use --moe-ep-backend=gloo or auto (auto falls back "
                                "to gloo)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", WORLD_MARKER_HELP)
    settings = Settings.from_config(config)
    _check_explicit_backend(settings)
    config.stash[SETTINGS] = settings
    if under_torchrun():
        from pytest_moe_ep.world.torchrun import TorchrunWorld

        engine: Any = TorchrunWorld(settings.backend, settings.timeout_s)
        if engine.rank != 0:  # only rank 0 writes reports
            config.option.xmlpath = None
    else:
        from pytest_moe_ep.world.engine import collective_timeout_s
        from pytest_moe_ep.world.supervisor import Supervisor

        engine = Supervisor(start_method=settings.start_method, capture=settings.capture,
                            pg_timeout_s=collective_timeout_s(settings.timeout_s),
                            default_timeout_s=settings.timeout_s, preload=settings.preload)
        handler = config.stash[SIGTERM_HANDLER] = TermAsInterrupt()
        if handler.install():
            config.pluginmanager.register(handler, TermAsInterrupt.NAME)
    config.stash[ENGINE] = engine


def pytest_report_header(config: pytest.Config) -> str:
    s = config.stash[SETTINGS]
    return f"moe-ep: backend={s.backend} timeout={s.timeout_s:g}s {engine_of(config).describe()}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        WorldMarker.from_item(item)  # a bad marker is a usage error before anything runs


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = WorldMarker.from_item(pyfuncitem)
    if marker is None:
        return None
    run_marked_test(pyfuncitem, marker)
    return True


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """A distributed test's pytest-timeout value becomes the engine's deadline, not a SIGALRM."""
    if not is_distributed(item):
        return None
    item.stash[TIMEOUT] = float(settings.timeout or 0)
    return True


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    return True if is_distributed(item) else None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    handler = session.config.stash.get(SIGTERM_HANDLER, None)
    if handler is not None:  # the reports are being written: a first SIGTERM now waits for them
        handler.finishing = True
    engine = session.config.stash.get(ENGINE, None)
    if engine is None:
        return
    session.exitstatus = engine.agree_on_exit(int(exitstatus))
    engine.shutdown()  # again from pytest_unconfigure and atexit: idempotent


def pytest_unconfigure(config: pytest.Config) -> None:
    engine = config.stash.get(ENGINE, None)
    if engine is not None:
        engine.shutdown()
    handler = config.stash.get(SIGTERM_HANDLER, None)
    if handler is not None:
        handler.uninstall()


@pytest.fixture
def moe_ep_shared_dir(request: pytest.FixtureRequest) -> Path:
    """A directory every rank of the test sees: the same path on every rank."""
    return engine_of(request.config).shared_dir(request.node.nodeid)


@pytest.fixture(scope="session")
def moe_ep_engine(pytestconfig: pytest.Config) -> Iterator[Any]:
    """The session's world engine: ``moe_ep_engine.run(fn, *args, world_size=n)``."""
    yield engine_of(pytestconfig)

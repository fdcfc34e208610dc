"""Every option, ini value, marker and stash key of the world engine, registered in one place.

Each setting is an ini value ``moe_ep_<name>`` and a command-line option ``--moe-ep-<name>``;
the command line wins.  Reading them never imports torch.  The conformance matrix registers its own
options in :mod:`conformance.plugin`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import pytest

from pytest_moe_ep.world.backend import BACKENDS

START_METHODS = ("forkserver", "spawn")
WORLD_MARKER = "moe_ep_world"
WORLD_MARKER_HELP = (
    f"{WORLD_MARKER}(n, backend='auto', timeout=None): run the test function on every rank of an "
    "n-rank world with the default process group initialized; it passes only when every rank "
    "passes."
)
#: the deadline of one call when ``moe_ep_timeout`` is not given: a whole distributed test's.
DEFAULT_TIMEOUT_S = 300.0
GROUP = ("moe-ep", "pytest-moe-ep: expert-parallel worlds and MoE checkpoint conformance")

#: the session's engine (an :class:`~pytest_moe_ep.world.engine.Engine`).
ENGINE = pytest.StashKey[Any]()
SETTINGS = pytest.StashKey["Settings"]()
#: a pytest-timeout value handed to us through ``pytest_timeout_set_timer``.
TIMEOUT = pytest.StashKey[float]()
#: set on items (conformance cells) that run on a world without a marker.
DISTRIBUTED_ATTR = "moe_ep_distributed"


#: the ini value types this project registers (a subset of what ``Parser.addini`` takes).
IniType = Literal["string", "bool", "int", "float", "args", "linelist"]


def ini_and_option(parser: pytest.Parser, name: str, help: str, *, type: IniType = "string",
                   default: Any = None, choices: tuple[str, ...] | None = None) -> None:
    """Register the ini value ``moe_ep_<name>`` and the option ``--moe-ep-<name>`` that overrides
    it."""
    parser.addini(f"moe_ep_{name}", help, type=type, default=default)
    parser.getgroup(*GROUP).addoption(
        f"--moe-ep-{name.replace('_', '-')}", dest=f"moe_ep_{name}", default=None,
        choices=choices, help=f"{help} (overrides the ini value moe_ep_{name})")


def setting(config: pytest.Config, name: str) -> Any:
    """The option ``--moe-ep-<name>`` if given, else the ini value ``moe_ep_<name>``."""
    given = config.getoption(f"moe_ep_{name}")
    return config.getini(f"moe_ep_{name}") if given is None else given


def number(config: pytest.Config, name: str, kind: type, minimum: float) -> Any:
    """A numeric setting, checked: a usage error that names the option and the value otherwise."""
    raw = setting(config, name)
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        value = None
    if value is None or value < minimum:
        what = "an integer" if kind is int else "a number"
        raise pytest.UsageError(f"--moe-ep-{name.replace('_', '-')} (ini moe_ep_{name}) must be "
                                f"{what} >= {minimum:g}, got {raw!r}")
    return value


def add_options(parser: pytest.Parser) -> None:
    ini_and_option(parser, "timeout",
                   "deadline in seconds of one call on a world; a pytest-timeout value for "
                   f"the test takes precedence (default {DEFAULT_TIMEOUT_S:g}; the matrix's cells "
                   "derive theirs from what the session measured unless this is given)", default="")
    ini_and_option(parser, "backend",
                   "process-group backend: auto, gloo or nccl (default auto: nccl when CUDA "
                   "has a GPU per rank, else gloo; an explicit nccl without GPUs is a usage error)",
                   default="auto", choices=BACKENDS)
    ini_and_option(parser, "start_method",
                   "how ranks start: forkserver (torch preloaded, default) or spawn",
                   default="forkserver", choices=START_METHODS)
    parser.addini("moe_ep_preload", "extra modules the rank forkserver imports once (for example a "
                  "framework the ranks all need)", type="linelist", default=[])


@dataclass(frozen=True)
class Settings:
    timeout_s: float
    backend: str
    start_method: str
    preload: tuple[str, ...]
    capture: bool
    #: whether ``moe_ep_timeout`` was given (command line, ini file or ``-o``): a deadline the user
    #: chose wins over one a caller derives (the matrix's cells: :mod:`conformance.deadlines`).
    timeout_given: bool = False

    @classmethod
    def from_config(cls, config: pytest.Config) -> Settings:
        given = setting(config, "timeout") not in (None, "")
        timeout_s = number(config, "timeout", float, 0.001) if given else DEFAULT_TIMEOUT_S
        backend, start_method = (str(setting(config, "backend")),
                                 str(setting(config, "start_method")))
        if backend not in BACKENDS:
            raise pytest.UsageError(f"moe_ep_backend: unknown backend {backend!r}; choose one of "
                                    f"{', '.join(BACKENDS)}")
        if start_method not in START_METHODS:
            raise pytest.UsageError(f"moe_ep_start_method: unknown {start_method!r}; choose one of "
                                    f"{', '.join(START_METHODS)}")
        return cls(timeout_s, backend, start_method, tuple(config.getini("moe_ep_preload")),
                   config.getoption("capture", "fd") != "no", given)


@dataclass(frozen=True)
class WorldMarker:
    """The arguments of one ``moe_ep_world`` marker, checked."""

    world_size: int
    backend: str = "auto"
    timeout: float | None = None

    @classmethod
    def from_item(cls, item: pytest.Item) -> WorldMarker | None:
        marker = item.get_closest_marker(WORLD_MARKER)
        if marker is None:
            return None
        try:
            found = cls(*marker.args, **marker.kwargs)
        except TypeError as exc:
            raise pytest.UsageError(f"{item.nodeid}: bad {WORLD_MARKER} marker: {exc}; expected "
                                    f"{WORLD_MARKER}(n, backend='auto', timeout=None)") from exc
        n = found.world_size
        if isinstance(n, bool) or not isinstance(n, int):
            raise pytest.UsageError(f"{item.nodeid}: {WORLD_MARKER} needs the world size n as an "
                                    f"int, got {type(n).__name__} {n!r}")
        if n < 1:
            raise pytest.UsageError(f"{item.nodeid}: {WORLD_MARKER} needs a world size n >= 1, got "
                                    f"{n!r}")
        if found.backend not in BACKENDS:
            raise pytest.UsageError(f"{item.nodeid}: {WORLD_MARKER} got unknown backend "
                                    f"{found.backend!r}; choose one of {', '.join(BACKENDS)}")
        if found.timeout is not None and (isinstance(found.timeout, bool)
                                          or not isinstance(found.timeout, (int, float))
                                          or found.timeout <= 0):
            raise pytest.UsageError(f"{item.nodeid}: {WORLD_MARKER} timeout must be a number of "
                                    f"seconds > 0, got {found.timeout!r}")
        return found

"""Every option, ini value and marker of pytest-moe-ep, registered in one place.

Each setting is an ini value ``moe_ep_<name>`` and a command-line option ``--moe-ep-<name>``;
the command line wins.  Reading them never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from pytest_moe_ep.world.backend import BACKENDS

START_METHODS = ("forkserver", "spawn")
WORLD_MARKER = "moe_ep_world"
WORLD_MARKER_HELP = (
    f"{WORLD_MARKER}(n, backend='auto', timeout=None): run the test function on every rank of an "
    "n-rank world with the default process group initialized; it passes only when every rank passes."
)


def _ini_and_option(parser: pytest.Parser, group: Any, name: str, help: str, *, type: str = "string",
                    default: Any = None, choices: tuple[str, ...] | None = None) -> None:
    parser.addini(f"moe_ep_{name}", help, type=type, default=default)
    group.addoption(f"--moe-ep-{name.replace('_', '-')}", dest=f"moe_ep_{name}", default=None,
                    choices=choices, help=f"{help} (overrides the ini value moe_ep_{name})")


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("moe-ep", "pytest-moe-ep: expert-parallel worlds and MoE checkpoint conformance")
    _ini_and_option(parser, group, "timeout", "deadline in seconds of one call on a world; a pytest-timeout "
                    "value for the test takes precedence (default 300)", default="300")
    _ini_and_option(parser, group, "backend", "process-group backend: auto, gloo or nccl (default auto: nccl "
                    "when CUDA has a GPU per rank, else gloo)", default="auto", choices=BACKENDS)
    _ini_and_option(parser, group, "world_size", "ranks in the world the conformance matrix runs on "
                    "(default 4)", default="4")
    _ini_and_option(parser, group, "start_method", "how ranks start: forkserver (torch preloaded, default) or "
                    "spawn", default="forkserver", choices=START_METHODS)
    group.addoption("--moe-ep-matrix", dest="moe_ep_matrix", nargs="?", const="default", default=None,
                    metavar="EPS", help="run the conformance matrix; EPS picks the EP degrees (e.g. 1,2,4; default: "
                    "every divisor of the world size)")
    _ini_and_option(parser, group, "adapter", "checkpoint adapter the matrix checks: a built-in name (reference, "
                    "legacy, ...) or module:attr (default: the pytest_moe_ep_adapter hook, else reference)")
    group.addoption("--moe-ep-functions", dest="moe_ep_functions", default=None, metavar="MODULE",
                    help="check a module exposing the nine expert-slice functions against the reference "
                    "(a built-in name such as nemo_automodel, or a dotted module path)")
    group.addoption("--moe-ep-report", dest="moe_ep_report", default=None, metavar="DIR",
                    help="write moe-ep-conformance.json and .md into DIR")
    parser.addini("moe_ep_preload", "extra modules the rank forkserver imports once (for example a "
                  "framework the ranks all need)", type="linelist", default=[])


@dataclass(frozen=True)
class Settings:
    timeout_s: float
    backend: str
    world_size: int
    start_method: str
    preload: tuple[str, ...]
    capture: bool

    @classmethod
    def from_config(cls, config: pytest.Config) -> Settings:
        def value(name: str) -> Any:
            given = config.getoption(f"moe_ep_{name}")
            return config.getini(f"moe_ep_{name}") if given is None else given

        try:
            timeout_s = float(value("timeout"))
            world_size = int(value("world_size"))
        except ValueError as exc:
            raise pytest.UsageError(f"pytest-moe-ep: {exc}") from exc
        backend, start_method = str(value("backend")), str(value("start_method"))
        if backend not in BACKENDS:
            raise pytest.UsageError(f"moe_ep_backend: unknown backend {backend!r}; choose one of "
                                    f"{', '.join(BACKENDS)}")
        if start_method not in START_METHODS:
            raise pytest.UsageError(f"moe_ep_start_method: unknown {start_method!r}; choose one of "
                                    f"{', '.join(START_METHODS)}")
        if world_size < 1:
            raise pytest.UsageError(f"moe_ep_world_size must be >= 1, got {world_size}")
        if timeout_s <= 0:
            raise pytest.UsageError(f"moe_ep_timeout must be > 0 seconds, got {timeout_s}")
        return cls(timeout_s, backend, world_size, start_method, tuple(config.getini("moe_ep_preload")),
                   config.getoption("capture", "fd") != "no")


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
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise pytest.UsageError(f"{item.nodeid}: {WORLD_MARKER} needs a world size n >= 1, got {n!r}")
        if found.backend not in BACKENDS:
            raise pytest.UsageError(f"{item.nodeid}: {WORLD_MARKER} got unknown backend {found.backend!r}; "
                                    f"choose one of {', '.join(BACKENDS)}")
        return found

"""The project's own test options (not the plugin's: those live in ``pytest_moe_ep/settings.py``).

``slow`` marks the tests that run a whole matrix for minutes: a real framework's whole as-found
matrix, the reference's 8-rank default tier (one to three minutes each on the 2-core CI machine).
They are skipped unless ``--run-slow`` is given, so the suite CI runs (``bash ci/test.sh``) stays
within its 12-minute budget; every framework still runs end to end there through its smaller tests
(seeded bugs, negative controls, a few cells), and the 8-rank reference through the cells only
eight ranks reach.  The project's nightly workflow (``ci/github/pytest-moe-ep-tests.yml``) runs
them with ``bash .ci/run --slow``; run them so before changing the harness or a pinned framework
version.
"""

from __future__ import annotations

# torch, and what the controller of an in-process matrix run may import, are imported before any
# test: pytester drops the modules first imported during a test that uses it (or during an
# in-process run), and a second import of torch or of its modules that register operators crashes
# the process.  The plugin's controller never imports torch, so nothing else guarantees these are
# imported first.
import importlib
import os
import sys
from typing import Any

import pytest
import torch  # noqa: F401

from pytest_moe_ep.world.engine import CHECKPOINT_PRELOAD

# DeepSpeed's CPU comm op is JIT-built into TORCH_EXTENSIONS_DIR (ci/install_deepspeed.sh builds it
# there ahead of the tests): one directory per environment, as the install script keeps it, so two
# venvs of one torch never rebuild each other's op inside a cell -- and a rank killed at its
# deadline mid-build never leaves another venv's build lock behind.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

for _module in (*CHECKPOINT_PRELOAD, "reference_impl", "conformance.adapters.reference",
                "conformance.adapters.legacy", "conformance.adapters.balanced_functions"):
    importlib.import_module(_module)


@pytest.fixture(scope="session")
def shared_fork_server(moe_ep_engine: Any) -> None:
    """This session's fork server, started now (with a one-rank world that lives as long as the
    session).

    A matrix run in this process (``matrix_expectations.run_inline``) then forks its ranks from it
    instead of starting a fork server of its own, which imports torch again: 4-5 s a run.  Its
    preloads are this project's ``moe_ep_preload`` (pyproject.toml).
    """
    moe_ep_engine.run(os.getpid, world_size=1, backend="gloo")


SLOW_REASON = ("a whole matrix of minutes (a real framework's as-found one, the 8-rank reference "
               "tier): run with --run-slow (bash ci/test.sh --slow)")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the tests marked slow (whole matrices of minutes: the real "
                     "frameworks' as-found ones, the 8-rank reference tier)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers",
                            "slow: a whole matrix of minutes; needs --run-slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason=SLOW_REASON)
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(skip)

"""The project's own test options (not the plugin's: those live in ``pytest_moe_ep/settings.py``).

``slow`` marks the tests that run a real framework through its whole as-found matrix (one to three
minutes each on the 2-core CI machine).  They are skipped unless ``--run-slow`` is given, so the
suite CI runs (``bash ci/test.sh``) stays well under its 15-minute budget; every framework still runs
end to end there through its smaller tests (seeded bugs, negative controls, a few cells).  Run them
with ``bash ci/test.sh --slow`` before changing the harness or a pinned framework version.
"""

from __future__ import annotations

# torch is imported before any test: pytester's in-process runs drop the modules first imported inside them from
# sys.modules, and a second import of torch crashes the process.  The plugin's controller no longer imports torch,
# so nothing else guarantees it is imported first.
import pytest
import torch  # noqa: F401

SLOW_REASON = "a real framework's whole as-found matrix (minutes): run with --run-slow (bash ci/test.sh --slow)"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the tests marked slow (the real frameworks' whole as-found matrices)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: a real framework's whole as-found matrix; needs --run-slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason=SLOW_REASON)
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(skip)

"""Hook specifications of the conformance matrix: the extension points a framework's conftest.py
implements.

They are registered by :mod:`conformance.plugin` (``pytest_addhooks``) and always called through
``config.hook``; nothing reads ad-hoc globals instead.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.hookspec(firstresult=True)
def pytest_moe_ep_adapter(config: pytest.Config) -> Any:
    """Return the checkpoint adapter ``--moe-ep-matrix`` checks, or ``None`` to leave the choice to
    others.

    Implement it in the framework's ``conftest.py`` to build an adapter that needs configuration
    (paths, feature flags).  ``--moe-ep-adapter`` on the command line takes precedence over it.
    """

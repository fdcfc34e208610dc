"""The world engine: persistent multi-rank gloo/NCCL worlds, supervised from the pytest process.

The interface and its result and error types: :mod:`.engine`.  Controller side: :mod:`.supervisor`.
Worker side: :mod:`.rank`.  Between them: :mod:`.protocol`.  Inside an existing torchrun launch:
:mod:`.torchrun`.  Importing this package imports neither torch nor an engine.
"""

from pytest_moe_ep.world.backend import BACKENDS, BackendUnavailable
from pytest_moe_ep.world.engine import (
    CallResult,
    Engine,
    RankFailure,
    RankOutput,
    WorldError,
    WorldStartError,
    WorldTimeout,
)
from pytest_moe_ep.world.protocol import FunctionRef, function_ref

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "CallResult",
    "Engine",
    "FunctionRef",
    "RankFailure",
    "RankOutput",
    "WorldError",
    "WorldStartError",
    "WorldTimeout",
    "function_ref",
]

"""The world engine: persistent multi-rank gloo/NCCL worlds, supervised from the pytest process.

Controller side: :mod:`.supervisor`.  Worker side: :mod:`.rank`.  Between them: :mod:`.protocol`.
Inside an existing torchrun launch: :mod:`.torchrun`.  Importing this package does not import torch.
"""

from pytest_moe_ep.world.backend import BACKENDS, BackendUnavailable
from pytest_moe_ep.world.protocol import FunctionRef, function_ref
from pytest_moe_ep.world.supervisor import (
    CallResult,
    RankFailure,
    RankOutput,
    Supervisor,
    WorldError,
    WorldStartError,
    WorldTimeout,
)

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "CallResult",
    "FunctionRef",
    "RankFailure",
    "RankOutput",
    "Supervisor",
    "WorldError",
    "WorldStartError",
    "WorldTimeout",
    "function_ref",
]

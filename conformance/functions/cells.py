"""Which functions-suite cells exist: the nine functions, the expert counts, and the mesh grid.

See :mod:`conformance.functions` for what the suite checks and why the grid is what it is.
"""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from typing import Any

from conformance.layout import ParallelLayout

__all__ = ["FUNCTIONS", "NUM_EXPERTS", "REFERENCE", "FunctionsCell", "functions_cells",
           "load_functions", "missing_functions", "parse_placements"]


#: the module every adapter is compared with.
REFERENCE = "reference_impl.state_dict_utils"
#: the nine functions an adapter must expose, in report order.
FUNCTIONS = (
    "is_dtensor",
    "get_submesh",
    "_get_expert_mesh_dim_index",
    "get_expert_slice_for_rank",
    "split_experts_weights_dtensor_aware",
    "validate_dtensor_expert_sharding",
    "create_dtensor_from_local",
    "get_expert_range_for_rank_from_mesh",
    "should_load_expert_for_rank",
)
#: expert counts tried in every cell: with k <= 4 this holds even, uneven and E < k cases.
NUM_EXPERTS = tuple(range(1, 17))


# ------------------------------------------------------------------------------------ the grid


@dataclass(frozen=True)
class FunctionsCell:
    """One mesh kind at one EP degree: one pytest item, one world call.

    ``k`` is the size of the mesh dim that partitions experts for the mesh-only functions (the
    ``ep`` dim, else the single dim of a 1-D mesh, else the ``Shard(0)`` dim), so "E % k" says
    whether the case is uneven.
    """

    mesh: str
    shape: tuple[int, ...]
    names: tuple[str, ...]
    placements: str
    k: int
    #: the global ranks in mesh order (nested lists); ``None``: row-major, as init_device_mesh
    #: places them.
    ranks: Any = None

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def node_name(self) -> str:
        return f"functions::{self.mesh}::k{self.k}"


def functions_cells() -> list[FunctionsCell]:
    """The default grid: world sizes 1..4, every mesh kind the reference distinguishes."""
    cells = [FunctionsCell("ep", (k,), ("ep",), "(Shard(0),)", k) for k in (1, 2, 3, 4)]
    cells += [
        FunctionsCell("dp,ep", (2, 2), ("dp", "ep"), "(Replicate(), Shard(0))", 2),
        FunctionsCell("ep_replicate,ep", (2, 2), ("ep_replicate", "ep"), "(Replicate(), Shard(0))",
                      2),
        FunctionsCell("ep,dp_shard", (2, 2), ("ep", "dp_shard"), "(Shard(0), Shard(0))", 2),
        FunctionsCell("dp_shard_cp", (3,), ("dp_shard_cp",), "(Shard(0),)", 3),
        FunctionsCell("dp,dp_shard", (2, 2), ("dp", "dp_shard"), "(Replicate(), Shard(0))", 2),
        FunctionsCell("ep+Shard(1)", (2, 2), ("ep", "ep_shard"), "(Shard(0), Shard(1))", 2),
        FunctionsCell("tp+Shard(2)", (4,), ("tp",), "(Shard(2),)", 4),
        FunctionsCell("ep+Replicate", (3,), ("ep",), "(Replicate(),)", 3),
    ]
    # The matrix's own meshes (conformance.layout): EP inside (dp_replicate, ep, dp_shard, etp), its
    # groups strided and consecutive, and an expert-tensor-parallel dim sharding the hidden axis.
    for order in ("strided", "consecutive"):
        layout = ParallelLayout.for_world(4, 2, ep_order=order)
        cells.append(FunctionsCell(f"layout:{layout.fragment}", layout.mesh_shape, layout.mesh_dims,
                                   "(Replicate(), Shard(0), Replicate(), Replicate())", 2,
                                   layout.rank_grid() if order != "strided" else None))
    etp = ParallelLayout.for_world(4, 2, etp=2)
    cells.append(FunctionsCell(f"layout:{etp.fragment}", etp.mesh_shape, etp.mesh_dims,
                               "(Replicate(), Shard(0), Replicate(), Shard(1))", 2))
    return cells


def parse_placements(text: str) -> list[Any]:
    """``"(Replicate(), Shard(0))"`` -> placement objects; the cell carries text so it stays
    cheap."""
    from torch.distributed.tensor import Replicate, Shard

    found = re.findall(r"Shard\((\d+)\)|(Replicate)\(\)", text)
    if not found:
        raise ValueError(f"no placements in {text!r}; expected e.g. '(Shard(0),)' or "
                         "'(Replicate(), Shard(0))'")
    return [Replicate() if rep else Shard(int(dim)) for dim, rep in found]


def load_functions(spec: str) -> Any:
    """``"pkg.module"`` or ``"pkg.module:attr.attr"``: the object whose attributes are the
    functions."""
    module_name, _, attr = spec.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        target = getattr(target, part)
    return target


def missing_functions(target: Any) -> list[str]:
    """The nine functions ``target`` lacks (or holds as something not callable), in report order."""
    return [name for name in FUNCTIONS if not callable(getattr(target, name, None))]

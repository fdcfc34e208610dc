"""What the two DeepSpeed adapters share: the import, the version, and the expert-group tables.

DeepSpeed picks its accelerator when it is imported, so ``DS_ACCELERATOR=cpu`` is set (unless set
already) when this module is imported -- the rank fork server imports an adapter module before it
preloads ``deepspeed``.  The CPU accelerator speaks gloo, the world's backend.

DeepSpeed keeps its expert groups in module globals (``deepspeed.utils.groups``) for the life of the
process and, for native MoE, names the optimizer file by *the largest EP group ever created*.  A
rank process of the matrix runs many cells at several EP degrees, so before each engine is built an
adapter calls :func:`use_expert_groups`: only that cell's groups stay visible -- what a fresh
DeepSpeed job sees -- and every group made before is kept aside and reused (``dist.new_group`` is a
collective on every rank and costs time; DeepSpeed creates a group only when its name is absent).
"""

from __future__ import annotations

import os
import sys
from typing import Any

if "deepspeed" not in sys.modules:  # DeepSpeed picks its accelerator at import; see the docstring
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

#: the deepspeed.utils.groups tables keyed by expert group name ("ep_size_<ep>").
GROUP_TABLES = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS",
                "_EXPERT_DATA_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP_RANKS")
#: every expert group this rank process created, by (variant, table): reused by later cells.
_CREATED_GROUPS: dict[tuple[str, str], dict[str, Any]] = {}
#: the variant whose groups each table holds now.
_LIVE_VARIANT: dict[str, str] = {}


def deepspeed() -> Any:
    """``import deepspeed`` with the CPU accelerator unless another was chosen."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed as module

    return module


def installed_version() -> str:
    """The installed DeepSpeed's version, read without importing it (pinned to 0.19.8 in CI)."""
    from conformance.adapter import installed_version as version_of

    return version_of("deepspeed") or "not installed"


def use_expert_groups(ep: int, variant: str = "") -> None:
    """Leave only ``ep_size_<ep>``'s expert groups of ``variant`` visible to DeepSpeed.

    ``variant`` tells apart groups DeepSpeed names alike but builds from other ranks (its
    ``use_data_before_expert_parallel_`` topology reuses the name ``ep_size_<ep>``).
    """
    from deepspeed.utils import groups

    name = f"ep_size_{ep}"
    for table in GROUP_TABLES:
        live = getattr(groups, table)
        # whatever the last engine left, under the variant it was made for
        for key, value in live.items():
            _CREATED_GROUPS.setdefault((_LIVE_VARIANT.get(table, ""), table), {})[key] = value
        live.clear()
        kept = _CREATED_GROUPS.get((variant, table), {})
        if name in kept:
            live[name] = kept[name]
        _LIVE_VARIANT[table] = variant

"""Wrong on purpose, for tests/test_functions_suite.py: three defects the functions suite must
catch.

- ``get_expert_slice_for_rank`` returns a copy of the local experts (right values, detached
  storage);
- ``should_load_expert_for_rank`` answers False for an expert id out of range instead of refusing
  it;
- ``WITHOUT_VALIDATE`` (use ``"functions_suite_wrong:WITHOUT_VALIDATE"``) is the reference lacking
  ``validate_dtensor_expert_sharding``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import reference_impl.state_dict_utils as reference
from reference_impl.state_dict_utils import (
    _get_expert_mesh_dim_index,
    create_dtensor_from_local,
    get_expert_range_for_rank_from_mesh,
    get_submesh,
    is_dtensor,
    split_experts_weights_dtensor_aware,
    validate_dtensor_expert_sharding,
)

__all__ = [
    "WITHOUT_VALIDATE",
    "_get_expert_mesh_dim_index",
    "create_dtensor_from_local",
    "get_expert_range_for_rank_from_mesh",
    "get_expert_slice_for_rank",
    "get_submesh",
    "is_dtensor",
    "should_load_expert_for_rank",
    "split_experts_weights_dtensor_aware",
    "validate_dtensor_expert_sharding",
]


def get_expert_slice_for_rank(experts_tensor: Any, n_experts: int) -> tuple[Any, int, int]:
    local, start, end = reference.get_expert_slice_for_rank(experts_tensor, n_experts)
    return local.clone(), start, end


def should_load_expert_for_rank(expert_id: int, device_mesh: Any, n_experts: int) -> bool:
    start, end = get_expert_range_for_rank_from_mesh(device_mesh, n_experts)
    return start <= expert_id < end


WITHOUT_VALIDATE = SimpleNamespace(**{
    name: getattr(reference, name)
    for name in (
        "is_dtensor", "get_submesh", "_get_expert_mesh_dim_index", "get_expert_slice_for_rank",
        "split_experts_weights_dtensor_aware", "create_dtensor_from_local",
        "get_expert_range_for_rank_from_mesh", "should_load_expert_for_rank",
    )
})

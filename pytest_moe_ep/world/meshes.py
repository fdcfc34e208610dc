"""Device meshes inside a rank, built once per process.

Creating a DeviceMesh creates process groups, a collective operation that costs time and leaves
groups behind.  In a persistent world the same few meshes serve every call, so they are cached per
rank process: all ranks run the same calls in the same order, so they hit and miss the cache
together and group creation stays collective.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def device_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """``init_device_mesh`` on this world's device type, cached by ``(shape, names)``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if len(shape) != len(names):
        raise ValueError(f"mesh shape {shape} and dim names {names} differ in length")
    size = 1
    for dim in shape:
        size *= dim
    if size != dist.get_world_size():
        raise ValueError(f"a mesh of shape {shape} needs {size} ranks, this world has {dist.get_world_size()}")
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, shape, mesh_dim_names=names)

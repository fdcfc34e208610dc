"""Device meshes inside a rank, built once per process.

Creating a DeviceMesh creates process groups, a collective operation that costs time and leaves
groups behind.  In a persistent world the same few meshes serve every call, so they are cached per
rank process: all ranks run the same calls in the same order, so they hit and miss the cache
together and group creation stays collective.
"""

from __future__ import annotations

import functools
import json
from typing import Any


def device_mesh(shape: tuple[int, ...], names: tuple[str, ...], ranks: Any = None) -> Any:
    """A DeviceMesh of ``shape`` on this world's device type, cached by ``(shape, names, ranks)``.

    ``ranks`` (nested lists of global ranks, of ``shape``) places ranks explicitly; ``None`` is
    ``init_device_mesh``'s row-major order.
    """
    return _device_mesh(tuple(shape), tuple(names), None if ranks is None else json.dumps(ranks))


@functools.cache
def _device_mesh(shape: tuple[int, ...], names: tuple[str, ...], ranks: str | None) -> Any:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if len(shape) != len(names):
        raise ValueError(f"mesh shape {shape} and dim names {names} differ in length")
    size = 1
    for dim in shape:
        size *= dim
    if size != dist.get_world_size():
        raise ValueError(f"a mesh of shape {shape} needs {size} ranks, this world has "
                         f"{dist.get_world_size()}")
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if ranks is None:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    grid = torch.tensor(json.loads(ranks), dtype=torch.int)
    if tuple(grid.shape) != shape or sorted(grid.flatten().tolist()) != list(range(size)):
        raise ValueError(f"rank grid {grid.tolist()} is not a permutation of the world's ranks of "
                         f"shape {shape}")
    return DeviceMesh(device_type, grid, mesh_dim_names=names)

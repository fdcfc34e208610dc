"""Submeshes, sliced once per mesh.

``DeviceMesh.__getitem__`` recomputes the slice's layout in Python on every call (1-2 ms); a model's
build, its state dict and the expert layout's translation ask for the same few slices hundreds of
times a run.  Every slicing in the reference goes through :func:`sliced`, which keeps each slice on
its mesh.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["sliced"]


def sliced(device_mesh: DeviceMesh, dims: tuple[str, ...]) -> DeviceMesh:
    """``device_mesh[dims]``, the same object on every call for the same ``dims``."""
    kept: dict[tuple[str, ...], DeviceMesh] = device_mesh.__dict__.setdefault(
        "_reference_submeshes", {})
    found = kept.get(dims)
    if found is None:
        found = kept[dims] = device_mesh[dims]
    return found

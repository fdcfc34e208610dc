"""How the functions suite compares two calls' outcomes: for meaning, not for form.

A returned value becomes a comparable summary (:func:`summarize`): a tensor by its place in the
global tensor, its local values and whether it aliases the input; a mesh by dim names, shape and
ranks.  An error counts by family only (:func:`error_family`).  Runs on the ranks, inside the
suite's world.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pytest_moe_ep.text import shorten

__all__ = ["TEXT_LIMIT", "MeshValue", "Outcome", "TensorValue", "agree", "outcome", "same", "short",
           "storage_of", "summarize"]

#: longest expected/got text in a record.
TEXT_LIMIT = 200


@dataclass(eq=False)
class TensorValue:
    """What matters about a returned tensor: where it sits in the global tensor, its values,
    aliasing."""

    dtensor: bool
    shape: tuple[int, ...]
    placements: tuple[str, ...]
    mesh_dims: tuple[str, ...] | None
    local: Any  # torch.Tensor, cloned so a later call cannot change it
    aliases: bool | None  # None: the case names no input to alias

    def agrees(self, other: TensorValue) -> bool:
        import torch

        return (
            (self.dtensor, self.shape, self.placements, self.mesh_dims) ==
            (other.dtensor, other.shape, other.placements, other.mesh_dims)
            and (self.aliases is None or other.aliases is None or self.aliases == other.aliases)
            and self.local.dtype == other.local.dtype
            and torch.equal(self.local, other.local)
        )

    def __repr__(self) -> str:
        local = self.local
        values = (f"first={local.flatten()[0].item():g} sum={local.sum().item():g}" if local.numel()
                  else "empty")
        storage = "" if self.aliases is None else (", view" if self.aliases else ", copy")
        if self.dtensor:
            return (f"DTensor(shape={self.shape}, {self.placements}, mesh={self.mesh_dims}, "
                    f"local={tuple(local.shape)} {values}{storage})")
        return f"Tensor({tuple(local.shape)} {values}{storage})"


@dataclass(frozen=True)
class MeshValue:
    """A device mesh by what a caller can observe: dim names, shape and which global ranks it
    spans."""

    names: tuple[str, ...] | None
    shape: tuple[int, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Outcome:
    """A call's result: the error family it raised, or the summary of what it returned."""

    error: str | None
    value: Any
    text: str


def storage_of(tensor: Any) -> int | None:
    """The data pointer of a tensor's (or DTensor's local) storage, the identity aliasing is
    about."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.untyped_storage().data_ptr() if isinstance(tensor, torch.Tensor) else None


def summarize(value: Any, source: int | None) -> Any:
    """``value`` with tensors and meshes replaced by comparable summaries; ``source`` is the input's
    storage."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        from torch.distributed.tensor import Replicate

        local = value.to_local()
        mesh = value.device_mesh
        # A size-1 dim that replicates changes nothing a caller can observe: (Replicate(), Shard(0))
        # over (dp_replicate=1, etp=2) is Shard(0) over etp.
        keep = [i for i, n in enumerate(mesh.shape) if n > 1
                or not isinstance(value.placements[i], Replicate)]
        names = tuple(mesh.mesh_dim_names[i] for i in keep) if mesh.mesh_dim_names else None
        return TensorValue(
            True, tuple(value.shape), tuple(repr(value.placements[i]) for i in keep), names,
            local.detach().clone(), None if source is None else storage_of(local) == source)
    if isinstance(value, torch.Tensor):
        return TensorValue(False, tuple(value.shape), (), None, value.detach().clone(),
                           None if source is None else storage_of(value) == source)
    if isinstance(value, DeviceMesh):
        return MeshValue(value.mesh_dim_names, tuple(value.shape),
                         tuple(value.mesh.flatten().tolist()))
    if isinstance(value, (tuple, list)):
        items = [summarize(v, source) for v in value]
        # torch.Size, namedtuples: plain tuples
        return items if isinstance(value, list) else tuple(items)
    return value


def same(expected: Any, got: Any) -> bool:
    """Semantic equality of summaries: sequences elementwise (tuple or list alike), tensors by
    meaning."""
    if isinstance(expected, TensorValue) or isinstance(got, TensorValue):
        return isinstance(expected,
                          TensorValue) and isinstance(got, TensorValue) and expected.agrees(got)
    sequences = (tuple, list)
    if isinstance(expected, sequences) or isinstance(got, sequences):
        return (isinstance(expected, sequences) and isinstance(got, sequences) and len(expected)
                == len(got) and all(map(same, expected, got)))
    try:
        return bool(expected == got)
    except Exception:  # an odd object whose == raises is not the same as anything
        return False


def short(text: str, limit: int = TEXT_LIMIT) -> str:
    """One line of at most ``limit`` characters, cut at a word, for reports and JSON."""
    return shorten(str(text), limit)


def error_family(exc: BaseException) -> str:
    """What the comparison sees of an error: ValueError, TypeError, or the class name of anything
    else."""
    for family in (ValueError, TypeError):
        if isinstance(exc, family):
            return family.__name__
    return type(exc).__name__


def outcome(fn: Callable[..., Any], args: tuple[Any, ...], source: int | None) -> Outcome:
    try:
        value = fn(*args)
    except Exception as exc:
        return Outcome(error_family(exc), None, short(f"raises {type(exc).__name__}: {exc}"))
    summary = summarize(value, source)
    return Outcome(None, summary, short(f"returns {summary!r}"))


def agree(expected: Outcome, got: Outcome) -> bool:
    if expected.error is not None or got.error is not None:
        return expected.error == got.error
    return same(expected.value, got.value)

"""What the checkpoint holds, as the save side held it: the state a load must give back bit for bit.

A load can get exactly one thing right: what was saved.  What was saved at ep=N may itself differ from the ep=1
truth by a kernel's rounding (a fused optimizer steps a shard of a tensor differently from the whole tensor:
:mod:`conformance.rounding`), and that is no layout's fault.  So the ``values`` check asks two questions:

- the state each rank yields after the load against this saved state, bit for bit (the load restored what the
  checkpoint holds, nothing more and nothing less);
- this saved state against the ep=1 truth within :data:`~conformance.rounding.ROUNDING_ULPS` (the save side
  trained and held the same model; another expert's, layer's or moment's values are named exactly).

At the save every rank's tensors (the adapter's walks, each with its region of the global tensor) travel to every
rank in one all-gather and are put together into whole tensors.  Each rank process keeps them per checkpoint
path for every later cell that loads that checkpoint; a world started after the save (a restart) has not kept
them, and its cells compare with the truth within rounding instead and say so.  Replicas that disagreed at the
save are named: the checkpoint can hold only one of their values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from conformance.checks.values import Held, agrees, diagnose, equal
from conformance.checks.verdict import Key, Mismatch, RankVerdict


@dataclass
class Saved:
    """The save side's state put together: whole tensors of every key its ranks held completely."""

    layout: str
    state: dict[Key, Any] = field(default_factory=dict)
    #: the lowest rank that held a part of each key (the rank a difference is named by).
    holder: dict[Key, int] = field(default_factory=dict)
    #: replicas that held different values for a key at the save: ``(rank, key, text)``.
    conflicts: list[tuple[int, Key, str]] = field(default_factory=list)

    def disagree(self, rank: int, key: Key) -> None:
        """``rank`` held other values for ``key`` than its first holder: replicas the checkpoint holds one of."""
        self.conflicts.append((rank, key, f"rank {rank} held other values for it at the save than rank "
                               f"{self.holder[key]} (replicas that disagree: the checkpoint holds one)"))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())


def pack(held: Held) -> tuple[list[tuple[Key, Any, tuple[int, ...], str, int]], dict[str, Any]]:
    """``held`` as one flat buffer per dtype and a list of ``(key, box, shape, dtype, offset)``: thousands of small
    tensors cross an all-gather as a few large ones (pickling each costs more than sending them all)."""
    import torch

    meta: list[tuple[Key, Any, tuple[int, ...], str, int]] = []
    parts: dict[str, list[Any]] = {}
    sizes: dict[str, int] = {}
    for key, (t, region) in sorted(held.items(), key=lambda kv: repr(kv[0])):
        dtype = str(t.dtype)
        box = None if region is None else tuple((s.start, s.stop) for s in region)
        meta.append((key, box, tuple(t.shape), dtype, sizes.get(dtype, 0)))
        parts.setdefault(dtype, []).append(t.reshape(-1))
        sizes[dtype] = sizes.get(dtype, 0) + t.numel()
    return meta, {dtype: torch.cat(ts) for dtype, ts in parts.items()}


def _unpack(meta: list[tuple[Key, Any, tuple[int, ...], str, int]], buffers: dict[str, Any]
            ) -> list[tuple[Key, Any, Any]]:
    return [(key, box, buffers[dtype][offset:offset + math.prod(shape)].view(shape))
            for key, box, shape, dtype, offset in meta]


def _same(a: Any, b: Any) -> bool:
    """Whether two ranks' :func:`pack` hold the same keys, regions and values (replicas that agree), in one compare
    per dtype instead of one per key."""
    import torch

    return bool(a[0] == b[0] and a[1].keys() == b[1].keys() and all(torch.equal(a[1][d], b[1][d]) for d in a[1]))


def gather(held: Held, truth: dict[Key, Any], layout: str) -> Saved:
    """Every rank's ``held`` on every rank (a collective), put together against the truth's global shapes."""
    import torch.distributed as dist

    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, pack(held))
    return assemble(found, truth, layout)


def assemble(found: list[Any], truth: dict[Key, Any], layout: str) -> Saved:
    """Each rank's :func:`pack` (by rank) put together into whole tensors; replicas that disagree named.

    Where ranks' regions of a key meet, the values must agree there; a key is whole when its regions cover it.
    Both are box arithmetic in Python (a bool mask per key only where regions overlapped): at 256 experts a mask
    per expert row and tensor was most of the assembly.
    """
    saved = Saved(layout)
    fill: dict[Key, Any] = {}
    boxes: dict[Key, list[tuple[tuple[int, int], ...]]] = {}
    overlapped: set[Key] = set()
    for rank, packed in enumerate(found):
        if any(_same(packed, found[other]) for other in range(rank)):
            continue  # a replica of an earlier rank's whole state, equal to it: nothing new, nothing to name
        for key, box, local in _unpack(*packed):
            want = truth.get(key)
            if want is None:
                continue
            if box is None:  # a whole tensor: the first rank's is it, a replica's must agree
                if key not in saved.state and key not in fill:
                    if tuple(local.shape) == tuple(want.shape):
                        saved.state[key], saved.holder[key] = local, rank
                elif key in saved.state and not equal(saved.state[key], local):
                    saved.disagree(rank, key)
                continue
            if (len(box) != want.dim() or any(b > n for (_, b), n in zip(box, want.shape, strict=False))
                    or tuple(local.shape) != tuple(b - a for a, b in box)):
                continue  # a region that does not fit: the load-side comparison names it
            if key not in fill:
                fill[key], boxes[key] = _empty_like(want, local), []
                saved.holder[key] = rank
            whole = fill[key]
            if whole.dtype != local.dtype:
                saved.conflicts.append((rank, key, f"held as {local.dtype} at the save by rank {rank}, as "
                                        f"{whole.dtype} by rank {saved.holder[key]}"))
                continue
            for other in boxes[key]:
                meet = _meet(box, other)
                if meet is None:
                    continue
                overlapped.add(key)
                mine = local[tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(meet, box, strict=True))]
                if not equal(whole[tuple(slice(a, b) for a, b in meet)], mine):
                    saved.disagree(rank, key)
                    break
            whole[tuple(slice(a, b) for a, b in box)] = local
            boxes[key].append(box)
    saved.state.update((key, whole) for key, whole in fill.items()
                       if _covers(boxes[key], tuple(whole.shape), key in overlapped))
    return saved


def _empty_like(want: Any, local: Any) -> Any:
    import torch

    return torch.empty(want.shape, dtype=local.dtype)


def _meet(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...] | None:
    """Where two boxes meet (``None``: they do not)."""
    meet = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return meet if all(lo < hi for lo, hi in meet) else None


def _covers(boxes: list[tuple[tuple[int, int], ...]], shape: tuple[int, ...], overlapped: bool) -> bool:
    """Whether ``boxes`` cover a tensor of ``shape``: disjoint boxes by their volume, overlapping ones by a mask."""
    if not overlapped:
        return sum(math.prod(b - a for a, b in box) for box in boxes) == math.prod(shape)
    import torch

    mask = torch.zeros(shape, dtype=torch.bool)
    for box in boxes:
        mask[tuple(slice(a, b) for a, b in box)] = True
    return bool(mask.all())


#: per checkpoint path, in each rank process: what its save held (bounded; a miss falls back to the truth).
_KEPT: dict[str, Saved] = {}
KEEP_BYTES = 1 << 30


def keep(path: str, saved: Saved) -> None:
    _KEPT.pop(path, None)
    _KEPT[path] = saved
    while len(_KEPT) > 1 and sum(s.nbytes() for s in _KEPT.values()) > KEEP_BYTES:
        _KEPT.pop(next(iter(_KEPT)))


def kept(path: str) -> Saved | None:
    return _KEPT.get(path)


def check_against_truth(saved: Saved, truth: dict[Key, Any], verdict: RankVerdict) -> None:
    """The saved state against the ep=1 truth within rounding; each difference named by the rank that held it."""
    for rank, (layer, expert, name), text in saved.conflicts:
        verdict.add(Mismatch(rank, layer, expert, name, text))
    for key, whole in sorted(saved.state.items(), key=lambda kv: repr(kv[0])):
        want = truth.get(key)
        if want is None or agrees(whole, want, verdict):
            continue
        layer, expert, name = key
        verdict.add(Mismatch(saved.holder[key], layer, expert, name,
                             f"as saved at {saved.layout} (before any load): {diagnose(key, whole, None, truth, {})}"))

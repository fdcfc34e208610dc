"""What the checkpoint holds, as the save side held it: the state a load must give back bit for bit.

A load can get exactly one thing right: what was saved.  What was saved at ep=N may itself differ
from the ep=1 truth by a kernel's rounding (a fused optimizer steps a shard of a tensor differently
from the whole tensor: :mod:`conformance.rounding`), and that is no layout's fault.  So the
``values`` check asks two questions:

- the state each rank yields after the load against this saved state, bit for bit (the load restored
  what the checkpoint holds, nothing more and nothing less);
- this saved state against the ep=1 truth within :data:`~conformance.rounding.ROUNDING_ULPS` (the
  save side trained and held the same model; another expert's, layer's or moment's values are named
  exactly).

At the save every rank's tensors (the adapter's walks, each with its region of the global tensor)
travel to every rank -- once per distinct content: replica ranks send a digest, not a copy, and a
rank that holds a state itself receives none of it -- and are put together into whole tensors.  Each
rank process keeps them per checkpoint path for every later cell that loads that checkpoint; a world
started after the save (a restart) has not kept them, and its cells compare with the truth within
rounding instead and say so.  Replicas that disagreed at the save are named: the checkpoint can hold
only one of their values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from conformance.checks.held import Held, Rows, State, box_of, settle
from conformance.checks.values import agrees, diagnose, equal
from conformance.checks.verdict import Key, Mismatch, RankVerdict
from conformance.world_state import world_state


@dataclass
class Saved:
    """The save side's state put together: whole tensors of every key its ranks held completely."""

    layout: str
    #: packed blocks kept whole (:class:`~conformance.checks.held.State`).
    tensors: State = field(default_factory=State)
    #: the lowest rank that held a part of each single key (the rank a difference is named by); of
    #: expert rows, :meth:`holder_of` reads ``held_rows``.
    holder: dict[Key, int] = field(default_factory=dict)
    #: per ``(layer, name)`` of a block: ``(first expert, stop, rank)`` in the order ranks were
    #: placed.
    held_rows: dict[tuple[int | None, str], list[tuple[int, int, int]]] = field(
        default_factory=dict)
    #: replicas that held different values for a key at the save: ``(rank, key, text)``.
    conflicts: list[tuple[int, Key, str]] = field(default_factory=list)

    def disagree(self, rank: int, key: Key) -> None:
        """``rank`` held other values for ``key`` than its first holder: replicas the checkpoint
        holds one of."""
        self.conflicts.append(
            (rank, key, f"rank {rank} held other values for it at the save than rank "
             f"{self.holder_of(key)} (replicas that disagree: the checkpoint holds one)"))

    def holder_of(self, key: Key) -> int:
        """The lowest rank that held a part of ``key``: rows are kept a block's span at a time, not
        per row."""
        found = self.holder.get(key)
        if found is not None:
            return found
        for first, stop, rank in self.held_rows.get((key[0], key[2]), ()):
            if key[1] is not None and first <= key[1] < stop:
                return rank
        raise KeyError(key)  # no rank held any of it: not in the saved state either

    def nbytes(self) -> int:
        return self.tensors.nbytes()


#: one entry of a :func:`pack`: ``(key, box, shape, dtype, offset, rows)``; ``rows`` > 0 for a block
#: of that many expert rows (``key`` its first row's, ``box`` each row's region), 0 for a single
#: tensor.
Entry = tuple[Key, Any, tuple[int, ...], str, int, int]


def pack(held: Mapping[Key, Any]) -> tuple[list[Entry], dict[str, Any]]:
    """``held`` as one flat buffer per dtype and a list of :data:`Entry`: thousands of small tensors
    cross the ranks as a few large ones (pickling each costs more than sending them all), a packed
    block as one entry."""
    import torch

    singles = held.singles() if isinstance(held, Held) else held
    found = [(key, t, region, 0)
             for key, (t, region) in sorted(singles.items(), key=lambda kv: repr(kv[0]))]
    if isinstance(held, Held):
        found += [((b.layer, b.first, b.name), b.data, b.region, int(b.data.shape[0]))
                  for b in sorted(held.blocks(), key=lambda b: repr((b.layer, b.first, b.name)))]
    meta: list[Entry] = []
    parts: dict[str, list[Any]] = {}
    sizes: dict[str, int] = {}
    for key, t, region, rows in found:
        dtype = str(t.dtype)
        meta.append((key, box_of(region), tuple(t.shape), dtype, sizes.get(dtype, 0), rows))
        parts.setdefault(dtype, []).append(t.reshape(-1))
        sizes[dtype] = sizes.get(dtype, 0) + t.numel()
    return meta, {dtype: _on_wire(torch.cat(ts)) for dtype, ts in parts.items()}


def _on_wire(buffer: Any) -> Any:
    """A buffer as it crosses the ranks: a float8 one (block-FP8 experts) as its bytes, since
    ``all_gather_object`` cannot unpickle float8 storages (torch 2.13); the same bits come back."""
    import torch

    floating8 = buffer.dtype.is_floating_point and buffer.element_size() == 1
    return buffer.view(torch.uint8) if floating8 else buffer


def _off_wire(buffer: Any, dtype: str) -> Any:
    import torch

    wanted = getattr(torch, dtype.removeprefix("torch."))
    return buffer if buffer.dtype == wanted else buffer.view(wanted)


def _unpack(meta: list[Entry], buffers: dict[str, Any]) -> list[tuple[Key, Any, Any, int]]:
    return [(key, box, _off_wire(buffers[dtype], dtype)[offset:offset + math.prod(shape)]
             .view(shape), rows)
            for key, box, shape, dtype, offset, rows in meta]


def _same(a: Any, b: Any) -> bool:
    """Whether two ranks' :func:`pack` hold the same keys, regions and values (replicas that agree),
    in one compare per dtype instead of one per key."""
    import torch

    return bool(a[0] == b[0] and a[1].keys() == b[1].keys()
                and all(torch.equal(a[1][d], b[1][d]) for d in a[1]))


#: below this many bytes in every distinct rank state, :func:`gather` sends them all in one
#: all-gather (a few collectives' latency is then the cost); above it, each as raw bytes to each
#: rank that does not hold it.
SMALL_BYTES = 1 << 20


def gather(held: Held, truth: Mapping[Key, Any], layout: str) -> Saved:
    """Every rank's ``held`` on every rank (collectives), put together against the truth's global
    shapes.

    Each rank's :func:`pack` is sent once per distinct content: the ranks first all-gather a digest
    of theirs, then only the first rank of each distinct digest sends its pack -- all in one
    all-gather when they are small, else as raw bytes to each rank that does not hold that state
    itself (an all-gather pads every rank's part to the largest; a broadcast reaches the replicas
    too).  A replica rank (every rank at ep=1, a data-parallel peer without FSDP) sends nothing, and
    at ep=1 nothing crosses at all: at 256 experts the all-gather of every rank's whole copy was
    most of a save side's time.
    """
    import torch.distributed as dist

    mine = pack(held)
    sent: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(sent, (digest(mine),
                                  sum(b.numel() * b.element_size() for b in mine[1].values())))
    first = [[d for d, _ in sent].index(d) == rank for rank, (d, _) in enumerate(sent)]
    found: list[Any] = [None] * len(sent)
    if max(n for (_, n), send in zip(sent, first, strict=True) if send) <= SMALL_BYTES:
        dist.all_gather_object(found, mine if first[dist.get_rank()] else None)
        return assemble(found, truth, layout)
    me, digests = dist.get_rank(), [d for d, _ in sent]
    # one source per distinct state; later ranks with its digest are replicas
    for src, send in enumerate(first):
        if not send:
            continue
        # this rank holds that state itself, byte for byte: nothing crosses
        if digests[me] == digests[src]:
            found[src] = mine
        # every rank in the same order
        for dst in (r for r, d in enumerate(digests) if d != digests[src]):
            if me == src:
                _send(mine, dst)
            elif me == dst:
                found[src] = _receive(src)
    return assemble(found, truth, layout)


def digest(packed: tuple[list[Any], dict[str, Any]]) -> bytes:
    """A digest of a :func:`pack`: its keys, regions, shapes and every byte of its values."""
    import hashlib
    import pickle

    import torch

    meta, buffers = packed
    h = hashlib.blake2b(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL), digest_size=32)
    for dtype in sorted(buffers):
        h.update(dtype.encode())
        h.update(buffers[dtype].contiguous().view(torch.uint8).numpy().data)
    return h.digest()


def _wire() -> Any:
    """The device the raw bytes cross on: CUDA under NCCL (it sends only CUDA tensors), else
    ``None`` (gloo sends the CPU tensors the pack holds)."""
    import torch
    import torch.distributed as dist

    return torch.device("cuda",
                        torch.cuda.current_device()) if dist.get_backend() == "nccl" else None


def _send(packed: tuple[list[Any], dict[str, Any]], dst: int) -> None:
    """This rank's :func:`pack` to rank ``dst`` (:func:`_receive` there): its key list as an object,
    each dtype's buffer as raw bytes."""
    import torch
    import torch.distributed as dist

    wire = _wire()
    dist.send_object_list([(packed[0], {dtype: b.numel() for dtype, b in packed[1].items()})],
                          dst=dst, device=wire)
    for dtype in sorted(packed[1]):
        raw = packed[1][dtype].contiguous().view(torch.uint8)  # bytes: every dtype crosses alike
        dist.send(raw if wire is None else raw.to(wire), dst=dst)


def _receive(src: int) -> tuple[list[Any], dict[str, Any]]:
    """Rank ``src``'s :func:`pack`, as :func:`_send` sends it."""
    import torch
    import torch.distributed as dist

    wire = _wire()
    head: list[Any] = [None]
    dist.recv_object_list(head, src=src, device=wire)
    meta, sizes = head[0]
    buffers: dict[str, Any] = {}
    for dtype in sorted(sizes):
        buffer = torch.empty(sizes[dtype], dtype=getattr(torch, dtype.removeprefix("torch.")))
        raw = buffer.view(torch.uint8)
        if wire is None:
            dist.recv(raw, src=src)
        else:
            sent = torch.empty_like(raw, device=wire)
            dist.recv(sent, src=src)
            raw.copy_(sent.cpu())
        buffers[dtype] = buffer
    return meta, buffers


def assemble(found: list[Any], truth: Mapping[Key, Any], layout: str) -> Saved:
    """Each rank's :func:`pack` (by rank; ``None``: a replica :func:`gather` did not send) put
    together into whole tensors; replicas that disagree named.

    Where ranks' regions of a key meet, the values must agree there; a key is whole when its regions
    cover it. Both are box arithmetic in Python (a bool mask only where regions overlapped).  A
    block of expert rows is put into the truth's whole block of its weight at once (rows named only
    where they disagree): at 256 experts a tensor and a mask per expert row was most of the
    assembly.
    """
    saved = Saved(layout)
    fill = _Fill(saved)
    for rank, packed in enumerate(found):
        if packed is None or any(found[other] is not None and _same(packed, found[other])
                                 for other in range(rank)):
            # a replica of an earlier rank's whole state, equal to it: nothing new, nothing to name
            continue
        for key, box, local, rows in _unpack(*packed):
            block = _truth_block(truth, key, rows)
            if block is not None:  # the rows at once, in the truth's block of this weight
                if box is None:
                    box = tuple((0, n) for n in block.data.shape[1:])
                offset = key[1] - block.first
                fill.place(rank, (block.layer, block.first, block.name),
                           ((offset, offset + rows), *box), local, block.data, block)
                continue
            # one tensor, or a block the truth does not keep whole: row by row
            for i in range(rows or 1):
                row_key = key if not rows else (key[0], key[1] + i, key[2])
                _place_single(saved, fill, rank, row_key, box, local[i] if rows else local,
                              truth.get(row_key))
    fill.finish()
    return saved


def _truth_block(truth: Mapping[Key, Any], key: Key, rows: int) -> Rows | None:
    """The truth's whole block holding expert rows ``key[1]..key[1]+rows-1`` of ``key``'s weight, if
    it has one."""
    if not rows or not isinstance(truth, State):
        return None
    block = truth.block_of(key)
    return block if block is not None and key[1] + rows <= block.stop else None


def _place_single(saved: Saved, fill: _Fill, rank: int, key: Key, box: Any, local: Any,
                  want: Any) -> None:
    if want is None:
        return
    if box is None:  # a whole tensor: the first rank's is it, a replica's must agree
        if key not in saved.tensors and key not in fill.pieces:
            if tuple(local.shape) == tuple(want.shape):
                saved.tensors[key], saved.holder[key] = local, rank
        elif key in saved.tensors and not equal(saved.tensors[key], local):
            saved.disagree(rank, key)
        return
    fill.place(rank, key, box, local, want, None)


class _Fill:
    """Whole tensors being put together from the ranks' regions (per single key, or per truth block
    of rows): each rank's piece kept as it came, compared with the earlier pieces where they meet,
    and copied into a whole tensor only at the end -- not at all when one piece is the whole tensor
    (every row at ep=1)."""

    def __init__(self, saved: Saved) -> None:
        self.saved = saved
        self.pieces: dict[Any, list[tuple[tuple[tuple[int, int], ...], Any]]] = {}
        self.want: dict[Any, Any] = {}
        self.blocks: dict[Any, Rows] = {}

    def keys(self, name: Any, rows: tuple[int, int]) -> list[Key]:
        """The row keys of ``rows`` (the first axis of a box) of ``name`` (a key, or a block's)."""
        block = self.blocks.get(name)
        if block is None:
            return [name]
        return [(block.layer, block.first + i, block.name) for i in range(*rows)]

    def place(self, rank: int, name: Any, box: tuple[tuple[int, int], ...], local: Any, want: Any,
              block: Rows | None) -> None:
        if (len(box) != want.dim() or any(b > n for (_, b), n in zip(box, want.shape, strict=False))
                or tuple(local.shape) != tuple(b - a for a, b in box)):
            return  # a region that does not fit: the load-side comparison names it
        if name not in self.pieces:
            self.pieces[name], self.want[name] = [], want
            if block is not None:
                self.blocks[name] = block
        if block is None:
            self.saved.holder.setdefault(name, rank)
        else:
            self.saved.held_rows.setdefault((block.layer, block.name), []).append(
                (block.first + box[0][0], block.first + box[0][1], rank))
        pieces = self.pieces[name]
        if pieces and pieces[0][1].dtype != local.dtype:
            for key in self.keys(name, box[0]):
                self.saved.conflicts.append(
                    (rank, key, f"held as {local.dtype} at the save by rank {rank}, as "
                     f"{pieces[0][1].dtype} by rank {self.saved.holder_of(key)}"))
            return
        differ: set[Key] = set()
        for other, theirs in pieces:
            meet = _meet(box, other)
            if meet is None:
                continue
            mine = local[_within(meet, box)]
            there = theirs[_within(meet, other)]
            if equal(there, mine):
                continue
            if block is None:
                differ.add(name)
                continue
            rows = (there != mine).reshape(mine.shape[0],
                                           -1).any(dim=1).nonzero().flatten().tolist()
            differ.update(self.keys(name, (meet[0][0] + r, meet[0][0] + r + 1))[0] for r in rows)
        for key in sorted(differ, key=repr):
            self.saved.disagree(rank, key)
        pieces.append((box, local))

    def finish(self) -> None:
        """Every whole tensor its pieces cover into the saved state (the earliest piece's values
        where pieces meet); of a block, the rows its pieces cover."""
        for name, pieces in self.pieces.items():
            want, block = self.want[name], self.blocks.get(name)
            shape = tuple(want.shape)
            boxes = [box for box, _ in pieces]
            overlapped = any(_meet(a, b) is not None for i, a in enumerate(boxes)
                             for b in boxes[i + 1:])
            if len(pieces) == 1 and boxes[0] == tuple((0, n) for n in shape):
                whole = pieces[0][1]  # one piece is all of it: no copy
            else:
                whole = _empty_like(want, pieces[0][1])
                # the earliest written last: its values stay where pieces meet
                for box, local in reversed(pieces):
                    whole[tuple(slice(a, b) for a, b in box)] = local
            if block is None:
                if _covers(boxes, shape, overlapped):
                    self.saved.tensors[name] = whole
            elif _covers(boxes, shape, overlapped):
                self.saved.tensors.put_rows(Rows(block.layer, block.first, block.name, whole, None))
            else:
                for i, covered in enumerate(_covered_rows(boxes, shape)):
                    if covered:
                        self.saved.tensors.put((block.layer, block.first + i, block.name), whole[i])


def _within(meet: tuple[tuple[int, int], ...],
            box: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    """Where ``meet`` sits inside a piece of region ``box``."""
    return tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(meet, box, strict=True))


def _covered_rows(boxes: list[tuple[tuple[int, int], ...]], shape: tuple[int, ...]) -> list[bool]:
    import torch

    mask = torch.zeros(shape, dtype=torch.bool)
    for box in boxes:
        mask[tuple(slice(a, b) for a, b in box)] = True
    return mask.reshape(shape[0], -1).all(dim=1).tolist()


def _empty_like(want: Any, local: Any) -> Any:
    import torch

    return torch.empty(want.shape, dtype=local.dtype)


def _meet(a: tuple[tuple[int, int], ...],
          b: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...] | None:
    """Where two boxes meet (``None``: they do not)."""
    meet = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return meet if all(lo < hi for lo, hi in meet) else None


def _covers(boxes: list[tuple[tuple[int, int], ...]], shape: tuple[int, ...],
            overlapped: bool) -> bool:
    """Whether ``boxes`` cover a tensor of ``shape``: disjoint boxes by their volume, overlapping
    ones by a mask."""
    if not overlapped:
        return sum(math.prod(b - a for a, b in box) for box in boxes) == math.prod(shape)
    import torch

    mask = torch.zeros(shape, dtype=torch.bool)
    for box in boxes:
        mask[tuple(slice(a, b) for a, b in box)] = True
    return bool(mask.all())


#: what each checkpoint's save held, per path (the world state's: a miss falls back to the truth).
_KEPT = world_state().store("saved tensors")


def keep(path: str, saved: Saved) -> None:
    _KEPT.put(path, saved)


def kept(path: str) -> Saved | None:
    found = _KEPT.get(path)
    return found if isinstance(found, Saved) else None


def check_against_truth(saved: Saved, truth: Mapping[Key, Any], verdict: RankVerdict) -> None:
    """The saved state against the ep=1 truth within rounding; each difference named by the rank
    that held it."""
    for rank, (layer, expert, name), text in saved.conflicts:
        verdict.add(Mismatch(rank, layer, expert, name, text))
    # blocks equal to the truth's at once; the rest one by one
    _, differ, rest = settle(saved.tensors, truth)
    for key in sorted([*differ, *rest], key=repr):
        whole, want = saved.tensors[key], truth.get(key)
        if want is None or agrees(whole, want, verdict):
            continue
        layer, expert, name = key
        verdict.add(Mismatch(saved.holder_of(key), layer, expert, name,
                             f"as saved at {saved.layout} (before any load): "
                             f"{diagnose(key, whole, None, truth, {})}"))

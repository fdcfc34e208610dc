"""Digests of a checkpoint's values, for :mod:`conformance.inspection.compare` and
:mod:`conformance.inspection.learn`: a 128-bit BLAKE2b digest of each tensor and of each row of a
packed key's expert axis, read in batches of at most ``memory_bytes``, and kept per DCP checkpoint
as found on disk, so a checkpoint compared with many others is read once.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from conformance.inspection.keys import KeyInfo
from conformance.inspection.model import CheckpointIndex
from conformance.world_state import world_state

#: a tensor's identity for value matching: dtype, shape and a 128-bit hash of its bytes.
Digest = tuple[str, tuple[int, ...], bytes]


# bounded, not ``functools.cache``: the dtype names come from the files read
@functools.lru_cache(maxsize=64)
def _element_size(dtype: str | None) -> int:
    import torch

    t = getattr(torch, dtype or "", None)
    return torch.empty((), dtype=t).element_size() if isinstance(t, torch.dtype) else 8


def _batches(index: CheckpointIndex, keys: Sequence[str], memory_bytes: int) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for key in keys:
        entry = index.entries[key]
        n = entry.nbytes_hint * (_element_size(entry.dtype) if entry.is_tensor else 1)
        if batch and size + n > memory_bytes:
            yield batch
            batch, size = [], 0
        batch.append(key)
        size += n
    if batch:
        yield batch


def _bytes_of(t: Any) -> Any:
    import torch

    t = t.detach().to("cpu").contiguous().reshape(-1)
    return t.view(torch.uint8).numpy() if t.numel() else b""


def digest(t: Any) -> Digest:
    """A tensor's identity for value matching: dtype, shape and a 128-bit hash of its bytes."""
    return (str(t.dtype), tuple(t.shape),
            hashlib.blake2b(memoryview(_bytes_of(t)), digest_size=16).digest())


def _row_digests(t: Any) -> list[Digest]:
    """:func:`digest` of each row of ``t``, hashing each row's bytes from one array (slicing a
    tensor per row cost more than hashing it: 7,000 rows a packed checkpoint at 256 experts)."""
    import torch

    if t.dim() == 0:
        return []
    flat = t.detach().to("cpu").contiguous()
    if not flat.numel():
        return [digest(flat[r]) for r in range(flat.shape[0])]
    dtype, shape = str(flat.dtype), tuple(flat.shape[1:])
    rows = flat.reshape(-1).view(torch.uint8).reshape(flat.shape[0], -1).numpy()
    return [(dtype, shape, hashlib.blake2b(memoryview(row), digest_size=16).digest())
            for row in rows]


#: which keys :func:`_fingerprints` also takes row digests of (a packed key's expert axis).
RowsOf = Callable[[str], bool]


def whole_only(key: str) -> bool:
    """Row digests of no key: a function rather than a table, since the keys asked about are every
    key of every checkpoint a session reads."""
    return False


def every_row(key: str) -> bool:
    """Row digests of every key (read as if each were packed)."""
    return True


def packed_rows(infos: Mapping[str, KeyInfo]) -> RowsOf:
    """Row digests of the keys ``infos`` classifies as packed."""
    return lambda key: infos[key].kind == "packed"


#: digests already taken, per DCP checkpoint as found on disk (see :func:`_stamp`): the truth
#: checkpoint is compared with every checkpoint saved from its model, and read once, not once per
#: cell.
_SEEN = world_state().store("checkpoint digests")


def _stamp(index: CheckpointIndex) -> tuple[Any, ...] | None:
    """A DCP checkpoint's files as found (name, inode, size, mtime of each): an unchanged stamp is
    an unchanged checkpoint, a rewritten or edited file a new one.  ``None`` for other formats
    (nothing is kept for them)."""
    import os

    if index.format != "dcp":
        return None
    try:
        with os.scandir(index.path) as entries:
            found = sorted((e.name, (st := e.stat(follow_symlinks=False)).st_ino, st.st_size,
                            st.st_mtime_ns)
                           for e in entries)
    except OSError:
        return None
    return tuple(found)


def _fingerprints(index: CheckpointIndex, keys: Sequence[str], rows_of: RowsOf, memory_bytes: int
                  ) -> tuple[dict[str, Any], dict[str, list[Digest]]]:
    """Each key's digest (or non-tensor value) and the digests of the rows of each key ``rows_of``
    names."""
    import torch

    if index.reader is None:
        raise ValueError(f"{index.path}: this index has no reader; values cannot be compared")
    stamp = _stamp(index)
    seen: dict[str, tuple[Any, list[Digest] | None]] = {}
    if stamp is not None:
        seen = _SEEN.get((index.path, stamp)) or {}
    wanted = [k for k in keys if k not in seen
              or (rows_of(k) and seen[k][1] is None)]
    for batch in _batches(index, wanted, memory_bytes):
        for key, value in index.reader(batch).items():
            if isinstance(value, torch.Tensor):
                seen[key] = (digest(value),
                             _row_digests(value) if rows_of(key) else None)
            else:
                seen[key] = (value, None)
    if stamp is not None and wanted:
        count = sum(1 + len(rows or ()) for _, rows in seen.values())
        _SEEN.put((index.path, stamp), seen, count * 200)  # a digest's tuple, strings, 16 bytes
    whole = {k: seen[k][0] for k in keys if k in seen}
    rows = {k: found for k in keys if rows_of(k) and k in seen
            and (found := seen[k][1]) is not None}
    return whole, rows


def _is_digest(value: Any) -> bool:
    """Whether a :func:`_fingerprints` value is a tensor's :func:`digest` (else it is a non-tensor
    entry)."""
    return isinstance(value, tuple) and len(value) == 3 and isinstance(value[2], bytes)

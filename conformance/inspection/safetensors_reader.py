"""Read a Hugging Face safetensors checkpoint's index from its files' headers, and its values.

``model.safetensors.index.json`` and each file's header are parsed here (8-byte little-endian length
+ JSON) rather than with the ``safetensors`` package: it is twenty lines, needs no extra dependency,
and lets every malformed header be a :class:`CheckpointError` naming the file and the byte it failed
at.  As :mod:`conformance.inspection.readers` does, every file is opened only after its path, links
resolved, is found inside the checkpoint directory.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from conformance.inspection.model import CheckpointError, CheckpointIndex, CheckpointProblem, Entry
from conformance.inspection.roots import WHAT, inside

__all__ = ["read_safetensors"]

SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32",
    "U64": "uint64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "C64": "complex64",
}
MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit


def _header(file: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a .safetensors file and the offset its data starts at."""
    expected = ("a .safetensors file: an 8-byte little-endian header length, then that many bytes "
                "of JSON")
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(str(file), f"is truncated: {len(head)} bytes, no header "
                                      "length", expected)
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(str(file), f"is truncated or corrupt: header length {n}, "
                                      f"file size {size}", expected)
            text = f.read(n)
    except OSError as exc:
        raise CheckpointError(str(file), f"cannot be read ({type(exc).__name__}: {exc})",
                              expected) from None
    try:
        header = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(str(file), f"has a corrupt JSON header ({exc})", expected) from None
    if not isinstance(header, dict):
        raise CheckpointError(str(file), f"has a header of type {type(header).__name__}", expected)
    return header, 8 + n


def read_safetensors(path: str | os.PathLike[str]) -> CheckpointIndex:
    """Every key of a Hugging Face checkpoint from its index and its files' headers."""
    p = Path(path)
    directory = p if p.is_dir() else p.parent
    root = directory.resolve()
    problems: list[CheckpointProblem] = []
    listed: dict[str, str] = {}
    indexes = sorted(directory.glob("*.safetensors.index.json")) if p.is_dir() else (
        [p] if p.name.endswith(".index.json") else [])
    for index_file in indexes:
        inside(root, index_file)
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"weight_map is a {type(weight_map).__name__}")
        except OSError as exc:
            raise CheckpointError(str(index_file), f"cannot be read ({type(exc).__name__}: {exc})",
                                  "a readable JSON index") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(str(index_file), f"is corrupt ({type(exc).__name__}: {exc})",
                                  'JSON with a "weight_map" object of key -> file name') from None
        for key, name in weight_map.items():
            inside(root, directory / str(name),
                    f"named by {index_file} for key {key!r} as {str(name)!r}")
        listed.update({str(k): str(v) for k, v in weight_map.items()})
    if listed:
        files = sorted({directory / name for name in listed.values()})
    elif p.is_file():
        files = [p]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(str(p), "holds no *.safetensors files", WHAT)
    entries: dict[str, Entry] = {}
    where: dict[str, tuple[Path, int, int, int]] = {}
    for file in files:
        inside(root, file)
        if not file.exists():
            keys = sorted(k for k, v in listed.items() if directory / v == file)
            raise CheckpointError(str(file),
                                  f"does not exist, but the index lists {len(keys)} key(s) in it "
                                  f"(first {keys[0]!r})", "every file the index names")
        header, start = _header(file)
        size = file.stat().st_size
        for key, info in header.items():
            if key == "__metadata__":
                continue
            try:
                dtype, shape, (begin, end) = (info["dtype"], tuple(int(s) for s in info["shape"]),
                                              info["data_offsets"])
            except (TypeError, KeyError, ValueError) as exc:
                raise CheckpointError(str(file), f"header entry {key!r} is malformed ({exc!r})",
                                      'each entry {"dtype", "shape", "data_offsets": [begin, '
                                      'end]}') from None
            if key in entries:
                problems.append(CheckpointProblem("index_mismatch", key,
                                                  f"stored twice: in {where[key][0].name} and "
                                                  f"{file.name}"))
            if start + end > size:
                problems.append(CheckpointProblem("index_mismatch", key,
                                                  f"its data ends at byte {start + end} of "
                                                  f"{file.name}, which has {size}: the file is "
                                                  "truncated"))
            if listed and listed.get(key) != file.name:
                problems.append(CheckpointProblem("index_mismatch", key,
                                                  f"in {file.name}, but the index says "
                                                  f"{listed.get(key)!r}"))
            entries[key] = Entry(key, shape, SAFETENSORS_DTYPES.get(dtype, dtype.lower()),
                                 ((tuple(0 for _ in shape), shape),))
            where[key] = (file, start, begin, end)
    for key in sorted(set(listed) - set(entries)):
        problems.append(CheckpointProblem("index_mismatch", key,
                                          f"listed by the index in {listed[key]}, but that "
                                          "file's header does not have it"))
    return CheckpointIndex(str(p), "safetensors", entries, tuple(problems),
                           reader=_SafetensorsReader(where, entries))


class _SafetensorsReader:
    def __init__(self, where: Mapping[str, tuple[Path, int, int, int]],
                 entries: Mapping[str, Entry]) -> None:
        self.where, self.entries = where, entries

    def __call__(self, keys: Sequence[str]) -> dict[str, Any]:
        import torch

        out: dict[str, Any] = {}
        for key in keys:
            file, start, begin, end = self.where[key]
            entry = self.entries[key]
            try:
                with file.open("rb") as f:
                    f.seek(start + begin)
                    data = bytearray(f.read(end - begin))
            except OSError as exc:
                raise CheckpointError(str(file), f"reading {key!r} failed ({exc})",
                                      "a readable file") from None
            dtype = getattr(torch, entry.dtype or "", None)
            if not isinstance(dtype, torch.dtype) or len(data) != end - begin:
                raise CheckpointError(str(file),
                                      f"{key!r}: dtype {entry.dtype} or {len(data)} data bytes",
                                      f"a torch dtype and {end - begin} bytes")
            assert entry.shape is not None  # read_safetensors makes every entry a tensor
            out[key] = (torch.frombuffer(data, dtype=dtype).reshape(entry.shape) if data
                        else torch.empty(entry.shape or (), dtype=dtype))
        return out

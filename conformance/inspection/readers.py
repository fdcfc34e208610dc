"""Read a checkpoint's index from its metadata alone, and its values one batch of keys at a time.

* DCP: ``.metadata`` through a restricted unpickler that knows DCP's metadata classes and refuses
  any other global (see :class:`_MetadataUnpickler`: no code runs and no torch import, where
  ``FileSystemReader.read_metadata()`` is a plain ``pickle.load``).  Values are read straight from
  the data files at the offsets ``.metadata`` gives (``dcp.load(no_dist=True)`` when a storage
  transform such as compression is in the way), so no process group is used even inside a running
  world; a tensor item is decoded by an unpickler that allows only a plain tensor's rebuild
  (:class:`_TensorUnpickler`), anything else with ``torch.load(weights_only=True)``, never with
  DCP's unrestricted unpickling.
* Hugging Face safetensors: :mod:`conformance.inspection.safetensors_reader`.
* DeepSpeed universal checkpoints: :mod:`conformance.inspection.deepspeed_universal`.

Nothing here writes to the checkpoint directory, and nothing outside it is read: every file is
opened only after its path, links resolved, is found inside the checkpoint directory
(:func:`~conformance.inspection.roots.inside`), so an index naming ``../../etc/passwd`` or a link
out of the directory is a :class:`CheckpointError` before anything is opened.
"""

from __future__ import annotations

import io
import os
import pickle
import types
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from conformance.inspection.deepspeed_universal import read_universal, universal_dir
from conformance.inspection.model import CheckpointError, CheckpointIndex, Entry, paused_gc
from conformance.inspection.roots import (
    ROOT_DEPTH,
    WHAT,
    dcp_dir,
    find_checkpoint,
    inside,
    is_checkpoint,
)
from conformance.inspection.safetensors_reader import read_safetensors
from pytest_moe_ep.text import shorten

__all__ = ["find_checkpoint", "index_state_dict", "read_checkpoint", "read_dcp"]

def read_checkpoint(path: str | os.PathLike[str]) -> CheckpointIndex:
    """The index of the checkpoint at (or below: :func:`find_checkpoint`) ``path``."""
    p = Path(path)
    if p.is_file() and p.name == ".metadata":
        p = p.parent
    if p.is_file() and (p.name.endswith(".safetensors")
                        or p.name.endswith(".safetensors.index.json")):
        return read_safetensors(p)
    if not p.exists():
        raise CheckpointError(str(p), "does not exist", WHAT)
    if not p.is_dir():
        raise CheckpointError(str(p), "is a file, not a checkpoint directory", WHAT)
    if universal_dir(p) is not None:  # DeepSpeed's: no .metadata, one directory per parameter
        return read_universal(p)
    p = find_checkpoint(p)
    if dcp_dir(p):
        return read_dcp(p)
    if is_checkpoint(p):
        return read_safetensors(p)
    raise CheckpointError(str(p), "holds neither a .metadata file nor *.safetensors files "
                          f"({ROOT_DEPTH} levels down)", WHAT)


# -- DCP ------------------------------------------------------------------------------------------
class _Record:
    """Stands for a DCP metadata class while unpickling: its fields land in ``__dict__``.

    An enum (``WriteItemType``, which Megatron's metadata holds) pickles as a call with its value:
    kept in ``args``.
    """

    def __init__(self, *args: Any) -> None:
        self.args = args


class _Properties:
    """Stands for TensorProperties, which pickles as a tuple (dtype, layout, ..)."""

    def __setstate__(self, state: Any) -> None:
        self.state = state


_SAFE_BUILTINS = {"set": set, "frozenset": frozenset, "tuple": tuple, "list": list, "dict": dict,
                  "int": int,
                  "float": float, "str": str, "bytes": bytes, "bool": bool, "complex": complex}


#: storage-layer records that frameworks' own DCP storage writers put in ``Metadata.storage_data``
#: (where DCP's FileSystemWriter puts its ``_StorageInfo``): dataclasses of plain fields, read as
#: plain records.
_STORAGE_INFO = {
    # OLMo-core's RemoteFileSystemWriter
    ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Reads a ``.metadata`` pickle allowing only what DCP writes there, as plain stand-ins.

    Why not ``FileSystemReader.read_metadata()``: that is ``pickle.load``, which runs whatever a
    file names.  Here a DCP class becomes a plain record, ``torch.Size`` a tuple, a dtype its name;
    any other global is refused, so inspecting a checkpoint cannot run code and needs no torch.

    The stand-in classes are this unpickler's own (one file's), not a module's: their names come
    from the file, so a table kept for the process would grow with every checkpoint read.
    """

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self._records: dict[str, type] = {}

    def _record(self, name: str, qualified: str) -> type:
        if qualified not in self._records:
            self._records[qualified] = type(name, (_Record,), {})
        return self._records[qualified]

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch":
            return tuple if name == "Size" else _constant(name)
        if module.startswith("torch.distributed.checkpoint"):
            if name == "TensorProperties":
                return _Properties
            if name == "_MEM_FORMAT_ENCODING":
                return int
            return self._record(name, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return str
        if module == "pathlib":  # StorageMeta.checkpoint_id: a path pickled as its parts
            return _path
        # a storage writer's own per-item record (storage_data): never read
        if (module, name) in _STORAGE_INFO:
            return self._record(name, f"{module}.{name}")
        if module == "builtins" and name in _SAFE_BUILTINS:
            return _SAFE_BUILTINS[name]
        if module == "collections" and name == "OrderedDict":
            return dict
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which DCP metadata never does")


def _path(*parts: str) -> str:
    return os.path.join(*parts) if parts else ""


def _constant(name: str) -> Any:
    if not name.isidentifier():
        raise pickle.UnpicklingError(f"it refers to torch.{name!r}")
    return name  # torch.float32 -> "float32"


def _dtype_of(props: Any) -> str:
    state = getattr(props, "state", None)
    if isinstance(state, tuple) and state and isinstance(state[0], str):
        return state[0]
    if isinstance(state, dict) and isinstance(state.get("dtype"), str):
        return state["dtype"]
    dtype = getattr(props, "dtype", None)
    if isinstance(dtype, str):
        return dtype
    raise TypeError(f"tensor properties {state!r} name no dtype")


def read_dcp(path: str | os.PathLike[str]) -> CheckpointIndex:
    """Every key of a DCP checkpoint (at or below ``path``) from ``.metadata``."""
    with paused_gc():
        return _read_dcp(find_checkpoint(path))


def _read_dcp(p: Path) -> CheckpointIndex:
    meta_path = p / ".metadata"
    if not p.is_dir():
        raise CheckpointError(str(p), "is not a directory" if p.exists() else "does not exist",
                              WHAT)
    expected = "a pickled torch.distributed.checkpoint Metadata, as dcp.save writes it"
    if meta_path.is_symlink():
        inside(p.resolve(), meta_path)
    try:
        with meta_path.open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(str(meta_path), "does not exist", expected) from None
    except OSError as exc:
        raise CheckpointError(str(meta_path), f"cannot be read ({type(exc).__name__}: {exc})",
                              expected) from None
    except Exception as exc:  # whatever a corrupt pickle raises
        what = "truncated" if isinstance(exc, EOFError) or "truncated" in str(exc) else "corrupt"
        raise CheckpointError(str(meta_path), f"is {what} ({type(exc).__name__}: {exc})",
                              expected) from None
    sdm = getattr(metadata, "state_dict_metadata", None)
    if type(metadata).__name__ != "Metadata" or not isinstance(sdm, dict):
        raise CheckpointError(str(meta_path),
                              f"holds a {type(metadata).__name__}, not a DCP Metadata", expected)
    entries: dict[str, Entry] = {}
    try:
        for key, md in sdm.items():
            kind = type(md).__name__
            if kind == "TensorStorageMetadata":
                entries[key] = Entry(key, tuple(md.size), _dtype_of(md.properties),
                                     tuple([(c.offsets, c.sizes) for c in md.chunks]))
            elif kind == "BytesStorageMetadata":
                entries[key] = Entry(key, None)
            else:
                raise TypeError(f"key {key!r} has metadata of type {kind}")
    except (TypeError, AttributeError) as exc:
        raise CheckpointError(str(meta_path), f"is not DCP metadata as expected ({exc})",
                              "TensorStorageMetadata or BytesStorageMetadata for every "
                              "key") from None
    _storageinside(p, metadata, str(meta_path))
    return CheckpointIndex(str(p), "dcp", entries, reader=_DcpReader(str(p)))


def _storageinside(p: Path, metadata: Any, meta_path: str) -> None:
    """Every data file ``.metadata`` names lies inside the checkpoint directory (DCP opens
    ``p / name``)."""
    root = p.resolve()
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return  # no data files named: values cannot be read, the metadata still can
    checked: set[str] = set()  # one data file holds thousands of items: each name is resolved once
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        if isinstance(name, str) and name and name not in checked:
            fqn = getattr(index, "fqn", index)
            inside(root, p / name, f"named by {meta_path} for key {fqn!r} as {name!r}")
            checked.add(name)


class _DcpReader:
    """Reads keys of one DCP checkpoint with no process group; the metadata is read once."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.metadata: Any = None  # DCP's Metadata, read on the first call

    def __call__(self, keys: Sequence[str]) -> dict[str, Any]:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        if self.metadata is None:  # read once, with DCP's own reader, only when values are wanted
            inside(Path(self.path).resolve(), Path(self.path) / ".metadata")
            self.metadata = _with_dcp_storage_info(FileSystemReader(self.path).read_metadata())
            _storageinside(Path(self.path), self.metadata, str(Path(self.path) / ".metadata"))
        metadata = self.metadata

        class Reader(FileSystemReader):
            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                return metadata

        class RawBytes(DefaultLoadPlanner):
            def __init__(self) -> None:
                super().__init__()
                self.raw: dict[str, bytes] = {}

            def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
                self.raw[read_item.dest_index.fqn] = value.read()

        if _direct(metadata):
            return self._direct(keys, metadata)
        state: dict[str, Any] = {}
        for key in keys:
            md = metadata.state_dict_metadata[key]
            state[key] = (torch.empty(md.size, dtype=md.properties.dtype)
                          if isinstance(md, TensorStorageMetadata) else None)
        planner = RawBytes()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(state, storage_reader=Reader(self.path), planner=planner, no_dist=True)
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            failures = getattr(exc, "failures", None) or {}
            first = next(iter(failures.values()), exc)
            cause = first[0] if isinstance(first, tuple) else first  # DCP wraps (exception, stack)
            raise CheckpointError(self.path, f"reading {len(keys)} key(s) from {keys[0]!r} failed "
                                  f"({type(cause).__name__}: {shorten(str(cause), 300)})",
                                  "data files that match .metadata") from None
        for key, raw in planner.raw.items():
            state[key] = _decode(raw)
        return state

    def _direct(self, keys: Sequence[str], metadata: Any) -> dict[str, Any]:
        """``keys`` read straight from the data files: each item's bytes where ``storage_data`` puts
        them, a tensor decoded by :func:`_tensor` and placed at its chunk's offsets, as DCP's own
        reader does.

        Why not ``dcp.load(no_dist=True)``: its planning and its ``torch.load(weights_only=True)``
        per item (a pure-Python unpickler) cost about 3 ms an item, and a checkpoint in one key per
        expert, weight and moment has thousands of items; reading the truth and every saved
        checkpoint was most of the inspection.
        """
        import torch
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorStorageMetadata,
        )

        # data file -> [(item's storage info, where it goes)]
        wanted: dict[str, list[tuple[Any, Any]]] = {}
        state: dict[str, Any] = {}
        root = Path(self.path)
        for key in keys:
            md = metadata.state_dict_metadata[key]
            pieces: list[tuple[MetadataIndex, tuple[str, ChunkStorageMetadata | None]]]
            if isinstance(md, TensorStorageMetadata):
                # one chunk that is the whole tensor: its decoded item is the value (None keeps its
                # place in the order)
                whole = len(md.chunks) == 1 and tuple(md.chunks[0].sizes) == tuple(md.size)
                state[key] = None if whole else torch.empty(md.size, dtype=md.properties.dtype)
                pieces = [(MetadataIndex(key, chunk.offsets), (key, chunk)) for chunk in md.chunks]
            else:
                pieces = [(MetadataIndex(key), (key, None))]
            for index, where in pieces:
                info = metadata.storage_data.get(index)
                if info is None:
                    raise CheckpointError(self.path,
                                          f"{key!r}: .metadata names no data for its chunk at "
                                          f"{index.offset}", "data for every chunk .metadata lists")
                wanted.setdefault(info.relative_path, []).append((info, where))
        for name, items in wanted.items():
            try:
                with (root / name).open("rb") as f:
                    for info, (key, chunk) in sorted(items, key=lambda item: item[0].offset):
                        f.seek(info.offset)
                        raw = f.read(info.length)
                        if len(raw) != info.length:
                            raise CheckpointError(
                                str(root / name), f"{key!r}: {len(raw)} of {info.length} bytes at "
                                f"{info.offset} (truncated)", "data files that match .metadata")
                        if chunk is None:
                            state[key] = _decode(raw)
                            continue
                        value = _tensor(raw)
                        dtype = metadata.state_dict_metadata[key].properties.dtype
                        if tuple(value.shape) != tuple(chunk.sizes) or value.dtype != dtype:
                            raise CheckpointError(str(root / name),
                                                  f"{key!r}: its chunk at {tuple(chunk.offsets)} "
                                                  f"holds {tuple(value.shape)} {value.dtype}",
                                                  f"{tuple(chunk.sizes)} {dtype} as .metadata says")
                        target = state[key]
                        if target is None:  # the whole tensor, no copy
                            state[key] = value
                            continue
                        for axis, (start, size) in enumerate(zip(chunk.offsets, chunk.sizes,
                                                                 strict=True)):
                            target = target.narrow(axis, start, size)
                        target.copy_(value)
            except OSError as exc:
                raise CheckpointError(self.path,
                                      f"reading {len(keys)} key(s) from {keys[0]!r} failed "
                                      f"({type(exc).__name__}: {shorten(str(exc), 300)})",
                                      "data files that match .metadata") from None
        return state


def _direct(metadata: Any) -> bool:
    """Whether every item is plain bytes at an offset of a file in the directory (DCP's own
    ``_StorageInfo`` with no stream transform such as compression), which :meth:`_DcpReader._direct`
    reads."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    storage = getattr(metadata, "storage_data", None)
    return isinstance(storage, dict) and all(
        type(info) is _StorageInfo and not info.transform_descriptors for info in storage.values())


class _TensorUnpickler(pickle.Unpickler):
    """The C unpickler allowing only what ``torch.save`` writes for one plain tensor: its rebuild
    function and storage types (``torch.load`` resolves those itself); any other global refuses the
    item, which is then read with ``torch.load(weights_only=True)``."""

    ALLOWED = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
               ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor")
        return super().find_class(module, name)


#: the ``pickle_module`` ``torch.load`` takes: a module whose ``Unpickler`` is
#: :class:`_TensorUnpickler`.
_TENSOR_PICKLE = types.ModuleType("conformance_tensor_pickle")
_TENSOR_PICKLE.Unpickler = _TensorUnpickler  # type: ignore[attr-defined]


def _tensor(raw: bytes) -> Any:
    """One DCP tensor item (a ``torch.save`` archive), decoded by :class:`_TensorUnpickler` (about
    5x faster than ``torch.load(weights_only=True)``, which it falls back to for anything but a
    plain tensor)."""
    import torch

    try:
        value = torch.load(io.BytesIO(raw), map_location="cpu", pickle_module=_TENSOR_PICKLE,
                           weights_only=False)
    except Exception:
        value = None
    if not isinstance(value, torch.Tensor) or type(value) not in (torch.Tensor, torch.nn.Parameter):
        value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    return value.detach()


def _with_dcp_storage_info(metadata: Any) -> Any:
    """``metadata`` with a framework storage writer's per-item records (:data:`_STORAGE_INFO`) as
    DCP's own.

    OLMo-core's writer pickles its own ``_StorageInfo(relative_path, offset, length)``, which torch
    2.13's ``FileSystemReader`` cannot read (it lacks ``transform_descriptors``); the same three
    fields say where the bytes are, so the values are read exactly as DCP's reader reads its own
    checkpoints.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    storage = getattr(metadata, "storage_data", None)
    if isinstance(storage, dict):
        for index, info in storage.items():
            if (type(info).__module__, type(info).__name__) in _STORAGE_INFO:
                storage[index] = _StorageInfo(info.relative_path, info.offset, info.length)
    return metadata


class Opaque(bytes):
    """A non-tensor entry ``torch.load(weights_only=True)`` refuses: compared by its bytes."""


def _decode(raw: bytes) -> Any:
    import torch

    try:
        return torch.load(io.BytesIO(raw), weights_only=True)
    except Exception:
        return Opaque(raw)


# -- in memory ------------------------------------------------------------------------------------
def index_state_dict(state: Mapping[str, Any], path: str = "<state dict>",
                     format: str = "state_dict"
                     ) -> CheckpointIndex:
    """An index of a flat ``key -> global tensor | value`` dict (an adapter's
    ``read_checkpoint``)."""
    import torch

    entries = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            shape = tuple(value.shape)
            entries[key] = Entry(key, shape, str(value.dtype).removeprefix("torch."),
                                 ((tuple(0 for _ in shape), shape),))
        else:
            entries[key] = Entry(key, None)
    return CheckpointIndex(path, format, entries, reader=lambda keys: {k: state[k] for k in keys})

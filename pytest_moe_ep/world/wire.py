"""What crosses the launch's store under torchrun: tagged JSON, never pickle.

The store of a torchrun launch is a TCPStore without authentication that anything reaching its port
can write to; unpickling what it holds would run whatever a writer chose.  So call names, outcomes,
directory paths and exit statuses travel as JSON.  A call's return value is the test's own and
travels as Python data: ``None``, bool, int, float, str, bytes, list, tuple, dict, set, frozenset,
and instances of dataclasses holding them.  A dataclass is rebuilt only from a class already
imported in the reading process (it ran the same call), never by importing a module a stored value
names.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

TAG = "$"


def _encode(value: Any, path: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        encoded = [_encode(v, f"{path}[{i}]") for i, v in enumerate(items)]
        return encoded if type(value) is list else {TAG: type(value).__name__, "items": encoded}
    if isinstance(value, dict):
        return {TAG: "dict", "items": [[_encode(k, f"{path} key"), _encode(v, f"{path}[{k!r}]")]
                                       for k, v in value.items()]}
    if isinstance(value, bytes):
        return {TAG: "bytes", "hex": value.hex()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        fields = {f.name: _encode(getattr(value, f.name), f"{path}.{f.name}")
                  for f in dataclasses.fields(value) if f.init}
        return {TAG: "dataclass", "type": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    raise TypeError(f"{path} is a {type(value).__qualname__}: under torchrun, values travel "
                    "between ranks as JSON-like data (None, bool, int, float, str, bytes, list, "
                    "tuple, dict, set, dataclasses of them)")


def dumps(value: Any) -> bytes:
    """``value`` as tagged JSON; ``TypeError`` naming the part that cannot travel."""
    return json.dumps(_encode(value, "the value")).encode()


def _dataclass(name: str) -> type:
    module_name, _, qualname = name.partition(":")
    obj: Any = sys.modules.get(module_name)
    if obj is None:
        raise ValueError(f"dataclass {name}: module {module_name!r} is not imported here")
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
        raise ValueError(f"{name} is not a dataclass")
    return obj


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(TAG)
    if tag in ("tuple", "set", "frozenset"):
        return {"tuple": tuple, "set": set,
                "frozenset": frozenset}[tag](_decode(v) for v in value["items"])
    if tag == "dict":
        return {_decode(k): _decode(v) for k, v in value["items"]}
    if tag == "bytes":
        return bytes.fromhex(value["hex"])
    if tag == "dataclass":
        return _dataclass(value["type"])(**{k: _decode(v) for k, v in value["fields"].items()})
    raise ValueError(f"unknown tag {tag!r}")


def loads(data: bytes) -> Any:
    """The value :func:`dumps` wrote; ``ValueError`` for anything else (never runs code a writer
    chose)."""
    try:
        return _decode(json.loads(data))
    except Exception as exc:  # whatever a writer put there, it is refused, never run
        raise ValueError(f"not JSON written by pytest-moe-ep ({type(exc).__name__}: "
                         f"{exc})") from exc

"""How the harness takes an adapter: by name, checked once, its members resolved for the checks.

:func:`load_adapter` finds it (a built-in name or ``module:attr``), :func:`check_adapter` refuses one that lacks a
required member (:data:`conformance.adapter.REQUIRED_MEMBERS`), has malformed optional values or cannot be sent to
the rank processes, and returns its :class:`Members`: plain data the controller resolves once and sends with every
cell, so no check probes the adapter again.  The contract itself is :mod:`conformance.adapter`.
"""

from __future__ import annotations

import importlib
import pickle
import re
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

from conformance.adapter import OPTIONAL_MEMBERS, REQUIRED_MEMBERS, AdapterError, Capabilities
from conformance.layout import EP_ORDERS

__all__ = ["Members", "capabilities_of", "check_adapter", "load_adapter", "members_of", "missing_members"]


_CAPABILITY_FIELDS = tuple(f.name for f in fields(Capabilities) if f.default is MISSING)


def capabilities_of(adapter: Any) -> Capabilities:
    found = adapter.capabilities
    if isinstance(found, Capabilities):
        return found

    def get(key: str, default: Any = None) -> Any:
        return found.get(key, default) if isinstance(found, Mapping) else getattr(found, key, default)

    missing = [f for f in _CAPABILITY_FIELDS if get(f, None) is None]
    if missing:
        raise AdapterError(f"adapter capabilities lack {', '.join(missing)}")
    kinds = tuple(get("kinds"))
    bad = [k for k in kinds if k not in ("packed", "unpacked")]
    if bad or not kinds:
        raise AdapterError(f"adapter capabilities.kinds must list 'packed' and/or 'unpacked', got {kinds!r}")
    orders = tuple(get("ep_orders", ("strided",)))
    bad = [o for o in orders if o not in EP_ORDERS]
    if bad or not orders:
        raise AdapterError(f"adapter capabilities.ep_orders must list {' and/or '.join(EP_ORDERS)}, got {orders!r}")
    stages = tuple(get("pp", (1,)))
    if not stages or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in stages) or 1 not in stages:
        raise AdapterError(f"adapter capabilities.pp must list the pipeline degrees it supports, 1 among them (ints "
                           f">= 1), got {stages!r}")
    flags = {f.name: bool(get(f.name, f.default)) for f in fields(Capabilities)
             if f.default is not MISSING and isinstance(f.default, bool)}
    return Capabilities(kinds=kinds, optimizer=bool(get("optimizer")), fsdp=bool(get("fsdp")),
                        uneven=bool(get("uneven")), max_ep=int(get("max_ep")), format=str(get("format")),
                        ep_orders=orders, pp=stages, **flags)


def missing_members(adapter: Any) -> list[str]:
    """Required members the adapter lacks (callables must be callable), capability fields included."""
    missing = [m for m in REQUIRED_MEMBERS if not hasattr(adapter, m)]
    missing += [m for m in REQUIRED_MEMBERS[3:] if hasattr(adapter, m) and not callable(getattr(adapter, m))]
    if "capabilities" not in missing:
        try:
            capabilities_of(adapter)
        except AdapterError as exc:
            missing.append(str(exc))
    return missing


def load_adapter(spec: str) -> Any:
    """The adapter named by a built-in name or ``module:attr`` (a class is instantiated)."""
    from conformance.adapters import builtin_name, checkpoint_builtins

    builtins = checkpoint_builtins()
    target = builtins.get(builtin_name(spec), spec)
    if ":" not in target:
        raise AdapterError(f"unknown adapter {spec!r}: give a built-in name ({', '.join(builtins)}) or module:attr")
    module_name, attr = target.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an adapter module failing to import is the user's to see, whatever it raised
        raise AdapterError(f"cannot import adapter module {module_name!r} (from {spec!r}): "
                           f"{type(exc).__name__}: {exc}") from exc
    try:
        found = module
        for part in attr.split("."):
            found = getattr(found, part)
    except AttributeError as exc:
        raise AdapterError(f"adapter module {module_name!r} has no attribute {attr!r} (from {spec!r})") from exc
    return found() if isinstance(found, type) else found


@dataclass(frozen=True)
class Members:
    """What :func:`check_adapter` found an adapter to have, resolved once: its capabilities, which optional
    callables it has and its optional values.  The checks read this instead of probing the adapter; they still
    call the members on the adapter itself (so a wrapper around it sees each call).  Plain data: it travels to
    the ranks with the cell."""

    #: ``module.qualname`` of the adapter's class: what the ranks cache its ground truths under.
    of: str
    capabilities: Capabilities
    step: bool = False
    scalars: bool = False
    forward: bool = False
    read_checkpoint: bool = False
    check_saved: bool = False
    save_legacy: bool = False
    end_cell: bool = False
    ep_dependent_keys: tuple[str, ...] = ()
    refusal_errors: tuple[type[BaseException], ...] = ()
    preload: tuple[str, ...] = ()
    expert_keys: tuple[str, ...] = ()

    def unreadable(self) -> str:
        """Why the checkpoint check cannot read this adapter's checkpoints ("" when it can)."""
        if self.capabilities.format == "dcp" or self.read_checkpoint:
            return ""
        return (f"the adapter's checkpoint format ({self.capabilities.format}) is not DCP and it has no "
                "read_checkpoint(path)")


#: the optional members that are values (sequences), not callables.
_OPTIONAL_VALUES = ("ep_dependent_keys", "refusal_errors", "preload", "expert_keys")


def members_of(adapter: Any) -> Members:
    """The adapter's :class:`Members`: the one place the optional members are looked up."""
    kind = type(adapter)

    def has(name: str) -> bool:
        return callable(getattr(adapter, name, None))

    def values(name: str) -> tuple[Any, ...]:
        return tuple(getattr(adapter, name, ()) or ())

    return Members(f"{kind.__module__}.{kind.__qualname__}", capabilities_of(adapter), step=has("step"),
                   scalars=has("scalars"), forward=has("forward"), read_checkpoint=has("read_checkpoint"),
                   check_saved=has("check_saved"), save_legacy=has("save_legacy"), end_cell=has("end_cell"),
                   ep_dependent_keys=values("ep_dependent_keys"), refusal_errors=values("refusal_errors"),
                   preload=values("preload"), expert_keys=values("expert_keys"))


def check_adapter(adapter: Any, origin: str) -> Members:
    """Refuse an adapter that lacks members or cannot be sent to ranks; what it has otherwise."""
    missing = missing_members(adapter)
    if missing:
        raise AdapterError(f"adapter {origin} is missing: {', '.join(missing)} (required: "
                           f"{', '.join(REQUIRED_MEMBERS)}; optional: {', '.join(OPTIONAL_MEMBERS)})")
    for name in _OPTIONAL_VALUES:
        found = getattr(adapter, name, ()) or ()
        if isinstance(found, (str, bytes)) or not isinstance(found, Iterable):
            raise AdapterError(f"adapter {origin}: {name} must be a sequence, got {type(found).__name__} "
                               f"{found!r}")
    members = members_of(adapter)
    for regex in members.expert_keys:
        try:
            re.compile(regex)
        except (re.error, TypeError) as exc:
            raise AdapterError(f"adapter {origin}: expert_keys entry {regex!r} is not a regular expression: "
                               f"{exc}") from None
    try:
        pickle.dumps(adapter)
    except Exception as exc:  # any pickling failure means the same: ranks cannot receive it
        raise AdapterError(f"adapter {origin} cannot be sent to rank processes ({exc}); define its class at "
                           "module level and keep framework objects out of its attributes") from exc
    return members

"""How the harness takes an adapter: by name, checked once, its members resolved for the checks.

:func:`load_adapter` finds it (a built-in name or ``module:attr``); :func:`check_adapter` refuses
one that lacks a required member of the contract (:class:`conformance.adapter.CheckpointAdapter`),
has malformed optional values or cannot be sent to the rank processes, and returns its
:class:`Members`: plain data the controller resolves once and sends with every cell, so no check
probes the adapter again.  Every member name comes from the contract's Protocols
(:func:`conformance.adapter.members`); nothing here lists one.
"""

from __future__ import annotations

import importlib
import pickle
import re
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, NamedTuple

from conformance.adapter import (
    FINETUNES,
    KINDS,
    AdapterError,
    Capabilities,
    CheckpointAdapter,
    OptionalMembers,
)
from conformance.adapter import (
    members as contract_members,
)
from conformance.layout import EP_ORDERS

__all__ = ["Built", "Members", "built", "capabilities_of", "check_adapter", "load_adapter",
           "members_of", "missing_members"]

_CAPABILITY_FIELDS = tuple(f.name for f in fields(Capabilities) if f.default is MISSING)


def _required() -> tuple[tuple[str, ...], tuple[str, ...]]:
    return contract_members(CheckpointAdapter)


def _optional() -> tuple[tuple[str, ...], tuple[str, ...]]:
    return contract_members(OptionalMembers)


def capabilities_of(adapter: Any) -> Capabilities:
    found = adapter.capabilities
    if isinstance(found, Capabilities):
        return found

    def get(key: str, default: Any = None) -> Any:
        if isinstance(found, Mapping):
            return found.get(key, default)
        return getattr(found, key, default)

    missing = [f for f in _CAPABILITY_FIELDS if get(f, None) is None]
    if missing:
        raise AdapterError(f"adapter capabilities lack {', '.join(missing)}")
    kinds = tuple(get("kinds"))
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise AdapterError(f"adapter capabilities.kinds must list some of {', '.join(KINDS)}, "
                           f"got {kinds!r}")
    orders = tuple(get("ep_orders", ("strided",)))
    bad = [o for o in orders if o not in EP_ORDERS]
    if bad or not orders:
        raise AdapterError("adapter capabilities.ep_orders must list "
                           f"{' and/or '.join(EP_ORDERS)}, got {orders!r}")
    stages = tuple(get("pp", (1,)))
    if (not stages or 1 not in stages
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in stages)):
        raise AdapterError(f"adapter capabilities.pp must list the pipeline degrees it supports, 1 "
                           f"among them (ints >= 1), got {stages!r}")
    finetune = tuple(get("finetune", ()) or ())
    bad = [s for s in finetune if s not in FINETUNES]
    if bad:
        raise AdapterError(f"adapter capabilities.finetune must list some of "
                           f"{', '.join(FINETUNES)}, got {finetune!r}")
    flags = {f.name: bool(get(f.name, f.default)) for f in fields(Capabilities)
             if f.default is not MISSING and isinstance(f.default, bool)}
    return Capabilities(kinds=kinds, optimizer=bool(get("optimizer")), fsdp=bool(get("fsdp")),
                        uneven=bool(get("uneven")), max_ep=int(get("max_ep")),
                        format=str(get("format")), ep_orders=orders, pp=stages,
                        finetune=finetune, **flags)


def missing_members(adapter: Any) -> list[str]:
    """Required members the adapter lacks (callables must be callable), capability fields
    included."""
    values, callables = _required()
    missing = [m for m in (*values, *callables) if not hasattr(adapter, m)]
    missing += [m for m in callables if hasattr(adapter, m) and not callable(getattr(adapter, m))]
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
        raise AdapterError(f"unknown adapter {spec!r}: give a built-in name "
                           f"({', '.join(builtins)}) or module:attr")
    module_name, attr = target.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    # an adapter module failing to import is the user's to see, whatever it raised
    except Exception as exc:
        raise AdapterError(f"cannot import adapter module {module_name!r} (from {spec!r}): "
                           f"{type(exc).__name__}: {exc}") from exc
    try:
        found = module
        for part in attr.split("."):
            found = getattr(found, part)
    except AttributeError as exc:
        raise AdapterError(f"adapter module {module_name!r} has no attribute {attr!r} "
                           f"(from {spec!r})") from exc
    return found() if isinstance(found, type) else found


@dataclass(frozen=True)
class Members:
    """What :func:`check_adapter` found an adapter to have, resolved once: its capabilities, which
    optional callables it has and its optional values.  The checks read this instead of probing the
    adapter; they still call the members on the adapter itself (so a wrapper around it sees each
    call). Plain data: it travels to the ranks with the cell."""

    #: ``module.qualname`` of the adapter's class: what the ranks keep its ground truths under.
    of: str
    capabilities: Capabilities
    #: the optional callables the adapter has.
    callables: frozenset[str] = frozenset()
    #: the optional values, each a tuple (empty when the adapter has none).
    values: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)

    def has(self, member: str) -> bool:
        """Whether the adapter has the optional callable ``member`` (a name outside the contract is
        a harness bug, not a missing member)."""
        if member not in _optional()[1]:
            raise KeyError(f"{member!r} is no optional callable of the adapter contract")
        return member in self.callables

    def value(self, member: str) -> tuple[Any, ...]:
        """The optional value ``member`` (``()`` when the adapter has none)."""
        if member not in _optional()[0]:
            raise KeyError(f"{member!r} is no optional value of the adapter contract")
        return tuple(self.values.get(member, ()))

    def unreadable(self) -> str:
        """Why the checkpoint check cannot read this adapter's checkpoints ("" when it can)."""
        if self.capabilities.format == "dcp" or self.has("read_checkpoint"):
            return ""
        return (f"the adapter's checkpoint format ({self.capabilities.format}) is not DCP and it "
                "has no read_checkpoint(path)")


def members_of(adapter: Any) -> Members:
    """The adapter's :class:`Members`: the one place the optional members are looked up."""
    kind = type(adapter)
    values, callables = _optional()
    return Members(f"{kind.__module__}.{kind.__qualname__}", capabilities_of(adapter),
                   frozenset(n for n in callables if callable(getattr(adapter, n, None))),
                   {n: tuple(getattr(adapter, n, ()) or ()) for n in values})


def check_adapter(adapter: Any, origin: str) -> Members:
    """Refuse an adapter that lacks members or cannot be sent to ranks; what it has otherwise."""
    missing = missing_members(adapter)
    if missing:
        required, optional = _required(), _optional()
        raise AdapterError(f"adapter {origin} is missing: {', '.join(missing)} (required: "
                           f"{', '.join((*required[0], *required[1]))}; optional: "
                           f"{', '.join((*optional[1], *optional[0]))})")
    for name in _optional()[0]:
        found = getattr(adapter, name, ()) or ()
        if isinstance(found, (str, bytes)) or not isinstance(found, Iterable):
            raise AdapterError(f"adapter {origin}: {name} must be a sequence, got "
                               f"{type(found).__name__} {found!r}")
    resolved = members_of(adapter)
    for regex in resolved.value("expert_keys"):
        try:
            re.compile(regex)
        except (re.error, TypeError) as exc:
            raise AdapterError(f"adapter {origin}: expert_keys entry {regex!r} is not a regular "
                               f"expression: {exc}") from None
    try:
        pickle.dumps(adapter)
    except Exception as exc:  # any pickling failure means the same: ranks cannot receive it
        raise AdapterError(f"adapter {origin} cannot be sent to rank processes ({exc}); define its "
                           "class at module level and keep framework objects out of its "
                           "attributes") from exc
    return resolved


class Built(NamedTuple):
    """What ``build`` returned: the model, its optimizer (or ``None``) and the rest of the training
    state."""

    model: Any
    optimizer: Any
    training_state: Mapping[str, Any] | None = None

    @property
    def extra(self) -> dict[str, Any]:
        """The keyword arguments ``save``/``load``/``step``/``scalars`` of this model get:
        ``state=`` (the contract's name for the training state) if any."""
        return {} if self.training_state is None else {"state": self.training_state}


def built(result: Any, where: str = "build") -> Built:
    """``build``'s result as a :class:`Built`; anything but ``(model, optimizer[, state])`` is an
    :class:`AdapterError`."""
    if isinstance(result, tuple) and len(result) in (2, 3):
        state = result[2] if len(result) == 3 else None
        if state is not None and not isinstance(state, Mapping):
            raise AdapterError(f"{where} returned a third element of type {type(state).__name__}; "
                               "expected a mapping of training-state objects by name (an LR "
                               "scheduler, a train-state dict)")
        return Built(result[0], result[1], state)
    length = f" of length {len(result)}" if isinstance(result, tuple) else ""
    raise AdapterError(f"{where} returned {type(result).__name__}{length}; expected "
                       "(model, optimizer) or (model, optimizer, state)")

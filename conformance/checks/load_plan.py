"""A load DCP cannot serve, said in expert terms: which keys this rank's load asked for that the
checkpoint lacks.

When a framework's load asks for a key the checkpoint does not hold, DCP raises from deep inside its
planner, in its own words -- at best a key (``Missing key in checkpoint state_dict: K``), at worst
an assertion that names none.  :func:`recorded` keeps, on each rank, what every ``dcp.load`` inside
the block asked for and what the checkpoint's metadata holds (DCP's
:class:`~torch.distributed.checkpoint.DefaultLoadPlanner` and any subclass that calls its
``set_up_planner``), and attaches it to whatever the block raises; :func:`explain` (the load-failure
translation, :func:`conformance.checks.blame.translate`, asks it first) names the keys asked for and
not held -- with their layer, expert and tensor where the key names them -- and the keys held in
another global shape.  No collective: each rank reads its own record, as every rank raises on its
own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ATTR", "LoadRecord", "explain", "recorded"]

#: the attribute :func:`recorded` sets on what the block raised: this rank's :class:`LoadRecord`.
ATTR = "moe_ep_load_plan"
SHOWN = 3


@dataclass
class LoadRecord:
    """What this rank's loads asked for, and what the checkpoint held: ``key -> global shape``
    (``None`` for a non-tensor entry), one pair per ``dcp.load``."""

    rank: int
    loads: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)


def _shape(value: Any) -> tuple[int, ...] | None:
    size = getattr(value, "size", None)
    if size is None or not hasattr(value, "dtype"):
        return None
    return tuple(size() if callable(size) else size)


@contextlib.contextmanager
def recorded() -> Iterator[LoadRecord]:
    """Record what each ``dcp.load`` of the block asks for; what the block raises carries the record
    (``ATTR``)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    record = LoadRecord(dist.get_rank() if dist.is_initialized() else 0)
    real = DefaultLoadPlanner.set_up_planner

    def set_up_planner(self: Any, state_dict: Any, metadata: Any = None,
                       is_coordinator: bool = False) -> None:
        real(self, state_dict, metadata, is_coordinator)
        held = getattr(metadata, "state_dict_metadata", None) or {}
        asked = {k: _shape(v) for k, v in (getattr(self, "state_dict", None) or {}).items()}
        record.loads.append((asked, {k: _held_shape(md) for k, md in held.items()}))

    DefaultLoadPlanner.set_up_planner = set_up_planner  # type: ignore[method-assign]
    try:
        yield record
    except BaseException as exc:
        with contextlib.suppress(AttributeError, TypeError):  # a type without attributes: none
            setattr(exc, ATTR, record)
        raise
    finally:
        DefaultLoadPlanner.set_up_planner = real  # type: ignore[method-assign]


def _held_shape(md: Any) -> tuple[int, ...] | None:
    size = getattr(md, "size", None)
    return tuple(size) if size is not None else None


def _of(exc: BaseException) -> LoadRecord | None:
    """The record ``exc`` (or what it wraps) carries."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        found = getattr(seen, ATTR, None)
        if isinstance(found, LoadRecord):
            return found
        seen = seen.__cause__ or seen.__context__
    return None


def _tensor(info: Any) -> str:
    """The tensor an expert key names, without its layer and expert: ``up.weight.exp_avg`` of
    ``optimizer.state.layers.1.moe.experts.3.up.weight.exp_avg``."""
    name = info.param
    for number in (info.expert, info.layer):
        if number is not None and f".{number}." in name:
            name = name.rsplit(f".{number}.", 1)[1]
            break
    return name + (f".{info.stat}" if info.stat else "")


def _where(key: str, info: Any) -> str:
    """``'K' (layer L, expert G, tensor T)``: what the key names, in expert terms where it names
    them."""
    if info is None or (info.layer is None and info.expert is None):
        return repr(key)
    parts = [f"layer {info.layer}"] if info.layer is not None else []
    parts += [f"expert {info.expert}"] if info.expert is not None else []
    parts += [f"tensor {_tensor(info)!r}"] if info.role == "expert" else []
    return f"{key!r} ({', '.join(parts)})"


def _problems(record: LoadRecord) -> tuple[dict[str, None], dict[str, tuple[Any, Any]], int]:
    """``(keys asked for and not held, key -> (held shape, asked shape) where they differ, keys
    held)``."""
    lacking: dict[str, None] = {}
    reshaped: dict[str, tuple[Any, Any]] = {}
    held_keys = 0
    for asked, held in record.loads:
        held_keys = max(held_keys, len(held))
        for key, shape in asked.items():
            if key not in held:
                lacking[key] = None
            elif shape is not None and held[key] is not None and shape != held[key]:
                reshaped[key] = (held[key], shape)
    return lacking, reshaped, held_keys


def named(exc: BaseException, text: str) -> bool:
    """Whether ``text`` (the framework's or DCP's own words) names a key this rank's load asked for
    and the checkpoint lacks: then those words already say what is missing, in the framework's
    terms (Megatron's ``KeyError: "chained_0.optimizer.state..."``)."""
    record = _of(exc)
    return record is not None and any(key in text for key in _problems(record)[0])


def explain(exc: BaseException, patterns: Sequence[Any] = (), *, shapes: bool = True) -> str:
    """What this rank's load asked for that the checkpoint lacks -- and, with ``shapes``, holds in
    another global shape -- in expert terms ("" when the load carries no record, or asked for
    nothing of the kind)."""
    from conformance.inspection import DEFAULT_PATTERNS, classify_keys

    record = _of(exc)
    if record is None:
        return ""
    lacking, reshaped, held_keys = _problems(record)
    reshaped = reshaped if shapes else {}
    if not lacking and not reshaped:
        return ""
    infos = classify_keys([*lacking, *reshaped], patterns or DEFAULT_PATTERNS)
    parts = []
    if lacking:
        keys = list(lacking)
        shown = ", ".join(_where(k, infos.get(k)) for k in keys[:SHOWN])
        more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
        parts.append(f"it asked for {len(keys)} key(s) the checkpoint lacks: {shown}{more} (the "
                     f"checkpoint holds {held_keys} keys)")
    if reshaped:
        key, (saved, wanted) = next(iter(reshaped.items()))
        more = f" (and {len(reshaped) - 1} more keys)" if len(reshaped) > 1 else ""
        parts.append(f"{_where(key, infos.get(key))}: it asked for global shape {list(wanted)}, "
                     f"the checkpoint holds {list(saved)}{more}")
    return "; ".join(parts)  # no rank: ranks that asked for the same keys say the same

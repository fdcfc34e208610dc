"""The optimizer's and the training state's scalars, in the same names at every EP degree.

``scalars`` (an adapter member) and ``state`` (``build``'s third element: LR schedulers, a
train-state dict) are read here into one flat ``name -> plain value`` mapping the ``scalars`` and
``resume`` checks compare with the ground truth's.  Nested state is walked: a mapping of schedulers
(one for the experts and one for the rest, as trainers keep them under EP) gives
``state.scheduler.experts.last_epoch`` beside the ep=1 truth's ``state.scheduler.last_epoch``; the
checks read such a name as the same field re-keyed (:func:`conformance.inspection.keys.field_of`),
not as one name missing and another unexpected.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: how deep nested training state is walked (a dict of schedulers is two levels).
DEPTH = 4
#: a param group's settings the scalars check compares, each group's by index (its state and
#: hyperparameters).
GROUP_SETTINGS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
#: a param group's settings that say how the optimizer computes, not what it holds: kernel choices a
#: trainer may make per layout (the fused kernel on plain tensors, a loop where the parameters are
#: DTensors).
KERNEL_CHOICES = frozenset({"fused", "foreach", "capturable", "differentiable"})


def is_configuration(name: str) -> bool:
    """Whether a scalar's name or a checkpoint's key is the optimizer's configuration, not its
    state: a param group's kernel choice (``optimizer.param_groups.0.fused``,
    ``param_groups.layers.0.w1.foreach``).  The one rule the ``scalars`` and ``resume`` checks
    (:func:`all_scalars`) and the checkpoint comparison
    (:func:`conformance.inspection.compare.compare_indexes`) read configuration by: neither compares
    it."""
    parts = name.split(".")
    return parts[-1] in KERNEL_CHOICES and "param_groups" in parts[:-1]


def plain(value: Any) -> Any:
    """A scalar-ish value as plain Python (a list for tuples and 0-d or small tensors), else
    ``None``."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        items = [plain(v) for v in value]
        return items if all(i is not None or v is None
                            for i, v in zip(items, value, strict=True)) else None
    if hasattr(value, "numel") and hasattr(value, "tolist") and value.numel() <= 16:
        return value.tolist()
    return None


def _walk(prefix: str, obj: Any, found: dict[str, Any], depth: int) -> None:
    fields_ = obj.state_dict() if callable(getattr(obj, "state_dict", None)) else obj
    if not isinstance(fields_, Mapping):
        value = plain(fields_)
        if value is not None or fields_ is None:
            found[prefix] = value
        return
    for name, value in sorted(fields_.items(), key=lambda kv: str(kv[0])):
        if depth and (isinstance(value, Mapping) or callable(getattr(value, "state_dict", None))):
            _walk(f"{prefix}.{name}", value, found, depth - 1)
            continue
        found_value = plain(value)
        if found_value is not None or value is None:
            found[f"{prefix}.{name}"] = found_value


def state_scalars(state: Mapping[str, Any] | None) -> dict[str, Any]:
    """The scalars of the training state beyond the optimizer, as ``state.<name>.<field>``.

    Each object's ``state_dict()`` (a torch LR scheduler: ``last_epoch``, ``base_lrs``,
    ``_last_lr``, ...), or a mapping's own items, walked into nested mappings and objects
    (``state.<name>.<key>.<field>``); values that are not plain scalars (tensors) are left out.
    """
    found: dict[str, Any] = {}
    for name, obj in sorted((state or {}).items()):
        _walk(f"state.{name}", obj, found, DEPTH)
    return found


def _is_torch_optimizer(obj: Any) -> bool:
    """A ``torch.optim.Optimizer`` by its shape (no torch import: the controller reads this module
    too)."""
    return (isinstance(getattr(obj, "param_groups", None), list)
            and isinstance(getattr(obj, "state", None), Mapping))


def optimizers_of(optimizer: Any) -> list[Any]:
    """The torch optimizers in ``optimizer``: itself, or a container's (a list, a dict, torchtitan's
    ``optimizers``, Megatron's ``chained_optimizers``, or a trainer's own object holding them as
    attributes under any name), in order; ``[]`` for ``None``."""
    if optimizer is None:
        return []
    if isinstance(optimizer, Mapping):
        return [o for value in optimizer.values() for o in optimizers_of(value)]
    if isinstance(optimizer, (list, tuple)):
        return [o for value in optimizer for o in optimizers_of(value)]
    for attr in ("chained_optimizers", "optimizers"):
        inner = getattr(optimizer, attr, None)
        if isinstance(inner, (list, tuple)):
            return [o for value in inner for o in optimizers_of(value)]
    if not _is_torch_optimizer(optimizer) and hasattr(optimizer, "__dict__"):
        # a trainer's own container: the optimizers among its attributes, whatever their names
        held = [o for value in vars(optimizer).values() for o in _held_optimizers(value)]
        if held:
            return held
    return [optimizer]


def _held_optimizers(value: Any) -> list[Any]:
    """The torch optimizers an attribute of a container is, or holds in a list or dict (one level).
    """
    if _is_torch_optimizer(value):
        return [value]
    items = (value.values() if isinstance(value, Mapping) else
             value if isinstance(value, (list, tuple)) else ())
    return [o for o in items if _is_torch_optimizer(o)]


def optimizer_state(optimizer: Any) -> dict[Any, Any]:
    """Every parameter's state across the optimizers in ``optimizer``."""
    state: dict[Any, Any] = {}
    for optim in optimizers_of(optimizer):
        state.update(optim.state)
    return state


def torch_optimizer_scalars(optimizer: Any) -> dict[str, Any]:
    """``scalars`` of a ``torch.optim`` optimizer or a container of several (:func:`optimizers_of`):
    each param group's hyperparameters, the groups numbered across the container in order, and the
    step counts of their state.

    The same names at every EP degree: groups by index, steps as the sorted set of distinct values.
    """
    found: dict[str, Any] = {}
    groups = [g for optim in optimizers_of(optimizer) for g in optim.param_groups]
    for i, group in enumerate(groups):
        for name in GROUP_SETTINGS:
            if name in group:
                value = group[name]
                found[f"param_groups.{i}.{name}"] = (list(value) if isinstance(value, tuple) else
                                                     float(value) if hasattr(value, "item")
                                                     else value)
    found["step"] = sorted({float(s["step"]) for s in optimizer_state(optimizer).values()
                            if "step" in s})
    return found


def all_scalars(adapter: Any, b: Any, optimizer: Any) -> dict[str, Any] | None:
    """The adapter's ``scalars`` and the training state's (:func:`state_scalars`) for a build ``b``
    (:class:`~conformance.adapter.Built`); ``None`` when there are neither.  ``adapter`` is the
    cell's (its ``members`` resolved by the controller)."""
    found = (dict(adapter.scalars(b.model, optimizer, **b.extra)) if adapter.members.has("scalars")
             else None)
    extra = state_scalars(b.training_state)
    if extra:
        found = {**(found or {}), **extra}
    return None if found is None else {k: v for k, v in found.items() if not is_configuration(k)}


__all__ = ["GROUP_SETTINGS", "KERNEL_CHOICES", "all_scalars", "is_configuration", "optimizer_state",
           "optimizers_of", "plain", "state_scalars", "torch_optimizer_scalars"]

"""A base for torch-native trainers' adapters: say where the experts live; keep your own build, save
and load.

Most of any adapter is four walks over the model in global expert terms: write
:func:`conformance.synthetic_weight` into every expert by global id, set
:func:`conformance.synthetic_grad` on every parameter and step, yield ``expert_tensors`` /
``other_tensors`` with the optimizer's moments, read the optimizer's scalars.  For a trainer whose
experts are torch parameters (torchtitan, OLMo-core, a research trainer on ``torch.distributed``)
they follow from one fact per parameter, which :meth:`TorchNativeAdapter.identify` (``model, fqn,
param``) gives as a :class:`Param`:

- ``experts="none"``: not an expert's (a router, a norm, a shared expert): ``(layer, name)``;
- ``experts="one"``: one expert's whole weight (one module per expert): its global id ``expert``;
- ``experts="packed"``: all experts' weights stacked on axis 0 (``[E, ...]``);
- ``experts="flat"``: all experts' weights as blocks of rows on axis 0 (``[E * rows, ...]``,
  OLMo-core's form).

A packed or flat parameter that is a DTensor places itself (its ``Shard(0)`` over ``ep``, FSDP's
shards on any dim); a plain tensor that holds only this rank's chunk gives the global id of its
first expert as ``first``, or this rank's place on ``ep`` as ``ep_place=(rank, ep)`` when the
framework splits by ``Shard(0)``'s chunk rule (:func:`reference_impl.layout.expert_range`; a chunk
that rule has no room for is a ``FrameworkRefusal``). The subclass keeps what differs between
frameworks: ``build_model(spec, mesh)`` (the framework's model, built and parallelized; the base
overwrites its values), ``build_optimizer(spec, model)`` (a torch optimizer or a container of
several: a list or dict of them, torchtitan's ``OptimizersContainer``, anything with ``optimizers``
or ``chained_optimizers``, a trainer's own object holding them as attributes), ``save``, ``load``,
and any optional member (``forward``).  A trainer with training state beyond its optimizer (a
schedule, a step counter) gives it by name from ``build_state(spec, model, optimizer)``;
``torch_optimizers(optimizer)`` and ``optimizer_step(optimizer, state)`` say where its torch
optimizers are and how it updates, when the defaults (found among the container's attributes; the
container's own ``step()`` and ``zero_grad()``) do not fit.

What the base then derives for every layout: ``build`` (synthetic weights by global id and the
cell's optimizer steps, :func:`conformance.adapter.run_steps`; ``(model, optimizer, state)`` when
there is state), ``step``, ``expert_tensors`` and ``other_tensors`` with every optimizer's moments,
and ``scalars`` (each group's settings and the step counts, numbered across the container; the
state's scalars the harness reads itself). Rows of a packed weight whose expert axis FSDP leaves
whole and whose inner dims it shards are per-expert DTensors
(:func:`reference_impl.regions.packed_rows`, the reference's own rule).  A flat weight whose FSDP
chunks end inside an expert is gathered (``full_tensor``), and each rank yields the experts it holds
rows of, whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from conformance.adapter import (
    ADAM_MOMENTS,
    FrameworkRefusal,
    Spec,
    TensorEntry,
    local_region,
    run_steps,
)
from conformance.scalars import optimizer_state, optimizers_of, torch_optimizer_scalars
from conformance.synthetic import synthetic_grad, synthetic_weight

#: ``make(layer, expert, name, shape) -> tensor``: the synthetic value of one tensor by global
#: identity.
Make = Callable[[Any, Any, str, tuple[int, ...]], Any]


@dataclass(frozen=True)
class Param:
    """Where one parameter sits in global terms (see the module docstring)."""

    layer: int | None
    name: str
    experts: str = "none"
    #: ``experts="one"``: the global id of the expert it is.
    expert: int | None = None
    #: ``"packed"`` / ``"flat"`` as a plain tensor holding one rank's chunk: the global id of its
    #: first expert.
    first: int | None = None
    #: ``"packed"`` as a plain tensor split by Shard(0)'s chunk rule:
    #: ``(this rank's place on ep, ep)``.
    ep_place: tuple[int, int] | None = None
    #: ``"packed"`` / ``"flat"``: the global expert count E.
    num_experts: int | None = None

    def __post_init__(self) -> None:
        if self.experts not in ("none", "one", "packed", "flat"):
            raise ValueError(f"Param {self.name!r}: experts={self.experts!r}; expected none, one, "
                             "packed or flat")
        if self.experts == "one" and self.expert is None:
            raise ValueError(f"Param {self.name!r}: experts='one' needs the expert's global id "
                             "(expert=)")
        if self.experts in ("packed", "flat") and not self.num_experts:
            raise ValueError(f"Param {self.name!r}: experts={self.experts!r} needs num_experts=E")


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def chunk_first(where: Param, rows: int) -> int | None:
    """The first global expert of a plain chunk of ``rows`` rows: ``where.first``, or from
    ``where.ep_place`` by the layout rule (all ``E`` rows are the whole axis, from expert 0),
    refused when the framework gave this rank rows that rule has no room for."""
    from reference_impl.layout import expert_range

    if where.ep_place is None:
        return where.first
    rank, ep = where.ep_place
    start, end = expert_range(int(where.num_experts or 0), ep, rank)
    if rows != end - start and rows != where.num_experts:
        raise FrameworkRefusal(
            f"{where.name!r} of layer {where.layer}: ep rank {rank} of {ep} holds a plain expert "
            f"tensor of {rows} rows where Shard(0)'s chunk rule (ceil(E/ep) per rank) gives it "
            f"experts [{start}, {end}) of E={where.num_experts}: the framework's split cannot "
            f"hold E={where.num_experts} at ep={ep}")
    return 0 if rows == where.num_experts else start


def placed(tensor: Any, where: Param) -> tuple[Any, tuple[slice, ...], tuple[int, ...]]:
    """``(local data, its region of the global tensor, the global shape)`` of a parameter or
    moment."""
    local, region = local_region(tensor)
    if region is not None:
        return local, region, tuple(tensor.shape)
    shape = tuple(tensor.shape)
    if where.experts == "packed":
        where = replace(where, first=chunk_first(where, shape[0]))
    if where.experts == "packed" and where.first is not None:
        full = (int(where.num_experts or 0), *shape[1:])
        if where.first + shape[0] > full[0]:
            raise ValueError(f"{where.name!r} of layer {where.layer}: {shape[0]} expert rows from "
                             f"global expert {where.first} run past E={full[0]}")
        return local, (slice(where.first, where.first + shape[0]),
                       *(slice(0, n) for n in shape[1:])), full
    if where.experts == "flat" and where.first is not None:
        raise ValueError(f"{where.name!r} of layer {where.layer}: a plain flat tensor holding one "
                         "rank's chunk does "
                         "not say its rows per expert; make it a DTensor, or name it packed")
    return local, tuple(slice(0, n) for n in shape), shape


def synthetic_full(where: Param, shape: tuple[int, ...], make: Make) -> Any:
    """The whole global tensor of ``where`` from ``make``, expert by expert for expert weights."""
    import torch

    if where.experts == "none":
        return make(where.layer, None, where.name, shape)
    if where.experts == "one":
        return make(where.layer, where.expert, where.name, shape)
    count = int(where.num_experts or 0)
    if where.experts == "packed":
        return torch.stack([make(where.layer, g, where.name, shape[1:]) for g in range(count)])
    rows = shape[0] // count
    return torch.cat([make(where.layer, g, where.name, (rows, *shape[1:])) for g in range(count)])


def _flat_rows(tensor: Any, where: Param) -> Iterator[tuple[int, Any]]:
    """``(global expert, whole per-expert block)`` of a flat weight on this rank; gathered where
    FSDP's chunks end inside an expert (decided from the placements alone, so every rank takes the
    same branch)."""
    import itertools

    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    local, region, shape = placed(tensor, where)
    rows = shape[0] // int(where.num_experts or 1)
    if any(r.start != 0 or r.stop != n for r, n in zip(region[1:], shape[1:], strict=True)):
        raise NotImplementedError(f"{where.name!r} of layer {where.layer}: this rank holds "
                                  f"{region} of a {shape} flat expert tensor: a split of its other "
                                  "dims")
    first, stop = region[0].start, region[0].stop
    cut = _is_dtensor(tensor) and any(
        offset[0] % rows or size[0] % rows
        for coordinate in itertools.product(*(range(n) for n in tensor.device_mesh.shape))
        for size, offset
        in [_compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh.shape,
                                                   list(coordinate), tensor.placements)])
    if cut:
        whole = tensor.full_tensor()
        for g in range(first // rows, -(-stop // rows) if stop > first else first // rows):
            yield g, whole[g * rows:(g + 1) * rows]
        return
    for i in range((stop - first) // rows):
        yield first // rows + i, local[i * rows:(i + 1) * rows]


def expert_rows(tensor: Any, where: Param) -> list[tuple[int, Any]]:
    """``(global expert, its tensor)`` for each expert of ``where`` this rank holds."""
    from reference_impl.regions import packed_rows

    if where.experts == "one":
        return [(int(where.expert or 0), tensor)]
    if where.experts == "packed":
        first = (where.first if _is_dtensor(tensor) else chunk_first(where, tensor.shape[0])) or 0
        return packed_rows(tensor, first, where=f"{where.name!r} of layer {where.layer}")
    return list(_flat_rows(tensor, where))


class TorchNativeAdapter:
    """The derived members of a torch-native trainer's adapter (see the module docstring for what to
    give)."""

    moments: tuple[str, ...] = ADAM_MOMENTS
    #: the module the framework installs (``"torchtitan"``): ``version`` is its distribution's.
    distribution: str = ""
    #: the last part of the names of buffers that are state the way weights are (an expert bias):
    #: ``build`` gives them synthetic values by their layer, as it gives weights.
    synthetic_buffers: tuple[str, ...] = ()

    @property
    def version(self) -> str:
        from conformance.adapter import installed_version

        return installed_version(self.distribution) or "not installed"

    # -- what the framework's adapter gives --------------------------------------------------------
    def build_model(self, spec: Spec, mesh: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.build_model(spec, mesh)")

    def build_optimizer(self, spec: Spec, model: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.build_optimizer(spec, model)")

    def identify(self, model: Any, fqn: str, param: Any) -> Param:
        raise NotImplementedError(f"{type(self).__name__}.identify(model, fqn, param)")

    # -- what the framework's adapter may give -----------------------------------------------------
    def build_state(self, spec: Spec, model: Any, optimizer: Any) -> Mapping[str, Any] | None:
        """The training state beyond the optimizer, by name (an LR scheduler, a step counter:
        objects with ``state_dict()``, or mappings), which ``save``, ``load``, ``step`` and
        ``scalars`` then get as ``state=`` and the scalars check compares; ``None`` (the default):
        none."""
        return None

    def torch_optimizers(self, optimizer: Any) -> list[Any]:
        """The ``torch.optim`` optimizers in what ``build_optimizer`` returned, whose moments and
        settings the checks read: :func:`conformance.scalars.optimizers_of` finds them in a list, a
        dict, a container's ``optimizers`` or ``chained_optimizers``, or among a trainer's
        container's attributes; override it for any other place."""
        return optimizers_of(optimizer)

    def optimizer_step(self, optimizer: Any, state: Mapping[str, Any] | None = None) -> None:
        """The trainer's update once the gradients are set: the optimizer's own ``step()`` (a
        container's, which may step its schedule and count its iterations too), each torch LR
        scheduler of ``state`` that the container does not hold, then ``zero_grad()`` as the trainer
        calls it (no arguments).  Override it when the trainer does more (a counter of its own in
        ``state``)."""
        own = callable(getattr(optimizer, "step", None))
        parts = [optimizer] if own else self.torch_optimizers(optimizer)
        for part in parts:
            part.step()
        for scheduler in (state or {}).values():
            if _is_lr_scheduler(scheduler) and not _holds(optimizer, scheduler):
                scheduler.step()
        for part in [optimizer] if callable(getattr(optimizer, "zero_grad", None)) else parts:
            part.zero_grad()

    # -- what the base derives ---------------------------------------------------------------------
    def build(self, spec: Spec, mesh: Any, seed: int) -> tuple[Any, ...]:
        import torch

        model = self.build_model(spec, mesh)
        with torch.no_grad():
            self.fill(model,
                      lambda layer, expert, name, shape: synthetic_weight(seed, layer, expert, name,
                                                                          shape))
        if spec.optimizer_steps <= 0:
            return model, None
        optimizer = self.build_optimizer(spec, model)
        state = self.build_state(spec, model, optimizer)
        run_steps(lambda index: self.step(model, optimizer, seed, index, state=state), 0,
                  spec.optimizer_steps)
        return (model, optimizer) if state is None else (model, optimizer, state)

    def params(self, model: Any) -> Iterator[tuple[Any, Param]]:
        for fqn, p in model.named_parameters():
            yield p, self.identify(model, fqn, p)

    def identify_buffer(self, model: Any, fqn: str, buffer: Any) -> Param | None:
        """Where a persistent floating-point buffer sits: by default as :meth:`identify` says of its
        name, or by its name alone (no layer) when that cannot say; ``None`` leaves it out."""
        try:
            where = self.identify(model, fqn, buffer)
        except Exception:  # identify knows parameters: a buffer's name may be new to it
            return Param(None, fqn)
        return Param(where.layer, where.name)

    def buffers(self, model: Any) -> Iterator[tuple[Any, Param]]:
        """Every persistent floating-point buffer -- state a checkpoint holds like a weight (an
        expert bias, a running statistic) -- with where it sits; compared whole on every rank (a
        router's buffers are replicated, whatever splits the experts)."""
        for fqn, buffer in persistent_buffers(model):
            if buffer.is_floating_point():
                where = self.identify_buffer(model, fqn, buffer)
                if where is not None:
                    yield buffer, where

    def fill(self, model: Any, make: Make) -> None:
        """Every parameter's local data := its region of the global tensor ``make`` gives; and
        every buffer named in :attr:`synthetic_buffers` := ``make``'s whole tensor."""
        for p, where in self.params(model):
            local, region, shape = placed(p, where)
            local.copy_(synthetic_full(where, shape,
                                       make)[region].to(device=local.device, dtype=local.dtype))
        for buffer, where in self.buffers(model):
            if where.name.rsplit(".", 1)[-1] in self.synthetic_buffers:
                value = make(where.layer, None, where.name, tuple(buffer.shape))
                buffer.copy_(value.to(device=buffer.device, dtype=buffer.dtype))

    def set_grads(self, model: Any, seed: int, step: int) -> None:
        from torch.distributed.tensor import DTensor

        for p, where in self.params(model):
            local, region, shape = placed(p, where)
            full = synthetic_full(where, shape,
                                  lambda layer, g, name, s: synthetic_grad(seed, step, layer, g,
                                                                           name, s))
            grad = full[region].to(device=local.device, dtype=local.dtype).contiguous()
            if isinstance(p, DTensor):
                grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False,
                                          shape=p.shape, stride=p.stride())
            p.grad = grad

    def step(self, model: Any, optimizer: Any, seed: int, step: int,
             state: Mapping[str, Any] | None = None) -> None:
        """Synthetic grads, then the trainer's own update (:meth:`optimizer_step`)."""
        self.set_grads(model, seed, step)
        self.optimizer_step(optimizer, state)

    def scalars(self, model: Any, optimizer: Any,
                state: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The torch optimizers' settings and step counts; ``state``'s are read by the harness
        itself."""
        return torch_optimizer_scalars(self.torch_optimizers(optimizer))

    def expert_tensors(self, model: Any, optimizer: Any) -> Iterator[TensorEntry]:
        state = optimizer_state(self.torch_optimizers(optimizer))
        for p, where in self.params(model):
            if where.experts == "none":
                continue
            for name, tensor in {where.name: p,
                                 **{f"{where.name}.{m}": state[p][m] for m in self.moments
                                    if m in state.get(p, {})}}.items():
                for g, row in expert_rows(tensor, where):
                    yield TensorEntry(where.layer, g, name, row)

    def other_tensors(self, model: Any, optimizer: Any) -> Iterator[TensorEntry]:
        state = optimizer_state(self.torch_optimizers(optimizer))
        for p, where in self.params(model):
            if where.experts != "none":
                continue
            yield TensorEntry(where.layer, None, where.name, p)
            for m in self.moments:
                if m in state.get(p, {}):
                    yield TensorEntry(where.layer, None, f"{where.name}.{m}", state[p][m])
        for buffer, where in self.buffers(model):
            yield TensorEntry(where.layer, None, where.name, buffer)


def persistent_buffers(model: Any) -> Iterator[tuple[str, Any]]:
    """``(fqn, buffer)`` of every buffer ``model``'s state dict holds: a non-persistent one (a token
    counter) is no checkpoint's business."""
    for prefix, module in model.named_modules():
        skipped: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for name, buffer in getattr(module, "_buffers", {}).items():
            if buffer is not None and name not in skipped:
                yield (f"{prefix}.{name}" if prefix else name), buffer


def _is_lr_scheduler(obj: Any) -> bool:
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    # ReduceLROnPlateau steps on a metric the trainer measures: no step without one
    return isinstance(obj, LRScheduler) and not isinstance(obj, ReduceLROnPlateau)


def _holds(container: Any, obj: Any) -> bool:
    """Whether ``container`` holds ``obj`` as an attribute (or in a list or dict attribute): then
    its ``step`` is the container's to take."""
    for value in vars(container).values() if hasattr(container, "__dict__") else ():
        items = (value.values() if isinstance(value, Mapping) else
                 value if isinstance(value, (list, tuple)) else (value,))
        if any(item is obj for item in items):
            return True
    return False


def reshard(model: Any) -> None:
    """Every FSDP2 module of ``model`` back to its sharded parameters (after a forward outside
    training)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


__all__ = ["Make", "Param", "TorchNativeAdapter", "chunk_first", "expert_rows", "optimizer_state",
           "optimizers_of", "placed", "reshard", "synthetic_full"]

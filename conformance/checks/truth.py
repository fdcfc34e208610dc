"""The ground truth of a cell: the same model at ep=1 with seed A, built on this rank alone.

It is a pure function of the adapter and the spec (adapters must build deterministically), so each
rank process caches it per ``(adapter, spec)`` and many cells share one.  Besides the tensors it
holds the optimizer scalars, the forward output on the suite's batch, and the state after one more
step -- what a resumed run must reproduce.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from conformance.adapter import FORWARD_OUTPUT, AdapterError, NotApplicable, Spec
from conformance.checks.context import TimedAdapter
from conformance.checks.values import canonical
from conformance.checks.verdict import Key
from conformance.members import built
from conformance.rounding import ROUNDING_ULPS
from conformance.scalars import all_scalars
from conformance.synthetic import synthetic_batch
from conformance.world_state import nbytes, world_state

SEED_A = 1234
SEED_B = 5678
#: the forward check's tolerance, for each output tensor alike (EP sums the experts' parts in
#: another order than ep=1 does): ``|got - want| <= FORWARD_RTOL * |want| + FORWARD_ATOL *
#: max|want|`` elementwise.  Both terms scale with the tensor's own values, so an MoE layer's own
#: output (``forward``'s named form) of ~1e-6 is held to its scale, not to that of the residual
#: stream it is added to (see :func:`forward_tolerance`). Float32's; an output in a lower precision
#: (bf16 parameters) is held to its own (:func:`forward_rtol_atol`).
FORWARD_RTOL, FORWARD_ATOL = 1e-5, 1e-6


@dataclass
class Truth:
    #: whole tensors by ``(layer, expert, name)``, packed blocks kept whole
    #: (:class:`~conformance.checks.held.State`).
    tensors: Mapping[Key, Any]
    scalars: dict[str, Any] | None = None
    #: the forward on the suite's batch by output name (:func:`forward_outputs`), after the extra
    #: step when there is one (the check runs last).
    output: dict[str, Any] | None = None
    #: after one more optimizer step (``adapter.step``), for the resume check.
    next_tensors: Mapping[Key, Any] | None = None
    next_scalars: dict[str, Any] | None = None
    #: why the framework's forward cannot run on the truth (its NotApplicable), when it cannot.
    output_not_applicable: str | None = None

    def nbytes(self) -> int:
        """What this truth holds, for the world state's budget."""
        found = _held_bytes(self.tensors) + _held_bytes(self.next_tensors or {})
        return found + _held_bytes(self.output or {})


def _held_bytes(tensors: Mapping[Any, Any]) -> int:
    told = getattr(tensors, "nbytes", None)
    return int(told()) if callable(told) else sum(nbytes(t) for t in tensors.values())


def truth_spec(spec: Spec) -> Spec:
    """What the truth builds for a side's ``spec``: unsharded, no layout."""
    return replace(spec, fsdp=False, layout=None)


def batch_for(spec: Spec) -> Any:
    import torch

    return synthetic_batch(spec.dim, SEED_A, dtype=getattr(torch, spec.dtype))


def forward_outputs(result: Any, adapter: str) -> dict[str, Any]:
    """``forward``'s result as detached CPU copies by name: a tensor is :data:`FORWARD_OUTPUT`; a
    mapping (the named form, :func:`conformance.adapter.forward_with_layers`) keeps its names and
    order."""
    import torch

    found = {FORWARD_OUTPUT: result} if isinstance(result, torch.Tensor) else result
    if not isinstance(found, Mapping) or not found or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in found.items()):
        raise AdapterError(f"{adapter}.forward returned {type(result).__name__}; expected a tensor "
                           "or a non-empty mapping of output names (str) to tensors")
    return {name: t.detach().cpu().clone() for name, t in found.items()}


def forward_rtol_atol(dtype: Any) -> tuple[float, float]:
    """``(rtol, atol)`` for an output of ``dtype``: :data:`FORWARD_RTOL` and :data:`FORWARD_ATOL`
    for float32 and wider; a coarser float gets both at ``ROUNDING_ULPS x eps(dtype)`` (bf16:
    0.0625), the rounding rule of the state checks (:mod:`conformance.rounding`): its partial sums
    (expert TP's, EP's) round to its own precision, and a sum that cancels keeps few of its bits,
    while a wrong expert's output is off by its whole size."""
    import torch

    if not dtype.is_floating_point or torch.finfo(dtype).eps <= torch.finfo(torch.float32).eps:
        return FORWARD_RTOL, FORWARD_ATOL
    coarse = ROUNDING_ULPS * torch.finfo(dtype).eps
    return coarse, coarse


def forward_tolerance(want: Any) -> Any:
    """The elementwise tolerance :func:`forward_rtol_atol` gives ``want`` (float64): the one rule of
    the forward check."""
    rtol, atol = forward_rtol_atol(want.dtype)
    want = want.double().abs()
    scale = want.max() if want.numel() else want.new_zeros(())
    return rtol * want + atol * scale


#: the ground truths this process built, per adapter class, version and spec (the world state's).
_TRUTHS = world_state().store("ground truths")


def ground_truth(adapter: TimedAdapter, spec: Spec, rank: int) -> Truth:
    """The ep=1 build with seed A, on this rank alone (no communication), kept per adapter class,
    version and spec.  ``adapter`` is the cell's (its ``members`` resolved by the controller)."""
    spec = truth_spec(spec)
    return _TRUTHS.keep((adapter.members.of, str(adapter.version), spec),
                        lambda: _build(adapter, spec, rank))


def optimizer_positions(adapter: TimedAdapter, model: Any,
                        optimizer: Any) -> tuple[tuple[Any, ...], ...]:
    """Each torch optimizer's parameters by position, as the live optimizer holds them (its param
    groups in order; the FQN from the model's named parameters), each placed by what the adapter's
    walks yield at its address: the parameter itself (dense, or one expert's), or its rows (a
    packed weight, an expert per row).  The evidence that places optimizer state a trainer saves by
    position, however deep it nests it (:func:`conformance.inspection.positional.resolve`); nothing
    where the optimizer is no torch one, or the walks yield copies."""
    from conformance.scalars import optimizers_of

    find = getattr(adapter, "torch_optimizers", None)
    optimizers = find(optimizer) if callable(find) else optimizers_of(optimizer)
    named = getattr(model, "named_parameters", None)
    fqns = {id(p): fqn for fqn, p in named()} if callable(named) else {}
    at: dict[tuple[int, tuple[int, ...]], tuple[Any, Any, str]] = {}
    for walk in (adapter.expert_tensors, adapter.other_tensors):
        for entry in walk(model, optimizer):
            layer, expert, name, tensor = entry[:4]
            tensor = _plain(tensor)
            if tensor is not None and tensor.numel():
                at.setdefault((tensor.data_ptr(), tuple(tensor.shape)), (layer, expert, str(name)))
    found = []
    for opt in optimizers:
        params = [p for group in opt.param_groups for p in group["params"]]
        found.append(tuple(_placed(p, fqns.get(id(p), ""), at) for p in params))
    return tuple(found)


def _plain(tensor: Any) -> Any:
    """A parameter's data or a plain tensor, whose address says what it is; ``None`` for anything
    else (a DTensor's address is its shard's)."""
    import torch

    data = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
    return data if type(data) is torch.Tensor else None


def _placed(p: Any, fqn: str, at: dict[tuple[int, tuple[int, ...]], tuple[Any, Any, str]]) -> Any:
    """:class:`~conformance.inspection.positional.ParamAt` of one parameter (see
    :func:`optimizer_positions`); ``kind`` "" where the walks yield nothing at its address."""
    from conformance.inspection.positional import ParamAt

    shape = tuple(p.shape)
    p = _plain(p)
    if p is None or not p.numel():
        return ParamAt(fqn, shape, "")
    whole = at.get((p.data_ptr(), shape))
    if whole is not None:
        layer, expert, name = whole
        return ParamAt(fqn, shape, "dense" if expert is None else "per_expert", layer, expert,
                       name)
    step = p.stride(0) * p.element_size() if p.dim() > 1 else 0
    rows = [at.get((p.data_ptr() + i * step, shape[1:])) for i in range(shape[0])] if step else []
    if rows and all(r is not None and r[1] is not None for r in rows):
        layers = {r[0] for r in rows if r is not None}
        names = {r[2] for r in rows if r is not None}
        return ParamAt(fqn, shape, "packed", layers.pop() if len(layers) == 1 else None, None,
                       names.pop() if len(names) == 1 else "")
    return ParamAt(fqn, shape, "")


def _build(adapter: TimedAdapter, spec: Spec, rank: int) -> Truth:
    b = built(adapter.build(spec, None, SEED_A), f"{type(adapter).__name__}.build")
    model = b.model
    optimizer = b.optimizer if spec.optimizer_steps else None
    tensors = canonical(adapter, model, optimizer, rank).tensors()
    if optimizer is not None:
        tensors.positions = optimizer_positions(adapter, model, optimizer)
    truth = Truth(tensors)
    if optimizer is not None:
        truth.scalars = all_scalars(adapter, b, optimizer)
    if optimizer is not None and adapter.members.has("step"):
        adapter.step(model, optimizer, SEED_A, spec.optimizer_steps, **b.extra)
        truth.next_tensors = canonical(adapter, model, optimizer, rank).tensors()
        truth.next_scalars = all_scalars(adapter, b, optimizer)
    # last: a forward may leave a framework's model in another state (FSDP2 unsharded)
    if adapter.members.has("forward"):
        try:
            truth.output = forward_outputs(adapter.forward(model, batch_for(spec)),
                                           type(adapter).__name__)
        except NotApplicable as exc:
            truth.output_not_applicable = ("the framework's forward cannot run on the ep=1 ground "
                                           f"truth: {exc}")
    return truth

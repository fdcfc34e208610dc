"""The adapter API: what a framework provides so the conformance matrix can check it.

A *checkpoint adapter* is any object with these members (a class or an instance; see README's
example adapter):

``name``, ``version``
    What the report calls the framework.
``capabilities``
    A :class:`Capabilities` (or a mapping with its fields): which cells apply.
``build(spec, mesh, seed) -> (model, optimizer | None)`` or ``(model, optimizer | None, state)``
    The framework's own MoE model at ``spec.layout`` (a :class:`~conformance.layout.ParallelLayout`:
    degrees and EP-group order; ``mesh`` is its DeviceMesh with dims ``dp_replicate``, ``ep``,
    ``dp_shard``, ``etp``, and ``pp`` first when ``spec.layout.pp > 1`` -- then the rank builds only its
    stage's layers, :meth:`~conformance.layout.ParallelLayout.layers_of`, under their global index, and
    ``expert_tensors``/``other_tensors`` name them so).  ``mesh=None`` asks for the unsharded ep=1 model
    built on this rank alone (the suite's ground truth).  Global expert weights depend only on ``seed``; when
    ``spec.optimizer_steps > 0`` the adapter has run that many steps of the framework's optimizer at
    learning rate ``spec.lr`` with gradients from :func:`conformance.synthetic_grad` (see
    :func:`run_steps`).  ``state`` is optional: a mapping of the rest of the training state by name
    (an LR scheduler, a train-state dict) -- see *Training state* below.
    :meth:`~conformance.layout.ParallelLayout.framework_mesh` gives the mesh with only the dims > 1,
    named as the framework names them; :meth:`~conformance.layout.ParallelLayout.rank_grid` and
    ``ep_groups`` give the ranks for frameworks that form their own groups.  Whatever the adapter
    builds, the harness checks that each rank reports the experts the layout gives its EP rank.
``save(model, optimizer, path)`` / ``load(model, optimizer, path)``
    The framework's real checkpoint path.  In model-only cells ``optimizer`` is ``None`` -- unless
    ``capabilities.model_saves_optimizer``: then it is the optimizer ``build`` made at step 0, as a
    trainer whose save always includes one needs (the checks still ignore it).
``expert_tensors(model, optimizer)`` / ``other_tensors(model, optimizer)``
    Yield ``(layer, global_expert_id, name, tensor)`` for this rank's experts (weights and their
    optimizer moments) and for everything else (``global_expert_id=None``).  A DTensor is compared
    through its local shard; a plain tensor must be the whole per-expert (or whole) tensor.  A packed
    weight (or moment) may be yielded as one :class:`ExpertBlock` instead of a row per expert: the
    harness reads its rows without a tensor per expert, which at hundreds of experts is most of a cell's checks.

Optional members (a check that needs one is ``n/a`` without it, with the reason):

``step(model, optimizer, seed, step)``
    One more optimizer step with :func:`conformance.synthetic_grad` gradients for step index ``step``:
    the resume check compares the step after a load with the ground truth's.
``scalars(model, optimizer) -> dict``
    Optimizer scalars by name (step counts, each param group's lr, betas, weight decay, eps; a
    scheduler's state), the same names at every layout.
``forward(model, batch) -> tensor | {name: tensor}``
    The framework's forward on :func:`conformance.synthetic.synthetic_batch` (tokens through the
    router): checks the model the framework will really run.  The named form (:func:`forward_with_layers`)
    adds each MoE layer's own output to the model's: behind a residual stream a layer's part can sit
    below the stream's rounding, and only the layer's output then shows a wrong dispatch.  Every
    output is held to a tolerance of its own scale (:func:`conformance.checks.truth.forward_tolerance`).
``read_checkpoint(path) -> dict``
    A non-DCP checkpoint's content as key -> tensor or value in global form (DCP is read directly).
``ep_dependent_keys``
    Regexes of checkpoint keys that legitimately differ with the EP degree (listed in the report).
``check_saved(model, path)`` / ``refusal_errors``
    The framework's refusal of a lossy checkpoint: a guard called before the load, and the exception
    types its load raises as a refusal.  A legacy cell passes only on one of these.
``save_legacy(model, optimizer, path)``
    The framework's old, lossy save, for the legacy-refusal cell.
``end_cell()``
    Called on each rank when its part of a cell ends, whatever happened in it (after its last check, or after it
    raised): release what the cell's builds set up and the checks after the load still needed -- process groups
    that a framework's layers keep (Megatron's), so that ``forward`` after a load can run on them.  (A rank still
    waiting in a collective when another rank's failure replaces the world ends with its process.)
A member that cannot run in one cell (``forward`` on a GPU-only kernel, say) raises :class:`NotApplicable` with
what stops it, alike on every rank: the check is skipped with that reason in the cell's record.

``preload``
    Module names the rank fork server imports once (the framework itself), so no cell pays for
    importing it.
``expert_keys``
    Regexes naming the checkpoint's expert keys (the ``--expert-key`` form of ``moe-ep-inspect``: a
    named group ``expert`` for per-expert keys, none for packed keys).  Rarely needed: the checkpoint
    check learns which keys (and packed rows) hold which experts from the ep=1 save's *content*; names
    are only hints, for experts stored in a form the values do not show (fused, transposed).

*Training state.*  When ``build`` returns a third element ``state`` (a mapping name -> object), the
harness passes it as the keyword ``state=`` to ``save``, ``load``, ``step`` and ``scalars`` of that
model -- and only then, so two-element adapters are called as before.  ``build`` gets the spec, so
whatever a real save needs (``spec.lr``, the scheduler) can ride in ``state``.  The ``scalars``
check compares, besides the adapter's own ``scalars``, every object in ``state``: a torch LR
scheduler's ``state_dict()`` (``last_epoch``, ``base_lrs``, ``_last_lr``, ...) and a mapping's plain
values, as ``state.<name>.<field>``.

*Capabilities mean what they say.*  A capability the framework does not have at all is declared
``False`` (its cells are ``n/a`` with the reason).  ``uneven=True`` means "run it": a framework that
refuses ``E % ep != 0`` loudly is declared ``uneven=True`` and its refusal is an ``error`` cell whose
first line is the framework's own message (a finding about the framework, not a crash of the
harness) -- declare ``uneven=False`` only when the framework has no such configuration at all.  The
same rule for legacy cells: they exist only with ``save_legacy`` (the framework's own old, lossy
save); a framework that never had a separate old save omits it and its legacy cells are ``n/a``.

Helpers a framework's own adapter may use: :data:`ADAM_MOMENTS`, :func:`world_device`,
:func:`run_steps`, :func:`installed_version`, :func:`local_region`, :func:`forward_with_layers`.  A trainer whose
experts are torch parameters can leave most of the members to :mod:`conformance.adapters.torch_native`.  How the
harness takes an adapter -- finds it, checks it, resolves its members once -- is :mod:`conformance.members`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from conformance.layout import ParallelLayout
from conformance.scalars import state_scalars, torch_optimizer_scalars

__all__ = [
    "ADAM_MOMENTS",
    "FORWARD_OUTPUT",
    "REQUIRED_MEMBERS",
    "AdapterError",
    "Built",
    "Capabilities",
    "CheckpointAdapter",
    "ExpertBlock",
    "HeldTensor",
    "NotApplicable",
    "OptionalMembers",
    "Spec",
    "TensorEntry",
    "built",
    "forward_with_layers",
    "held_tensors",
    "installed_version",
    "local_region",
    "run_steps",
    "state_scalars",
    "torch_optimizer_scalars",
    "with_moments",
    "world_device",
]

REQUIRED_MEMBERS = ("name", "version", "capabilities", "build", "save", "load", "expert_tensors",
                    "other_tensors")
OPTIONAL_MEMBERS = ("step", "scalars", "forward", "read_checkpoint", "ep_dependent_keys", "check_saved",
                    "refusal_errors", "save_legacy", "preload", "expert_keys", "end_cell")
#: the optimizer state every Adam-family optimizer keeps per parameter.
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
#: the name of the model's output in ``forward``'s results (a plain tensor's, and the named form's).
FORWARD_OUTPUT = "output"


class AdapterError(Exception):
    """The adapter cannot be used: the message says what is missing or what was tried."""


class FrameworkRefusal(RuntimeError):
    """Raised by an adapter that finds the framework cannot do what the cell asks (a split it cannot form, a load
    that found nothing) although no framework code raised: the cell is ``refused``, as a framework's own raise is,
    not an ``error`` of the adapter's code.  Raise it ``from`` the framework's error when there is one."""


@dataclass(frozen=True)
class Spec:
    """The model a cell asks an adapter to build.  ``dtype`` is a torch dtype name ("float32")."""

    num_layers: int = 2
    num_experts: int = 4
    dim: int = 16
    hidden: int = 32
    kind: str = "unpacked"
    activation: str = "swiglu"
    top_k: int = 2
    shared_expert: bool = True
    dtype: str = "float32"
    optimizer_steps: int = 0
    #: the optimizer's learning rate: configuration, the same on the save and the load side (a real resume keeps
    #: its configuration; the load side's other *state* -- seed, step count, schedule position -- is what differs).
    lr: float = 1e-2
    #: compose FSDP2 over the mesh's ``dp_shard`` dim (and ``dp_replicate``: HSDP) after the EP split.
    fsdp: bool = False
    #: the rank layout to build at (``None``: the unsharded ground truth).
    layout: ParallelLayout | None = None


@dataclass(frozen=True)
class Capabilities:
    """What an adapter supports; a cell outside them is reported ``n/a`` with the reason."""

    kinds: tuple[str, ...]
    optimizer: bool
    fsdp: bool
    uneven: bool
    max_ep: int
    format: str
    #: a checkpoint saved in one layer kind loads into the other (packed <-> unpacked).
    cross_kind: bool = False
    #: which EP-group orders the framework forms (see :mod:`conformance.layout`).
    ep_orders: tuple[str, ...] = ("strided",)
    #: HSDP: FSDP2 over ``dp_replicate`` x ``dp_shard``.
    hsdp: bool = False
    #: expert tensor parallelism: each expert's weights split over ``etp`` ranks.
    etp: bool = False
    #: the framework's save and load need its optimizer even in model-only cells (built at step 0).
    model_saves_optimizer: bool = False
    #: EP without FSDP2 (``False``: the framework composes EP only with FSDP2, so EP-only cells are n/a).
    ep_only: bool = True
    #: the pipeline-parallel degrees the framework builds (``mesh["pp"]``, the outermost dim): each stage holds the
    #: layers :func:`reference_impl.layout.stage_layers` gives, named by their global index.  Absent: pp=1 only.
    pp: tuple[int, ...] = (1,)


def world_device(mesh: Any) -> Any:
    """The device an adapter builds on: the mesh's (cuda under NCCL), and for the ground truth (no mesh) the
    world's, so the truth's optimizer runs the same kernels as the model it is compared with."""
    import torch
    import torch.distributed as dist

    if mesh is not None:
        kind = mesh.device_type
    else:
        kind = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


def local_region(tensor: Any) -> tuple[Any, tuple[slice, ...] | None]:
    """``(local data, its region of the global tensor)`` of a DTensor; a plain tensor is whole (``None``).

    The reference's one rule for it (:func:`reference_impl.regions.local_region`), for adapters to share.
    """
    from reference_impl.regions import local_region as reference_local_region

    return reference_local_region(tensor)


def run_steps(step: Callable[[int], None], first: int, count: int) -> None:
    """``count`` optimizer steps with indices ``first, first + 1, ...``: the one loop every adapter's build and
    the resume check share, so step indices (and with them :func:`conformance.synthetic_grad`) agree."""
    for index in range(first, first + count):
        step(index)


def forward_with_layers(run: Callable[[], Any], layers: Mapping[str, Any]) -> dict[str, Any]:
    """``forward``'s named form: ``{"output": run(), name: that module's output, ...}``, each named module's own
    output (a tuple's first element) caught by a forward hook while ``run`` runs the model.

    For models whose MoE layers add to a residual stream (DeepSpeed's test models: a layer's ~1e-6 on a stream of
    ~3, below its rounding): the layer's output, held to its own scale, shows what the stream hides.  Each module
    must run exactly once in ``run``.
    """
    if FORWARD_OUTPUT in layers:
        raise AdapterError(f"forward_with_layers: {FORWARD_OUTPUT!r} names the model's output, not a layer")
    caught: dict[str, Any] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(module: Any, args: Any, output: Any) -> None:
            if name in caught:
                raise AdapterError(f"forward_with_layers: layer {name!r} ran more than once in one forward")
            caught[name] = (output[0] if isinstance(output, (tuple, list)) else output).detach()
        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in layers.items()]
    try:
        output = run()
    finally:
        for handle in handles:
            handle.remove()
    missing = [name for name in layers if name not in caught]
    if missing:
        raise AdapterError(f"forward_with_layers: layers {missing} did not run in the forward")
    return {FORWARD_OUTPUT: output, **caught}


@functools.cache
def installed_version(module: str) -> str:
    """The installed version of the distribution that provides ``module`` ("" when unknown).

    Kept per process: ``packages_distributions()`` reads every installed distribution's file list (0.7 s with the
    frameworks installed), and an adapter whose ``version`` asks it paid that for every ground truth it looked up.
    """
    from importlib import metadata

    top = module.split(":")[0].split(".")[0]
    for dist in metadata.packages_distributions().get(top, []):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return ""


class Built(NamedTuple):
    """What ``build`` returned: the model, its optimizer (or ``None``) and the rest of the training state."""

    model: Any
    optimizer: Any
    state: Mapping[str, Any] | None = None

    @property
    def extra(self) -> dict[str, Any]:
        """The keyword arguments ``save``/``load``/``step``/``scalars`` of this model get: ``state=`` if any."""
        return {} if self.state is None else {"state": self.state}


def built(result: Any, where: str = "build") -> Built:
    """``build``'s result as a :class:`Built`; anything but ``(model, optimizer[, state])`` is an AdapterError."""
    if isinstance(result, tuple) and len(result) in (2, 3):
        state = result[2] if len(result) == 3 else None
        if state is not None and not isinstance(state, Mapping):
            raise AdapterError(f"{where} returned a third element of type {type(state).__name__}; expected a "
                               "mapping of training-state objects by name (an LR scheduler, a train-state dict)")
        return Built(result[0], result[1], state)
    raise AdapterError(f"{where} returned {type(result).__name__}"
                       f"{f' of length {len(result)}' if isinstance(result, tuple) else ''}; expected "
                       "(model, optimizer) or (model, optimizer, state)")


# -- the contract, typed ---------------------------------------------------------------------------------------
class TensorEntry(NamedTuple):
    """One tensor ``expert_tensors`` / ``other_tensors`` yields: ``expert`` is the global id (``None`` for
    everything that is not an expert's)."""

    layer: int | None
    expert: int | None
    name: str
    tensor: Any


class ExpertBlock(NamedTuple):
    """A packed tensor's expert rows as one ``expert_tensors`` entry: row ``i`` is expert ``first + i``.

    ``tensor`` is the weight (or moment) as the model holds it: a plain tensor of this rank's rows, ``first`` its
    first expert; or a DTensor, ``first`` the id of its global row 0 (its rows cover that expert onwards), each
    row split as its placements split it (expert TP, FSDP) -- :func:`reference_impl.regions.block_rows`, the
    reference's own row rule.  Equivalent to a :class:`TensorEntry` per row, without a tensor made per expert.
    """

    layer: int | None
    first: int
    name: str
    tensor: Any


class HeldTensor(NamedTuple):
    """One tensor of this rank as the checks read it: its key, its local data and its region (``None``: whole)."""

    layer: int | None
    expert: int | None
    name: str
    local: Any
    region: tuple[slice, ...] | None


class HeldBlock(NamedTuple):
    """An :class:`ExpertBlock` as the checks read it: row ``i`` of ``local`` is expert ``first + i``, each row at
    ``region`` of its expert's whole tensor (``None``: whole)."""

    layer: int | None
    first: int
    name: str
    local: Any
    region: tuple[slice, ...] | None


def held_blocks(entries: Iterable[Any], copy: bool = False) -> Iterator[HeldTensor | HeldBlock]:
    """``expert_tensors`` / ``other_tensors`` entries as :class:`HeldTensor`, an :class:`ExpertBlock` as one
    :class:`HeldBlock`: the one place the harness turns what an adapter yields into tensors (the layout check reads
    only a block's ids, from the same :func:`~reference_impl.regions.block_region`).  ``copy``: each local tensor a
    detached CPU copy (a block copied once)."""
    from reference_impl.regions import block_region
    from reference_impl.regions import local_region as reference_local_region

    for entry in entries:
        if isinstance(entry, ExpertBlock):
            local, first, region = block_region(entry.tensor, entry.first, where=f"{entry.name!r} of layer "
                                                                                 f"{entry.layer}")
            yield HeldBlock(entry.layer, first, entry.name, local.detach().cpu().clone() if copy else local, region)
            continue
        layer, expert, name, tensor = entry
        local, region = reference_local_region(tensor)
        yield HeldTensor(layer, expert, name, local.detach().cpu().clone() if copy else local, region)


def held_tensors(entries: Iterable[Any], copy: bool = False) -> Iterator[HeldTensor]:
    """:func:`held_blocks` a row each: a block's rows are views of its one (copied) local tensor."""
    for held in held_blocks(entries, copy):
        if isinstance(held, HeldBlock):
            for i in range(held.local.shape[0]):
                yield HeldTensor(held.layer, held.first + i, held.name, held.local[i], held.region)
        else:
            yield held


@runtime_checkable
class CheckpointAdapter(Protocol):
    """The required members of a checkpoint adapter (see the module docstring for what each must do).

    An outside framework's adapter can be type-checked against it; the optional members are in
    :class:`OptionalMembers`.  A class with these members is an adapter: nothing needs to inherit from this.
    """

    name: str
    version: str
    capabilities: Capabilities | Mapping[str, Any]

    def build(self, spec: Spec, mesh: Any, seed: int) -> tuple[Any, ...]: ...
    def save(self, model: Any, optimizer: Any, path: str) -> None: ...
    def load(self, model: Any, optimizer: Any, path: str) -> None: ...
    def expert_tensors(self, model: Any, optimizer: Any) -> Iterable[tuple[int | None, int | None, str, Any]]: ...
    def other_tensors(self, model: Any, optimizer: Any) -> Iterable[tuple[int | None, None, str, Any]]: ...


class OptionalMembers(Protocol):
    """The optional members, as a checker sees them (an adapter has any subset of these)."""

    ep_dependent_keys: Sequence[str]
    refusal_errors: tuple[type[BaseException], ...]
    preload: Sequence[str]
    expert_keys: Sequence[str]

    def step(self, model: Any, optimizer: Any, seed: int, step: int) -> None: ...
    def scalars(self, model: Any, optimizer: Any) -> dict[str, Any]: ...
    def forward(self, model: Any, batch: Any) -> Any: ...
    def read_checkpoint(self, path: str) -> dict[str, Any]: ...
    def check_saved(self, model: Any, path: str) -> None: ...
    def save_legacy(self, model: Any, optimizer: Any, path: str) -> None: ...
    def end_cell(self) -> None: ...


def with_moments(layer: int | None, experts: Iterable[tuple[int, Any]], name: str, state: Mapping[Any, Any],
                 param: Any, rows: Callable[[Any], Iterable[tuple[int, Any]]] | None = None,
                 moments: Sequence[str] = ADAM_MOMENTS) -> Iterator[TensorEntry]:
    """A parameter's expert tensors and their optimizer moments: the loop every adapter's ``expert_tensors`` writes.

    ``experts`` gives ``(global id, tensor)`` of ``param``'s experts; each moment ``state[param][m]`` is cut the
    same way by ``rows`` (default: the moment's row ``i`` for the ``i``-th expert of ``experts``).
    """
    found = list(experts)
    for g, tensor in found:
        yield TensorEntry(layer, g, name, tensor)
    for moment in moments:
        held = state.get(param, {}).get(moment) if hasattr(state.get(param, {}), "get") else None
        if held is None:
            continue
        cut = rows(held) if rows is not None else ((g, held[i]) for i, (g, _) in enumerate(found))
        for g, tensor in cut:
            yield TensorEntry(layer, g, f"{name}.{moment}", tensor)


# -- a check the framework cannot run in one cell (a self-contained block: issue 21) ----------------------
class NotApplicable(Exception):
    """Raised by an optional member (``forward``) when the framework cannot run it in this cell.

    The message names what stops it (a GPU-only kernel, a dispatcher that cannot split E % ep != 0, ...);
    the check is then recorded as skipped with that reason (the record's ``skipped_checks``) instead of
    erroring the cell.  Every rank must raise it alike -- decided from the spec and mesh, or from a framework
    error every rank hits before any collective -- so no rank waits in a collective the others left.
    """

"""The adapter contract: what a framework provides so the conformance matrix can check it.

A *checkpoint adapter* is any object (a class or an instance) with the members of
:class:`CheckpointAdapter`, and any subset of those of :class:`OptionalMembers`.  Nothing needs to
inherit from either: they are typed Protocols, and each member is documented once, in its own
docstring below.  Everything that needs a list of members derives it from these two classes
(:func:`members` and :func:`framework_calls`): how the harness takes an adapter
(:mod:`conformance.members`), the timing of its calls, the rule that a framework's exception is a
refusal, and docs/adapters.md (a test compares the guide's member list with these Protocols).  The
complete, runnable example is the built-in :mod:`conformance.adapters.reference`; a trainer whose
experts are torch parameters can leave most members to :mod:`conformance.adapters.torch_native`.

*Training state.*  When ``build`` returns a third element ``state`` (a mapping name -> object: an LR
scheduler, a train-state dict), the harness passes it as the keyword ``state=`` to ``save``,
``load``, ``step`` and ``scalars`` of that model -- and only then, so a two-element adapter's
members never get it. The ``scalars`` check compares every object in it: a torch LR scheduler's
``state_dict()`` and a mapping's plain values, as ``state.<name>.<field>``.

*Capabilities mean what they say.*  A capability the framework does not have at all is declared
``False`` (its cells are ``n/a`` with the reason).  ``uneven=True`` means "run it": a framework that
refuses ``E % ep != 0`` loudly declares ``uneven=True`` and its refusal is a ``refused`` cell whose
first line is the framework's own message.  Legacy cells exist only with ``save_legacy``.

*Who is to blame.*  An exception a :func:`framework_call` raises in the framework's code (or
torch's, DCP's) makes the cell ``refused``; one raised in the adapter's own code makes it ``error``.
An adapter that finds the framework cannot do what a cell asks, though no framework code raised,
raises :class:`FrameworkRefusal`.  A member that cannot run in one cell raises
:class:`NotApplicable`.

The helpers adapters share (:data:`ADAM_MOMENTS`, :func:`world_device`, :func:`run_steps`,
:func:`installed_version`, :func:`local_region`, :func:`forward_with_layers`, :func:`with_moments`)
are at the end of this module: they are not part of the contract.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

from conformance.layout import ParallelLayout
from conformance.scalars import state_scalars, torch_optimizer_scalars

__all__ = [
    "ADAM_MOMENTS",
    "FINETUNES",
    "FORWARD_OUTPUT",
    "HF_MEMBERS",
    "KINDS",
    "AdapterError",
    "Capabilities",
    "CheckpointAdapter",
    "ExpertBlock",
    "FrameworkRefusal",
    "HFModel",
    "NotApplicable",
    "OptionalMembers",
    "Spec",
    "TensorEntry",
    "forward_with_layers",
    "framework_call",
    "framework_calls",
    "installed_version",
    "local_region",
    "members",
    "run_steps",
    "state_scalars",
    "torch_optimizer_scalars",
    "with_moments",
    "world_device",
]

#: the expert forms a model's MoE layers come in (:attr:`Capabilities.kinds`).
KINDS = ("packed", "unpacked", "fused")
#: the fine-tuning setups a cell can ask for (:attr:`Capabilities.finetune`, :attr:`Spec.finetune`):
#: LoRA adapters on every expert's projections, routed and shared, over a frozen base that is
#: plain (``lora``) or holds its routed experts quantized -- MXFP4 blocks with e8m0 scales
#: (``lora+mxfp4``, as gpt-oss ships experts) or block FP8 with fp32 ``scale_inv`` (``lora+fp8``,
#: as DeepSeek-V3 does).  Only the adapters train; the blocks and scales are each expert's frozen
#: state, saved and moved with it.  Node ids carry the setup; ``-k`` takes ``lora``, ``mxfp4``,
#: ``fp8``.
FINETUNES = ("lora", "lora+mxfp4", "lora+fp8")
#: the optimizer state every Adam-family optimizer keeps per parameter.
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
#: the name of the model's output in ``forward``'s results (a plain tensor's, and the named form's).
FORWARD_OUTPUT = "output"
#: the optional members of a Hugging Face export: the HF checks run where an adapter has all four.
HF_MEMBERS = ("hf_model", "export_hf", "import_hf", "hf_forward")


class AdapterError(Exception):
    """The adapter cannot be used: the message says what is missing or what was tried."""


class FrameworkRefusal(RuntimeError):
    """The framework cannot do what the cell asks (a split it cannot form, a load that found
    nothing), though no framework code raised: the cell is ``refused``, as a framework's own raise
    is, not an ``error`` of the adapter.  Raise it ``from`` the framework's error when there is
    one."""


class NotApplicable(Exception):
    """Raised by an optional member when the framework cannot run it in this cell.

    The message names what stops it (a GPU-only kernel, a dispatcher that cannot split E % ep != 0);
    the check is recorded as skipped with that reason (the record's ``skipped_checks``) instead of
    failing the cell.  Every rank must raise it alike -- decided from the spec and mesh, or from a
    framework error every rank hits before any collective -- so no rank waits in a collective the
    others left.
    """


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
    #: a shared expert beside the routed ones: :attr:`Capabilities.shared_expert`, in every cell.
    shared_expert: bool = True
    dtype: str = "float32"
    optimizer_steps: int = 0
    #: the optimizer's learning rate: configuration, the same on the save and the load side (a real
    #: resume keeps its configuration; the load side's *state* -- seed, step count, schedule
    #: position -- is what differs).
    lr: float = 1e-2
    #: compose FSDP2 over the mesh's ``dp_shard`` dim (and ``dp_replicate``: HSDP) after the EP
    #: split.
    fsdp: bool = False
    #: the rank layout to build at (``None``: the unsharded ground truth).
    layout: ParallelLayout | None = None
    #: multi-token-prediction layers after the main stack, on the last pipeline stage: MTP layer
    #: ``i`` is global layer ``num_layers + i`` in ``expert_tensors`` / ``other_tensors``.
    mtp_layers: int = 0
    #: ``""``: every weight trains; else one of :data:`FINETUNES`: LoRA adapters of rank
    #: ``lora_rank`` and scale ``lora_alpha / lora_rank`` on every expert (routed and shared) over a
    #: frozen base (quantized for ``mxfp4`` / ``fp8``), their B nonzero from the seed (a zero B, as
    #: PEFT starts, would hide every misfiled adapter); only the adapters train and have optimizer
    #: state.
    finetune: str = ""
    lora_rank: int = 2
    lora_alpha: int = 4


@dataclass(frozen=True)
class Capabilities:
    """What an adapter supports; a cell outside them is reported ``n/a`` with the reason."""

    #: the expert forms it builds (:data:`KINDS`): ``packed`` (a weight per linear, ``[E, ...]``),
    #: ``unpacked`` (a module per expert), ``fused`` (packed, with gate and up in one weight).
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
    #: EP without FSDP2 (``False``: the framework composes EP only with FSDP2; EP-only cells are
    #: n/a).
    ep_only: bool = True
    #: the pipeline-parallel degrees the framework builds (``mesh["pp"]``, the outermost dim): each
    #: stage holds the layers :func:`reference_impl.layout.stage_layers` gives, named by their
    #: global index.  Absent: pp=1 only.
    pp: tuple[int, ...] = (1,)
    #: multi-token-prediction layers: the cells with pipeline stages and optimizer state build
    #: ``spec.mtp_layers`` of them (node ids say ``mtp``).
    mtp: bool = False
    #: the model family has a shared expert (an ungated dense FFN beside the routed experts); a
    #: family without one (Qwen3-MoE, gpt-oss) says ``False``, and every cell's spec then asks for
    #: none (:attr:`Spec.shared_expert`).  The ``setup`` check holds the build to it.
    shared_expert: bool = True
    #: the fine-tuning setups it builds (:data:`FINETUNES`): the cells of each ask for
    #: ``spec.finetune``; the others are ``n/a``.
    finetune: tuple[str, ...] = ()


class TensorEntry(NamedTuple):
    """One tensor ``expert_tensors`` / ``other_tensors`` yields: ``expert`` is the global id
    (``None`` for everything that is not an expert's)."""

    layer: int | None
    expert: int | None
    name: str
    tensor: Any


class ExpertBlock(NamedTuple):
    """A packed tensor's expert rows as one ``expert_tensors`` entry: row ``i`` is expert
    ``first + i``.

    ``tensor`` is the weight (or moment) as the model holds it: a plain tensor of this rank's rows,
    ``first`` its first expert; or a DTensor, ``first`` the id of its global row 0 (its rows cover
    that expert onwards), each row split as its placements split it (expert TP, FSDP) --
    :func:`reference_impl.regions.block_rows`, the reference's own row rule.  Equivalent to a
    :class:`TensorEntry` per row, without a tensor made per expert.
    """

    layer: int | None
    first: int
    name: str
    tensor: Any


@dataclass(frozen=True)
class HFModel:
    """The Hugging Face model an adapter's export is for (``hf_model``): what ``from_pretrained``
    loads it as."""

    #: the transformers class, by its name in ``transformers`` (``"Qwen3MoeForCausalLM"``).
    cls: str
    #: the config's fields, ``model_type`` among them: the export's ``config.json`` need not exist
    #: (torchtitan writes none), the check passes this config to ``from_pretrained``.
    config: Mapping[str, Any]
    #: regexes of keys the family's checkpoints carry that the class does not load (DeepSeek-V3's
    #: multi-token-prediction layer, filed as one more layer): not an unexpected key.
    extra_keys: tuple[str, ...] = ()
    #: the forward tolerance of :func:`conformance.checks.truth.forward_tolerance` times this: for a
    #: family whose transformers code computes a part another way (another attention kernel), by
    #: what the adapter measured; 1 for the same kernels.
    tolerance_scale: float = 1.0


F = TypeVar("F", bound=Callable[..., Any])
_FRAMEWORK_CALL = "__moe_ep_framework_call__"


def framework_call(member: F) -> F:
    """Marks a contract member that runs the framework's own code: its calls are timed as the
    framework's work, and an exception the framework raises in one makes the cell ``refused``."""
    setattr(member, _FRAMEWORK_CALL, True)
    return member


# -- the contract ----------------------------------------------------------------------------------
@runtime_checkable
class CheckpointAdapter(Protocol):
    """The required members of a checkpoint adapter."""

    #: what the report calls the framework.
    name: str
    #: the framework's version, as the report prints it (:func:`installed_version` finds it).
    version: str
    #: a :class:`Capabilities` (or a mapping with its fields): which cells apply.
    capabilities: Capabilities | Mapping[str, Any]

    @framework_call
    def build(self, spec: Spec, mesh: Any, seed: int) -> tuple[Any, ...]:
        """The framework's own MoE model at ``spec.layout``: ``(model, optimizer | None)`` or
        ``(model, optimizer | None, state)``.

        ``mesh`` is the layout's DeviceMesh with dims ``dp_replicate``, ``ep``, ``dp_shard``,
        ``etp`` (some of size 1), and ``pp`` first when ``spec.layout.pp > 1`` -- then the rank
        builds only its stage's layers (:meth:`~conformance.layout.ParallelLayout.layers_of`) under
        their global index. ``mesh=None`` asks for the unsharded ep=1 model built on this rank
        alone, with no collective (the ground truth).  Every expert's weights depend only on
        ``seed`` and its global id (:func:`conformance.synthetic_weight`); with
        ``spec.optimizer_steps > 0`` the framework's optimizer has run that many steps at
        ``spec.lr`` on :func:`conformance.synthetic_grad` gradients (:func:`run_steps`).  ``state``
        maps the rest of the training state by name. ``spec.layout.framework_mesh`` gives the mesh
        as the framework names its dims; ``rank_grid`` and ``ep_groups`` give the ranks to a
        framework that forms its own groups.  Whatever it builds, the harness checks that each rank
        reports the experts the layout gives its EP rank.
        """
        ...

    @framework_call
    def save(self, model: Any, optimizer: Any, path: str) -> None:
        """The framework's real checkpoint save into ``path`` (a directory the harness made).

        ``path`` may be the run's checkpoint root: the framework may write under a directory it
        names there (``step-100/``), and the harness finds the checkpoint under it.  In model-only
        cells ``optimizer`` is ``None``, unless ``capabilities.model_saves_optimizer``: then it is
        the optimizer ``build`` made at step 0.
        """
        ...

    @framework_call
    def load(self, model: Any, optimizer: Any, path: str) -> None:
        """The framework's real checkpoint load from ``path`` (as given to ``save``) into ``model``
        (and ``optimizer``), built at another layout with another seed."""
        ...

    def expert_tensors(self, model: Any, optimizer: Any) -> Iterable[TensorEntry | ExpertBlock]:
        """This rank's expert tensors -- weights, their optimizer moments and any per-expert buffer
        -- as :class:`TensorEntry` ``(layer, global expert id, name, tensor)`` or a packed tensor's
        rows as one :class:`ExpertBlock`.  A DTensor is compared through its local shard; a plain
        tensor must be the whole per-expert tensor."""
        ...

    def other_tensors(self, model: Any, optimizer: Any) -> Iterable[TensorEntry]:
        """Everything else this rank holds -- dense weights, their moments, persistent buffers such
        as a router's expert bias -- as :class:`TensorEntry` with ``expert=None``."""
        ...


class OptionalMembers(Protocol):
    """The optional members: an adapter has any subset.  A check that needs a missing one is ``n/a``
    with the reason."""

    #: regexes of checkpoint keys that legitimately differ with the EP degree (listed in the
    #: report).
    ep_dependent_keys: Sequence[str]
    #: exception types the framework's load raises to refuse a lossy checkpoint (a legacy cell
    #: passes on one of these, or on ``check_saved``).
    refusal_errors: tuple[type[BaseException], ...]
    #: module names the rank fork server imports once (the framework), so no cell pays for it.
    preload: Sequence[str]
    #: regexes naming the checkpoint's expert keys (a named group ``expert`` for per-expert keys,
    #: none for packed keys): hints for forms the values do not show (fused, transposed); the
    #: checkpoint check otherwise learns expert keys from the ep=1 save's content.
    expert_keys: Sequence[str]

    @framework_call
    def step(self, model: Any, optimizer: Any, seed: int, step: int) -> None:
        """One more optimizer step on :func:`conformance.synthetic_grad` gradients for step index
        ``step``: the ``resume`` check compares the step after a load with the ground truth's."""
        ...

    @framework_call
    def scalars(self, model: Any, optimizer: Any) -> dict[str, Any]:
        """Optimizer scalars by name (step counts, each param group's lr, betas, weight decay, eps;
        a scheduler's state), the same names at every layout: the ``scalars`` check."""
        ...

    @framework_call
    def forward(self, model: Any, batch: Any) -> Any:
        """The framework's forward on :func:`conformance.synthetic.synthetic_batch`: a tensor, or a
        mapping of named outputs (:func:`forward_with_layers`: the output and each MoE layer's own,
        for layers behind a residual stream too large for their part to show).  Each output is held
        to a tolerance of its own scale (:func:`conformance.checks.truth.forward_tolerance`)."""
        ...

    def read_checkpoint(self, path: str) -> dict[str, Any]:
        """A non-DCP checkpoint's content as key -> tensor or value in global form, for the
        ``checkpoint`` check (a DCP checkpoint is read directly)."""
        ...

    @framework_call
    def check_saved(self, model: Any, path: str) -> None:
        """The framework's guard against a lossy checkpoint, called before a legacy cell's load: it
        raises to refuse."""
        ...

    @framework_call
    def save_legacy(self, model: Any, optimizer: Any, path: str) -> None:
        """The framework's own old, lossy save, for the legacy cells (absent: they are ``n/a``)."""
        ...

    def hf_model(self, spec: Spec) -> HFModel:
        """The transformers class and config the framework's Hugging Face export of ``spec``'s model
        is for (``Qwen3MoeForCausalLM``, ...): the ``hf_export`` and ``hf_import`` checks load it
        with them.  Raise :class:`NotApplicable` for a model the framework cannot export."""
        ...

    @framework_call
    def export_hf(self, model: Any, path: str) -> None:
        """The framework's own Hugging Face export of ``model`` (at the cell's layout, a collective
        on every rank) into the directory ``path``: safetensors files and their index, as the
        framework writes them for a release (``config.json`` optional)."""
        ...

    @framework_call
    def import_hf(self, model: Any, path: str) -> None:
        """The framework's own load of a Hugging Face checkpoint (the ep=1 export) into ``model``,
        built at the cell's layout with another seed: every tensor the export holds, the expert
        bias included."""
        ...

    def hf_forward(self, hf_model: Any, batch: Any) -> Any:
        """What ``forward`` computes, by the transformers model loaded from the export (on one
        process, no mesh): the outputs of ``forward``'s that the family's model has, under the same
        names (``"output"`` among them)."""
        ...

    def end_cell(self) -> None:
        """Called on each rank when its part of a cell ends, whatever happened in it: release what
        the cell's builds set up that the checks after the load still needed (process groups a
        framework's layers keep, so ``forward`` after a load can run on them)."""
        ...


@functools.cache
def members(protocol: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(values, callables)`` of a contract Protocol, in the order it declares them: the one list
    of member names everything else derives from."""
    values = tuple(name for name in getattr(protocol, "__annotations__", {})
                   if not name.startswith("_"))
    callables = tuple(name for name, found in vars(protocol).items()
                      if callable(found) and not name.startswith("_"))
    return values, callables


@functools.cache
def framework_calls() -> frozenset[str]:
    """The members that run the framework's own code (:func:`framework_call`)."""
    return frozenset(name for protocol in (CheckpointAdapter, OptionalMembers)
                     for name in members(protocol)[1]
                     if getattr(getattr(protocol, name), _FRAMEWORK_CALL, False))


# -- helpers adapters share (not the contract) -----------------------------------------------------
def world_device(mesh: Any) -> Any:
    """The device an adapter builds on: the mesh's (cuda under NCCL), and for the ground truth (no
    mesh) the world's, so the truth's optimizer runs the same kernels as the model it is compared
    with."""
    import torch
    import torch.distributed as dist

    if mesh is not None:
        kind = mesh.device_type
    else:
        kind = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_region(tensor: Any) -> tuple[Any, tuple[slice, ...] | None]:
    """``(local data, its region of the global tensor)`` of a DTensor; a plain tensor is whole
    (``None``): the reference's one rule for it (:func:`reference_impl.regions.local_region`)."""
    from reference_impl.regions import local_region as reference_local_region

    return reference_local_region(tensor)


def run_steps(step: Callable[[int], None], first: int, count: int) -> None:
    """``count`` optimizer steps with indices ``first, first + 1, ...``: the one loop every
    adapter's build and the resume check share, so step indices (and the synthetic gradients)
    agree."""
    for index in range(first, first + count):
        step(index)


def forward_with_layers(run: Callable[[], Any], layers: Mapping[str, Any]) -> dict[str, Any]:
    """``forward``'s named form: ``{"output": run(), name: that module's output, ...}``, each named
    module's own output (a tuple's first element) caught by a forward hook while ``run`` runs.

    For models whose MoE layers add to a residual stream (a layer's ~1e-6 on a stream of ~3, below
    its rounding): the layer's output, held to its own scale, shows what the stream hides.  Each
    module must run exactly once in ``run``.
    """
    if FORWARD_OUTPUT in layers:
        raise AdapterError(f"forward_with_layers: {FORWARD_OUTPUT!r} names the model's output, "
                           "not a layer")
    caught: dict[str, Any] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(module: Any, args: Any, output: Any) -> None:
            if name in caught:
                raise AdapterError(f"forward_with_layers: layer {name!r} ran more than once in one "
                                   "forward")
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
    """The installed version of the distribution that provides ``module`` ("" when unknown); kept
    per process, since reading every distribution's file list takes most of a second."""
    from importlib import metadata

    top = module.split(":")[0].split(".")[0]
    for dist in metadata.packages_distributions().get(top, []):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return ""


def with_moments(layer: int | None, experts: Iterable[tuple[int, Any]], name: str,
                 state: Mapping[Any, Any], param: Any,
                 rows: Callable[[Any], Iterable[tuple[int, Any]]] | None = None,
                 moments: Sequence[str] = ADAM_MOMENTS) -> Iterator[TensorEntry]:
    """A parameter's expert tensors and their optimizer moments: the loop every ``expert_tensors``
    writes.  ``experts`` gives ``(global id, tensor)`` of ``param``'s experts; each moment
    ``state[param][m]`` is cut the same way by ``rows`` (default: row ``i`` for the ``i``-th
    expert)."""
    found = list(experts)
    for g, tensor in found:
        yield TensorEntry(layer, g, name, tensor)
    held_state = state.get(param, {})
    for moment in moments:
        held = held_state.get(moment) if hasattr(held_state, "get") else None
        if held is None:
            continue
        cut = rows(held) if rows is not None else ((g, held[i]) for i, (g, _) in enumerate(found))
        for g, tensor in cut:
            yield TensorEntry(layer, g, f"{name}.{moment}", tensor)

"""Which checkpoint cells exist for an adapter, in which tier, and why a cell is ``n/a``.

A cell is one save/load experiment: save at one rank layout, load at another (each a
:class:`~conformance.layout.ParallelLayout`: EP degree, EP-group order, HSDP, expert tensor
parallelism), for a layer kind (packed, unpacked, or one kind saved and the other loaded), a state
(the model alone, or with its optimizer), with or without FSDP2, at ``num_experts`` experts.  Legacy
cells save the old, lossy way, and pass only when the framework refuses the checkpoint.  For an
adapter that builds multi-token-prediction layers (``Capabilities.mtp``), the cells with pipeline
stages and optimizer state build them too, on the last stage (node ids say ``mtp``).

Tiers (``--moe-ep-matrix=TIER``):

- ``full``: the whole cross product of those dimensions (release reports);
- ``default``: a deterministic covering subset that covers by what a cell tests
  (:func:`~conformance.covering.covering`): pairs among the cells that compare values, uneven
  splits at ep > 1 and optimizer state through every layout family; legacy cells, which end at the
  refusal, are their own stratum;
- ``1,2,4`` (EP degrees): the plain layouts at those degrees, in the adapter's (first) EP-group
  order: same-kind cells for every state, FSDP mode and EP pair at the first expert count; each kind
  loaded as the other (model+optimizer, EP only); the other expert counts where they are uneven
  (with FSDP2 for a framework that composes EP only with it); and legacy cells -- the shape
  adapters' own tests pin cell by cell.

A cell the adapter's capabilities rule out stays in the matrix as ``n/a`` with the reason -- nothing
is silently dropped.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from conformance.adapter import FINETUNES, KINDS, Capabilities, Spec
from conformance.covering import covering
from conformance.layout import ParallelLayout

#: (saved as, loaded as) for every layer-kind combination a cell can test.
KIND_PAIRS = (("packed", "packed"), ("unpacked", "unpacked"), ("packed", "unpacked"),
              ("unpacked", "packed"), ("fused", "fused"))
#: the multi-token-prediction layers a cell with pipeline stages builds for an adapter that has
#: them.
MTP_LAYERS = 1
STATES = ("model", "model+optim")
#: the expert count node ids leave unnamed (the matrix's first even count).
PLAIN_EXPERTS = 4
#: the layers a cell with pipeline stages on either side builds: 3 over 2 stages is the uneven split
#: (2, 1), where a stage map off by one shows itself (the stage rule puts layers 0-1 on stage 0 and
#: layer 2 on stage 1).
PIPELINE_LAYERS = 3
OPTIMIZER_STEPS = 2


class MatrixError(ValueError):
    """A matrix that cannot be made (bad tier, EP degrees that do not fit the world)."""


@dataclass(frozen=True)
class Cell:
    save_kind: str
    load_kind: str
    state: str
    fsdp: bool
    save: ParallelLayout
    load: ParallelLayout
    num_experts: int
    legacy: bool = False
    #: why the cell does not apply to this adapter; empty when it runs.
    na: str = ""
    #: whether both sides build :data:`MTP_LAYERS` multi-token-prediction layers: the cells with
    #: pipeline stages and optimizer state, where every part of an MTP layer's state moves (its
    #: weights, its moments, the stage it sits on) -- an MTP layer in every cell with stages cost
    #: the default tier a tenth of its time for nothing more.
    mtp: bool = False
    #: the fine-tuning setup both sides build (:data:`~conformance.adapter.FINETUNES`; ``""``: every
    #: weight trains): node ids carry it after the kind.
    finetune: str = ""

    @property
    def kind(self) -> str:
        return (self.save_kind if self.save_kind == self.load_kind
                else f"{self.save_kind}->{self.load_kind}")

    @property
    def save_ep(self) -> int:
        return self.save.ep

    @property
    def load_ep(self) -> int:
        return self.load.ep

    @property
    def pipeline(self) -> bool:
        """Whether either side has pipeline stages (pp > 1)."""
        return max(self.save.pp, self.load.pp) > 1

    @property
    def node_name(self) -> str:
        """The readable part of the node id, e.g.
        ``checkpoint::unpacked::model+optim::fsdp::ep2c->ep4``."""
        pair = f"{self.save.fragment}->{self.load.fragment}"
        experts = [] if self.num_experts == PLAIN_EXPERTS else [f"E{self.num_experts}"]
        if self.legacy:
            return "::".join(["checkpoint", "legacy", self.kind, *experts, pair])
        mtp = ["mtp"] if self.mtp else []
        finetune = [self.finetune] if self.finetune else []
        return "::".join(["checkpoint", self.kind, *finetune, self.state,
                          "fsdp" if self.fsdp else "ep-only", *mtp, *experts, pair])

    def keywords(self) -> set[str]:
        """``-k`` keywords (``-k`` cannot contain ``>``): each side's degrees, prefixed and
        plain."""
        words = {f"save_ep{self.save.ep}", f"load_ep{self.load.ep}", f"E{self.num_experts}",
                 f"kind_{self.kind}" if self.save_kind == self.load_kind else
                 f"cross_{self.save_kind}_to_{self.load_kind}"}
        for side, layout in (("save", self.save), ("load", self.load)):
            words |= layout.keywords() | {f"{side}_{w}" for w in layout.keywords()}
        if self.finetune:  # "lora", and the base's format: "mxfp4", "fp8"
            words |= {"finetune", *self.finetune.split("+")}
        return words | ({"mtp"} if self.mtp else set())

    def spec(self, base: Spec, side: str) -> Spec:
        """The model a side builds: the side's kind and layout, steps only with the optimizer."""
        steps = OPTIMIZER_STEPS if self.state == "model+optim" else 0
        kind, layout = (self.save_kind,
                        self.save) if side == "save" else (self.load_kind, self.load)
        layers = max(base.num_layers, PIPELINE_LAYERS) if self.pipeline else base.num_layers
        return replace(base, kind=kind, num_experts=self.num_experts, optimizer_steps=steps,
                       fsdp=self.fsdp,
                       layout=layout, num_layers=layers, mtp_layers=MTP_LAYERS if self.mtp else 0,
                       finetune=self.finetune)

    @property
    def save_key(self) -> tuple[object, ...]:
        """What the checkpoint this cell loads is a pure function of: cells with one key share one
        save (:mod:`conformance.saves`), and the covering counts that save once
        (:func:`covering`)."""
        return (self.save_kind, self.state, self.fsdp, self.save, self.num_experts, self.legacy,
                self.pipeline, self.mtp, self.finetune)

    def record(self) -> dict[str, object]:
        """The cell's fields in the report."""
        return {"kind": self.kind, "state": self.state, "fsdp": self.fsdp, "save_ep": self.save.ep,
                "load_ep": self.load.ep, "save_pp": self.save.pp, "load_pp": self.load.pp,
                "save_layout": self.save.fragment, "load_layout": self.load.fragment,
                "num_experts": self.num_experts, "legacy": self.legacy, "mtp": self.mtp,
                "finetune": self.finetune}


# -- applicability ---------------------------------------------------------------------------------
def _layout_na(layout: ParallelLayout, caps: Capabilities) -> str:
    if layout.pp not in caps.pp:
        supported = (f"pp in {', '.join(map(str, caps.pp))}" if len(caps.pp) > 1
                     else "no pipeline parallelism")
        return f"adapter supports {supported}, not pp={layout.pp}"
    if layout.ep > caps.max_ep:
        return f"adapter supports ep up to {caps.max_ep}"
    if layout.order_matters and layout.ep_order not in caps.ep_orders:
        return f"adapter forms {' or '.join(caps.ep_orders)} EP groups, not {layout.ep_order}"
    if layout.etp > 1 and not caps.etp:
        return "adapter does not support expert tensor parallelism (etp > 1)"
    if layout.hsdp and not caps.hsdp:
        return "adapter does not support HSDP (dp_replicate > 1)"
    return ""


def why_not(cell: Cell, caps: Capabilities) -> str:
    """Why ``cell`` does not apply to an adapter with ``caps`` ("" when it does)."""
    if cell.finetune and cell.finetune not in caps.finetune:  # first: one reason for all its cells
        return (f"adapter fine-tunes with {', '.join(caps.finetune)}, not {cell.finetune}"
                if caps.finetune else "adapter does not fine-tune (Capabilities.finetune: LoRA on "
                "the experts over a frozen, possibly quantized base)")
    for kind in dict.fromkeys((cell.save_kind, cell.load_kind)):
        if kind not in caps.kinds:
            return f"adapter supports layer kinds {', '.join(caps.kinds)}, not {kind}"
    if cell.save_kind != cell.load_kind and not caps.cross_kind:
        return ("adapter does not declare cross_kind (loading one layer kind's checkpoint into the "
                "other)")
    if cell.state == "model+optim" and not caps.optimizer:
        return "adapter does not support optimizer state"
    if cell.fsdp and not caps.fsdp:
        return "adapter does not support FSDP2"
    if not cell.fsdp and not caps.ep_only:
        return "adapter composes EP only with FSDP2 (no EP-only cells)"
    for layout in (cell.save, cell.load):
        found = _layout_na(layout, caps)
        if found:
            return found
    if not caps.uneven and any(cell.num_experts % ep for ep in (cell.save.ep, cell.load.ep)):
        return f"adapter does not support E % ep != 0 (E={cell.num_experts})"
    return ""


def unwritable_legacy(cell: Cell) -> str:
    """Why a rank-local (legacy) save cannot be written at all ("" when it can): nothing to refuse
    then.

    Under expert TP each EP rank's packed weight is a DTensor over its etp ranks whose global shape
    is that EP rank's row count; when E % ep != 0 the EP ranks hold different counts under one key,
    and DCP refuses the global plan of any such save, whichever framework writes it.
    """
    if (cell.legacy and cell.save_kind == "packed" and cell.save.etp > 1
        and cell.num_experts % cell.save.ep):
        return (f"a legacy (rank-local) save cannot be written here: at E={cell.num_experts}, "
                f"ep={cell.save.ep}, etp={cell.save.etp} the EP ranks hold different numbers of "
                "rows under each packed key, and DCP refuses the global plan (nothing to refuse on "
                "load)")
    return ""


def _valid(cell: Cell) -> bool:
    """Combinations that are not experiments at all (rather than unsupported ones) are never
    cells."""
    # the lossy save is lossy only at ep > 1, and is a same-kind, no-FSDP, no-stages experiment
    if cell.legacy:
        return (cell.save.ep > 1 and cell.save_kind == cell.load_kind and not cell.fsdp
                and not cell.pipeline
                and cell.save_kind != "fused")  # (the lossy save is the split forms' own)
    # HSDP is FSDP2 over replicate x shard
    return cell.fsdp or not (cell.save.hsdp or cell.load.hsdp)


# -- the cells -------------------------------------------------------------------------------------
def layouts(world_size: int) -> list[ParallelLayout]:
    """The rank layouts of a world: every EP degree, both EP-group orders, HSDP and etp=2 at ep=2,
    and two pipeline stages (pp=2, the outermost dim) over each plain layout of the half world
    (pp2.ep1 and pp2.ep2 at 4 ranks)."""
    found = _stage_layouts(world_size)
    if world_size % 2 == 0 and world_size >= 4:
        found += [replace(layout, pp=2) for layout in _stage_layouts(world_size // 2)
                  if layout.etp == 1 and not layout.hsdp]
    return found


def _stage_layouts(world_size: int) -> list[ParallelLayout]:
    """The pp=1 layouts of a ``world_size``-rank world (one stage's)."""
    found: list[ParallelLayout] = []
    for ep in (ep for ep in range(1, world_size + 1) if world_size % ep == 0):
        found.append(ParallelLayout.for_world(world_size, ep))
        consecutive = ParallelLayout.for_world(world_size, ep, ep_order="consecutive")
        if consecutive.order_matters:  # at ep=1 or ep=world the two orders are the same ranks
            found.append(consecutive)
    if world_size % 4 == 0:
        found.append(ParallelLayout.for_world(world_size, 2, dp_replicate=2))
        found.append(ParallelLayout.for_world(world_size, 2, etp=2))
    return found


def full_product(world_size: int, num_experts: tuple[int, ...]) -> list[Cell]:
    """Every valid cell (applicable or not), in a fixed order."""
    found = layouts(world_size)
    cells = []
    for (save_kind, load_kind), state, fsdp, experts, save, load, legacy in itertools.product(
            KIND_PAIRS, STATES, (False, True), num_experts, found, found, (False, True)):
        if legacy and state != STATES[-1]:
            continue  # one legacy cell per layout pair and kind: with the richest state
        cell = Cell(save_kind, load_kind, state, fsdp, save, load, experts, legacy)
        cell = replace(cell, mtp=cell.pipeline and state == "model+optim" and not legacy)
        if _valid(cell):
            cells.append(cell)
    return cells + _finetune_cells(found, num_experts)


def _finetune_cells(found: list[ParallelLayout], num_experts: tuple[int, ...]) -> list[Cell]:
    """Every fine-tuning cell: each setup of :data:`~conformance.adapter.FINETUNES` with each kind
    it applies to, saved and loaded in that kind (a LoRA checkpoint is loaded back by the trainer
    that wrote it), at every pair of one-stage layouts, each state, with and without FSDP2.  Stages
    split no expert's tensors (a stage holds whole layers), so their cells add nothing here; nor do
    legacy saves.  Block FP8 has no fused cells: DeepSeek-V3 ships gate and up apart, and a
    ``128 x 128`` tile of a fused weight would straddle its two halves."""
    one_stage = [layout for layout in found if layout.pp == 1]
    cells = []
    for setup, kind, state, fsdp, experts, save, load in itertools.product(
            FINETUNES, KINDS, STATES, (False, True), num_experts, one_stage, one_stage):
        if setup.endswith("fp8") and kind == "fused":
            continue
        cell = Cell(kind, kind, state, fsdp, save, load, experts, finetune=setup)
        if _valid(cell):
            cells.append(cell)
    return cells


def ep_tier(world_size: int, eps: list[int], num_experts: tuple[int, ...], ep_order: str,
            uneven_fsdp: bool = False, kinds: tuple[str, ...] = KINDS) -> list[Cell]:
    """The ``--moe-ep-matrix=1,2,4`` shape (see the module docstring), in a fixed order;
    ``uneven_fsdp``: the uneven cells with FSDP2 (for a framework that composes EP only with FSDP,
    whose EP-only cells are all n/a); ``kinds``: the layer kinds it has cells of."""
    plain = [ParallelLayout.for_world(world_size, ep, ep_order=ep_order) for ep in eps]
    pairs = [(s, t) for s in plain for t in plain]
    first, *others = num_experts
    cells = [Cell(kind, kind, state, fsdp, s, t, first) for kind in kinds for state in STATES
             for fsdp in (False, True) for s, t in pairs]
    cells += [Cell(a, b, "model+optim", False, s, t, first) for a, b in KIND_PAIRS if a != b
              for s, t in pairs]
    cells += [Cell(kind, kind, "model+optim", uneven_fsdp, s, t, e) for e in others
              for kind in kinds for s, t in pairs if e % s.ep or e % t.ep]
    wide = [layout for layout in plain if layout.ep > 1]
    if wide:
        cells += [Cell(kind, kind, "model+optim", False, wide[0], t, first, legacy=True)
                  for kind in kinds if kind != "fused" for t in plain]
    return cells


def parse_tier(text: str | None, world_size: int) -> tuple[str, list[int] | None]:
    """``--moe-ep-matrix``'s value: ``("default"|"full", None)`` or ``("eps", [1, 2, 4])``."""
    if text in (None, "", "default", "full"):
        return (text or "default"), None
    try:
        eps = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as exc:
        raise MatrixError("--moe-ep-matrix takes default, full or comma-separated EP degrees such "
                          f"as 1,2,4; got {text!r}") from exc
    divisors = [ep for ep in range(1, world_size + 1) if world_size % ep == 0]
    bad = [ep for ep in eps if ep not in divisors]
    if bad or not eps:
        raise MatrixError(f"EP degrees {bad or eps} do not divide the world size {world_size}; "
                          f"choose from {divisors}")
    return "eps", eps


def checkpoint_cells(caps: Capabilities, tier: str | tuple[str, list[int] | None] | None,
                     world_size: int,
                     num_experts: tuple[int, ...], *, has_legacy: bool = True) -> list[Cell]:
    """The cells of ``tier`` (as given, or as :func:`parse_tier` parsed it) for an adapter with
    ``caps``, each with its n/a reason (if any)."""
    name, eps = tier if isinstance(tier, tuple) else parse_tier(tier, world_size)
    if eps is None:
        everything = full_product(world_size, num_experts)
    else:
        # the fused form is the newest kind: an adapter without it gets no fused cells here (its
        # default tier names the reason once), where the split forms' cells it lacks are listed n/a
        # as they always were
        kinds = tuple(k for k in KINDS if k != "fused" or "fused" in caps.kinds)
        everything = ep_tier(world_size, eps, num_experts, "strided" if "strided" in caps.ep_orders
                             else caps.ep_orders[0], uneven_fsdp=not caps.ep_only, kinds=kinds)
    if not caps.optimizer:  # a legacy cell saves the richest state the adapter has
        everything = [replace(c, state="model") if c.legacy else c for c in everything]
    if not caps.mtp:  # its pipeline cells are the same cells without the MTP layers
        everything = [replace(c, mtp=False) for c in everything]
    if not caps.finetune:  # one fine-tuning cell says why there are none (as the default tier's
        # n/a cells do), not a report of them: an adapter that fine-tunes with nothing has no cell
        # of any setup
        first = next((c for c in everything if c.finetune), None)
        everything = [c for c in everything if not c.finetune or c is first]
    legacy_na = "" if has_legacy else "adapter has no save_legacy (its old, lossy save)"
    marked = [replace(c, na=(legacy_na if c.legacy and legacy_na else "") or why_not(c, caps)
                      or unwritable_legacy(c)) for c in everything]
    if name != "default":
        return marked
    applicable = [c for c in marked if not c.na]
    chosen = set(covering(applicable))
    first_of_reason: dict[str, Cell] = {}
    for c in marked:  # what the adapter cannot do stays visible: one cell per reason
        if c.na:
            first_of_reason.setdefault(c.na, c)
    chosen |= set(first_of_reason.values())
    return [c for c in marked if c in chosen]


def full_size(world_size: int, num_experts: tuple[int, ...]) -> int:
    """How many cells the full tier has at this world size and these expert counts."""
    return len(full_product(world_size, num_experts))

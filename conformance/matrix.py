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
- ``default``: a deterministic covering subset that covers by what a cell tests (:func:`covering`):
  pairs among the cells that compare values, uneven splits at ep > 1 and optimizer state through
  every layout family; legacy cells, which end at the refusal, are their own stratum;
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
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from conformance.adapter import KINDS, Capabilities, Spec
from conformance.layout import ParallelLayout
from reference_impl.layout import UNEVEN_CLASSES, uneven_classes

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
        return "::".join(["checkpoint", self.kind, self.state, "fsdp" if self.fsdp else "ep-only",
                          *mtp, *experts, pair])

    def keywords(self) -> set[str]:
        """``-k`` keywords (``-k`` cannot contain ``>``): each side's degrees, prefixed and
        plain."""
        words = {f"save_ep{self.save.ep}", f"load_ep{self.load.ep}", f"E{self.num_experts}",
                 f"kind_{self.kind}" if self.save_kind == self.load_kind else
                 f"cross_{self.save_kind}_to_{self.load_kind}"}
        for side, layout in (("save", self.save), ("load", self.load)):
            words |= layout.keywords() | {f"{side}_{w}" for w in layout.keywords()}
        return words | ({"mtp"} if self.mtp else set())

    def spec(self, base: Spec, side: str) -> Spec:
        """The model a side builds: the side's kind and layout, steps only with the optimizer."""
        steps = OPTIMIZER_STEPS if self.state == "model+optim" else 0
        kind, layout = (self.save_kind,
                        self.save) if side == "save" else (self.load_kind, self.load)
        layers = max(base.num_layers, PIPELINE_LAYERS) if self.pipeline else base.num_layers
        return replace(base, kind=kind, num_experts=self.num_experts, optimizer_steps=steps,
                       fsdp=self.fsdp,
                       layout=layout, num_layers=layers, mtp_layers=MTP_LAYERS if self.mtp else 0)

    @property
    def save_key(self) -> tuple[object, ...]:
        """What the checkpoint this cell loads is a pure function of: cells with one key share one
        save (:mod:`conformance.saves`), and the covering counts that save once
        (:func:`covering`)."""
        return (self.save_kind, self.state, self.fsdp, self.save, self.num_experts, self.legacy,
                self.pipeline, self.mtp)

    def record(self) -> dict[str, object]:
        """The cell's fields in the report."""
        return {"kind": self.kind, "state": self.state, "fsdp": self.fsdp, "save_ep": self.save.ep,
                "load_ep": self.load.ep, "save_pp": self.save.pp, "load_pp": self.load.pp,
                "save_layout": self.save.fragment, "load_layout": self.load.fragment,
                "num_experts": self.num_experts, "legacy": self.legacy, "mtp": self.mtp}


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


def _family(layout: ParallelLayout) -> str | None:
    """A layout's family for the interactions the tier must reach (None: ep=1 or ep=world, no
    family)."""
    if layout.etp > 1:
        return "etp"
    if layout.hsdp:
        return "hsdp"
    return layout.ep_order if layout.order_matters else None


def _ep_change(save: int, load: int) -> str:
    return "same ep" if save == load else "ep up" if save < load else "ep down"


def _uneven(cell: Cell, layout: ParallelLayout) -> bool:
    return layout.ep > 1 and cell.num_experts % layout.ep != 0


def _pairs(cell: Cell) -> set[tuple[object, ...]]:
    """What a cell tests, so what it covers (see :func:`covering`)."""
    if "fused" in (cell.save_kind, cell.load_kind):
        return _fused_pairs(cell)
    if cell.legacy:  # state and FSDP are fixed for legacy cells; their pairs are their own stratum
        values = [("save", cell.save), ("load", cell.load), ("kind", cell.kind),
                  ("E", cell.num_experts)]
        found: set[tuple[object, ...]] = {("legacy", a, b)
                                          for a, b in itertools.combinations(values, 2)
                                          if (a[0], b[0]) != ("save", "load")}
        found.add(("legacy", "ep pair", cell.kind, cell.save.ep, cell.load.ep))
        return found
    values = [("save", cell.save), ("load", cell.load), ("kind", cell.kind), ("state", cell.state),
              ("fsdp", cell.fsdp), ("E", cell.num_experts)]
    found = {(a, b) for a, b in itertools.combinations(values, 2)}
    # not every pair of layouts: each stage change with each EP change (Megatron-LM
    if cell.pipeline:
        # issue 1517's pp2.ep1 -> pp1.ep2 and back), each stage layout with each other value
        found.discard((values[0], values[1]))
        found.add(("pp change", cell.save.pp, cell.load.pp, _ep_change(cell.save.ep, cell.load.ep)))
        if (cell.save.pp != cell.load.pp
            and cell.save.pp * cell.save.ep == cell.load.pp * cell.load.ep):
            found.add(("stages traded for EP ranks", cell.save.fragment, cell.load.fragment))
    found.add(("ep pair", cell.kind, cell.save.ep, cell.load.ep))
    for side, layout in (("save", cell.save), ("load", cell.load)):
        # an uneven split at this degree, on this side, for this kind, and each class
        if _uneven(cell, layout):
            # of split it puts in front of the framework
            found.add(("uneven", cell.kind, side, layout.ep))
            found |= {("uneven", cell.kind, side, name)
                      for name in uneven_classes(cell.num_experts, layout.ep)}
    if cell.state == "model+optim":  # optimizer state through every layout family and EP change
        families = {_family(cell.save), _family(cell.load)} - {None}
        if cell.save.ep != cell.load.ep:
            families.add(_ep_change(cell.save.ep, cell.load.ep))
        found |= {("optim", family) for family in families}
        # stage to stage, into each kind at each stage layout: each rank's
        if cell.save.pp > 1 and cell.load.pp > 1:
            # param groups list its stage's own
            found.add(("optim", "stages", cell.load_kind, cell.load.fragment))
    return found


def _fused_pairs(cell: Cell) -> set[tuple[object, ...]]:
    """What a fused cell covers: its own stratum, a few cells, not every pair again.  A fused weight
    differs from a packed one in how its rows are split (each half on its own), so what it must meet
    is every split: FSDP2 and EP alone, each EP change (same, up, down), FSDP2 across an EP change,
    each layout family across an EP change (expert TP among them), each state, and an uneven
    split."""
    change = _ep_change(cell.save.ep, cell.load.ep)
    found: set[tuple[object, ...]] = {("fused", "fsdp", cell.fsdp), ("fused", change),
                                      ("fused", cell.state)}
    if change != "same ep":
        found |= {("fused", family) for family in (_family(cell.save), _family(cell.load))
                  if family}
        if cell.fsdp:
            found.add(("fused", "fsdp across an EP change"))
    if _uneven(cell, cell.save) or _uneven(cell, cell.load):
        found.add(("fused", "uneven"))
    return found


def cost(cell: Cell) -> tuple[float, float]:
    """What a cell costs, ``(load side, save side)``, in units of a model-only load at pp=1: the
    covering's price.

    Measured on the reference adapter (docs/benchmarks.md, 2026-12-04, a fit over three default-tier
    runs): a save side costs about two loads (its build, the save, the saved state gathered and
    inspected); optimizer state adds AdamW's steps, with FSDP2 five times as much (DTensor sharding
    propagation), on each side in proportion to the experts a rank holds there, (1 + 4 / ep) / 5:
    full at ep=1, 0.4 of it at ep=4 -- at a real expert count the moments of every expert a rank
    holds are stepped, gathered and compared, and a side at ep=1 made the E=256 tier twice as slow;
    stages build three layers; a legacy load ends at the refusal.  Only the ratios matter, and they
    change which cells are picked, never what the picked cells cover.
    """
    optim = cell.state == "model+optim"
    extra = (0.7 if optim else 0.0) + (3.5 if optim and cell.fsdp else 0.0)

    def side(layout: ParallelLayout, base: float) -> float:
        return base + extra * (1 + 4 / layout.ep) / 5

    load, save = (0.5 if cell.legacy else side(cell.load, 1.0)), side(cell.save, 2.0)
    if cell.pipeline:
        load, save = 1.5 * load, 1.5 * save
    return load, save


def covering(cells: list[Cell]) -> list[Cell]:
    """A deterministic subset of ``cells`` covering everything any of them covers, at a low
    :func:`cost`.

    What a cell covers is what it tests: a non-legacy cell, each pair of its dimension values (save
    layout, load layout, kind, state, FSDP, E) and its (kind, save_ep, load_ep); for each side whose
    EP degree does not divide E, (kind, side, ep) and (kind, side, class) for each uneven class the
    split reaches (:func:`reference_impl.layout.uneven_classes`); with optimizer state, (kind,
    family) for each layout family it uses (strided, consecutive, HSDP, ETP) and its EP change (up,
    down).  A cell with pipeline stages covers its layouts' pairs with the other values but not its
    pair of layouts: instead its stage change with its EP change, a trade of stages for EP ranks in
    one world (pp2.ep1 -> ep2), and, with optimizer state saved and loaded with stages, its load
    kind at its load layout.  A legacy cell ends at the refusal and compares no values, so it covers
    only legacy pairs: each pair of its save layout, load layout, kind and E, and its (kind,
    save_ep, load_ep).

    The weighted greedy set cover: each pick is the cell that covers the most not yet covered per
    unit of what it adds to the run (its load, and its save unless a picked cell already writes that
    checkpoint: one save feeds every load of it); then each pick whose coverage the others hold is
    dropped, the costliest first.
    """
    covers = [_pairs(c) for c in cells]
    wanted = set().union(*covers) if covers else set()
    prices, keys = [cost(c) for c in cells], [c.save_key for c in cells]
    # what each cell covers of ``wanted``, kept as ``wanted`` shrinks
    gains = [len(pairs) for pairs in covers]
    holders: dict[tuple[object, ...], list[int]] = {}
    for i, pairs in enumerate(covers):
        for pair in pairs:
            holders.setdefault(pair, []).append(i)
    chosen: list[int] = []
    written: set[tuple[object, ...]] = set()

    def value(i: int) -> tuple[float, int]:
        load, save = prices[i]
        return gains[i] / (load + (0.0 if keys[i] in written else save)), -i

    while wanted:
        best = max(range(len(cells)), key=value)
        chosen.append(best)
        written.add(keys[best])
        for pair in covers[best] & wanted:
            for i in holders[pair]:
                gains[i] -= 1
        wanted -= covers[best]
    held = Counter(pair for i in chosen for pair in covers[i])
    for i in sorted(chosen, key=lambda i: (-sum(prices[i]), -i)):
        if all(held[pair] > 1 for pair in covers[i]):
            chosen.remove(i)
            held.subtract(covers[i])
    return [cells[i] for i in sorted(chosen)]


def guarantee(tier: str) -> str:
    """What a tier's green run means, for the report's coverage line (``tier`` as the report names
    it)."""
    if tier == "default":
        return ("covering what each cell tests: every pair of dimension values among the cells "
                "that compare values, every (save_ep, load_ep) pair per kind, an uneven split (E % "
                "ep != 0) at every ep > 1 and each uneven class its expert counts reach on each "
                "side for each kind, optimizer state through every layout family (strided, "
                "consecutive, HSDP, ETP) and EP change (up, down); pipeline stages changing with "
                "every EP change, traded for EP ranks in one world, and optimizer state stage to "
                "stage; legacy cells cover the pairs among themselves")
    if tier == "full":
        return "every cell"
    return "the plain layouts at those EP degrees (see the README's Tiers)"


def uneven_reach(records: Iterable[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Which uneven classes the value-comparing cells among ``records`` (report records) put in
    front of the framework, each with where (``"E=5 at ep=4"``): the coverage line says it, so a
    green tier says which split bugs it could have caught (a tier that never reaches ``mislabel``
    cannot catch a silent mislabel)."""
    found: dict[str, set[tuple[int, int]]] = {}
    for r in records:
        experts, eps = r.get("num_experts"), {ep for ep in (r.get("save_ep"), r.get("load_ep"))
                                              if isinstance(ep, int)}
        if (r.get("suite") != "checkpoint" or r.get("legacy") or r.get("status") == "n/a"
            or not experts):
            # (a record without its layout -- an older report's -- reaches nothing we can name)
            continue
        for ep in eps:
            for name in uneven_classes(experts, ep) if experts % ep else ():
                found.setdefault(name, set()).add((experts, ep))
    return {name: [f"E={e} at ep={ep}" for e, ep in sorted(found[name])] for name in UNEVEN_CLASSES
            if name in found}


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

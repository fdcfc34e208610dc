"""What a checkpoint cell covers, and the default tier: the cheapest subset of the applicable cells
that covers everything any of them covers.

:mod:`conformance.matrix` says which cells exist and which apply; this module says what each one
tests -- pairs of its dimension values, an uneven split's classes, optimizer state through each
layout family, a stage change with an EP change, a fused layer's splits -- and picks the covering
subset by a measured price (:func:`cost`), so that a green default tier says what it reached
(:func:`guarantee`, :func:`uneven_reach`).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from conformance.layout import ParallelLayout
from reference_impl.layout import UNEVEN_CLASSES, uneven_classes

if TYPE_CHECKING:
    from conformance.matrix import Cell

__all__ = ["cost", "covering", "guarantee", "uneven_reach"]

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
    if cell.finetune:
        return _finetune_pairs(cell)
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


def _finetune_pairs(cell: Cell) -> set[tuple[object, ...]]:
    """What a fine-tuning cell covers: a stratum per part of its setup -- the adapters (``lora``,
    in every setup) and the base's format (``mxfp4``, ``fp8``) -- a few cells each.  Adapters,
    blocks and scales move with their experts through the same saves and loads as any expert
    tensor; what is new is how each is split and paired, so each part must meet each kind it
    applies to, FSDP2 and EP alone, each EP change, the layouts that split an expert's own tensors
    (expert TP: where a shard may be smaller than a quantization block; HSDP), each state, and an
    uneven split.  A quantized setup's cell covers the adapters' pairs too, so the plain ``lora``
    setup runs only where none of them reaches."""
    change = _ep_change(cell.save.ep, cell.load.ep)
    found: set[tuple[object, ...]] = set()
    for part in cell.finetune.split("+"):
        found |= {("finetune", part, cell.kind), ("finetune", part, "fsdp", cell.fsdp),
                  ("finetune", part, change), ("finetune", part, cell.state)}
        found |= {("finetune", part, family)
                  for family in (_family(cell.save), _family(cell.load))
                  if family in ("etp", "hsdp")}
        if _uneven(cell, cell.save) or _uneven(cell, cell.load):
            found.add(("finetune", part, "uneven"))
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
                "stage; LoRA adapters and each quantized base (MXFP4, FP8) through each kind, "
                "FSDP2 and EP alone, each EP change, expert TP and HSDP, each state and an "
                "uneven split; legacy cells cover the pairs among themselves")
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

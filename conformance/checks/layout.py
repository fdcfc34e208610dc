"""The cell's layout is checked, not assumed: the framework formed the EP groups the cell is named
for.

An adapter builds the framework's model from the cell's :class:`~conformance.layout.ParallelLayout`,
but a framework may form its own process groups (from the global rank, from its own mesh), so a cell
called ``ep2`` (strided EP groups) could silently test consecutive ones -- or an adapter's own
mistake.  Right after each build, every rank reports which global experts it holds (the ids
``expert_tensors`` yields) and the ranks compare that with the layout (one ``all_gather_object``):

- for an even split (``E % ep == 0``) the ranks at EP coordinate ``e`` must together hold exactly
  the layout rule's experts :meth:`~conformance.layout.ParallelLayout.experts_of` -- every
  contiguous split agrees there, so a difference means other EP groups;
- for an uneven split the framework may split otherwise (how well that survives a checkpoint, and
  whether an expert was left out, is for the other checks to say, layer by layer), but each EP
  coordinate's experts must still be one contiguous range, in coordinate order, disjoint from the
  others'.

Under pipeline parallelism (``pp > 1``) the layers each rank reports must fit the stages the same
way (a stage's ranks hold the same layers: the stage rule's,
:meth:`~conformance.layout.ParallelLayout.layers_of`, when ``pp`` divides the layer count, else one
contiguous range after the previous stage's; :class:`StageMismatch` names the stage, its ranks and
layers), and each stage's ranks are checked as an EP world of their own.

A mismatch raises :class:`LayoutMismatch` on every rank: the cell is an ``error`` whose first line
names the groups the framework formed and the ones the layout expects.

It is a check -- a row of the table, run after each build like any check at its stage -- though
what it finds is about the experiment (the cell would test another layout than its name says), not
about the framework's checkpoint: so it raises instead of reporting (no later check means anything
in such a cell), its finding is ``error``, and a passing cell does not list it among the promises
it kept.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from conformance.adapter import ExpertBlock
from conformance.checks.context import CheckContext, TimedAdapter
from conformance.inspection.model import expert_ranges
from conformance.layout import EP_ORDERS, ParallelLayout


class LayoutMismatch(Exception):
    """The framework's experts sit on other ranks than the cell's layout says.

    ``side`` is "save" or "load", ``held`` each rank's expert ids, ``expected`` each EP
    coordinate's.
    """

    def __init__(self, side: str, layout: ParallelLayout, num_experts: int,
                 held: list[tuple[int, ...]], expected: list[tuple[int, int]], formed: str) -> None:
        self.side, self.layout, self.num_experts = side, layout, num_experts
        self.held, self.expected, self.formed = held, expected, formed
        super().__init__(self._message())

    def _message(self) -> str:
        want = "; ".join(f"experts {_span(range(a, b))} to ranks {_ranks(self.layout, e)}"
                         for e, (a, b) in enumerate(self.expected) if b > a)
        got = ", ".join(f"rank {r}: {_span(ids)}" for r, ids in enumerate(self.held))
        groups = ", ".join(map(str, self.layout.ep_groups()))
        order = f"{self.layout.ep_order} " if self.layout.order_matters else ""
        return (f"the {self.side} side's experts are not where the cell's layout puts them: "
                f"{self.formed}; the layout {self.layout.fragment} ({order}EP groups {groups}) "
                f"gives {want}; the framework's ranks hold {got} (E={self.num_experts})")


def _span(ids: Any) -> str:
    ids = sorted(ids)
    return expert_ranges(ids) if ids else "none"


def _ranks(layout: ParallelLayout, coordinate: int) -> str:
    return ", ".join(str(r) for r in range(layout.world_size)
                     if layout.coordinates(r)["ep"] == coordinate)


def reported(adapter: TimedAdapter, model: Any,
             optimizer: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(layers, experts)``: the layer indices of every tensor this rank yields (``expert_tensors``
    and ``other_tensors``) and the global expert ids of its ``expert_tensors``.

    Layers come from the whole model, not from its experts alone: a rank that holds none of a
    layer's experts (E=5 over ep=4: the last EP rank holds none) still holds that layer's router and
    dense tensors."""
    from reference_impl.regions import block_region

    ids: set[int] = set()
    layers = {int(entry[0]) for entry in adapter.other_tensors(model, optimizer)
              if entry[0] is not None}
    for entry in adapter.expert_tensors(model, optimizer):
        if entry[0] is not None:
            layers.add(int(entry[0]))
        if isinstance(entry, ExpertBlock):
            local, first, _ = block_region(entry.tensor, entry.first,
                                           where=f"{entry.name!r} of layer {entry.layer}")
            ids.update(range(first, first + local.shape[0]))
        elif entry[1] is not None:
            ids.add(int(entry[1]))
    return tuple(sorted(layers)), tuple(sorted(ids))


def stage_problem(layout: ParallelLayout, num_layers: int, layers: list[tuple[int, ...]]) -> str:
    """Why the layers each rank reports (``layers[rank]``) do not fit ``layout``'s stages; "" when
    they do.

    As for experts: every rank of a stage holds the same layers; when ``pp`` divides the layer count
    every contiguous split agrees, so each stage must hold the stage rule's layers
    (:meth:`~conformance.layout.ParallelLayout.layers_of`); otherwise a framework may weigh its
    stages otherwise (DeepSpeed balances them by parameters), but each stage's layers must be one
    contiguous range after the previous stage's.  Only under pipeline parallelism: at pp=1 a
    framework may hold dense layers the harness does not see.
    """
    if layout.pp == 1:
        return ""
    stages = layout.stage_ranks()
    rule = f"{num_layers} layers over {layout.pp} stages"
    start = 0
    for stage, ranks in enumerate(stages):
        held = set(layers[ranks[0]])
        other = next((r for r in ranks if set(layers[r]) != held), None)
        if other is not None:
            return (f"ranks of pipeline stage {stage} hold different layers: rank {ranks[0]} "
                    f"{_span(held)}, rank {other} {_span(layers[other])} ({rule})")
        a, b = layout.layers_of(ranks[0], num_layers)
        if num_layers % layout.pp == 0 and held != set(range(a, b)):
            return (f"the ranks of pipeline stage {stage} ({', '.join(map(str, ranks))}) hold "
                    f"layers {_span(held)}, the stage rule gives them {_span(range(a, b))} "
                    f"({rule})")
        if held and (min(held) != start or held != set(range(min(held), max(held) + 1))):
            return (f"the ranks of pipeline stage {stage} ({', '.join(map(str, ranks))}) hold "
                    f"layers {_span(held)}: not the contiguous range after the previous stages' "
                    f"layers (next expected: {start}; {rule})")
        start = max(held, default=start - 1) + 1
    return ""


def problem(layout: ParallelLayout, num_experts: int, held: list[tuple[int, ...]],
            ranks: list[int] | None = None) -> str:
    """Why ``held`` (each rank's expert ids) does not fit ``layout``; "" when it does.  ``ranks``:
    only these ranks (one pipeline stage's; default every rank)."""
    ranks = list(range(layout.world_size)) if ranks is None else ranks
    coords = {r: layout.coordinates(r)["ep"] for r in ranks}
    unions: list[set[int]] = [set() for _ in range(layout.ep)]
    for rank in ranks:
        unions[coords[rank]] |= set(held[rank])

    def at(e: int) -> str:
        return ", ".join(str(r) for r in ranks if coords[r] == e)

    if not any(unions):
        return "no rank reports any expert (expert_tensors yields none)"
    if num_experts % layout.ep == 0:
        for e, found in enumerate(unions):
            a, b = layout.experts_of(next(r for r in ranks if coords[r] == e), num_experts)
            if found != set(range(a, b)):
                return (f"the ranks at EP coordinate {e} ({at(e)}) hold experts {_span(found)}, "
                        f"the layout gives them {_span(range(a, b))}")
        return ""
    start = 0
    for e, found in enumerate(unions):
        if not found:
            continue
        if min(found) != start or found != set(range(min(found), max(found) + 1)):
            return (f"the ranks at EP coordinate {e} ({at(e)}) hold experts {_span(found)}: not "
                    "the contiguous range after the previous coordinates' experts (next expected: "
                    f"{start})")
        start = max(found) + 1
    return ""  # experts no rank holds are the missing and values checks' to name, per layer


def formed_groups(layout: ParallelLayout, num_experts: int, held: list[tuple[int, ...]],
                  ranks: list[int] | None = None) -> str:
    """What the framework did instead, in EP-group terms where another order explains it."""
    for order in EP_ORDERS:
        if order == layout.ep_order or not layout.order_matters:
            continue
        other = replace(layout, ep_order=order)
        if not problem(other, num_experts, held, ranks):
            groups = ", ".join(map(str, other.ep_groups()))
            return f"the framework formed {order} EP groups {groups}"
    return problem(layout, num_experts, held, ranks)


def check_layout(adapter: TimedAdapter, model: Any, optimizer: Any, layout: ParallelLayout,
                 num_experts: int, side: str, num_layers: int = 0) -> None:
    """Raise :class:`LayoutMismatch` on every rank when the experts are not where ``layout`` puts
    them -- or, under pipeline parallelism, the layers not where its stages put them (``num_layers``
    of the model)."""
    import torch.distributed as dist

    mine = reported(adapter, model, optimizer)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    layers, held = [g[0] for g in gathered], [g[1] for g in gathered]
    why = stage_problem(layout, num_layers, layers) if num_layers else ""
    if why:
        raise StageMismatch(side, layout, num_experts, held, [], why)
    # each stage is an EP world of its own: its experts are checked stage by stage
    if layout.pp > 1:
        for ranks in layout.stage_ranks():
            _check_experts(side, layout, num_experts, {r: held[r] for r in ranks})
        return
    _check_experts(side, layout, num_experts, dict(enumerate(held)))


def _check_experts(side: str, layout: ParallelLayout, num_experts: int,
                   held: dict[int, tuple[int, ...]]) -> None:
    """The expert check over the ranks of ``held`` (one pipeline stage, or the whole world)."""
    by_rank = [held.get(r, ()) for r in range(layout.world_size)]
    why = problem(layout, num_experts, by_rank, ranks=list(held))
    if why:
        expected = [layout.experts_of(next(r for r in held if layout.coordinates(r)["ep"] == e),
                                      num_experts)
                    for e in range(layout.ep)]
        raise LayoutMismatch(side, layout, num_experts, by_rank, expected,
                             formed_groups(layout, num_experts, by_rank, list(held)))


class StageMismatch(LayoutMismatch):
    """The framework's layers sit on other pipeline stages than the cell's layout says (``formed``
    says which)."""

    def _message(self) -> str:
        return (f"the {self.side} side's layers are not where the cell's pipeline stages put them: "
                f"{self.formed}")


def run(ctx: CheckContext) -> None:
    """After each side's build: its experts (and stages) where the cell's layout puts them."""
    check_layout(ctx.adapter, ctx.model, ctx.optimizer, ctx.layout, ctx.cell.num_experts,
                 ctx.side, ctx.spec.num_layers)

"""The cell's layout is checked, not assumed: the framework formed the EP groups the cell is named for.

An adapter builds the framework's model from the cell's :class:`~conformance.layout.ParallelLayout`, but a
framework may form its own process groups (from the global rank, from its own mesh), so a cell called
``ep2`` (strided EP groups) could silently test consecutive ones -- or an adapter's own mistake.  Right
after each build, every rank reports which global experts it holds (the ids ``expert_tensors`` yields) and
the ranks compare that with the layout (one ``all_gather_object``):

- for an even split (``E % ep == 0``) the ranks at EP coordinate ``e`` must together hold exactly the
  layout rule's experts :meth:`~conformance.layout.ParallelLayout.experts_of` -- every contiguous split
  agrees there, so a difference means other EP groups;
- for an uneven split the framework may split otherwise (how well that survives a checkpoint, and whether
  an expert was left out, is for the other checks to say, layer by layer), but each EP coordinate's
  experts must still be one contiguous range, in coordinate order, disjoint from the others'.

A mismatch raises :class:`LayoutMismatch` on every rank: the cell is an ``error`` whose first line names
the groups the framework formed and the ones the layout expects.
"""

from __future__ import annotations

from typing import Any

from conformance.adapter import ExpertBlock
from conformance.inspection.model import expert_ranges
from conformance.layout import EP_ORDERS, ParallelLayout


class LayoutMismatch(Exception):
    """The framework's experts sit on other ranks than the cell's layout says.

    ``side`` is "save" or "load", ``held`` each rank's expert ids, ``expected`` each EP coordinate's.
    """

    def __init__(self, side: str, layout: ParallelLayout, num_experts: int, held: list[tuple[int, ...]],
                 expected: list[tuple[int, int]], formed: str) -> None:
        self.side, self.layout, self.num_experts = side, layout, num_experts
        self.held, self.expected, self.formed = held, expected, formed
        super().__init__(self._message())

    def _message(self) -> str:
        want = "; ".join(f"experts {_span(range(a, b))} to ranks {_ranks(self.layout, e)}"
                         for e, (a, b) in enumerate(self.expected) if b > a)
        got = ", ".join(f"rank {r}: {_span(ids)}" for r, ids in enumerate(self.held))
        groups = ", ".join(map(str, self.layout.ep_groups()))
        order = f"{self.layout.ep_order} " if self.layout.order_matters else ""
        return (f"the {self.side} side's experts are not where the cell's layout puts them: {self.formed}; the "
                f"layout {self.layout.fragment} ({order}EP groups {groups}) gives {want}; the framework's ranks "
                f"hold {got} (E={self.num_experts})")


def _span(ids: Any) -> str:
    ids = sorted(ids)
    return expert_ranges(ids) if ids else "none"


def _ranks(layout: ParallelLayout, coordinate: int) -> str:
    return ", ".join(str(r) for r in range(layout.world_size) if layout.coordinates(r)["ep"] == coordinate)


def reported_experts(adapter: Any, model: Any, optimizer: Any) -> tuple[int, ...]:
    """The global expert ids this rank's ``expert_tensors`` yields (no copies)."""
    from reference_impl.regions import block_region

    ids: set[int] = set()
    for entry in adapter.expert_tensors(model, optimizer):
        if isinstance(entry, ExpertBlock):
            local, first, _ = block_region(entry.tensor, entry.first, where=f"{entry.name!r} of layer {entry.layer}")
            ids.update(range(first, first + local.shape[0]))
        elif entry[1] is not None:
            ids.add(int(entry[1]))
    return tuple(sorted(ids))


def problem(layout: ParallelLayout, num_experts: int, held: list[tuple[int, ...]]) -> str:
    """Why ``held`` (each rank's expert ids) does not fit ``layout``; "" when it does."""
    coords = [layout.coordinates(r)["ep"] for r in range(layout.world_size)]
    unions: list[set[int]] = [set() for _ in range(layout.ep)]
    for rank, ids in enumerate(held):
        unions[coords[rank]] |= set(ids)
    if not any(unions):
        return "no rank reports any expert (expert_tensors yields none)"
    if num_experts % layout.ep == 0:
        for e, found in enumerate(unions):
            a, b = layout.experts_of(next(r for r in range(layout.world_size) if coords[r] == e), num_experts)
            if found != set(range(a, b)):
                return (f"the ranks at EP coordinate {e} ({_ranks(layout, e)}) hold experts {_span(found)}, the "
                        f"layout gives them {_span(range(a, b))}")
        return ""
    start = 0
    for e, found in enumerate(unions):
        if not found:
            continue
        if min(found) != start or found != set(range(min(found), max(found) + 1)):
            return (f"the ranks at EP coordinate {e} ({_ranks(layout, e)}) hold experts {_span(found)}: not the "
                    f"contiguous range after the previous coordinates' experts (next expected: {start})")
        start = max(found) + 1
    return ""  # experts no rank holds are the missing and values checks' to name, per layer


def formed_groups(layout: ParallelLayout, num_experts: int, held: list[tuple[int, ...]]) -> str:
    """What the framework did instead, in EP-group terms where another order explains it."""
    for order in EP_ORDERS:
        if order == layout.ep_order or not layout.order_matters:
            continue
        other = ParallelLayout(layout.ep, layout.dp_shard, layout.dp_replicate, layout.etp, order)
        if not problem(other, num_experts, held):
            groups = ", ".join(map(str, other.ep_groups()))
            return f"the framework formed {order} EP groups {groups}"
    return problem(layout, num_experts, held)


def check_layout(adapter: Any, model: Any, optimizer: Any, layout: ParallelLayout, num_experts: int,
                 side: str) -> None:
    """Raise :class:`LayoutMismatch` on every rank when the experts are not where ``layout`` puts them."""
    import torch.distributed as dist

    mine = reported_experts(adapter, model, optimizer)
    held: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(held, mine)
    why = problem(layout, num_experts, held)
    if why:
        expected = [layout.experts_of(next(r for r in range(layout.world_size)
                                           if layout.coordinates(r)["ep"] == e), num_experts)
                    for e in range(layout.ep)]
        raise LayoutMismatch(side, layout, num_experts, held, expected, formed_groups(layout, num_experts, held))

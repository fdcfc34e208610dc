"""The rank layout of a checkpoint cell: parallel degrees, which ranks form an EP group, and its
mesh.

:class:`ParallelLayout` is the one owner of the layout (like torchtitan's ``ParallelDims``): the
cells, node ids, the report, the adapters and the benchmarks ask it, and nothing else spells out the
dimensions.  A world of ``pp * dp_replicate * ep * dp_shard * etp`` ranks is a 5-D grid, pipeline
stages outermost (as torchtitan and Megatron-Core order them).  Its DeviceMesh has the dims
:data:`STAGE_DIMS` in that order, every one present (size 1 where unused), so an adapter reads
``mesh["ep"]`` whatever the layout -- and, under pipeline parallelism (``pp > 1``), ``pp`` before
them (:attr:`ParallelLayout.mesh_dims`): a pp=1 cell's mesh is the 4-D one an adapter without
pipeline support has always been given.  Within one stage the ranks form the same grid a pp=1 world
of ``world / pp`` ranks would; which layers a stage holds is
:func:`reference_impl.layout.stage_layers`.

Which ranks form an EP group is the ``ep_order``:

- ``strided`` (torchtitan's and this suite's default): the grid is ``arange(world)`` in mesh order,
  so an EP group's ranks are ``dp_shard * etp`` apart -- ranks 0 and 2 at ep=2 on 4 ranks;
- ``consecutive`` (DeepSpeed, Megatron-Core): an EP group is ``ep * etp`` consecutive ranks -- ranks
  0 and 1 at ep=2 on 4 ranks.

A framework that takes the global or data-parallel rank for its EP rank passes on one of these
orders and fails on the other, which is why both are cells.  ``etp`` is expert tensor parallelism:
each expert's weights split over ``etp`` ranks (always the innermost, consecutive ranks).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["EP_ORDERS", "MESH_DIMS", "STAGE_DIMS", "LayoutError", "ParallelLayout"]

#: every dimension's name, outermost first: pipeline stages, then the grid within one stage.
MESH_DIMS = ("pp", "dp_replicate", "ep", "dp_shard", "etp")
#: the dims within one pipeline stage: a pp=1 layout's whole DeviceMesh.
STAGE_DIMS = MESH_DIMS[1:]
EP_ORDERS = ("strided", "consecutive")


class LayoutError(ValueError):
    """A layout that cannot exist: ``field`` is the offending degree, ``value`` what was given."""

    def __init__(self, field: str, value: Any, expected: str) -> None:
        super().__init__(f"parallel layout: {field}={value!r} is invalid: expected {expected}")
        self.field, self.value, self.expected = field, value, expected


@dataclass(frozen=True, order=True)
class ParallelLayout:
    """The degrees of one rank layout; ``dp_shard`` is whatever the world leaves over."""

    ep: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    etp: int = 1
    ep_order: str = "strided"
    #: pipeline stages (the outermost dim): each holds the layers
    #: :func:`reference_impl.layout.stage_layers` gives.
    pp: int = 1

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(name, value, "an int >= 1")
        if self.ep_order not in EP_ORDERS:
            raise LayoutError("ep_order", self.ep_order, f"one of {', '.join(EP_ORDERS)}")
        if not self.order_matters:  # the two orders give the same ranks: one name for one layout
            object.__setattr__(self, "ep_order", "strided")

    @classmethod
    def for_world(cls, world_size: int, ep: int, *, dp_replicate: int = 1, etp: int = 1,
                  ep_order: str = "strided", pp: int = 1) -> ParallelLayout:
        """The layout at ``ep`` (and ``dp_replicate``, ``etp``, ``pp``) that fills a
        ``world_size``-rank world."""
        inner = ep * dp_replicate * etp * pp
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise LayoutError("world_size", world_size, "an int >= 1")
        if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
            raise LayoutError("pp", pp, "an int >= 1")
        if inner < 1 or world_size % inner:
            raise LayoutError("ep", ep, f"pp * ep * dp_replicate * etp ({pp} * {ep} * "
                              f"{dp_replicate} * {etp}) to divide the world size {world_size}")
        return cls(ep=ep, dp_shard=world_size // inner, dp_replicate=dp_replicate, etp=etp,
                   ep_order=ep_order, pp=pp)

    # -- what the layout is ------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.pp * self.stage_size

    @property
    def stage_size(self) -> int:
        """The ranks of one pipeline stage (the whole world at pp=1)."""
        return self.dp_replicate * self.ep * self.dp_shard * self.etp

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """Every dim's size, in :data:`MESH_DIMS` order."""
        return (self.pp, self.dp_replicate, self.ep, self.dp_shard, self.etp)

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """The DeviceMesh's dim names: :data:`STAGE_DIMS`, with ``pp`` first only under pipeline
        parallelism."""
        return MESH_DIMS if self.pp > 1 else STAGE_DIMS

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self.shape if self.pp > 1 else self.shape[1:]

    @property
    def order_matters(self) -> bool:
        """Whether strided and consecutive EP groups are different ranks (ep > 1 and dp_shard >
        1)."""
        return self.ep > 1 and self.dp_shard > 1

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s index along each dim (:data:`MESH_DIMS`, ``pp`` included)."""
        for coords in self._coords():
            if self.rank_at(*coords) == rank:
                return dict(zip(MESH_DIMS, coords, strict=True))
        raise LayoutError("rank", rank, f"a rank in [0, {self.world_size})")

    def _coords(self) -> list[tuple[int, ...]]:
        return list(itertools.product(*(range(n) for n in self.shape)))

    def rank_at(self, pp: int, dp_replicate: int, ep: int, dp_shard: int, etp: int) -> int:
        """The global rank at a coordinate (:data:`MESH_DIMS` order): the one place the EP order is
        decided."""
        if self.ep_order == "strided":
            inner = (ep * self.dp_shard + dp_shard) * self.etp + etp
        else:
            inner = (dp_shard * self.ep + ep) * self.etp + etp
        return (pp * self.dp_replicate + dp_replicate) * (self.ep * self.dp_shard
                                                          * self.etp) + inner

    def stage_of(self, rank: int) -> int:
        """The pipeline stage ``rank`` belongs to (0 at pp=1)."""
        return self.coordinates(rank)["pp"]

    def stage_ranks(self) -> list[list[int]]:
        """Each pipeline stage's ranks, in stage order (one list, the whole world, at pp=1)."""
        return self.groups(*STAGE_DIMS)

    def layers_of(self, rank: int, num_layers: int) -> tuple[int, int]:
        """``(start, end)`` of the global layers ``rank`` holds: the stage rule at its ``pp``
        coordinate."""
        from reference_impl.layout import stage_layers

        return stage_layers(num_layers, self.pp, self.stage_of(rank))

    def rank_grid(self) -> list[Any]:
        """Global ranks as a nested list of shape :attr:`mesh_shape` (the DeviceMesh's dims)."""
        grid = [_nest(self, (p,), self.shape[1:]) for p in range(self.pp)]
        return grid if self.pp > 1 else grid[0]

    def groups(self, *dims: str) -> list[list[int]]:
        """The rank groups that vary along ``dims`` with every other coordinate fixed (sorted
        ranks)."""
        unknown = [d for d in dims if d not in MESH_DIMS]
        if unknown:
            raise LayoutError("dims", unknown, f"names among {', '.join(MESH_DIMS)}")
        found: dict[tuple[int, ...], list[int]] = {}
        for coords in self._coords():
            fixed = tuple(c for d, c in zip(MESH_DIMS, coords, strict=True) if d not in dims)
            found.setdefault(fixed, []).append(self.rank_at(*coords))
        return [sorted(g) for _, g in sorted(found.items())]

    def ep_groups(self) -> list[list[int]]:
        """Each EP group's ranks, in EP-rank order (what DeepSpeed and Megatron form themselves)."""
        return [sorted(g, key=lambda r: self.coordinates(r)["ep"]) for g in self.groups("ep")]

    def replica_groups(self, fsdp: bool) -> list[list[int]]:
        """Sets of ranks that together hold one whole copy of the model (its experts and its
        layers).

        Without FSDP one copy is spread over ``ep`` x ``etp`` and over the pipeline stages (``pp``);
        with FSDP2 each rank's experts are also sharded over ``dp_shard``, so a copy spans that too.
        ``dp_replicate`` always holds copies.
        """
        return self.groups("pp", "ep", "etp",
                           "dp_shard") if fsdp else self.groups("pp", "ep", "etp")

    # -- names -------------------------------------------------------------------------------------
    @property
    def fragment(self) -> str:
        """The short, ``-k`` friendly node-id part: ``ep2``, ``ep2c`` (consecutive), ``ep2.etp2``,
        ``ep2.hsdp2``, ``pp2.ep2`` (pipeline stages first, as they are the outermost dim)."""
        parts = [f"pp{self.pp}"] if self.pp > 1 else []
        parts.append(f"ep{self.ep}{'c' if self.ep_order == 'consecutive' else ''}")
        if self.etp > 1:
            parts.append(f"etp{self.etp}")
        if self.dp_replicate > 1:
            parts.append(f"hsdp{self.dp_replicate}")
        return ".".join(parts)

    def keywords(self) -> set[str]:
        """``-k`` keywords: each degree, the EP order, ``hsdp``/``etp`` when they are used, and
        every name the node id shows (:attr:`fragment` and its parts: ``ep2c``, ``ep2.etp2``,
        ``hsdp2``), so ``-k load_ep2c`` selects."""
        words = {f"ep{self.ep}", f"dp_shard{self.dp_shard}", f"dp_replicate{self.dp_replicate}",
                 f"etp{self.etp}", f"pp{self.pp}", self.ep_order, self.fragment,
                 *self.fragment.split(".")}
        if self.hsdp:
            words.add("hsdp")
        if self.pp > 1:
            words.add("pipeline")
        return words

    def describe(self) -> str:
        """For messages: ``ep=2 (consecutive EP groups), etp=1, dp_shard=2,
        dp_replicate=1`` (``pp=2, `` first under pipeline parallelism)."""
        order = f" ({self.ep_order} EP groups)" if self.order_matters else ""
        stages = f"pp={self.pp}, " if self.pp > 1 else ""
        return (f"{stages}ep={self.ep}{order}, etp={self.etp}, dp_shard={self.dp_shard}, "
                f"dp_replicate={self.dp_replicate}")

    def experts_of(self, rank: int, num_experts: int) -> tuple[int, int]:
        """``(start, end)`` of the global experts ``rank`` holds: the layout rule at its EP
        coordinate."""
        from reference_impl.layout import expert_range

        return expert_range(num_experts, self.ep, self.coordinates(rank)["ep"])

    def framework_dims(self, names: Mapping[str, str]
                       | None = None) -> tuple[tuple[str, ...], tuple[int, ...], Any]:
        """``(dim names, sizes, rank grid)`` of the dims > 1 only, named as a framework names them.

        ``names`` maps this module's dim names (:data:`MESH_DIMS`) to the framework's
        (``{"dp_shard": "fsdp"}``); a framework that branches on which dims exist, or builds its own
        groups from a grid, gets the layout in its own terms.  With every dim of size 1 the result
        is one dim of the whole world.
        """
        names = dict(names or {})
        unknown = sorted(set(names) - set(MESH_DIMS))
        if unknown:
            raise LayoutError("names", unknown, f"keys among {', '.join(MESH_DIMS)}")
        keep = [i for i, n in enumerate(self.shape) if n > 1] or [MESH_DIMS.index("dp_shard")]
        grid = _fill(self, keep)
        return tuple(names.get(MESH_DIMS[i], MESH_DIMS[i])
                     for i in keep), tuple(self.shape[i] for i in keep), grid

    # -- the mesh ----------------------------------------------------------------------------------
    def framework_mesh(self, names: Mapping[str, str] | None = None) -> Any:
        """This layout's DeviceMesh with only the dims > 1, named by ``names`` (see
        :meth:`framework_dims`)."""
        from pytest_moe_ep.world.meshes import device_mesh

        dims, sizes, grid = self.framework_dims(names)
        return device_mesh(sizes, dims, grid)

    def build_mesh(self) -> Any:
        """This layout's DeviceMesh on the world's device (inside a rank; cached per process)."""
        from pytest_moe_ep.world.meshes import device_mesh

        return device_mesh(self.mesh_shape, self.mesh_dims,
                           self.rank_grid() if self.ep_order != "strided" else None)


def _nest(layout: ParallelLayout, prefix: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
    """The global ranks below coordinate ``prefix``, nested over the remaining dims' ``sizes``."""
    if not sizes:
        return layout.rank_at(*prefix)
    return [_nest(layout, (*prefix, c), sizes[1:]) for c in range(sizes[0])]


def _fill(layout: ParallelLayout, keep: list[int]) -> Any:
    """The rank grid over the kept dims (sizes > 1): dropped dims are size 1, so each cell is one
    rank."""
    sizes = [layout.shape[i] for i in keep]

    def build(depth: int, coords: list[int]) -> Any:
        if depth == len(sizes):
            full = [0] * len(MESH_DIMS)
            for i, c in zip(keep, coords, strict=True):
                full[i] = c
            return layout.rank_at(*full)
        return [build(depth + 1, [*coords, c]) for c in range(sizes[depth])]

    return build(0, [])

"""The expert layout rule: which global experts an expert-parallel rank holds (and the stage rules
beside it: which global layers a pipeline stage holds, :func:`stage_layers`, and which stage holds
the multi-token-prediction layers, :func:`mtp_stage`).

Everything in this project that needs to know where an expert lives asks :func:`expert_range`.
The rule is DTensor's own ``Shard(0)`` rule (``torch.chunk`` semantics), because that is the
layout torch.distributed.checkpoint records: with ``chunk = ceil(E / k)`` rank ``i`` holds rows
``[min(i * chunk, E), min((i + 1) * chunk, E))``, and trailing ranks may hold none.

The tempting "first ``E % k`` ranks get one extra expert" split disagrees with it whenever
``E % k != 0``: with E=6 on k=4 it puts experts 4:5 on rank 2 and 5:6 on rank 3, while DTensor
records rows 4:6 for rank 2 and none for rank 3, so a checkpoint saved from it loses expert 5.
"""

from __future__ import annotations

__all__ = ["UNEVEN_CLASSES", "balanced_range", "expert_counts", "expert_owner", "expert_range",
           "layer_stage", "mtp_stage", "stage_layers", "stage_mtp_layers", "uneven_classes"]


def _check(num_experts: int, num_ranks: int) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError("the number of expert-parallel ranks must be an int >= 1, got "
                         f"{num_ranks!r}")


def expert_range(num_experts: int, num_ranks: int, rank: int) -> tuple[int, int]:
    """``(start, end)`` of the global experts ``rank`` holds among ``num_ranks`` (end exclusive)."""
    _check(num_experts, num_ranks)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be an int in [0, {num_ranks}), got {rank!r}")
    chunk = -(-num_experts // num_ranks)
    start = min(rank * chunk, num_experts)
    return start, min(start + chunk, num_experts)


def expert_counts(num_experts: int, num_ranks: int) -> list[int]:
    """How many experts each of ``num_ranks`` ranks holds, in rank order."""
    _check(num_experts, num_ranks)
    return [end - start
            for start, end in (expert_range(num_experts, num_ranks, r) for r in range(num_ranks))]


def expert_owner(expert_id: int, num_experts: int, num_ranks: int) -> int:
    """The rank that holds global expert ``expert_id``."""
    _check(num_experts, num_ranks)
    if isinstance(expert_id, bool) or not isinstance(expert_id,
                                                     int) or not 0 <= expert_id < num_experts:
        raise ValueError(f"expert id must be an int in [0, {num_experts}), got {expert_id!r}")
    return expert_id // -(-num_experts // num_ranks)


def _first_ones_one_more(count: int, parts: int, part: int) -> tuple[int, int]:
    """``count`` items over ``parts`` in contiguous blocks, the first ``count % parts`` one item
    longer."""
    base, extra = divmod(count, parts)
    start = part * base + min(part, extra)
    return start, start + base + (part < extra)


def balanced_range(num_experts: int, num_ranks: int, rank: int) -> tuple[int, int]:
    """The tempting split, **not** the layout rule: the first ``E % k`` ranks hold one more expert.

    Named here, beside the rule it breaks, so that where the two disagree is computed in one place:
    the matrix's uneven classes (:func:`uneven_classes`) and the negative controls that use this
    split.
    """
    _check(num_experts, num_ranks)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be an int in [0, {num_ranks}), got {rank!r}")
    return _first_ones_one_more(num_experts, num_ranks, rank)


def stage_layers(num_layers: int, pp: int, stage: int) -> tuple[int, int]:
    """``(start, end)`` of the global layers pipeline stage ``stage`` of ``pp`` holds (end
    exclusive).

    The stage rule, beside the expert rule and asked the same way: contiguous blocks, the first
    ``L % pp`` stages one layer longer -- torchtitan's default split of decoder layers (it also
    weighs the embedding and output, which this model does not have); Megatron-Core's default needs
    ``pp`` to divide ``L`` and then agrees.  Layers are not rows of one tensor, so no DTensor layout
    constrains this split: what a checkpoint needs is only that a stage names its layers by their
    global index (stage 1 of 2 holds layers 2 and 3 of 4, saved as ``layers.2`` and ``layers.3``).
    """
    for name, value in (("num_layers", num_layers), ("pp", pp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if pp > num_layers:
        raise ValueError(f"pp={pp} stages need at least {pp} layers to hold one each, got "
                         f"num_layers={num_layers}")
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < pp:
        raise ValueError(f"stage must be an int in [0, {pp}), got {stage!r}")
    return _first_ones_one_more(num_layers, pp, stage)


def mtp_stage(pp: int) -> int:
    """The pipeline stage of ``pp`` that holds every multi-token-prediction layer: the last.

    The stage rule of the MTP layers, beside the main stack's: they read the main stack's last
    hidden state and feed the output head, both on the last stage (DeepSeek-V3 puts them there,
    Megatron-Core's ``mtp_num_layers`` builds them in the last stage's model; torchtitan 0.3.0
    refuses MTP with pipeline parallelism).  MTP layer ``i`` is global layer ``num_layers + i``
    (:func:`stage_mtp_layers`), named ``mtp.{i}`` in the state dict, whatever the stage it runs on.
    """
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp must be an int >= 1, got {pp!r}")
    return pp - 1


def stage_mtp_layers(num_layers: int, mtp_layers: int, pp: int, stage: int) -> tuple[int, int]:
    """``(start, end)`` of the global layer ids of the MTP layers stage ``stage`` of ``pp`` holds
    (end exclusive): ``(num_layers, num_layers + mtp_layers)`` on :func:`mtp_stage`, an empty range
    at ``num_layers`` elsewhere."""
    stage_layers(num_layers, pp, stage)  # the same checks of num_layers, pp and stage
    if isinstance(mtp_layers, bool) or not isinstance(mtp_layers, int) or mtp_layers < 0:
        raise ValueError(f"mtp_layers must be an int >= 0, got {mtp_layers!r}")
    return num_layers, num_layers + (mtp_layers if stage == mtp_stage(pp) else 0)


def layer_stage(layer: int, num_layers: int, pp: int, mtp_layers: int = 0) -> int:
    """The pipeline stage that holds global layer ``layer`` (:func:`stage_layers`' inverse); a layer
    id from ``num_layers`` on is an MTP layer's (``mtp_layers`` of them), on :func:`mtp_stage`."""
    layers = num_layers + mtp_layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layers:
        raise ValueError(f"layer must be an int in [0, {layers}), got {layer!r}")
    if layer >= num_layers:
        return mtp_stage(pp)
    return next(s for s in range(pp) if layer < stage_layers(num_layers, pp, s)[1])


#: what an uneven split (``E % k != 0``) can put in front of a framework, and so what a bug needs to
#: show itself.
UNEVEN_CLASSES = {
    "partial": "a rank holding a partial chunk",
    "empty": "a rank holding no expert",
    "miscount": "the balanced split's row counts disagreeing with the chunk's (a shape mismatch: "
    "loud)", "mislabel": "the balanced split's first ids disagreeing where the row counts agree "
    "(silent: a rank files its experts under other experts' ids)",
}


def uneven_classes(num_experts: int, num_ranks: int) -> tuple[str, ...]:
    """Which of :data:`UNEVEN_CLASSES` splitting ``num_experts`` over ``num_ranks`` reaches, in that
    order.

    E=6 on 4 ranks (``2, 2, 2, 0`` against the balanced ``2, 2, 1, 1``) reaches ``empty`` and
    ``miscount``; E=5 on 4 (``2, 2, 1, 0`` against ``2, 1, 1, 1``) reaches all four: rank 2 holds
    one expert under both splits, expert 4 by the chunk's and expert 3 by the balanced one's.
    """
    _check(num_experts, num_ranks)
    chunk = -(-num_experts // num_ranks)
    found: set[str] = set()
    for rank in range(num_ranks):
        start, end = expert_range(num_experts, num_ranks, rank)
        first, last = balanced_range(num_experts, num_ranks, rank)
        if 0 < end - start < chunk:
            found.add("partial")
        if end == start:
            found.add("empty")
        if end - start != last - first:
            found.add("miscount")
        elif end > start and start != first:
            found.add("mislabel")
    return tuple(name for name in UNEVEN_CLASSES if name in found)

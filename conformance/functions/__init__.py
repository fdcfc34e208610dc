"""The functions suite: does a framework's state-dict helpers behave like the reference, rank by
rank?

A framework hands in a module (or an object) exposing the nine functions of
:mod:`reference_impl.state_dict_utils`.  Inside a real gloo world, on every rank, the suite builds
the same inputs once -- real DTensors made by ``distribute_tensor`` (so DTensor itself decides which
rows a rank holds), plain tensors, device meshes -- and calls the framework's function and the
reference's on them, in the same order on every rank (``create_dtensor_from_local`` is collective).
Each pair of outcomes is compared for meaning, not for form:

- returned values: ints, bools and tuples by value; tensors by local values (``torch.equal``), and
  for DTensors also global shape, placements and mesh dim names; meshes by dim names, shape and
  ranks;
- aliasing: a tensor the reference returns as a view of the input's local storage must be a view in
  the framework too, because a copy silently detaches loaded weights from the model;
- errors: by family only (``ValueError``, ``TypeError``, another class, or no error), never by
  message, so a framework that returns quietly where the reference refuses bad input is caught.

One :class:`FunctionsCell` is one mesh kind at one EP degree ``k``; within it every expert count E
in :data:`NUM_EXPERTS` (1..16: even, uneven and E < k) and all nine functions run in one call,
because a world call costs far more than the work inside it.  The cells cover 1-D ``ep`` at k =
1..4, ``(dp, ep)``, ``(ep_replicate, ep)``, nested ``(ep, dp_shard)`` with ``(Shard(0), Shard(0))``,
EP-free FSDP meshes (``dp_shard_cp`` and ``(dp, dp_shard)``), inner-axis shards and ``Replicate()``
on the ep dim.

Why so many uneven E: the reference places experts by DTensor's own ``Shard(0)`` rule
(:func:`reference_impl.layout.expert_range`, i.e. ``torch.chunk``), and the tempting "first E % k
ranks get one more" split agrees with it whenever k divides E and often when it does not (E=7, k=4),
but not always (E=6, k=4: ``2, 2, 2, 0`` versus ``2, 2, 1, 1``).  Only a grid finds those E.

:func:`check_functions` returns one record per function for its rank; :func:`merge_rank_records`
folds the ranks' records into one per function for the report.

Modules: :mod:`.cells` (which cells exist), :mod:`.rank` (what a rank does), :mod:`.merge` (how the
controller folds the ranks' records), as the checkpoint suite splits ``matrix``, ``checks`` and
``items``.
"""

from conformance.functions.cells import (
    FUNCTIONS,
    NUM_EXPERTS,
    REFERENCE,
    FunctionsCell,
    functions_cells,
)

__all__ = ["FUNCTIONS", "NUM_EXPERTS", "REFERENCE", "FunctionsCell", "functions_cells"]

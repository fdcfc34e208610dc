"""Megatron-Core on CPU for the ``megatron`` adapter: scoped CUDA bypasses and process-group
hygiene.

CUDA hard-wires on Megatron's CPU path, each bypassed only inside this adapter's own calls by
:func:`megatron_on_cpu` (patches module attributes and restores them on exit):

* ``dist_checkpointing/strategies/filesystem_async.py``, ``FileSystemWriterAsync.preload_tensors``:
  ``torch.cuda.synchronize()`` after the (no-op on CPU) device-to-host copies;
* ``dist_checkpointing/strategies/state_dict_saver.py``, ``save_state_dict_async_finalize``: the
  failure flag it broadcasts is allocated on ``torch.cuda.current_device()``;
* ``optimizer/optimizer.py``, ``FP32Optimizer.__init__``: its loss scale ``torch.tensor([1.0],
  device='cuda')``;
* ``transformer/moe/grouped_gemm_util.py``, ``assert_grouped_gemm_is_available`` (called by
  ``GroupedMLP.__init__``): the ``grouped_gemm`` CUDA package, used only by ``GroupedMLP.forward``
  (never by build, save or load).

In those three modules the ``torch`` global is swapped for a proxy whose ``cuda.synchronize`` does
nothing, whose ``cuda.current_device()`` is the CPU and whose ``tensor(..., device='cuda')``
allocates on the CPU; everything else is torch.  :func:`megatron_forward_on_cpu` does the same for
``MoELayer.forward`` (each bypass named there).  Not bypassed because never run here: the
``alltoall`` dispatcher (a ``torch.cuda.Stream`` at construction).

Process hygiene.  The save path's writer results go through a module-global queue that Megatron
creates as a ``multiprocessing`` *spawn* ``Manager``
(``filesystem_async._get_write_results_queue``): it starts a server process that re-imports the main
module and costs 4-6 s at a process's first save.  The save here is synchronous and runs in this
process, so the bypass context puts a plain ``queue.Queue`` there (restored afterwards): no Manager
is ever started.  Megatron still forks its writer processes (``write_preloaded_data_multiproc``), as
in training.  ``destroy_model_parallel()`` leaves most of the groups ``initialize_model_parallel``
created alive; the adapter destroys every one of them at the end of each ``save`` and at the end of
each cell (``end_cell``: the layers keep their EP groups, which the checks after a load -- the
forward -- still use), and before a new set-up, so a rank process that runs many cells at several EP
degrees holds no Megatron group between cells. ``initialize_model_parallel`` runs with
``create_gloo_process_groups=False``: the world is gloo already, and the extra gloo groups serve
only the distributed optimizer.

The ground truth's expert-bias update runs under :func:`expert_bias_update_over` its one-rank
group: ``moe_utils.get_updated_expert_bias`` reduces over ``parallel_state``'s group whatever groups
the layers were built with.

The ground truth's optimizer set-up runs under :func:`one_rank_world`: ``optimizer/__init__.py``,
``_get_param_groups``, aligns param-group keys with an ``all_gather_object`` over the *world*, which
the truth (built on each rank alone) must not do; that module sees a one-rank ``torch.distributed``
while it builds.  :func:`tear_down` destroys exactly the groups ``initialize_model_parallel``
created (those that appeared during the call), never a group the harness or anyone else made
meanwhile.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator
from typing import Any

#: ProcessGroupCollection fields the layers and the optimizer read (the ground truth's one-rank
#: view).
_PG_FIELDS = ("ep", "tp", "cp", "pp", "expt_tp", "expt_dp", "tp_ep", "tp_cp", "tp_dp_cp", "dp",
              "dp_cp", "mp", "tp_ep_pp", "intra_dist_opt")
#: the process groups this process's current Megatron set-up created (None: no set-up).
_CREATED: set[Any] | None = None


# -- CUDA bypasses, scoped to the adapter's calls --------------------------------------------------
class _CpuCuda:
    """``torch.cuda`` as the three patched Megatron modules see it: the current device is the
    CPU."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cuda, name)


class _CpuTorch:
    """``torch`` with CUDA allocations of ``torch.tensor`` on the CPU; everything else is torch."""

    cuda = _CpuCuda()

    @staticmethod
    def tensor(*args: Any, device: Any = None, **kwargs: Any) -> Any:
        import torch

        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        kwargs["device"] = device
        return torch.tensor(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)


class _OneRankDistributed:
    """``torch.distributed`` as a world of one rank: what the ground truth's optimizer set-up
    sees."""

    @staticmethod
    def get_world_size(group: Any = None) -> int:
        return 1

    @staticmethod
    def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
        object_list[0] = obj

    def __getattr__(self, name: str) -> Any:
        import torch.distributed

        return getattr(torch.distributed, name)


class _OneRankTorch:
    """``torch`` whose ``distributed`` is :class:`_OneRankDistributed`; everything else is torch."""

    distributed = _OneRankDistributed()

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)


_ABSENT = object()


def _own(owner: Any, name: str) -> Any:
    """``owner.name`` as ``owner`` itself holds it; :data:`_ABSENT` for a class attribute it only
    inherits (restored by deleting, so the base class's stays the one found)."""
    if isinstance(owner, type):
        return vars(owner).get(name, _ABSENT)
    return getattr(owner, name, _ABSENT)


@contextlib.contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set module attributes for the duration of the block; restore them on exit, also on error (an
    attribute the module did not have is deleted again)."""
    saved = [(module, name, _own(module, name)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            if value is _ABSENT:
                delattr(module, name)
            else:
                setattr(module, name, value)


@contextlib.contextmanager
def one_rank_world() -> Iterator[None]:
    """``get_megatron_optimizer`` for the ground truth, as if this rank were the whole world.

    ``optimizer/__init__.py``, ``_get_param_groups``: aligns param-group keys across ranks with an
    ``all_gather_object`` over the *world* (not over any group it is given).  The ground truth is
    built on each rank alone, so that module sees a one-rank ``torch.distributed`` while it builds.
    """
    import megatron.core.optimizer as optimizer_package

    with _patched([(optimizer_package, "torch", _OneRankTorch())]):
        yield


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Megatron's save, load, GroupedMLP and FP32Optimizer on CPU, for the duration of one adapter
    call.

    Patches (see the module docstring for why each): the ``torch`` global of
    ``filesystem_async``, ``state_dict_saver`` and ``optimizer.optimizer``; ``filesystem_async``'s
    results queue (a process-local queue instead of a spawn Manager); ``grouped_gemm_util``'s
    availability assertion.  Everything is restored on exit, also on error.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async, state_dict_saver
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.transformer.moe import grouped_gemm_util

    patches: list[tuple[Any, str, Any]] = [(m, "torch", _CpuTorch())
                                           for m in (filesystem_async, state_dict_saver,
                                                     megatron_optimizer)]
    patches += [(filesystem_async, "_results_queue", queue.Queue()),
                (grouped_gemm_util, "assert_grouped_gemm_is_available", lambda: None)]
    with _patched(patches):
        yield


@contextlib.contextmanager
def megatron_forward_on_cpu() -> Iterator[None]:
    """``MoELayer.forward`` (SequentialMLP, the ``allgather`` dispatcher) on CPU, for one adapter
    ``forward`` call.

    * ``transformer/moe/moe_utils.py``, ``RouterGatingLinearFunction.forward`` reads the name
      ``te_general_gemm``, which the module defines only when Transformer Engine imports (a
      ``NameError`` without it, megatron-core 0.16.0): set to ``None``, its own "no TE" branch (a
      plain matmul) runs;
    * ``transformer/moe/router.py``, ``Router.gating``: moves its weight to
      ``torch.cuda.current_device()`` at the first forward -- the CPU here, so the weight stays the
      tensor the adapter wrote (``TopKRouter.__init__`` allocates its expert bias and token counter
      there too: the adapter builds its layers in this context);
    * ``core/utils.py``, ``GlobalMemoryBuffer.get_tensor`` (the dispatcher's token gather at ep *
      etp > 1) and ``tensor_parallel/mappings.py`` (its gathers' and reduce-scatters' buffers):
      allocate on ``torch.cuda.current_device()``, the CPU here.
    """
    from megatron.core import utils as megatron_utils
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, router

    patches: list[tuple[Any, str, Any]] = [(m, "torch", _CpuTorch())
                                           for m in (router, megatron_utils, mappings)]
    patches.append((moe_utils, "te_general_gemm", None))
    with _patched(patches):
        yield


class _ParallelStateOver:
    """``parallel_state`` as ``moe_utils.get_updated_expert_bias`` sees it: its
    tensor-and-data-parallel group is ``group``; everything else is ``parallel_state``."""

    def __init__(self, group: Any) -> None:
        self._group = group

    def get_tensor_and_data_parallel_group(self, check_initialized: bool = True,
                                           with_context_parallel: bool = False) -> Any:
        return self._group

    def __getattr__(self, name: str) -> Any:
        from megatron.core import parallel_state

        return getattr(parallel_state, name)


@contextlib.contextmanager
def expert_bias_update_over(group: Any) -> Iterator[None]:
    """The expert-bias update's all-reduce over ``group`` (the ground truth's one-rank group).

    ``transformer/moe/moe_utils.py``, ``get_updated_expert_bias``: sums the token counts over
    ``parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)`` whatever
    process groups the layers were built with (its own TODO says so); the ground truth, built
    through a ``pg_collection`` without ``parallel_state``, would fail its assertion that the
    group is initialised.
    """
    from megatron.core.transformer.moe import moe_utils

    with _patched([(moe_utils, "parallel_state", _ParallelStateOver(group))]):
        yield


# -- process groups --------------------------------------------------------------------------------
def _live_groups() -> set[Any]:
    from torch.distributed.distributed_c10d import _world

    return set(_world.pg_map)


def set_up(ep: int, etp: int = 1, *, gloo_groups: bool = False) -> None:
    """Megatron's parallel state at EP degree ``ep`` and expert-TP degree ``etp`` over the world's
    default group (a collective); ``gloo_groups``: also Megatron's gloo copies of the data-parallel
    groups, which only the distributed optimizer's gather/scatter formats use."""
    global _CREATED
    from megatron.core import parallel_state

    tear_down()
    before = _live_groups()
    try:
        parallel_state.initialize_model_parallel(expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=etp,
                                                 create_gloo_process_groups=gloo_groups)
    finally:
        _CREATED = _live_groups() - before


def tear_down() -> None:
    """``destroy_model_parallel()``, then every group :func:`set_up` created that it left alive
    (most)."""
    global _CREATED
    import torch.distributed as dist
    from megatron.core import parallel_state

    if _CREATED is None:
        return
    parallel_state.destroy_model_parallel()
    for group in _CREATED & _live_groups():
        dist.destroy_process_group(group)
    _CREATED = None


_ONE_RANK_GROUP: Any = None


def _one_rank_group() -> Any:
    """This rank alone as a c10d-registered gloo group: made by this rank only
    (``use_local_synchronization``), once per world, and never in a collective with another rank."""
    global _ONE_RANK_GROUP
    import torch.distributed as dist

    if _ONE_RANK_GROUP is None or _ONE_RANK_GROUP not in _live_groups():
        _ONE_RANK_GROUP = dist.new_group([dist.get_rank()], backend="gloo",
                                         use_local_synchronization=True)
    return _ONE_RANK_GROUP


def one_rank_view(*, registered: bool = False) -> Any:
    """A ``ProcessGroupCollection`` whose every group is one single-rank gloo group (ground truth).

    By default a private ``ProcessGroupGloo`` (never registered with c10d).  ``registered=True``
    gives a registered one instead (:func:`_one_rank_group`): Megatron's ``DistributedDataParallel``
    reduces gradients through c10d's coalescing manager, which needs a ``ProcessGroup`` (the private
    backend lacks ``reduce_scatter_single_coalesced``)."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    # torch's stub omits the default of ProcessGroupGloo's timeout (30 minutes), which the binding
    # has
    group = (_one_rank_group() if registered
             else dist.ProcessGroupGloo(dist.HashStore(), 0, 1))  # type: ignore[call-arg]
    view = ProcessGroupCollection()
    for name in _PG_FIELDS:
        setattr(view, name, group)
    return view

"""The world engine driven directly: reuse, per-rank failures, deaths, hangs, bad input.

These run real 4-rank gloo worlds through the session's supervisor (``moe_ep_engine``).
"""

from __future__ import annotations

import ctypes
import os
import re
import time

import pytest

from pytest_moe_ep.world import RankFailure, WorldTimeout
from pytest_moe_ep.world.supervisor import Supervisor

N = 4


# -- functions the ranks run (module level, so ranks can import them) ----------------------------
def rank_and_pid() -> tuple[int, int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size(), os.getpid()


def noop() -> None:
    return None


def raise_on(rank: int) -> str:
    import torch.distributed as dist

    if dist.get_rank() == rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    return "fine"


def hang_on(rank: int) -> None:
    import torch.distributed as dist

    if dist.get_rank() == rank:
        time.sleep(3600)
    dist.barrier()


def deadlock() -> None:
    """Rank 0 all-reduces over the pair {0, 1} while ranks 1-3 enter a barrier of the whole world:
    no collective is ever joined by all its members.  Every rank says it is in the save's save()."""
    import torch
    import torch.distributed as dist

    from pytest_moe_ep.world.activity import activity

    pair = dist.new_group([0, 1])
    with activity(side="save", call="save"):
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1), group=pair)
        else:
            dist.barrier()


def exit_on(rank: int, code: int) -> None:
    import torch.distributed as dist

    if dist.get_rank() == rank:
        os._exit(code)
    dist.barrier()


def segfault_on(rank: int) -> None:
    import torch.distributed as dist

    if dist.get_rank() == rank:
        ctypes.string_at(0)
    dist.barrier()


def environment() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}


def unpicklable_result() -> object:
    return lambda: None


def raise_everywhere(unwaited_on: int | None = None) -> None:
    """Every rank raises after one matched all-reduce; ``unwaited_on`` first posts one more
    all-reduce it never waits for, which its peers never reach."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))
    if dist.get_rank() == unwaited_on:
        dist.all_reduce(torch.ones(1), async_op=True)
    raise ValueError(f"rank {dist.get_rank()} refuses")


def all_reduce_sum(value: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value])
    dist.all_reduce(t)
    return int(t.item())


# -- tests ---------------------------------------------------------------------------------------
def test_world_serves_100_calls_with_one_start(moe_ep_engine: Supervisor) -> None:
    first = moe_ep_engine.run(rank_and_pid, world_size=N, backend="gloo")
    starts = moe_ep_engine.starts
    assert [r for r, _, _ in first] == list(range(N))
    assert {w for _, w, _ in first} == {N}
    for _ in range(100):
        assert moe_ep_engine.run(noop, world_size=N, backend="gloo") == [None] * N
    assert moe_ep_engine.run(all_reduce_sum, 3, world_size=N, backend="gloo") == [3 * N] * N
    assert moe_ep_engine.starts == starts, "the world was restarted during 100 calls"
    assert moe_ep_engine.run(rank_and_pid, world_size=N, backend="gloo") == first


def test_exception_on_one_rank_names_it_and_replaces_the_world(moe_ep_engine: Supervisor) -> None:
    before = moe_ep_engine.run(rank_and_pid, world_size=N, backend="gloo")
    with pytest.raises(RankFailure) as info:
        moe_ep_engine.run(raise_on, 2, world_size=N, backend="gloo")
    err = info.value
    assert err.at_fault == [2] and err.replaced_because == "not every rank raised and returned"
    assert ("failed on rank(s) 2: rank 2 raised ValueError: deliberate failure on rank 2"
            in err.headline)
    report = err.report()
    assert "rank 2 traceback" in report and 'in raise_on' in report
    assert "rank 0: returned" in report
    after = moe_ep_engine.run(rank_and_pid, world_size=N, backend="gloo")
    assert {p
            for _, _, p in after}.isdisjoint({p for _, _, p in before}), "a broken world was reused"


def test_a_failure_every_rank_raised_in_step_keeps_the_world(moe_ep_engine: Supervisor) -> None:
    """A framework refusing a load on every rank: the world and what its ranks built stay."""
    before = moe_ep_engine.run(rank_and_pid, world_size=N, backend="gloo")
    starts = moe_ep_engine.starts
    with pytest.raises(RankFailure) as info:
        moe_ep_engine.run(raise_everywhere, world_size=N, backend="gloo")
    assert info.value.at_fault == list(range(N)) and "rank 3 refuses" in info.value.report()
    assert info.value.kept and not info.value.replaced_because
    assert moe_ep_engine.run(rank_and_pid, world_size=N, backend="gloo") == before
    assert moe_ep_engine.starts == starts
    assert moe_ep_engine.run(all_reduce_sum, 2, world_size=N, backend="gloo") == [2 * N] * N


def test_a_rank_that_raised_out_of_step_gets_the_world_replaced(moe_ep_engine: Supervisor) -> None:
    """Negative control: rank 1 posted a collective its peers never reached; kept, the world would
    pair it with their next one."""
    before = moe_ep_engine.run(rank_and_pid, world_size=N, backend="gloo")
    with pytest.raises(RankFailure) as info:
        moe_ep_engine.run(raise_everywhere, 1, world_size=N, backend="gloo")
    found = re.fullmatch(r"process group 0 ran different numbers of collectives \(rank 0: (\d+), "
                         r"rank 1: (\d+), rank 2: \1, rank 3: \1\)", info.value.replaced_because)
    assert not info.value.kept and found and int(found[2]) == int(found[1]) + 1, info.value
    after = moe_ep_engine.run(rank_and_pid, world_size=N, backend="gloo")
    assert {p for _, _, p in after}.isdisjoint({p for _, _, p in before}), "an out-of-step world"
    assert moe_ep_engine.run(all_reduce_sum, 2, world_size=N, backend="gloo") == [2 * N] * N


def test_out_of_step_names_the_group_and_the_ranks() -> None:
    from pytest_moe_ep.world.health import out_of_step

    group = {"0": ((0, 1, 2), 5)}
    assert out_of_step([group, group, group]) is None
    assert out_of_step([group, {"0": ((0, 1, 2), 6)}, group]) == (
        "process group 0 ran different numbers of collectives (rank 0: 5, rank 1: 6, rank 2: 5)")
    assert out_of_step([group, {}, group]) == (
        "process group 0 (ranks [0, 1, 2]) is unknown to rank(s) [1]")
    pair = {"0": ((0, 1, 2), 5), "1": ((0, 1), 2)}
    assert out_of_step([pair, pair, group]) is None  # rank 2 is no member of group 1


def test_hang_names_the_suspect_with_its_stack(moe_ep_engine: Supervisor) -> None:
    moe_ep_engine.run(noop, world_size=N, backend="gloo")
    t0 = time.monotonic()
    with pytest.raises(WorldTimeout) as info:
        moe_ep_engine.run(hang_on, 1, world_size=N, backend="gloo", timeout=3)
    elapsed = time.monotonic() - t0
    assert elapsed < 3 + 10, f"the hang was reported after {elapsed:.1f}s, deadline 3s"
    err = info.value
    assert err.at_fault == [1]
    assert err.kind == "hang" and err.waiting == [0, 2, 3]
    assert "hung: passed its 3s deadline; suspect rank 1 (rank 1 at " in err.headline
    assert "in hang_on); ranks 0, 2, 3 waiting in a collective" in err.headline
    assert err.locations[1].endswith("in hang_on") and "test_world_engine.py:" in err.locations[1]
    report = err.report()
    assert "rank 1 stack when given up (suspect)" in report
    suspect_stack = report.split("rank 1 stack when given up (suspect)")[1].split("--------")[1]
    assert "in hang_on" in suspect_stack
    victim = report.split("rank 0 (victim)")[1].split("--------")[1]
    assert "waiting in a collective at " in victim and "in barrier" in victim
    assert moe_ep_engine.run(all_reduce_sum, 1, world_size=N, backend="gloo") == [N] * N


SAVING = {"side": "save", "call": "save"}
#: where each rank of :func:`deadlock` waits, as the hang's cause says it.
DEADLOCKED = (r"rank 0 in all_reduce \(torch/distributed/distributed_c10d\.py:\d+\) from "
              r"\S*test_world_engine\.py:\d+ in deadlock; ranks 1, 2, 3 in barrier "
              r"\(torch/distributed/distributed_c10d\.py:\d+\) from "
              r"\S*test_world_engine\.py:\d+ in deadlock")


def test_a_deadlock_names_where_every_rank_waits_and_what_it_was_doing(
        moe_ep_engine: Supervisor) -> None:
    """No rank runs its own code: the story is each rank's collective and its caller, and what
    every rank said it was doing (:mod:`pytest_moe_ep.world.activity`)."""
    with pytest.raises(WorldTimeout) as info:
        moe_ep_engine.run(deadlock, world_size=N, backend="gloo", timeout=3)
    err = info.value
    assert err.at_fault == [0, 1, 2, 3] and err.waiting == []
    assert re.fullmatch(r"hung: passed its 3s deadline with every rank waiting in a collective "
                        rf"\(a deadlock\): {DEADLOCKED}", err.cause), err.cause
    assert err.activity == dict.fromkeys(range(N), SAVING)
    assert moe_ep_engine.run(all_reduce_sum, 1, world_size=N, backend="gloo") == [N] * N


def test_a_deadlock_the_process_groups_timeout_ends_is_still_a_hang() -> None:
    """When the process group's timeout fires before the deadline, every rank raises the transport's
    own text, which names no call: the call is still a hang, each rank's place first (from its
    traceback), the transport's text after, and each rank's activity as it raised."""
    engine = Supervisor(pg_timeout_s=2.0, default_timeout_s=60.0)
    try:
        with pytest.raises(WorldTimeout) as info:
            engine.run(deadlock, world_size=N, backend="gloo")
    finally:
        engine.shutdown()
    err = info.value
    assert re.match(r"hung: every rank timed out in a collective after the process group's 2s "
                    rf"timeout \(a deadlock\): {DEADLOCKED}; the transport: rank", err.cause), \
        err.cause
    assert err.activity == dict.fromkeys(range(N), SAVING)
    assert err.replaced_because == "not every rank raised and returned"  # no probe of a broken one


def test_dead_rank_is_reported_with_its_exit_code(moe_ep_engine: Supervisor) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        moe_ep_engine.run(exit_on, 3, 3, world_size=N, backend="gloo", timeout=120)
    assert time.monotonic() - t0 < 30, "the other ranks were left waiting for the dead one"
    assert info.value.at_fault == [3]
    assert "rank 3 exited with code 3" in info.value.headline
    assert moe_ep_engine.run(noop, world_size=N, backend="gloo") == [None] * N


def test_segfault_is_reported_with_the_signal_and_stack(moe_ep_engine: Supervisor) -> None:
    with pytest.raises(RankFailure) as info:
        moe_ep_engine.run(segfault_on, 0, world_size=N, backend="gloo", timeout=120)
    assert info.value.at_fault == [0]
    assert "rank 0 died of signal SIGSEGV" in info.value.headline
    assert "in segfault_on" in info.value.report()


@pytest.mark.parametrize("fn", [lambda: None, pytest.param("closure", id="closure")])
def test_functions_ranks_cannot_import_are_refused_before_starting(
        moe_ep_engine: Supervisor, fn: object) -> None:
    if fn == "closure":
        def fn() -> None:  # a function defined inside another one
            return None
    starts = moe_ep_engine.starts
    with pytest.raises(TypeError, match="cannot run on ranks: lambdas, closures"):
        moe_ep_engine.run(fn, world_size=N, backend="gloo")
    assert moe_ep_engine.starts == starts


def test_bad_world_size_and_backend(moe_ep_engine: Supervisor) -> None:
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        moe_ep_engine.run(noop, world_size=0)
    with pytest.raises(ValueError, match="unknown backend 'mpi': choose one of auto, gloo, nccl"):
        moe_ep_engine.run(noop, world_size=2, backend="mpi")


def test_unpicklable_result_is_a_clear_error(moe_ep_engine: Supervisor) -> None:
    with pytest.raises(RankFailure,
                       match=r"return value of .*unpicklable_result could not be sent"):
        moe_ep_engine.run(unpicklable_result, world_size=2, backend="gloo")


def test_inherited_rendezvous_variables_are_stripped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "10.9.9.9")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("WORLD_SIZE", "64")
    supervisor = Supervisor()
    try:
        envs = supervisor.run(environment, world_size=2, backend="gloo")
    finally:
        supervisor.shutdown()
    assert envs == [{"MASTER_ADDR": None, "MASTER_PORT": None, "RANK": str(r), "WORLD_SIZE": "2"}
                    for r in range(2)]

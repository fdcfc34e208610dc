"""A rank's state kept a block at a time reads, compares and travels exactly as its rows did.

:mod:`conformance.checks.held` keeps a packed weight's expert rows as one tensor (at 256 experts a
tensor per row was most of the harness's time in a cell) and answers per row as a mapping.  These
tests hold each block shortcut to the per-row answer it replaced: the mapping itself,
:func:`~conformance.checks.held.settle` (the block compare), the saved state's assembly from blocks
(rows that disagree named one by one, rows no rank covered left out), and -- in real 4-rank worlds
at every layout -- :func:`~conformance.checks.saved.gather`, which sends each distinct rank state
once, against every rank's state all-gathered the old way.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conformance.adapter import Spec
from conformance.adapters.reference import ReferenceAdapter
from conformance.checks import saved
from conformance.checks.held import Held, Rows, held_tensors, settle
from conformance.checks.truth import SEED_A, truth_spec
from conformance.checks.values import canonical
from conformance.layout import ParallelLayout

WORLD = 4


def _held(*blocks: Rows, **singles: Any) -> Held:
    held = Held()
    for block in blocks:
        assert held.put_rows(block) == []
    for name, tensor in singles.items():
        held.put((None, None, name), tensor, None)
    return held


def test_a_held_block_reads_as_a_mapping_of_its_rows() -> None:
    data = torch.arange(24.0).reshape(3, 2, 4)
    held = _held(Rows(0, 5, "up", data, None), norm=torch.ones(2))
    assert list(held) == [(None, None, "norm"), (0, 5, "up"), (0, 6, "up"),
                          (0, 7, "up")] and len(held) == 4
    tensor, region = held[(0, 6, "up")]
    assert region is None and torch.equal(tensor,
                                          data[1]) and tensor.data_ptr() == data[1].data_ptr()
    assert (0, 8, "up") not in held and (0, 7, "up") in held
    state = held.tensors()
    assert torch.equal(state[(0, 7, "up")],
                       data[2]) and state.whole_rows(0, "up", 6, 8).shape == (2, 2, 4)
    assert state.whole_rows(0, "up", 6, 9) is None and state.block_of((0, 5, "up")).first == 5


def test_a_row_given_twice_keeps_the_later_and_is_named() -> None:
    held = _held(Rows(0, 0, "up", torch.zeros(3, 2), None))
    # replaces the block's row: the block reads row by row
    assert held.put((0, 1, "up"), torch.ones(2)) is False
    assert held.blocks() == [] and torch.equal(held[(0, 1, "up")][0],
                                               torch.ones(2)) and len(held) == 3
    again = held.put_rows(Rows(0, 2, "up", torch.full((2, 2), 7.0), None))
    assert again == [(0, 2, "up")] and torch.equal(held[(0, 2, "up")][0],
                                                   torch.full((2,), 7.0)) and len(held) == 4


def _listed(settled: tuple[Any, ...]) -> tuple[list[Any], ...]:
    return tuple(list(keys) for keys in settled)


def test_settle_compares_a_block_at_once_and_leaves_only_the_rows_that_differ() -> None:
    torch.manual_seed(3)
    truth = _held(Rows(0, 0, "up", torch.rand(8, 4, 6), None), norm=torch.rand(3)).tensors()
    whole = truth.whole_rows(0, "up", 0, 8)
    region = (slice(0, 4), slice(3, 6))  # an expert-TP shard of each row
    got = _held(Rows(0, 2, "up", whole[2:6, :, 3:6].clone(), region))
    assert _listed(settle(got, truth)) == ([(0, e, "up") for e in range(2, 6)], [], [])
    got.blocks()[0].data[1, 0, 0] += 1.0  # expert 3 differs
    same, differ, _ = settle(got, truth)
    assert _listed(settle(got, truth)) == ([(0, 2, "up"), (0, 4, "up"), (0, 5, "up")],
                                           [(0, 3, "up")], [])
    # counted, indexed
    assert (len(same), len(differ), same[1], differ[0]) == (3, 1, (0, 4, "up"), (0, 3, "up"))
    # expert 5 differs in its last element only (its first agrees)
    got.blocks()[0].data[3, -1, -1] += 1.0
    assert _listed(settle(got, truth)) == ([(0, 2, "up"), (0, 4, "up")],
                                           [(0, 3, "up"), (0, 5, "up")], [])
    assert settle(_held(Rows(0, 2, "up", whole[2:4].double(), None)),
                  truth)[2] == [(0, 2, "up"), (0, 3, "up")]
    assert (_listed(settle(_held(norm=truth[(None, None, "norm")]), truth))
            == ([], [], [(None, None, "norm")]))
    plain = {(0, 0, "up"): (whole[0], None)}
    # not a Held: every key is the per-key checks'
    assert _listed(settle(plain, truth)) == ([], [], [(0, 0, "up")])


def test_the_saved_state_assembles_blocks_as_it_did_their_rows() -> None:
    torch.manual_seed(4)
    truth = _held(Rows(0, 0, "up", torch.rand(6, 2, 3), None)).tensors()
    whole = truth.whole_rows(0, "up", 0, 6)

    def rank(first: int, stop: int, bump: int | None = None) -> Held:
        data = whole[first:stop].clone()
        if bump is not None:
            data[bump - first, 1, 2] += 1.0
        return _held(Rows(0, first, "up", data, None))

    # rank 2 overlaps both; its expert 4 disagrees
    ranks = [rank(0, 3), rank(3, 6), rank(2, 5, bump=4)]
    got = saved.assemble([saved.pack(r) for r in ranks], truth, "ep=2")
    # the per-row way
    rows = saved.assemble([saved.pack(dict(r.items())) for r in ranks], truth, "ep=2")
    assert [(r, k) for r, k, _
            in got.conflicts] == [(2, (0, 4, "up"))] == [(r, k) for r, k, _ in rows.conflicts]
    # rows held by spans, not per row
    assert set(got.tensors) == set(rows.tensors) == set(truth) and not got.holder
    assert {k: got.holder_of(k) for k in truth} == {k: rows.holder_of(k) for k in truth} == {
        (0, e, "up"): 0 if e < 3 else 1 for e in range(6)}
    assert all(torch.equal(got.tensors[k], rows.tensors[k])
               for k in truth) and len(got.tensors.blocks()) == 1
    partial = saved.assemble([saved.pack(rank(0, 2)), saved.pack(rank(4, 6))], truth, "ep=2")
    # rows no rank held are no reference
    assert sorted(partial.tensors) == [(0, e, "up") for e in (0, 1, 4, 5)]


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize("case", ["ep1", "ep2", "ep4-E6", "ep2.etp2", "ep2.hsdp2-fsdp", "ep1-fsdp"])
def test_gather_sends_each_distinct_rank_state_once_and_puts_together_what_all_ranks_held(
        case: str) -> None:
    import torch.distributed as dist

    layouts = {"ep1": (1, 1, 1, False, 4), "ep2": (2, 1, 1, False, 4),
               "ep4-E6": (4, 1, 1, False, 6), "ep2.etp2": (2, 1, 2, False, 4),
               "ep2.hsdp2-fsdp": (2, 2, 1, True, 4), "ep1-fsdp": (1, 1, 1, True, 4)}
    ep, replicate, etp, fsdp, num_experts = layouts[case]
    layout = ParallelLayout.for_world(WORLD, ep, dp_replicate=replicate, etp=etp)
    adapter = ReferenceAdapter()
    spec = Spec(num_experts=num_experts, kind="packed", optimizer_steps=1, fsdp=fsdp, layout=layout)
    model, optimizer = adapter.build(spec, layout.build_mesh(), seed=SEED_A)
    held = canonical(adapter, model, optimizer, dist.get_rank())
    per_row = {(h.layer, h.expert, h.name): (h.local, h.region)
               for h in held_tensors([*adapter.expert_tensors(model, optimizer),
                                      *adapter.other_tensors(model, optimizer)])}
    assert held.keys() == per_row.keys() and held.blocks(), (
        f"{case}: the packed weights are held as blocks")
    assert all(torch.equal(held[k][0], t) and held[k][1] == r for k, (t, r) in per_row.items())

    truth = canonical(adapter, *adapter.build(truth_spec(spec), None, SEED_A),
                      dist.get_rank()).tensors()
    sent: list[int] = []
    real, small = saved._send, saved.SMALL_BYTES

    def counted(packed: Any, dst: int) -> None:
        sent.append(dst)
        real(packed, dst)

    saved._send = counted
    try:
        in_one = saved.gather(held, truth, case)  # small: the distinct states in one all-gather
        assert sent == [], f"{case}: a few KiB a rank went point to point, not in one all-gather"
        saved.SMALL_BYTES = 0
        # large: each distinct state to each rank that does not hold it
        got = saved.gather(held, truth, case)
    finally:
        saved._send, saved.SMALL_BYTES = real, small
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, saved.pack(per_row))
    want = saved.assemble(everyone, truth, case)
    for found in (got, in_one):
        assert set(found.tensors) == set(want.tensors)
        assert {k: found.holder_of(k)
                for k in want.tensors} == {k: want.holder_of(k) for k in want.tensors}
        assert found.conflicts == want.conflicts
        assert all(torch.equal(found.tensors[k], want.tensors[k]) for k in want.tensors)
    digests = [saved.digest(p) for p in everyone]
    sends: list[Any] = [None] * WORLD
    dist.all_gather_object(sends, sent)
    # the distinct states each rank does not hold itself
    lacking = sum(len(set(digests) - {d}) for d in digests)
    assert sum(map(len, sends)) == lacking, f"{case}: {sends} sent, {lacking} states lacking"
    assert all(len(set(to)) == len(to)
               for to in sends), f"{case}: a state sent twice to one rank: {sends}"
    if case == "ep1":
        assert lacking == 0, "every rank holds the same at ep=1 without FSDP: nothing crosses"
    _, differ, rest = settle(held, truth)
    assert not differ and set(rest) == set(held.singles()), (
        f"{case}: every block equals the truth's rows")


@pytest.mark.parametrize("seed", range(6))
def test_the_replica_check_over_blocks_finds_what_a_row_by_row_check_finds(seed: int) -> None:
    """The replica check cuts each family's experts where any rank's block starts or ends and checks
    a span once; on random holdings (blocks, single rows, etp halves, gaps, overlaps) it names
    exactly the keys and parts that a check of every row on its own names."""
    import random

    from conformance.checks.held import State
    from conformance.checks.missing import _gap, _held, _lacking, _truth_pieces

    rng = random.Random(seed)
    experts, shape = 12, (4, 6)
    truth = State()
    truth.put((None, None, "embed"), torch.zeros(3, 6))
    for layer in (0, 1):
        truth.put_rows(Rows(layer, 0, "up", torch.zeros(experts, *shape), None))
        for e in range(experts):
            truth.put((layer, e, "down"), torch.zeros(*shape))
    halves = [(slice(0, 2), slice(0, 6)), (slice(2, 4), slice(0, 6)), None]
    ranks = []
    for _ in range(3):
        held = Held()
        if rng.random() < 0.8:
            held.put((None, None, "embed"), torch.zeros(3, 6))
        for layer in (0, 1):
            first = rng.randrange(experts)
            stop = rng.randrange(first + 1, experts + 1)
            held.put_rows(Rows(layer, first, "up", torch.zeros(stop - first, *shape),
                               rng.choice(halves)))
            for e in rng.sample(range(experts), rng.randrange(experts)):
                held.put((layer, e, "down"), torch.zeros(*shape), rng.choice(halves))
        ranks.append(held)
    found = [_held(h) for h in ranks]
    missing, gaps = _lacking(found, _truth_pieces(truth), 2)

    want_missing, want_gaps = set(), {}
    for key in truth:
        regions = [h[key][1] for h in ranks if key in h]
        if not regions:
            want_missing.add(key)
            continue
        boxes = [None if r is None else tuple((s.start, s.stop) for s in r) for r in regions]
        gap = _gap(tuple(truth[key].shape), boxes, 2)
        if gap:
            want_gaps[key] = gap
    assert (missing, gaps) == (want_missing, want_gaps)
    # every seed's holdings leave whole keys and parts out: the comparison has work to do
    assert missing and gaps

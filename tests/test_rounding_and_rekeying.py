"""Unit tests of two rules: a kernel's rounding is no wrong value (:mod:`conformance.rounding`),
re-keyed state is named as re-keyed (the checkpoint comparison and the scalars check), nested
training state is walked, and the checkpoint comparison's findings come worst first.  The multi-rank
controls are in test_detection.py."""

from __future__ import annotations

import pytest
import torch

from conformance.checks.scalars import scalar_lines
from conformance.inspection import compare_indexes, index_state_dict
from conformance.rounding import ROUNDING_ULPS, describe, ulps, within_rounding
from conformance.scalars import state_scalars


def test_the_fused_kernels_rounding_of_a_shard_is_within_the_tolerance() -> None:
    """torch's fused CPU AdamW on thirds of a tensor against the whole: a real kernel's rounding
    passes."""
    torch.manual_seed(0)
    full = torch.randn(3 * 37, 3)
    whole = torch.nn.Parameter(full.clone())
    thirds = [torch.nn.Parameter(full[i * 37:(i + 1) * 37].clone()) for i in range(3)]
    one = torch.optim.AdamW([whole], lr=1e-2, weight_decay=0.1, fused=True)
    three = torch.optim.AdamW(thirds, lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(20):
        grad = torch.randn_like(full)
        whole.grad = grad.clone()
        for i, p in enumerate(thirds):
            p.grad = grad[i * 37:(i + 1) * 37].clone()
        one.step()
        three.step()
    differ = 0
    for key in ("exp_avg", "exp_avg_sq"):
        got = torch.cat([three.state[p][key] for p in thirds])
        differ += int((got != one.state[whole][key]).sum())
        assert within_rounding(got,
                               one.state[whole][key]), (key, describe(got, one.state[whole][key]))
    assert within_rounding(torch.cat([p.detach() for p in thirds]), whole.detach())
    assert differ, ("the fused kernel rounded no element differently: this control would pass "
                    "without the rule")


def test_what_is_more_than_rounding_is_outside_it() -> None:
    torch.manual_seed(1)
    want = torch.rand(4, 8) + 0.5
    assert ulps(want, want) == 0.0 and within_rounding(want.clone(), want)
    one_ulp = torch.nextafter(want, torch.full_like(want, 2.0))
    assert 0 < ulps(one_ulp, want) <= 1.0 and within_rounding(one_ulp, want)
    assert not within_rounding(want * (1 + 1e-4), want)  # ~840 ulps of the tensor's largest
    assert ulps(want * (1 + 1e-4), want) > 100 * ROUNDING_ULPS / 8
    near_zero = want.clone()
    near_zero[0, 0] = 1e-5
    off = near_zero.clone()
    # 2 ulps of the tensor's scale, ~1e6 of the element's own
    off[0, 0] += 2 * torch.finfo(torch.float32).eps
    assert within_rounding(off, near_zero)
    assert not within_rounding(want.double(), want) and not within_rounding(want[:2], want)
    assert not within_rounding(torch.tensor([1, 2]),
                               torch.tensor([1, 3])) and within_rounding(None, want) is False
    nan = want.clone()
    nan[1, 1] = float("nan")
    assert ulps(nan, want) == float("inf") and ulps(nan, nan.clone()) == 0.0
    assert "ulps" in describe(one_ulp, want)


def test_nested_training_state_is_walked() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    found = state_scalars({"scheduler": {"experts": sched, "rest": sched}, "train": {"tokens": 5}})
    assert (found["state.scheduler.experts.last_epoch"] == 0
            and found["state.scheduler.rest.base_lrs"] == [0.1])
    assert found["state.train.tokens"] == 5


def test_a_scheduler_re_keyed_under_ep_is_no_missing_scalar() -> None:
    truth = {"state.scheduler.last_epoch": 3, "state.scheduler.base_lrs": [0.1], "step": [3.0]}
    under_ep = {"state.scheduler.experts.last_epoch": 3, "state.scheduler.rest.last_epoch": 3,
                "state.scheduler.experts.base_lrs": [0.1], "state.scheduler.rest.base_lrs": [0.1],
                "step": [3.0]}
    assert scalar_lines(under_ep, truth, "after the load") == []
    wrong = {**under_ep, "state.scheduler.rest.last_epoch": 4}
    (line,) = scalar_lines(wrong, truth, "after the load")
    assert line.startswith(
        "training state 'state.scheduler.last_epoch' is re-keyed after the load as "
        "'state.scheduler.experts.last_epoch' and 1 more: values 3, 4, expected 3"), line
    grown = {"state.scheduler.rest.last_epoch": 3, "state.scheduler.experts.last_epoch": 3}
    assert scalar_lines(grown, {"state.scheduler.rest.last_epoch": 3}, "after the load") == []
    assert scalar_lines(
        {**grown, "state.scheduler.experts.last_epoch": 5}, {"state.scheduler.rest.last_epoch": 3},
         "after the load") == ["training state 'state.scheduler.experts.last_epoch' = 5 after "
                               "the load is not in the ground truth"]
    lost_group = {"param_groups.0.lr": 0.1}
    assert scalar_lines(lost_group, {"param_groups.0.lr": 0.1, "param_groups.1.lr": 0.1}, "after "
                        "the load") == ["optimizer scalar 'param_groups.1.lr' is missing after the "
                                        "load (expected 0.1)"]
    gone = {k: v for k, v in under_ep.items() if "last_epoch" not in k}
    assert scalar_lines(gone, truth, "after the load") == [
        "training state 'state.scheduler.last_epoch' is missing after the load (expected 3)"]


def _optimizer(settings: dict[str, object], per_parameter: bool,
               names: list[str]) -> dict[str, object]:
    if per_parameter:
        return {f"optimizer.param_groups.{n}.{k}": v for n in names for k, v in settings.items()}
    return {**{f"optimizer.param_groups.0.{k}": v for k, v in settings.items()},
            "optimizer.param_groups.0.params": names}


def test_re_keyed_settings_are_named_with_where_they_went_and_whether_they_agree() -> None:
    names = ["layers.0.w1", "layers.0.w2", "layers.1.w1"]
    settings = {"lr": 0.1, "amsgrad": False, "betas": [0.9, 0.999]}
    truth = index_state_dict({"w": torch.ones(2), **_optimizer(settings, False, names)}, "ep1")
    got = index_state_dict({"w": torch.ones(2), **_optimizer(settings, True, names)}, "ep2")
    (finding,) = compare_indexes(got, truth, values=True, names=("checkpoint", "ep=1 checkpoint"))
    assert finding.problem == "key_rekeyed" and finding.key == "optimizer.param_groups.0.*"
    assert ("re-keyed: its 3 field(s) (amsgrad, betas, lr) are absent from the checkpoint, which "
            "holds them under 9 other key(s)" in finding.message
            and "the values agree; absent with no counterpart: params"
            in finding.message), finding.message
    disagree = index_state_dict({"w": torch.ones(2),
                                 **_optimizer({**settings, "lr": 0.3}, True, names)}, "ep2")
    (finding,) = compare_indexes(disagree, truth, values=True,
                                 names=("checkpoint", "ep=1 checkpoint"))
    assert ("the values do not agree: lr: ['0.3'] here, ['0.1'] in the ep=1 checkpoint"
            in finding.message)


def test_a_wrong_value_leads_a_re_keying_and_rounding_is_no_finding() -> None:
    names = ["w"]
    torch.manual_seed(2)
    w, v = torch.rand(4, 4) + 0.5, torch.rand(4) + 0.5
    truth = index_state_dict({"w": w, "v": v, **_optimizer({"lr": 0.1}, False, names)}, "ep1")
    state = {"w": torch.nextafter(w, torch.full_like(w, 2.0)), "v": v * 1.01,
             **_optimizer({"lr": 0.1}, True, names)}
    found = compare_indexes(index_state_dict(state, "ep2"), truth, values=True,
                            rounding_ulps=ROUNDING_ULPS)
    assert [f.problem for f in found] == ["values_differ",
                                          "key_rekeyed"] and found[0].key == "v", found
    exact = compare_indexes(index_state_dict(state, "ep2"), truth, values=True)
    assert {f.key for f in exact if f.problem == "values_differ"} == {"w", "v"}


@pytest.mark.parametrize("rows", [[0, 2], [1]])
def test_packed_rows_within_rounding_are_no_finding(rows: list[int]) -> None:
    torch.manual_seed(3)
    packed = torch.rand(4, 2, 3) + 0.5
    got = packed.clone()
    got[rows[0]] = torch.nextafter(got[rows[0]], torch.full_like(got[rows[0]], 2.0))  # rounding
    if len(rows) > 1:
        got[rows[1]] *= 1.01  # a wrong value
    key = "layers.0.moe.experts.w1"
    found = compare_indexes(index_state_dict({key: got}), index_state_dict({key: packed}),
                            values=True, rounding_ulps=ROUNDING_ULPS)
    assert [(f.problem, f.experts) for f in found] == ([("values_differ", (rows[1],))]
                                                       if len(rows) > 1 else []), found


def test_another_experts_values_are_named_through_a_kernels_rounding() -> None:
    from conformance.checks.values import diagnose

    torch.manual_seed(4)
    truth = {(0, e, "up"): torch.rand(2, 3) + 0.5 for e in range(4)}
    rounded = torch.nextafter(truth[(0, 2, "up")], torch.full((2, 3), 2.0))
    assert diagnose((0, 1, "up"), rounded, None, truth, {}) == \
        "holds expert 2's values (within a kernel's rounding) instead of expert 1's"
    assert diagnose((0, 1, "up"), truth[(0, 2, "up")].clone(), None, truth, {}) == \
        "holds expert 2's values instead of expert 1's"
    assert diagnose((0, 1, "up"), truth[(0, 1, "up")] * 1.01, None, truth, {}).startswith(
        "values differ from the ep=1 ground truth and match no tensor of it: max abs diff")


def test_a_tensor_held_under_another_key_is_one_re_keyed_finding() -> None:
    """Megatron's ChainedOptimizer at etp>1: ``chained_0.optimizer.state.X`` holds what the ep=1
    save keeps as ``optimizer.state.X``; one finding names both, before a key that is merely
    extra."""
    torch.manual_seed(5)
    moment, extra = torch.rand(3), torch.rand(2)
    truth = index_state_dict({"optimizer.state.exp_avg.w": moment}, "ep1")
    got = index_state_dict({"chained_0.optimizer.state.exp_avg.w": moment.clone(),
                            "z.extra": extra}, "ep2")
    found = compare_indexes(got, truth, values=True, names=("checkpoint", "ep=1 checkpoint"))
    assert [(f.problem, f.key)
            for f in found] == [("key_rekeyed", "chained_0.optimizer.state.exp_avg.w"),
                                ("key_unexpected", "z.extra")], found
    assert found[0].message == ("re-keyed: holds the ep=1 checkpoint's "
                                "'optimizer.state.exp_avg.w', which is absent "
                                "from the checkpoint; the values agree") and found[0].other_key == \
        "optimizer.state.exp_avg.w"


def test_regions_that_meet_must_agree_where_they_meet_and_cover_the_tensor_to_count() -> None:
    from conformance.checks.saved import assemble, pack

    torch.manual_seed(7)
    key = (0, 2, "up")
    truth = {key: torch.rand(4, 6)}
    w = truth[key]

    def held(*boxes: tuple[slice, slice]) -> list[dict]:
        return [{key: (w[b].clone(), b)} for b in boxes]

    left, right, middle = (slice(0, 4), slice(0, 3)), (slice(0, 4),
                                                       slice(3, 6)), (slice(1, 3), slice(2, 5))
    whole = assemble([pack(r) for r in held(left, right, middle, left)], truth, "etp=2")
    # replicas and a partial overlap that agree
    assert torch.equal(whole.tensors[key], w) and not whole.conflicts
    ranks = held(left, middle, right)
    # rank 1's element at (1, 2) disagrees with rank 0's, where their regions meet
    ranks[1][key][0][0, 0] += 1.0
    named = assemble([pack(r) for r in ranks], truth, "etp=2")
    assert [(r, k) for r, k, _ in named.conflicts] == [(1, key)] and named.holder[key] == 0
    # not covered
    assert key not in assemble([pack(r) for r in held(left, middle)], truth, "etp=2").tensors
    same = [{key: (w[left].clone(), left)}] * 2 + [{key: (w[right].clone(), right)}]
    # an equal replica rank
    assert torch.equal(assemble([pack(r) for r in same], truth, "etp=2").tensors[key], w)


def test_the_saved_state_is_put_together_and_replicas_that_disagree_are_named() -> None:
    from conformance.checks.saved import assemble, check_against_truth, pack
    from conformance.checks.verdict import RankVerdict

    torch.manual_seed(6)
    truth = {(0, 0, "up"): torch.rand(4, 2), (0, 1, "up"): torch.rand(4, 2),
             (None, None, "norm"): torch.rand(3)}
    halves = [(slice(0, 2), slice(0, 2)), (slice(2, 4), slice(0, 2))]
    norm = (None, None, "norm")
    rank = [{(0, 0, "up"): (truth[(0, 0, "up")][halves[r]].clone(), halves[r]),
             (0, 1, "up"): (truth[(0, 1, "up")].clone(), None), norm: (truth[norm].clone(), None)}
            for r in range(2)]
    rank[1][(0, 1, "up")][0][0, 0] += 1.0  # rank 1's replica of expert 1 disagrees with rank 0's
    saved = assemble([pack(r) for r in rank], truth, "ep=2")
    assert set(saved.tensors) == set(truth) and torch.equal(saved.tensors[(0, 0, "up")],
                                                            truth[(0, 0, "up")])
    assert saved.holder[(0, 1, "up")] == 0 and [(r, k) for r, k, _
                                                in saved.conflicts] == [(1, (0, 1, "up"))]
    verdict = RankVerdict(0)
    check_against_truth(saved, truth, verdict)
    (m,) = verdict.mismatches
    assert (m.rank, m.expert, m.name) == (1, 1, "up") and "replicas that disagree" in m.problem
    only_half = assemble([pack({(0, 0, "up"): rank[0][(0, 0, "up")]})], truth, "ep=2")
    # half a tensor is no reference: the truth within rounding is
    assert (0, 0, "up") not in only_half.tensors

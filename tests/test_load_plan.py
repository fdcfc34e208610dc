"""A load that asks for what the checkpoint lacks is said in expert terms, whatever DCP raised.

Real 2-rank gloo worlds save a small DCP checkpoint and load it with a state dict asking for more:
DCP's own refusal (``Missing key ...``), and a raw assertion raised after a partial load (the form
that used to reach a cell's first line as ``AssertionError: item.index.fqn not in md``), both carry
what the load asked for (:func:`conformance.checks.load_plan.recorded`), which the load-failure
translation (:func:`conformance.checks.blame.translate`) names first.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from conformance.checks import load_plan
from conformance.checks.blame import load_failed, translate
from conformance.layout import ParallelLayout

KEY = "model.layers.{layer}.moe.experts.{expert}.up.weight"
LAYOUT = ParallelLayout.for_world(2, 2)


def _saved(path: Path) -> None:
    experts = {str(g): {"up": {"weight": torch.ones(3, 2) * g}} for g in range(2)}
    dcp.save({"model": {"layers": {"0": {"moe": {"experts": experts}}}}}, checkpoint_id=str(path))


def _asking(*extra: tuple[int, int]) -> dict[str, torch.Tensor]:
    state = {KEY.format(layer=0, expert=g): torch.zeros(3, 2) for g in range(2)}
    state.update({KEY.format(layer=layer, expert=g): torch.zeros(3, 2) for layer, g in extra})
    return state


@pytest.mark.moe_ep_world(2)
def test_a_key_the_checkpoint_lacks_is_named_in_expert_terms(moe_ep_shared_dir: Path) -> None:
    """DCP's own ``Missing key`` names the key: read in expert terms; the record says the same."""
    path = moe_ep_shared_dir / "ckpt"
    _saved(path)
    with pytest.raises(BaseException) as info, load_plan.recorded():
        dcp.load(_asking((1, 3)), checkpoint_id=str(path))
    assert load_plan.explain(info.value) == (
        "it asked for 1 key(s) the checkpoint lacks: 'model.layers.1.moe.experts.3.up.weight' "
        "(layer 1, expert 3, tensor 'up.weight') (the checkpoint holds 2 keys)")
    blamed = load_failed(info.value, findings=(), checked="", layout=LAYOUT, num_experts=4,
                         patterns=(), rank=dist.get_rank())
    assert re.match(rf"the load at {re.escape(LAYOUT.describe())} raised: rank \d: the model asks "
                    r"for 'model\.layers\.1\.moe\.experts\.3\.up\.weight' \(layer 1, expert 3\), "
                    "which the checkpoint does not hold", str(blamed)), blamed


@pytest.mark.moe_ep_world(2)
def test_whatever_raised_after_such_a_load_the_keys_it_asked_for_lead(
        moe_ep_shared_dir: Path) -> None:
    """A partial load that goes on and trips over a raw assertion: DCP's words name no key; the
    record does."""
    path = moe_ep_shared_dir / "ckpt"
    _saved(path)
    with pytest.raises(AssertionError) as info, load_plan.recorded():
        dcp.load(_asking((0, 2), (0, 3)), checkpoint_id=str(path),
                 planner=DefaultLoadPlanner(allow_partial_load=True))
        raise AssertionError("item.index.fqn not in md")
    text = translate(info.value, LAYOUT, 4, (), rank=dist.get_rank())
    assert text.startswith("it asked for 2 key(s) the checkpoint lacks: "
                           "'model.layers.0.moe.experts.2.up.weight' (layer 0, expert 2, tensor "
                           "'up.weight'), 'model.layers.0.moe.experts.3"), text


@pytest.mark.moe_ep_world(2)
def test_a_key_held_in_another_shape_is_said_after_dcps_own_words(moe_ep_shared_dir: Path) -> None:
    path = moe_ep_shared_dir / "ckpt"
    _saved(path)
    state = _asking()
    state[KEY.format(layer=0, expert=1)] = torch.zeros(2, 3)
    with pytest.raises(BaseException) as info, load_plan.recorded():
        dcp.load(state, checkpoint_id=str(path))
    assert load_plan.explain(info.value, shapes=False) == ""
    assert load_plan.explain(info.value) == (
        "'model.layers.0.moe.experts.1.up.weight' (layer 0, expert 1, tensor 'up.weight'): it "
        "asked for global shape [2, 3], the checkpoint holds [3, 2]")
    text = translate(info.value, LAYOUT, 4, (), rank=dist.get_rank())
    assert text.endswith("the checkpoint holds global shape [3, 2], the model offers [2, 3]"), text


def test_an_exception_without_a_record_is_left_to_dcps_words() -> None:
    key = "model.layers.2.moe.experts.1.up.weight"
    error = RuntimeError(f"Missing key in checkpoint state_dict: {key}.")
    assert load_plan.explain(error) == ""
    assert translate(error, LAYOUT, 4, (), rank=1) == (
        f"rank 1: the model asks for {key!r} (layer 2, expert 1), which the checkpoint does not "
        "hold")

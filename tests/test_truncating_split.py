"""The reference's refusal of a split other than ``Shard(0)``'s says once what differs.

A packed layer whose ranks hold ``E // ep`` rows each (a truncating split: E=5 over ep=2 leaves
expert 4 on no rank) cannot be placed as the global ``[E, ...]`` tensor: ``Shard(0)`` gives rank 0
three rows.  :class:`reference_impl.expert_layout.ExpertLayout` refuses it, naming the rows the rank
holds and the shard the placements give, each once (a real 2-rank gloo world).
"""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist
from torch import nn

from pytest_moe_ep.world.meshes import device_mesh
from reference_impl import checkpoint
from reference_impl.expert_layout import expert_layout, moe_layers
from reference_impl.moe import MoEConfig, apply_expert_parallel, build_model


@pytest.mark.moe_ep_world(2)
def test_a_truncating_split_is_refused_saying_once_what_differs() -> None:
    model = build_model(MoEConfig(num_experts=5, dim=16, hidden=32, kind="packed"), 1, seed=1)
    apply_expert_parallel(model, device_mesh((2,), ("ep",)))
    rank = dist.get_rank()
    for _, moe in moe_layers(model):  # the framework's split: E // ep rows, from rank * (E // ep)
        for weight in moe.packed_weights():
            setattr(moe, weight, nn.Parameter(getattr(moe, weight).detach()[:2].clone()))
        moe.local_expert_start, moe.num_local_experts = 2 * rank, 2
    layout = expert_layout(model, packed_form=[name for name, _ in moe_layers(model)])
    assert layout is not None
    with pytest.raises(ValueError) as info:
        layout.to_global(checkpoint.state_dict(model, None))
    message = str(info.value)
    rows = f"{2 * rank}..{2 * rank + 1}"
    held = rf"'[\w.]+_w': this rank holds rows {rows} of 5 \(local shape \(2, 32, 16\)\)"
    if rank == 0:  # Shard(0) gives it three rows: the shard differs
        assert re.match(rf"{held}, but DTensor \(Shard\(dim=0\),\) on .+ gives it shape "
                        r"\(3, 32, 16\) at offset \(0, 0, 0\): a split other than Shard\(0\)'s",
                        message), message
    else:  # two rows, as Shard(0) gives it, but 3..4, not 2..3: the place differs
        assert re.match(rf"{held}, but DTensor \(Shard\(dim=0\),\) on .+ places them at rows 3..4$",
                        message), message
    assert message.count("(2, 32, 16)") == 1 and message.count(" but ") == 1, message

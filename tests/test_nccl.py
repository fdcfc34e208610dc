"""The NCCL path: worlds with one GPU per rank.  On a machine without CUDA every test here skips
with the reason; on a GPU machine they run (see README "Development" for the command)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_moe_ep.world import BackendUnavailable, Engine


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def backend_and_device() -> tuple[str, str]:
    import torch
    import torch.distributed as dist

    t = torch.ones(1, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t)
    return dist.get_backend(), t.device.type


@pytest.mark.moe_ep_world(1, backend="nccl")
def test_nccl_world_all_reduces_on_the_gpu() -> None:
    assert backend_and_device() == ("nccl", "cuda")


@pytest.mark.moe_ep_world(1, backend="nccl")
def test_reference_checkpoint_round_trip_on_the_gpu(moe_ep_shared_dir: Path) -> None:
    import torch

    from reference_impl import checkpoint
    from reference_impl.moe import MoEConfig, build_model

    config = MoEConfig(num_experts=4, dim=16, hidden=32, kind="packed")
    model = build_model(config, num_layers=1, seed=1).cuda()
    checkpoint.save(model, None, moe_ep_shared_dir / "ckpt")
    other = build_model(config, num_layers=1, seed=2).cuda()
    checkpoint.load(other, None, moe_ep_shared_dir / "ckpt")
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items(),
                                 strict=True):
        assert a.is_cuda and torch.equal(a, b), name


def test_nccl_without_a_gpu_per_rank_is_unavailable(moe_ep_engine: Engine) -> None:
    wanted = _gpus() + 1
    with pytest.raises(BackendUnavailable, match=f"nccl needs {wanted} GPUs \\(one per rank\\)"):
        moe_ep_engine.run(backend_and_device, world_size=wanted, backend="nccl")


def test_auto_picks_nccl_only_with_a_gpu_per_rank(moe_ep_engine: Engine) -> None:
    expected = ("nccl", "cuda") if _gpus() >= 1 else ("gloo", "cpu")
    assert moe_ep_engine.run(backend_and_device, world_size=1, backend="auto") == [expected]
    assert moe_ep_engine.run(backend_and_device, world_size=_gpus() + 1,
                             backend="auto") == [("gloo", "cpu")] * (_gpus() + 1)

"""Save at one ep, load at another: every expert comes back bit for bit, weights and AdamW moments.

Every test runs on each rank of one persistent 4-rank gloo world.  The expected values never come
from another rank: each rank builds and trains an ep=1 model itself (weights and gradients are pure
functions of global names), and :func:`reference_impl.regions.global_regions` says which part of
that model a rank's (split, FSDP-sharded) parameter is.

Meshes on 4 ranks are ``(ep, dp_shard)``: ep=1 -> (1, 4), ep=2 -> (2, 2), ep=4 -> (4, 1).  With
E=6, ep=4 leaves rank 3 without experts and FSDP at ep=1 leaves rank 3 without packed rows.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pytest_moe_ep.world.meshes import device_mesh
from reference_impl import checkpoint
from reference_impl.expert_layout import check_saved_experts
from reference_impl.moe import (
    MoEConfig,
    apply_expert_parallel,
    apply_fsdp,
    build_model,
)
from reference_impl.regions import global_regions, set_deterministic_grads

WORLD = 4
LAYERS = 2
SAVE_SEED, LOAD_SEED, GRAD_SEED = 1, 2, 3
#: the saving run's AdamW settings; the loading run starts from others, so they must be loaded.
SAVED_HP = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
OTHER_HP = {"lr": 5e-1, "betas": (0.5, 0.5), "eps": 1e-3, "weight_decay": 0.0}
EPS = (1, 2, 4)


def mesh_for(ep: int) -> Any:
    return device_mesh((ep, WORLD // ep), ("ep", "dp_shard"))


def build(config: MoEConfig, ep: int, fsdp: bool, seed: int, hp: dict[str, Any]
          ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model at ``ep`` (and FSDP2 over dp_shard), with a fresh AdamW."""
    model = build_model(config, LAYERS, seed)
    mesh = mesh_for(ep)
    apply_expert_parallel(model, mesh)
    if fsdp:
        apply_fsdp(model, mesh)
    # foreach=False: the same per-tensor kernels at every shape, so results agree bit for bit.
    return model, torch.optim.AdamW(model.parameters(), foreach=False, **hp)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    for step in range(steps):
        set_deterministic_grads(model, GRAD_SEED, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@functools.cache
def reference(config: MoEConfig) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """The ep=1 run, on this rank alone: parameters and optimizer state by ep=1 name (cached: read
    only)."""
    model = build_model(config, LAYERS, SAVE_SEED)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False, **SAVED_HP)
    train(model, optimizer)
    params = {name: p.detach() for name, p in model.named_parameters()}
    return params, {name: optimizer.state[p] for name, p in model.named_parameters()}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view({1: torch.int8, 2: torch.int16, 4: torch.int32,
                            8: torch.int64}[t.element_size()])


def local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def assert_matches_reference(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                             config: MoEConfig, case: str) -> int:
    """Every parameter (and its moments) holds bit for bit what ep=1 holds there; how many
    checked."""
    params, states = reference(config)
    rank = dist.get_rank()
    checked = 0
    for piece in global_regions(model):
        where = (f"{case} rank {rank}: {piece.name} rows "
                 f"{piece.region[0].start}:{piece.region[0].stop}")
        got = piece.local
        expected = piece.of(params[piece.name])  # a fused weight is read in its frame, both sides
        assert got.shape == expected.shape, (f"{where}: shape {tuple(got.shape)} != "
                                             f"{tuple(expected.shape)}")
        assert torch.equal(bits(got),
                           bits(expected)), f"{where}: weights differ from the ep=1 run's"
        if optimizer is not None:
            state, ref_state = optimizer.state[piece.param], states[piece.name]
            for moment in ("exp_avg", "exp_avg_sq"):
                got_moment, ref_moment = piece.mine(state[moment]), piece.of(ref_state[moment])
                assert torch.equal(bits(got_moment), bits(ref_moment)), (
                    f"{where}: {moment} differs from the ep=1 run's")
            assert float(state["step"]) == float(ref_state["step"]) == 2.0, (
                f"{where}: step {float(state['step'])} != {float(ref_state['step'])}")
        checked += 1
    if optimizer is not None:
        for i, group in enumerate(optimizer.param_groups):
            for key, value in SAVED_HP.items():
                assert tuple(group[key]) == value if key == "betas" else group[key] == value, (
                    f"{case} rank {rank}: param group {i} {key}={group[key]!r}, saved {value!r}")
    return checked


def roundtrip(path: Path, config: MoEConfig, fsdp: bool, save_ep: int, load_eps: tuple[int, ...],
              load_kind: str | None = None) -> None:
    """Train and save at ``save_ep``, then load at each of ``load_eps`` (into ``load_kind`` layers)
    and compare with ep=1 (whose weights and gradients are the same in both kinds)."""
    model, optimizer = build(config, save_ep, fsdp, SAVE_SEED, SAVED_HP)
    train(model, optimizer)
    load_config = replace(config, kind=load_kind or config.kind)
    case = (f"{config.kind}/{config.activation}/E={config.num_experts}/fsdp={fsdp} saved at "
            f"ep={save_ep}{f' into {load_config.kind}' if load_config.kind != config.kind else ''}")
    # The saving run itself must equal the ep=1 run, or a load failure would blame the checkpoint.
    assert_matches_reference(model, optimizer, config, f"{case} (before saving)")
    checkpoint.save(model, optimizer, path)
    for load_ep in load_eps:
        model, optimizer = build(load_config, load_ep, fsdp, LOAD_SEED, OTHER_HP)
        checkpoint.load(model, optimizer, path)
        assert_matches_reference(model, optimizer, load_config, f"{case}, loaded at ep={load_ep}")


#: (activation, fsdp): GELU experts (no gate weight) without FSDP only -- FSDP shards every weight
#: alike.
VARIANTS = [pytest.param("swiglu", False, id="swiglu-plain"),
            pytest.param("swiglu", True, id="swiglu-fsdp"),
            pytest.param("gelu", False, id="gelu-plain")]


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize("save_ep", EPS)
@pytest.mark.parametrize(("activation", "fsdp"), VARIANTS)
@pytest.mark.parametrize("kind", ["unpacked", "packed"])
def test_roundtrip_every_ep_pair(kind: str, activation: str, fsdp: bool, save_ep: int,
                                 moe_ep_shared_dir: Path) -> None:
    config = MoEConfig(num_experts=6, kind=kind, activation=activation)  # type: ignore[arg-type]
    roundtrip(moe_ep_shared_dir / "ckpt", config, fsdp, save_ep, EPS)


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize("save_ep", EPS)
@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp"])
@pytest.mark.parametrize(("save_kind", "load_kind"),
                         [("packed", "unpacked"), ("unpacked", "packed")])
def test_cross_kind_every_ep_pair(save_kind: str, load_kind: str, fsdp: bool, save_ep: int,
                                  moe_ep_shared_dir: Path) -> None:
    """Each form into the other kind: saved packed (the packed form) it loads unpacked, saved
    unpacked (per expert) it loads packed, at every ep, moments too."""
    config = MoEConfig(num_experts=6, kind=save_kind)  # type: ignore[arg-type]
    roundtrip(moe_ep_shared_dir / "ckpt", config, fsdp, save_ep, EPS, load_kind=load_kind)


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize("num_experts", [2, 3, 5])
@pytest.mark.parametrize("kind", ["unpacked", "packed"])
def test_fewer_rows_than_shards(kind: str, num_experts: int, moe_ep_shared_dir: Path) -> None:
    """E=2, 3, 5 at ep=2 over dp_shard=2: FSDP2 pads ranks that hold fewer rows than shards."""
    config = MoEConfig(num_experts=num_experts, kind=kind, top_k=2)  # type: ignore[arg-type]
    roundtrip(moe_ep_shared_dir / "ckpt", config, True, 2, EPS)


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize("kind", ["unpacked", "packed"])
def test_model_only(kind: str, moe_ep_shared_dir: Path) -> None:
    """No optimizer: the model alone round-trips from ep=4 to ep=2."""
    config = MoEConfig(kind=kind)  # type: ignore[arg-type]
    model, optimizer = build(config, 4, False, SAVE_SEED, SAVED_HP)
    train(model, optimizer)
    checkpoint.save(model, None, moe_ep_shared_dir / "ckpt")
    model, _ = build(config, 2, False, LOAD_SEED, OTHER_HP)
    checkpoint.load(model, None, moe_ep_shared_dir / "ckpt")
    assert_matches_reference(model, None, config, f"{kind} model only, ep=4 -> ep=2")


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp"])
@pytest.mark.parametrize("kind", ["unpacked", "packed"])
def test_legacy_checkpoint_is_refused_before_loading(kind: str, fsdp: bool,
                                                     moe_ep_shared_dir: Path) -> None:
    config = MoEConfig(kind=kind)  # type: ignore[arg-type]
    path = moe_ep_shared_dir / "legacy"
    model, optimizer = build(config, 2, fsdp, SAVE_SEED, SAVED_HP)
    train(model, optimizer)
    checkpoint.save_legacy(model, optimizer, path)
    metadata = dist.checkpoint.FileSystemReader(str(path)).read_metadata()
    with pytest.raises(ValueError) as info:
        check_saved_experts(model, metadata.state_dict_metadata, where=str(path))
    message = str(info.value)
    for part in (str(path), "'layers.0.moe'", "holds 3 experts", "the model has 6"):
        assert part in message, f"{part!r} missing from: {message}"

    for load_ep in EPS:
        model, optimizer = build(config, load_ep, fsdp, LOAD_SEED, OTHER_HP)
        before = {n: local(p).detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(ValueError, match=r"holds 3 experts of MoE layer 'layers\.0\.moe'"):
            checkpoint.load(model, optimizer, path)
        for name, p in model.named_parameters():
            assert torch.equal(local(p),
                               before[name]), f"ep={load_ep}: refused load still changed {name}"
        assert not optimizer.state, f"ep={load_ep}: refused load touched the optimizer"


def _load_unguarded(model: nn.Module, path: Path) -> None:
    state = {"model": checkpoint.get_model_state_dict(model)}
    dist.checkpoint.load(state, checkpoint_id=str(path))
    checkpoint.set_model_state_dict(model, state["model"])


@pytest.mark.moe_ep_world(WORLD)
def test_legacy_checkpoint_really_loses_experts(moe_ep_shared_dir: Path) -> None:
    """The negative control: without the layout, ep=2 -> ep=2 silently gives one rank's experts."""
    config = MoEConfig(kind="unpacked")
    path = moe_ep_shared_dir / "legacy"
    model, _ = build(config, 2, False, SAVE_SEED, SAVED_HP)
    checkpoint.save_legacy(model, None, path)
    model, _ = build(config, 2, False, LOAD_SEED, OTHER_HP)
    _load_unguarded(model, path)  # succeeds: nothing tells the user anything went wrong
    moe = model.layers[0].moe
    ref = build_model(config, LAYERS, SAVE_SEED).layers[0].moe
    held = [g for g in range(6) if torch.equal(moe.experts[0].up.weight, ref.experts[g].up.weight)]
    # Both EP ranks now hold the same expert in slot 0: the checkpoint kept one rank's experts.
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, held)
    assert gathered[0] == gathered[2] and len(gathered[0]) == 1, (
        f"slot 0 holds global experts {gathered}")

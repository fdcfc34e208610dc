"""Fine-tuning state through DCP (reference_impl.checkpoint, reference_impl.tuned_checkpoint): LoRA
adapters over a frozen base held plain, MXFP4 or FP8, in every kind, saved at ep2.etp2 hold the
ep=1 save's keys and bytes; that save loads at ep=4, ep=2 x FSDP2 or ep=1 into a model of another
seed, and a save there is the ep=1 save again (so those layouts' saves are checked too); the
adapter-only save, and its load over a base from elsewhere; scales that do not match their blocks'
grid; and a negative control (scales left in place while their blocks moved) the comparison
catches.

One 4-rank world runs every case in one call: a world and its meshes cost seconds on 2 cores, a
case a fraction of that.  The truth is the ep=1 save, read whole on rank 0 and compared key by
key, bit for bit (a param group's ``params`` list aside: DCP keeps one rank's names).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pytest_moe_ep.world.meshes import device_mesh
from reference_impl import checkpoint
from reference_impl.layout import expert_range
from reference_impl.lora import apply_lora, is_adapter, quantize_experts, quantized_names
from reference_impl.moe import MoEConfig, apply_expert_parallel, apply_fsdp, build_model
from reference_impl.quantized import QuantizedShapeError
from reference_impl.regions import set_deterministic_grads

WORLD = 4
SAVE_SEED, LOAD_SEED = 1, 2
#: (ep, dp_shard, etp, FSDP2): the layouts a case is saved and loaded at.
LAYOUTS = {"ep1": (1, 4, 1, False), "ep2.etp2": (2, 1, 2, False), "ep4": (4, 1, 1, False),
           "ep2.fsdp2": (2, 2, 1, True)}
#: (kind, quantized format, block, loaded at): blocks that no etp shard of hidden 24 cuts (FP8's
#: tiles of 6 leave a partial tile on dim 16); fused rows interleaved, the frame's hard case.  Each
#: case is saved at ep=1 and ep2.etp2 and loads the ep2.etp2 save at one more layout, where a save
#: again is the ep=1 save: the cases together save and load at every layout.
CASES = [("packed", "fp8", 6, "ep4"), ("fused", "mxfp4", 4, "ep2.fsdp2"),
         ("unpacked", "mxfp4", 4, "ep1"), ("packed", None, 0, "ep2.fsdp2")]


def _config(kind: str) -> MoEConfig:
    return MoEConfig(kind=kind, num_experts=5, dim=16, hidden=24,  # type: ignore[arg-type]
                     fused_order="interleaved")


def _build(kind: str, fmt: str | None, block: int, layout: str, seed: int,
           lora_seed: int | None = None, scales_in_place: bool = False
           ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The case's model at ``layout``: base of ``seed`` (quantized), adapters of ``lora_seed``,
    with AdamW over the adapters (the base is frozen).  ``scales_in_place``: the seeded bug, a
    rank's scales are the layer's first experts' (left where they were while the blocks moved)."""
    ep, dp, etp, fsdp = LAYOUTS[layout]
    model = build_model(_config(kind), 1, seed=seed)
    if fmt is not None:
        quantize_experts(model, fmt, block)
    apply_lora(model, 2, 4.0, b_init="synthetic", seed=seed if lora_seed is None else lora_seed)
    mesh = device_mesh((ep, dp, etp), ("ep", "dp_shard", "etp"))
    if scales_in_place and fmt is not None:
        moe = model.layers[0].moe
        start, end = expert_range(5, ep, mesh["ep"].get_local_rank())
        for weight in moe.base_weights():
            scales = getattr(moe, quantized_names(fmt, weight)[1])
            scales[start:end] = scales[: end - start].clone()
    apply_expert_parallel(model, mesh)
    if fsdp:
        apply_fsdp(model, mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-2, foreach=False)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for step in range(2):
        set_deterministic_grads(model, 7, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _read(path: Path) -> dict[str, Any]:
    """A checkpoint whole on this rank, under its flattened keys (``model.layers.0.moe.lora_up_A``,
    ``optimizer.state...exp_avg``, ``optimizer.param_groups.0.lr``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dist.checkpoint.FileSystemReader(str(path))
    state: dict[str, Any] = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        if isinstance(md, TensorStorageMetadata) else "<unread>"
        for key, md in reader.read_metadata().state_dict_metadata.items()}
    dist.checkpoint.load(state, storage_reader=reader, no_dist=True)
    assert state and "<unread>" not in state.values(), f"{path}: unread entries"
    return state


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def differences(truth: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """Every key whose presence, shape, dtype or bytes differ between two read checkpoints; a
    param group's ``params`` list is each rank's own names (DCP keeps one rank's) and skipped."""
    found = [f"{k}: only in the ep=1 save" for k in truth.keys() - got.keys()]
    found += [f"{k}: not in the ep=1 save" for k in got.keys() - truth.keys()]
    for key in sorted(truth.keys() & got.keys()):
        a, b = truth[key], got[key]
        if key.endswith(".params"):
            continue
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                found.append(f"{key}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}")
            elif not torch.equal(_bits(a), _bits(b)):
                rows = [g for g in range(a.shape[0] if a.dim() else 0)
                        if not torch.equal(_bits(a[g]), _bits(b[g]))]
                found.append(f"{key}: values differ (rows {rows})")
        elif a != b:
            found.append(f"{key}: {a!r} != {b!r}")
    return found


def _agree(truth: dict[str, Any] | None, other: Path, what: str) -> None:
    """On rank 0 (which read ``truth``): ``other`` holds exactly ``truth``'s keys and bytes."""
    if truth is not None:
        diff = differences(truth, _read(other))
        assert not diff, f"{what}: {len(diff)} difference(s), first {diff[:4]}"


@pytest.mark.moe_ep_world(WORLD)
def test_fine_tuning_state_is_ep_invariant_and_loads_at_every_layout(
        moe_ep_shared_dir: Path) -> None:
    rank0 = dist.get_rank() == 0
    for index, (kind, fmt, block, target) in enumerate(CASES):
        case = f"{kind}-{fmt}"
        root = moe_ep_shared_dir / case
        for layout in ("ep1", "ep2.etp2"):
            model, optimizer = _build(kind, fmt, block, layout, SAVE_SEED)
            _train(model, optimizer)
            checkpoint.save(model, optimizer, root / layout)
            if layout == "ep1" or index % 2:
                checkpoint.save(model, optimizer, root / f"adapters.{layout}", adapters_only=True)
        truth = _read(root / "ep1") if rank0 else None
        _agree(truth, root / "ep2.etp2", f"{case} saved at ep2.etp2")
        if rank0:
            adapters = _read(root / "adapters.ep1")
            tensors = [k for k, v in adapters.items() if isinstance(v, torch.Tensor)]
            assert tensors and all(is_adapter(k) for k in tensors), case
            assert any(k.endswith("exp_avg") for k in tensors), case
            if index % 2:
                _agree(adapters, root / "adapters.ep2.etp2", f"{case} adapters at ep2.etp2")
        # the ep2.etp2 save into another seed's model at another layout: a save there is ep=1's
        model, optimizer = _build(kind, fmt, block, target, LOAD_SEED)
        checkpoint.load(model, optimizer, root / "ep2.etp2")
        checkpoint.save(model, optimizer, root / f"loaded-{target}")
        _agree(truth, root / f"loaded-{target}", f"{case} ep2.etp2 -> {target}")
        if index % 2:  # the adapters over a base from elsewhere (the release: the save's seed)
            model, optimizer = _build(kind, fmt, block, "ep4", SAVE_SEED, lora_seed=LOAD_SEED)
            with pytest.raises(ValueError, match="adapter-only checkpoint"):
                checkpoint.load(model, optimizer, root / "adapters.ep1")
            checkpoint.load(model, optimizer, root / "adapters.ep2.etp2", adapters_only=True)
            checkpoint.save(model, optimizer, root / "adapters-ep4")
            _agree(truth, root / "adapters-ep4", f"{case} adapters -> ep4")


@pytest.mark.moe_ep_world(WORLD)
def test_scales_left_in_place_are_caught_and_a_bad_grid_is_one_line(
        moe_ep_shared_dir: Path) -> None:
    """The negative control: an EP split that moves the blocks to their experts but leaves the
    scales of the rank's first rows (a rank's scales are experts 0..n-1's) saves a checkpoint the
    comparison tells from the ep=1 one, on the scales' keys only.  Then a checkpoint whose scales
    are cut to another grid is refused before anything loads, naming the key and both shapes."""
    root = moe_ep_shared_dir
    for layout in ("ep1", "ep2.etp2"):
        model, _ = _build("packed", "mxfp4", 4, layout, SAVE_SEED, scales_in_place=True)
        checkpoint.save(model, None, root / f"bad-{layout}")
    if dist.get_rank() == 0:
        diff = differences(_read(root / "bad-ep1"), _read(root / "bad-ep2.etp2"))
        assert diff and all("_scales: values differ" in d for d in diff), diff
        assert all("rows [3, 4]" in d for d in diff), diff  # ep rank 1's experts
    dist.barrier()
    model, _ = _build("packed", "mxfp4", 4, "ep1", SAVE_SEED)
    moe = model.layers[0].moe
    moe.register_buffer("down_w_scales", moe.down_w_scales[..., :2].clone())  # 6 blocks -> 2
    checkpoint.save(model, None, root / "grid")
    model, optimizer = _build("packed", "mxfp4", 4, "ep2.etp2", LOAD_SEED)
    with pytest.raises(QuantizedShapeError) as found:
        checkpoint.load(model, optimizer, root / "grid")
    e = found.value
    assert e.key == "model.layers.0.moe.down_w_scales", e.key
    assert (e.blocks_shape, e.scales_shape, e.expected) == ((5, 16, 6, 2), (5, 16, 2),
                                                            (5, 16, 6)), str(e)
    assert "\n" not in str(e) and "[5, 16, 6, 2]" in str(e) and "[5, 16, 2]" in str(e)

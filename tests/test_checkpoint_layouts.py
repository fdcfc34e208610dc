"""Save at one parallel layout, load at another: every expert comes back bit for bit, weights and
AdamW moments.

The layouts are :class:`conformance.layout.ParallelLayout`'s: EP groups of strided and of
consecutive ranks, HSDP (``dp_replicate=2``), expert tensor parallelism (``etp=2``), FSDP2 or not,
and both layer kinds, each saving its own form (packed layers the packed form, or per expert with
``per_expert=True``; unpacked layers per expert), each form loading into either kind.  Each test
saves once and loads at every layout of its world, alternating the layer kind and FSDP, and
compares each rank with the ep=1 run it makes itself
(:func:`test_checkpoint.assert_matches_reference`), never with another rank.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint import (
    LAYERS,
    LOAD_SEED,
    OTHER_HP,
    SAVE_SEED,
    SAVED_HP,
    assert_matches_reference,
    train,
)
from torch import nn

from conformance.layout import ParallelLayout
from reference_impl import checkpoint
from reference_impl.moe import MoEConfig, apply_expert_parallel, apply_fsdp, build_model

#: every layout of a 4-rank world the matrix uses.
LAYOUTS_4 = {
    "ep1": ParallelLayout.for_world(4, 1),
    "ep2": ParallelLayout.for_world(4, 2),
    "ep2c": ParallelLayout.for_world(4, 2, ep_order="consecutive"),
    "ep4": ParallelLayout.for_world(4, 4),
    "ep2.hsdp2": ParallelLayout.for_world(4, 2, dp_replicate=2),
    "ep1.hsdp2": ParallelLayout.for_world(4, 1, dp_replicate=2),
    "ep1.etp2": ParallelLayout.for_world(4, 1, etp=2),
    "ep2.etp2": ParallelLayout.for_world(4, 2, etp=2),
}
#: a few of an 8-rank world: ep up to 8, HSDP with expert TP, consecutive groups of 4.
LAYOUTS_8 = {
    "ep8": ParallelLayout.for_world(8, 8),
    "ep2.etp2.hsdp2": ParallelLayout.for_world(8, 2, etp=2, dp_replicate=2),
    "ep4c.etp2": ParallelLayout.for_world(8, 4, etp=2, ep_order="consecutive"),
    "ep2c": ParallelLayout.for_world(8, 2, ep_order="consecutive"),
}


def build_at(config: MoEConfig, layout: ParallelLayout, fsdp: bool, seed: int, hp: dict[str, Any]
             ) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = build_model(config, LAYERS, seed)
    mesh = layout.build_mesh()
    apply_expert_parallel(model, mesh)
    if fsdp:
        apply_fsdp(model, mesh)
    return model, torch.optim.AdamW(model.parameters(), foreach=False, **hp)


def roundtrip(path: Path, layouts: dict[str, ParallelLayout], save: str, kind: str, fsdp: bool,
              num_experts: int, per_expert: bool = False) -> int:
    """Save at ``layouts[save]`` (packed layers per expert with ``per_expert``), load at every
    layout (kind and FSDP alternating); how many loads."""
    config = MoEConfig(num_experts=num_experts, kind=kind, hidden=24)  # type: ignore[arg-type]
    other = "packed" if kind == "unpacked" else "unpacked"
    model, optimizer = build_at(config, layouts[save], fsdp, SAVE_SEED, SAVED_HP)
    train(model, optimizer)
    case = (f"{kind}/E={num_experts}/fsdp={fsdp}{'/per-expert' if per_expert else ''} saved at "
            f"{save}")
    assert_matches_reference(model, optimizer, config, f"{case} (before saving)")
    checkpoint.save(model, optimizer, path, per_expert=per_expert)
    for i, (name, layout) in enumerate(layouts.items()):
        load_config = replace(config, kind=kind if i % 2 == 0 else other)
        load_fsdp = fsdp if i % 3 else not fsdp
        model, optimizer = build_at(load_config, layout, load_fsdp, LOAD_SEED, OTHER_HP)
        checkpoint.load(model, optimizer, path)
        assert_matches_reference(model, optimizer, load_config,
                                 f"{case}, loaded at {name} into {load_config.kind} "
                                 f"fsdp={load_fsdp}")
    return len(layouts)


#: each save layout once, the saving kind and FSDP varying over them (kind, fsdp: every combination
#: occurs), packed saves at the first four layouts per expert and at the others (HSDP, expert TP) in
#: the packed form; every save is loaded at every layout into both kinds, with and without FSDP.
SAVES_4 = [(save, ("unpacked", "packed")[i % 2], (i // 2) % 2 == 1, i % 2 == 1 and i < 4)
           for i, save in enumerate(LAYOUTS_4)]


@pytest.mark.moe_ep_world(4)
@pytest.mark.parametrize(("save", "kind", "fsdp", "per_expert"), SAVES_4,
                         ids=[f"{s}-{k}{'-per-expert' if e else ''}" for s, k, _, e in SAVES_4])
def test_every_layout_pair_on_4_ranks(save: str, kind: str, fsdp: bool, per_expert: bool,
                                      moe_ep_shared_dir: Path) -> None:
    assert roundtrip(moe_ep_shared_dir / "ckpt", LAYOUTS_4, save, kind, fsdp, num_experts=6,
                     per_expert=per_expert) == len(LAYOUTS_4)


@pytest.mark.moe_ep_world(8)
@pytest.mark.parametrize("save", ["ep2.etp2.hsdp2", "ep8"])
def test_layouts_on_8_ranks(save: str, moe_ep_shared_dir: Path) -> None:
    """ep up to 8 (E=6 leaves two ranks without experts), HSDP with expert TP, consecutive EP
    groups."""
    roundtrip(moe_ep_shared_dir / "ckpt", LAYOUTS_8, save, "packed", save == "ep2.etp2.hsdp2",
              num_experts=6)


@pytest.mark.moe_ep_world(4)
def test_each_kind_saves_its_own_form_and_per_expert_saves_the_unpacked_form(
        moe_ep_shared_dir: Path) -> None:
    """A packed save at ep2.etp2 holds the packed form (``up_w`` ``[E, ...]`` and its moments, one
    item per rank's chunk); the same save with ``per_expert=True`` and an unpacked save at ep2c
    (FSDP) index the same per-expert tensors."""
    indexes = {}
    for name, kind, layout, fsdp, per_expert in (("packed", "packed", "ep2.etp2", False, False),
                                                  ("per-expert", "packed", "ep2.etp2", False, True),
                                                  ("unpacked", "unpacked", "ep2c", True, False)):
        config = MoEConfig(num_experts=6, kind=kind)  # type: ignore[arg-type]
        model, optimizer = build_at(config, LAYOUTS_4[layout], fsdp, SAVE_SEED, SAVED_HP)
        train(model, optimizer)
        path = moe_ep_shared_dir / f"ckpt-{name}"
        checkpoint.save(model, optimizer, path, per_expert=per_expert)
        metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        indexes[name] = {k: tuple(v.size) for k, v in metadata.items() if hasattr(v, "size")}
        # each rank's rows of each etp shard: 2 ep x 2 etp chunks per weight and moment
        if name == "packed":
            assert len(metadata["model.layers.0.moe.up_w"].chunks) == 4
    packed, per_expert, unpacked = indexes["packed"], indexes["per-expert"], indexes["unpacked"]
    assert per_expert == unpacked, ("keys only in one: "
                                    f"{sorted(set(per_expert) ^ set(unpacked))[:6]}")
    assert unpacked["model.layers.1.moe.experts.5.down.weight"] == (32, 64)
    assert unpacked["optimizer.state.layers.1.moe.experts.5.up.weight.exp_avg"] == (64, 32)
    assert not [k for k in unpacked if k.endswith("_w")
                or "_w." in k], "a packed [E, ...] tensor was saved"
    assert packed["model.layers.1.moe.down_w"] == (6, 32, 64)
    assert packed["optimizer.state.layers.1.moe.up_w.exp_avg"] == (6, 64, 32)
    assert not [k for k in packed if ".experts." in k], "a packed layer was saved per expert"


@pytest.mark.moe_ep_world(4)
@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp"])
def test_the_packed_form_loads_into_either_kind_at_every_layout(
        fsdp: bool, moe_ep_shared_dir: Path) -> None:
    """An ep=1 packed run's raw save (``up_w`` ``[E, ...]``, the packed form) loads at any layout
    into packed layers (views of their rows) and into unpacked ones (their experts stacked, loaded,
    copied back), moments and step too."""
    config = MoEConfig(num_experts=6, kind="packed", hidden=24)
    model, optimizer = build_at(config, LAYOUTS_4["ep1"], fsdp, SAVE_SEED, SAVED_HP)
    train(model, optimizer)
    path = moe_ep_shared_dir / "old-packed"
    # at ep=1 the raw state dict is whole: the old packed form
    checkpoint.save_legacy(model, optimizer, path)
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert tuple(metadata["model.layers.0.moe.up_w"].size) == (6, 24, 32)
    for (name, layout), kind in itertools.product(LAYOUTS_4.items(), ("packed", "unpacked")):
        into = replace(config, kind=kind)  # type: ignore[arg-type]
        model, optimizer = build_at(into, layout, fsdp, LOAD_SEED, OTHER_HP)
        checkpoint.load(model, optimizer, path)
        assert_matches_reference(model, optimizer, into,
                                 f"packed form (fsdp={fsdp}) loaded at {name} into {kind}")

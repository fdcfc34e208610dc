"""``compare_conversion`` on checkpoints a real 4-rank gloo world writes (issue 61).

The in-process tests (``tests/test_inspect_conversion.py``) build both sides from the model's whole
state; what a conversion tool meets is a training checkpoint saved *at a layout* -- experts split
over EP ranks, their hidden rows over expert-TP ranks, the rest sharded by FSDP2 -- which DCP
stores as chunks, and an export gathered from that layout by a collective.  So each save here is
the reference adapter's own (:meth:`~conformance.adapters.reference.ReferenceAdapter.save`) and its
own export (:func:`reference_impl.hf.export_hf`, a collective at any layout), and the inspection
reads both back as global tensors on rank 0 after the world's last collective (a failing assertion
there cannot leave the other ranks waiting).

Two layouts, one world: fused experts at ``ep2.etp2`` (each expert's gate/up rows split over two
expert-TP ranks, the export's ``gate_up_proj`` stacked from them), and packed experts at ``ep2``
under FSDP2 (the export per expert).  The seeded corruption is ``tests/seeded_hf.py``'s
:class:`~seeded_hf.HFExportRankZeroOnly` -- an export holding only the experts of rank 0's EP
rank, not gathered from the others -- which must read as exactly the other EP rank's experts
missing from every layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from conformance.adapter import Spec
from conformance.adapters.reference import ReferenceAdapter
from conformance.inspection import read_checkpoint
from conformance.inspection.conversion import compare_conversion
from conformance.layout import ParallelLayout

WORLD, E, LAYERS = 4, 4, 2


def _save_and_export(adapter: ReferenceAdapter, spec: Spec,
                     root: Path) -> tuple[Path, Path, Any]:
    """The adapter's DCP save of a model trained one step at ``spec.layout``, its Hugging Face
    export (both written by every rank), and the model."""
    assert spec.layout is not None
    model, optimizer = adapter.build(spec, spec.layout.build_mesh(), seed=1)
    training, export = root / "train", root / "hf"
    adapter.save(model, optimizer, str(training))
    adapter.export_hf(model, str(export))
    return training, export, model


@pytest.mark.moe_ep_world(WORLD)
def test_a_save_at_ep2_with_etp_or_fsdp_against_its_export(moe_ep_shared_dir: Path) -> None:
    from seeded_hf import HFExportRankZeroOnly

    fused = Spec(num_layers=LAYERS, num_experts=E, kind="fused", optimizer_steps=1,
                 layout=ParallelLayout.for_world(WORLD, 2, etp=2))
    packed = Spec(num_layers=LAYERS, num_experts=E, kind="packed", optimizer_steps=1, fsdp=True,
                  layout=ParallelLayout.for_world(WORLD, 2))
    made = {"fused": _save_and_export(ReferenceAdapter(), fused, moe_ep_shared_dir / "fused"),
            "packed": _save_and_export(ReferenceAdapter(), packed, moe_ep_shared_dir / "packed")}
    # the same packed save, exported by a converter that keeps rank 0's experts only
    bad = moe_ep_shared_dir / "packed" / "hf-rank0"
    HFExportRankZeroOnly().export_hf(made["packed"][2], str(bad))
    dist.barrier()
    if dist.get_rank():
        return
    for kind, (training, export, _) in made.items():
        index = read_checkpoint(training)
        # the training side really is chunked by the layout (not one rank's whole tensors)
        assert any(len(e.chunks) > 1 for e in index.entries.values() if e.is_tensor), kind
        report = compare_conversion(index, read_checkpoint(export))
        assert report.problems == [], (kind, [str(f) for f in report.problems])
        # every routed expert's gate, up and down (a fused row once), and the shared expert's
        assert report.atoms == LAYERS * (E * (2 if kind == "fused" else 3) + 3), (kind, report)
    found = compare_conversion(read_checkpoint(made["packed"][0]), read_checkpoint(bad)).problems
    assert [(f.problem, f.layer, f.experts) for f in found] == [
        ("export_missing", 0, (2, 3)), ("export_missing", 1, (2, 3))], [str(f) for f in found]
    assert "experts 2..3 missing from the export: their values (down, gate, up) are nowhere" in (
        found[0].message), found[0].message


@pytest.mark.moe_ep_world(WORLD)
def test_torchtitan_deepseek_v3_saved_and_exported_at_ep2(moe_ep_shared_dir: Path) -> None:
    """torchtitan's own save (``dcp_save``) and export (``last_save_in_hf``: ``to_hf`` of the
    ep-sharded DTensors, each split into E experts) of a model trained one step at ep=2 under
    FSDP2: the export is the save's, expert by expert."""
    pytest.importorskip("torchtitan", reason="torchtitan is not installed "
                        "(ci/install_torchtitan.sh installs torchtitan==0.3.0)")
    from conformance.adapters.torchtitan_deepseek import TorchtitanDeepSeekAdapter

    adapter = TorchtitanDeepSeekAdapter()
    spec = Spec(num_layers=LAYERS, num_experts=E, kind="packed", optimizer_steps=1, fsdp=True,
                layout=ParallelLayout.for_world(WORLD, 2))
    assert spec.layout is not None
    model, optimizer, *_ = adapter.build(spec, spec.layout.build_mesh(), seed=1)
    root = moe_ep_shared_dir / "torchtitan"
    adapter.save(model, optimizer, str(root / "train"))
    adapter.export_hf(model, str(root / "hf"))
    dist.barrier()
    if dist.get_rank():
        return
    index = read_checkpoint(root / "train")
    report = compare_conversion(index, read_checkpoint(root / "hf" / "step-0"))
    assert report.problems == [], [str(f) for f in report.problems]
    # routed w1, w2, w3 and the shared expert's, of both layers and the MTP layer
    assert report.atoms == (LAYERS + 1) * (3 * E + 3), report.atoms

"""The inspection's readers on checkpoints the frameworks' own savers write here (issue 61).

**Megatron-Core ``torch_dist``** (``dist_checkpointing.save``, the ``megatron`` adapter's save):
DCP underneath -- a ``.metadata`` whose pickles name Megatron's own classes besides DCP's, data
files ``__<rank>_<n>.distcp``, and ``common.pt`` / ``metadata.json`` beside them -- with *sharded
keys*: each rank offers its chunk of one global tensor per key
(``layers.0.mlp.experts.experts.linear_fc1.weight`` ``[E, 2h, dim]``, its expert rows from every EP
rank).  The DCP reader (:mod:`conformance.inspection.readers`) reads it as it stands: global
tensors stitched from the chunks.  What proves it is the values: the save of a model trained one
step at ep=2 (``SequentialMLP`` experts, Megatron's chained optimizer), compared by
:func:`~conformance.inspection.conversion.compare_conversion` with a Hugging Face export made from
the ep=1 ground truth of the same model -- the names a Megatron-to-HF converter writes
(``linear_fc1`` split in its gate and up halves) -- is clean, every expert at its global id, and
two experts swapped in the export are named.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from conformance.adapter import Spec
from conformance.inspection import inspect_index, read_checkpoint
from conformance.inspection.conversion import compare_conversion
from conformance.layout import ParallelLayout
from reference_impl import hf

E, LAYERS = 4, 2
#: the Megatron adapter's canonical names -> the Hugging Face family's (DeepSeek-V3 / Qwen3-MoE).
_HF = {"linear_fc1.gate": "gate_proj", "linear_fc1.up": "up_proj", "linear_fc2": "down_proj"}


def _fresh(path: Path) -> Path:
    """An empty directory ``path`` on every rank (``dist_checkpointing.save`` wants one)."""
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    dist.barrier()
    return path


def megatron_as_hf(adapter: Any, model: Any) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of a whole (ep=1) Megatron model, from the adapter's views by
    global identity: what a Megatron-to-HF converter writes."""
    out: dict[str, torch.Tensor] = {}
    for layer, expert, name, value in adapter.expert_tensors(model, None):
        out[f"model.layers.{layer}.mlp.experts.{expert}.{_HF[name]}.weight"] = value.detach()
    for layer, _, name, value in adapter.other_tensors(model, None):
        prefix = f"model.layers.{layer}.mlp."
        if name == "shared_experts.linear_fc1.weight":
            gate, up = value.detach().chunk(2, 0)
            out[prefix + "shared_experts.gate_proj.weight"] = gate
            out[prefix + "shared_experts.up_proj.weight"] = up
        elif name == "shared_experts.linear_fc2.weight":
            out[prefix + "shared_experts.down_proj.weight"] = value.detach()
        elif name == "router.weight":
            out[prefix + "gate.weight"] = value.detach()
    return {k: v.contiguous() for k, v in out.items()}


@pytest.mark.moe_ep_world(2)
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                    reason="megatron-core is not installed (ci/install_megatron.sh)")
def test_megatron_torch_dist_is_read_as_global_tensors(moe_ep_shared_dir: Path) -> None:
    from conformance.adapters.megatron import MegatronAdapter

    adapter = MegatronAdapter()
    spec = Spec(num_layers=LAYERS, num_experts=E, kind="unpacked", optimizer_steps=1,
                layout=ParallelLayout.for_world(2, 2))
    assert spec.layout is not None
    model, optimizer = adapter.build(spec, spec.layout.build_mesh(), seed=1)
    path = _fresh(moe_ep_shared_dir / "torch_dist")
    adapter.save(model, optimizer, str(path))  # tears Megatron's process groups down
    dist.barrier()
    if dist.get_rank():
        return
    assert (path / "metadata.json").exists() and (path / ".metadata").exists()
    index = read_checkpoint(path)
    assert index.format == "dcp"
    assert inspect_index(index).findings == ()
    fc1 = index.entries["layers.0.mlp.experts.experts.linear_fc1.weight"]
    assert fc1.shape == (E, 2 * spec.hidden, spec.dim) and len(fc1.chunks) > 1, fc1
    truth, _ = adapter.build(Spec(num_layers=LAYERS, num_experts=E, kind="unpacked",
                                  optimizer_steps=1), None, seed=1)
    export = moe_ep_shared_dir / "hf"
    tensors = megatron_as_hf(adapter, truth)
    hf.write_safetensors(tensors, export, {})
    report = compare_conversion(index, read_checkpoint(export))
    assert report.problems == [], [str(f) for f in report.problems]
    # every expert's linear_fc1 (matched by its gate and up halves) and linear_fc2, and the
    # shared expert's two
    assert report.atoms == LAYERS * (2 * E + 2), report.atoms
    assert any("linear_fc#.weight[e] concatenated half 1 along axis 0 -> model.layers.#.mlp."
               "experts.*.up_proj.weight" in line for line in report.mapping), report.mapping
    for name in ("gate_proj", "up_proj", "down_proj"):
        a, b = (f"model.layers.1.mlp.experts.{g}.{name}.weight" for g in (0, 1))
        tensors[a], tensors[b] = tensors[b], tensors[a]
    hf.write_safetensors(tensors, moe_ep_shared_dir / "swapped", {})
    found = compare_conversion(index, read_checkpoint(moe_ep_shared_dir / "swapped"))
    assert sorted((f.problem, f.layer, f.experts) for f in found.problems) == [
        ("export_holds_other", 1, (0,))] * 3 + [("export_holds_other", 1, (1,))] * 3, [
        str(f) for f in found.problems]

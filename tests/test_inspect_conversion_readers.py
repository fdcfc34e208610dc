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

**DeepSpeed universal checkpoints** (``ds_to_universal`` of the ``deepspeed-autoep`` adapter's
ZeRO-1 save at ep=2, what a load at another EP degree reads): one directory per parameter,
``zero/<param>/fp32.pt`` and its moments, each the whole tensor -- read by
:mod:`conformance.inspection.deepspeed_universal`.  The same proof: every expert of AutoEP's
packed ``w1``/``w2``/``w3`` ``[E, ...]`` once (EP rank 1's experts are rows 2..3), and the values
those of the ep=1 truth written in transformers 5's Mixtral names (``gate_up_proj`` of ``w1`` and
``w3``, ``down_proj`` of ``w2``): clean, and two swapped experts named.  DeepSpeed's own
consolidated export of the same save, ``zero_to_fp32``, refuses it (the finding is asserted as
found: docs/frameworks/deepspeed.md).
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
    assert any("linear_fc1.weight[e] concatenated half 1 along axis 0 -> model.layers.#.mlp."
               "experts.*.up_proj.weight" in line for line in report.mapping), report.mapping
    for name in ("gate_proj", "up_proj", "down_proj"):
        a, b = (f"model.layers.1.mlp.experts.{g}.{name}.weight" for g in (0, 1))
        tensors[a], tensors[b] = tensors[b], tensors[a]
    hf.write_safetensors(tensors, moe_ep_shared_dir / "swapped", {})
    found = compare_conversion(index, read_checkpoint(moe_ep_shared_dir / "swapped"))
    assert sorted((f.problem, f.layer, f.experts) for f in found.problems) == [
        ("export_holds_other", 1, (0,))] * 3 + [("export_holds_other", 1, (1,))] * 3, [
        str(f) for f in found.problems]


@pytest.mark.moe_ep_world(2)
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (ci/install_deepspeed.sh)")
def test_deepspeed_universal_checkpoint_is_read_as_global_tensors(moe_ep_shared_dir: Path) -> None:
    from conformance.adapters._deepspeed_universal import convert_once
    from conformance.adapters.deepspeed_autoep import DeepSpeedAutoEPAdapter
    from conformance.inspection.deepspeed_universal import FORMAT

    adapter = DeepSpeedAutoEPAdapter()
    spec = Spec(num_layers=LAYERS, num_experts=E, kind="packed", optimizer_steps=1,
                layout=ParallelLayout.for_world(2, 2))
    assert spec.layout is not None
    model, optimizer = adapter.build(spec, spec.layout.build_mesh(), seed=1)
    path = _fresh(moe_ep_shared_dir / "deepspeed")
    adapter.save(model, optimizer, str(path))
    convert_once(str(path))  # ds_to_universal on rank 0, its outcome on every rank
    if dist.get_rank():
        return
    index = read_checkpoint(path)  # the run's root: latest_universal names the directory
    assert index.format == FORMAT and index.path.endswith("_universal"), index.path
    assert inspect_index(index).findings == ()
    assert index.entries["model.layers.0.mlp.experts.w1"].shape == (E, spec.hidden, spec.dim)
    assert "optimizer.state.model.layers.0.mlp.experts.w1.exp_avg" in index.entries
    truth, _ = adapter.build(Spec(num_layers=LAYERS, num_experts=E, kind="packed",
                                  optimizer_steps=1), None, seed=1)
    tensors = {}
    for key, value in truth.state_dict().items():
        value = value.detach()
        if key.endswith("mlp.experts.w1"):
            w3 = truth.state_dict()[key[:-1] + "3"]
            tensors[key[:-2] + "gate_up_proj"] = torch.cat([value, w3], 1)
        elif key.endswith("mlp.experts.w2"):
            tensors[key[:-2] + "down_proj"] = value.contiguous()
        elif not key.endswith("mlp.experts.w3"):
            tensors[key] = value.contiguous()
    hf.write_safetensors(tensors, moe_ep_shared_dir / "hf", {})
    report = compare_conversion(index, read_checkpoint(moe_ep_shared_dir / "hf"))
    assert report.problems == [], [str(f) for f in report.problems]
    assert report.atoms == LAYERS * 3 * E, report.atoms
    for name in ("gate_up_proj", "down_proj"):
        key = f"model.layers.1.mlp.experts.{name}"
        tensors[key] = tensors[key][[1, 0, *range(2, E)]].contiguous()
    hf.write_safetensors(tensors, moe_ep_shared_dir / "swapped", {})
    found = compare_conversion(index, read_checkpoint(moe_ep_shared_dir / "swapped"))
    assert {(f.problem, f.layer, f.experts) for f in found.problems} == {
        ("export_holds_other", 1, (0,)), ("export_holds_other", 1, (1,))}, [
        str(f) for f in found.problems]
    # DeepSpeed's own consolidated export, zero_to_fp32 (shipped in every checkpoint directory,
    # ``--safe_serialization`` for safetensors), refuses the MoE checkpoint: its glob of
    # ``*_model_states.pt`` takes the per-expert files for model states (DeepSpeed #4497)
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    with pytest.raises(ValueError, match=r"/layer_0_expert_0_mp_rank_00_model_states\.pt is "
                       r"not a model state checkpoint$"):
        convert_zero_checkpoint_to_fp32_state_dict(str(path), str(moe_ep_shared_dir / "fp32"),
                                                   safe_serialization=True)


def test_a_universal_checkpoint_is_read_only_inside_its_directory(tmp_path: Path) -> None:
    """Made here with ``torch.save`` in DeepSpeed's layout: the index names ``fp32.pt`` by its
    parameter and the moments as optimizer state; a parameter directory linked out of the
    checkpoint, or a ``latest_universal`` naming a directory outside it, is a CheckpointError
    before anything there is opened."""
    from conformance.inspection import CheckpointError
    from conformance.inspection.deepspeed_universal import read_universal

    universal = tmp_path / "run" / "global_step3_universal"
    w1 = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    for param, value in (("layers.0.moe.experts.w1", w1), ("layers.0.moe.router.weight",
                                                           torch.ones(2, 4))):
        (universal / "zero" / param).mkdir(parents=True)
        torch.save({"param": value, "cat_dim": 0}, universal / "zero" / param / "fp32.pt")
        torch.save({"param": value * 0}, universal / "zero" / param / "exp_avg.pt")
        torch.save(torch.tensor(3.0), universal / "zero" / param / "step.pt")
    torch.save({"param_groups": []}, universal / "zero" / "optimizer_state.pt")
    (tmp_path / "run" / "latest_universal").write_text("global_step3_universal")
    index = read_checkpoint(tmp_path / "run")
    assert index.path == str(universal) and index.entries["layers.0.moe.experts.w1"].shape == (
        2, 3, 4)
    assert index.entries["optimizer.state.layers.0.moe.experts.w1.step"].shape == ()
    assert index.reader is not None
    assert torch.equal(index.reader(["layers.0.moe.experts.w1"])["layers.0.moe.experts.w1"], w1)
    assert inspect_index(index).findings == ()
    outside = tmp_path / "elsewhere"
    (universal / "zero" / "layers.0.moe.experts.w1").rename(outside)
    (universal / "zero" / "layers.0.moe.experts.w1").symlink_to(outside)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        read_universal(universal)
    (tmp_path / "run" / "latest_universal").write_text("../elsewhere")
    with pytest.raises(CheckpointError, match="latest_universal, which resolves"):
        read_checkpoint(tmp_path / "run")

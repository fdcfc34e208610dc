"""``compare_conversion`` on the exports real frameworks write here (issue 61).

Each built-in adapter with an ``export_hf`` is driven the cheapest way its own tests allow -- the
ep=1 model built in this process, no world -- through its own DCP save (``save``: the framework's
checkpoint path) and its own Hugging Face export (``export_hf``: the framework's converter), and
the two are compared expert by expert by value: clean, and with two experts of the export filed
under each other's ids (what a converter mixing local and global ids writes) named by layer and
expert.  The reference's own export is checked at ep>1 in a world
(``tests/test_inspect_conversion_worlds.py``) and transformers' ``save_pretrained`` in
``tests/test_inspect_conversion.py``.

* **torchtitan-deepseek** (torchtitan 0.3.0's DeepSeek-V3 with one MTP layer): ``save`` is
  ``CheckpointManager.dcp_save`` of the model and optimizer state; ``export_hf`` the checkpointer's
  ``last_save_in_hf`` through ``DeepSeekV3StateDictAdapter``, which splits the packed
  ``w1``/``w2``/``w3`` ``[E, ...]`` into per-expert ``gate_proj``/``down_proj``/``up_proj`` and
  files the MTP layer (``mtp_layers.0``) as layer ``num_layers``.
* **transformers-deepseek_v3** (``DeepseekV3ForCausalLM``): ``export_hf`` is ``save_pretrained``,
  which writes the packed ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` as the model holds
  them.  Its ``save`` (``save_pretrained(distributed_checkpoint=True)``) refuses a model FSDP2 does
  not wrap, and the EP build it needs is transformers 5.24's (the venv keeps 5.18), so the training
  side is the model's state saved with DCP, as for the ``transformers`` adapter.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from conformance.adapter import Spec
from conformance.inspection import read_checkpoint
from conformance.inspection.conversion import compare_conversion
from reference_impl import hf

E, LAYERS = 4, 2
_EXPERT = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts\.)(\d+)(\..+)$")


def swap_experts(tensors: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """``layer``'s experts 0 and 1 filed under each other's ids (per-expert keys)."""
    out = {}
    for key, tensor in tensors.items():
        m = _EXPERT.match(key)
        if m and int(m[2]) == layer and int(m[3]) in (0, 1):
            key = f"{m[1]}{1 - int(m[3])}{m[4]}"
        out[key] = tensor
    return out


def problems(report: Any) -> list[tuple[str, Any, tuple[int, ...]]]:
    return sorted((f.problem, f.layer, f.experts) for f in report.problems)


def test_torchtitan_deepseek_v3_save_against_its_last_save_in_hf(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan", reason="torchtitan is not installed "
                        "(ci/install_torchtitan.sh installs torchtitan==0.3.0)")
    from conformance.adapters.torchtitan_deepseek import TorchtitanDeepSeekAdapter

    adapter = TorchtitanDeepSeekAdapter()
    model, optimizer, *_ = adapter.build(
        Spec(num_layers=LAYERS, num_experts=E, kind="packed", optimizer_steps=1), None, 0)
    adapter.save(model, optimizer, str(tmp_path / "train"))
    adapter.export_hf(model, str(tmp_path / "hf"))
    export = tmp_path / "hf" / "step-0"  # where last_save_in_hf writes the consolidated files
    training = read_checkpoint(tmp_path / "train")
    report = compare_conversion(training, read_checkpoint(export))
    assert report.problems == [], [str(f) for f in report.problems]
    # every routed expert's w1, w2, w3 and the shared expert's, of both layers and the MTP layer
    assert report.atoms == (LAYERS + 1) * (3 * E + 3), report.atoms
    assert ("mtp_layers.#.moe.routed_experts.inner_experts.w2_EDF[e] -> "
            "model.layers.#.mlp.experts.*.down_proj.weight (4 matrices)") in report.mapping
    assert any("optimizer state" in n for n in report.notes), report.notes
    tensors = hf.read_safetensors(export)
    # two experts swapped in a main layer and in the MTP layer (exported as layer 2)
    for layer in (1, LAYERS):
        bad = tmp_path / f"swapped-{layer}"
        hf.write_safetensors(swap_experts(tensors, layer), bad, {})
        found = compare_conversion(training, read_checkpoint(bad))
        assert problems(found) == [("export_holds_other", layer, (0,))] * 3 + [
            ("export_holds_other", layer, (1,))] * 3, [str(f) for f in found.problems]
        assert any(f.message.startswith("gate_proj: holds expert 1's values, not its own")
                   for f in found.problems), [f.message for f in found.problems]
    # the MTP layer's expert 3 left out: named by the layer the export files the MTP layer as
    hf.write_safetensors({k: v for k, v in tensors.items()
                          if not k.startswith(f"model.layers.{LAYERS}.mlp.experts.3.")},
                         tmp_path / "dropped", {})
    found = compare_conversion(training, read_checkpoint(tmp_path / "dropped"))
    assert problems(found) == [("export_missing", LAYERS, (3,))], [str(f) for f in found.problems]
    assert found.problems[0].key.startswith("mtp_layers.0.moe.routed_experts.inner_experts.")


def _swap_rows(tensors: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """``layer``'s experts 0 and 1 filed under each other's ids (packed ``[E, ...]`` keys)."""
    out = dict(tensors)
    for name in ("gate_up_proj", "down_proj"):
        key = f"model.layers.{layer}.mlp.experts.{name}"
        out[key] = tensors[key][[1, 0, *range(2, E)]].contiguous()
    return out


def test_transformers_deepseek_v3_state_against_its_save_pretrained(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import torch.distributed.checkpoint as dcp

    from conformance.adapters.transformers_deepseek import TransformersDeepseekV3Adapter

    adapter = TransformersDeepseekV3Adapter()
    model, _ = adapter.build(Spec(num_layers=LAYERS, num_experts=E, kind="packed"), None, 0)
    dcp.save({k: v.detach() for k, v in model.state_dict().items()},
             checkpoint_id=str(tmp_path / "train"), no_dist=True)
    adapter.export_hf(model, str(tmp_path / "hf"))
    training = read_checkpoint(tmp_path / "train")
    report = compare_conversion(training, read_checkpoint(tmp_path / "hf"))
    assert report.problems == [], [str(f) for f in report.problems]
    # every routed expert's gate_up and down, and the shared expert's three
    assert report.atoms == LAYERS * (2 * E + 3), report.atoms
    bad = tmp_path / "swapped"
    hf.write_safetensors(_swap_rows(hf.read_safetensors(tmp_path / "hf"), 1), bad, {})
    found = compare_conversion(training, read_checkpoint(bad))
    assert problems(found) == [("export_holds_other", 1, (0,))] * 2 + [
        ("export_holds_other", 1, (1,))] * 2, [str(f) for f in found.problems]

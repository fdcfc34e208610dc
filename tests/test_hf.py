"""The Hugging Face export and import: the reference's converter, and the ``hf_export`` and
``hf_import`` checks against the seeded bugs of ``tests/seeded_hf.py``.

The held-out plant of the steering bar is :class:`~seeded_hf.HFExpertsSwapped`: complete, the same
at every layout, read back right by its own import; only the transformers model's forward shows it,
in every cell that writes an export.  The rest of each slice is the no-false-alarm control.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from matrix_expectations import run_inline

from reference_impl.hf import export_hf, from_hf, hf_config, import_hf, read_safetensors, to_hf
from reference_impl.moe import MoEConfig, build_model

pytestmark = pytest.mark.usefixtures("shared_fork_server")
SEEDED = (Path(__file__).parent / "seeded_hf.py").read_text()
MODEL_CELLS = "model and not optim and not legacy"
MISFILED = re.compile(r"^\[hf_export\] the export at [^:]+: layer 0, key 'model\.layers\.0\.mlp\."
                      r"experts\.[^']+', expert ([01]): (row [01]: )?holds the model's '\w+' of "
                      r"layer 0, expert (?!\1)[01], not expert \1's")
EXPORT_LINE = re.compile(r"^\[hf_export\] Ernie4_5_MoeForCausalLM loaded from the export at "
                         r"(pp=\d, )?ep=\d[^:]*, dp_replicate=\d: the forward differs from the "
                         r"ground truth's: element \[\d+, \d+\] expected ")


def _config(kind: str, order: str = "concatenated") -> MoEConfig:
    return MoEConfig(num_experts=4, dim=16, hidden=32, kind=kind,  # type: ignore[arg-type]
                     fused_order=order, expert_bias=True)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kind", "order"), [("unpacked", "concatenated"),
                                             ("packed", "concatenated"),
                                             ("fused", "concatenated"), ("fused", "interleaved")])
def test_the_reference_export_is_its_model_to_transformers_and_imports_back(
        tmp_path: Path, kind: str, order: str) -> None:
    transformers = pytest.importorskip("transformers")
    from conformance.checks.hf import load_hf_model

    config = _config(kind, order)
    model = build_model(config, 2, seed=1)
    export_hf(model, tmp_path)
    keys = read_safetensors(tmp_path)
    fused = "model.layers.0.mlp.experts.gate_up_proj" in keys
    assert fused == (kind == "fused")
    assert ("model.layers.1.mlp.experts.3.down_proj.weight" in keys) == (kind != "fused")
    assert keys["model.layers.0.mlp.moe_statics.e_score_correction_bias"].shape == (1, 4)
    assert torch.equal(keys["model.layers.0.mlp.moe_statics.e_score_correction_bias"][0],
                       model.layers[0].moe.router.expert_bias)
    from conformance.adapter import HFModel

    hf, info = load_hf_model(HFModel("Ernie4_5_MoeForCausalLM", hf_config(config, 2)),
                             str(tmp_path), torch.float32)
    assert isinstance(hf, transformers.Ernie4_5_MoeForCausalLM)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(x), hf.model(inputs_embeds=x[None]).last_hidden_state[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    other = build_model(config, 2, seed=2)
    import_hf(other, tmp_path)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors",
                                            "model.safetensors.index.json"]


def test_the_converter_names_what_it_cannot_place() -> None:
    config = _config("packed")
    state = {k.removeprefix("model."): v for k, v in to_hf(
        {"layers.0.moe.experts.0.up.weight": torch.zeros(32, 16)} | {
            f"layers.0.moe.experts.{g}.{w}.weight": torch.zeros(1) for g in range(4)
            for w in ("gate", "up", "down")}, config, 1).items()}
    assert "lm_head.weight" in state
    with pytest.raises(ValueError, match=r"has no place for the reference's 'layers.0.moe.odd'"):
        to_hf({"layers.0.moe.odd": torch.zeros(1)}, config, 1)
    with pytest.raises(ValueError, match=r"layer 0's up weight: the state holds experts \[0, 2\], "
                       r"expected 0..3"):
        to_hf({f"layers.0.moe.experts.{g}.up.weight": torch.zeros(1) for g in (0, 2)}, config, 1)
    with pytest.raises(ValueError, match=r"no place for the Ernie4_5_MoeForCausalLM key "
                       r"'model.layers.0.mlp.router.bias'"):
        from_hf({"model.layers.0.mlp.router.bias": torch.zeros(1)}, config)
    for bad, why in ((MoEConfig(activation="gelu"), "SwiGLU experts"),
                     (MoEConfig(mtp_layers=1), "no multi-token-prediction layers")):
        with pytest.raises(ValueError, match=why):
            hf_config(bad, 2)


def _run(pytester: pytest.Pytester, adapter: str, select: str) -> dict[str, dict[str, Any]]:
    pytester.makepyfile(seeded_hf=SEEDED)
    out = pytester.path / "out"
    run_inline(pytester, "--moe-ep-matrix=default", f"--moe-ep-adapter=seeded_hf:{adapter}",
               "-k", select, f"--moe-ep-report={out}", "-p", "no:cacheprovider")
    doc = json.loads((out / "moe-ep-conformance.json").read_text())
    return {c["id"].removeprefix("moe-ep-matrix::checkpoint::"): c for c in doc["cells"]
            if c["status"] != "n/a"}


def _red(cells: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Failing cell -> its first line after the findings it leads with."""
    return {i: c["detail"].splitlines()[0].split(": ", 1)[1] for i, c in cells.items()
            if c["status"] in ("fail", "stopped")}


def test_experts_swapped_in_every_export_is_red_in_every_export_cell(
        pytester: pytest.Pytester) -> None:
    """The plant: complete, the same at every layout, read back right by its own import."""
    cells = _run(pytester, "HFExpertsSwapped", MODEL_CELLS)
    exported = {i for i, c in cells.items() if "[hf_export]" in c["detail"]
                or "hf_export" in c["detail"].split("(checks: ")[-1]}
    red = _red(cells)
    assert len(exported) >= 10 and set(red) == exported, (sorted(red), sorted(exported))
    for cell_id, first in red.items():
        # named by value: which key holds which expert's tensor; and the forward that shows it
        assert cells[cell_id]["findings"] == ["on-disk"] and MISFILED.match(first), first
        detail = cells[cell_id]["detail"]
        assert (any(EXPORT_LINE.match(line) for line in detail.splitlines())
                or "more problems (the record has them all" in detail), detail
        # the import round-trips the export's own mistake: nothing else is wrong
        assert "checks that passed: checkpoint, values, missing, forward, hf_import" in (
            cells[cell_id]["detail"]), cells[cell_id]["detail"]


def test_an_export_of_rank_zeros_experts_only_is_red_where_ep_splits_them(
        pytester: pytest.Pytester) -> None:
    cells = _run(pytester, "HFExportRankZeroOnly", f"{MODEL_CELLS} and ep-only")
    red = _red(cells)
    # a pipeline stage's rank 0 holds its stage's layers only: the others are left out too
    split = {i for i, c in cells.items() if "hf_export" in c["detail"]
             and (c["save_ep"] > 1 or "pp" in c["save_layout"])}
    assert split and set(red) == split, (sorted(red), sorted(split))
    for first in red.values():
        assert re.match(r"\[hf_export\] the export at (pp=\d, )?ep=\d[^:]*: layer \d, key "
                        r"'model\.layers\.\d\.mlp\.experts\.[^']+', experts \d", first), first


def test_an_export_that_raises_at_the_truth_is_export_hfs_and_gates_nothing(
        pytester: pytest.Pytester) -> None:
    """An optional member's failure is named as that member's: every E=5 cell is red on
    ``hf_export`` alone (the cell that wrote the save, and those reading it, which carry its
    export's problems), a refusal naming the call and the ep=1 truth, with the DCP checks run and
    passed; ``hf_import`` has no export to read and says so; the E=4 cells are green."""
    cells = _run(pytester, "HFExportRefusesUneven", f"{MODEL_CELLS} and ep-only and not pp2")
    red = _red(cells)
    uneven = {i for i, c in cells.items() if c["num_experts"] == 5}
    assert {cells[i]["shared_save"] for i in uneven} == {True, False}, sorted(uneven)
    assert set(red) == uneven, (sorted(red), sorted(uneven))
    for cell_id, first in red.items():
        cell = cells[cell_id]
        assert cell["status"] == "fail" and cell["findings"] == ["refused"], cell
        assert first.startswith("[hf_export] the framework's export_hf() raised at the ep=1 "
                                "truth: RuntimeError: split_with_sizes expects split_sizes to sum "
                                "exactly to 5"), first
        assert "checks that passed: checkpoint, values, missing, forward" in cell["detail"], cell
        assert cell["skipped_checks"]["hf_import"].startswith("the ep=1 export raised"), cell


def test_the_export_that_drops_experts_leads_and_the_import_refusal_follows(
        pytester: pytest.Pytester) -> None:
    """The defect is on disk, in the export: a cell whose export keeps rank 0's experts and whose
    import then refuses leads with ``hf_export`` (on-disk, layer and experts) and gives the import's
    refusal after it, as ``import_hf``'s -- in the cell that wrote the save and in every cell that
    reads it."""
    cells = _run(pytester, "HFExportRankZeroOnlyImportRefuses",
                 f"{MODEL_CELLS} and unpacked and fsdp and not pp2 and not E5")
    both = {i: c for i, c in cells.items() if c["save_ep"] > 1 and c["load_ep"] > 1}
    # a cell that reads a save another cell wrote carries that cell's export problems
    assert {c["shared_save"] for c in both.values()} == {True, False}, sorted(both)
    for cell_id, cell in both.items():
        assert cell["status"] == "fail" and cell["findings"] == ["on-disk", "refused"], cell
        first = _red({cell_id: cell})[cell_id]
        assert re.match(r"\[hf_export\] the export at ep=\d[^:]*: layer \d, key", first), first
        imported = [p for p in cell["problems"] if p["check"] == "hf_import"]
        assert imported and imported[0]["finding"] == "refused", cell["problems"]
        assert imported[0]["text"].startswith("the framework's import_hf() raised importing the "
                                              "ep=1 export at ep="), imported
        assert "checks that passed: checkpoint, values, missing, forward" in cell["detail"], cell


def test_a_transposed_down_projection_is_named_by_the_loader(pytester: pytest.Pytester) -> None:
    cells = _run(pytester, "HFDownTransposed", f"{MODEL_CELLS} and unpacked and fsdp")
    red = _red(cells)
    exported = {i for i, c in cells.items() if "hf_export" in c["detail"]}
    assert exported and set(red) == exported
    for first in red.values():
        assert first.startswith("[hf_export] transformers' Ernie4_5_MoeForCausalLM reports "), first
        assert "mismatched keys" in first and "down_proj" in first, first


def test_an_import_that_resets_the_bias_or_does_nothing_is_silent(
        pytester: pytest.Pytester) -> None:
    for adapter, tensor in (("HFImportBiasReset", "router.expert_bias"),
                            ("HFImportDoesNothing", None)):
        cells = _run(pytester, adapter, f"{MODEL_CELLS} and fused")
        red = _red(cells)
        assert red and set(red) == set(cells), adapter
        for cell_id, first in red.items():
            assert cells[cell_id]["findings"] == ["silent"], cells[cell_id]
            assert first.startswith("first difference: rank "), first
            assert "after the import of the ep=1 Hugging Face export: " in first, first
            if tensor is not None:
                assert f"tensor {tensor!r}" in first and "expert 0" in first, first
            assert "checks that passed: checkpoint, values, missing, forward" in (
                cells[cell_id]["detail"])


def test_inspect_checks_an_export_against_its_model_class(tmp_path: Path, capsys: Any) -> None:
    pytest.importorskip("transformers")
    from conformance.inspect import main
    from reference_impl.hf import write_safetensors

    export_hf(build_model(_config("packed"), 2, seed=1), tmp_path)
    assert main([str(tmp_path), "--hf-model", "Ernie4_5_MoeForCausalLM"]) == 0
    assert "against transformers' Ernie4_5_MoeForCausalLM (keys and shapes): the same" in (
        capsys.readouterr().out)
    tensors = read_safetensors(tmp_path)
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    down = "model.layers.0.mlp.experts.3.down_proj.weight"
    tensors[down] = tensors[down].t().contiguous()
    tensors["model.layers.0.mlp.experts.9.up_proj.weight"] = tensors[down]
    config = json.loads((tmp_path / "config.json").read_text())
    write_safetensors(tensors, tmp_path, config)
    assert main([str(tmp_path), "--hf-model", "Ernie4_5_MoeForCausalLM", "--json"]) == 1
    found = {(f["problem"], f["layer"], tuple(f["experts"])): f["text"]
             for f in json.loads(capsys.readouterr().out)["hf_model"]["findings"]}
    assert set(found) == {("hf_missing", 1, (2,)), ("hf_shape", 0, (3,)),
                          ("hf_unexpected", 0, (9,))}, found
    assert "shape [32, 16] in the export, [16, 32] in Ernie4_5_MoeForCausalLM" in (
        found[("hf_shape", 0, (3,))])
    (tmp_path / "config.json").unlink()
    assert main([str(tmp_path), "--hf-model", "Ernie4_5_MoeForCausalLM"]) == 2
    assert "holds no config.json" in capsys.readouterr().err
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    assert main([str(tmp_path), "--hf-model", "Qwen3MoeForCausalLM", "--hf-config",
                 str(tmp_path / "cfg.json")]) == 2
    assert "model_type 'ernie4_5_moe'; Qwen3MoeForCausalLM takes 'qwen3_moe'" in (
        capsys.readouterr().err)


def test_torchtitan_exports_and_imports_deepseek_v3_through_its_checkpointer(
        pytester: pytest.Pytester) -> None:
    """``last_save_in_hf`` and ``dcp_load(from_hf=True)`` at every layout of the model cells: the
    export (its MTP layer filed as layer 2, which DeepseekV3ForCausalLM does not load) is the ep=1
    export, and transformers computes torchtitan's forward from it; E=5 over ep > 1 is n/a for
    torchtitan's converter, with its reason."""
    pytest.importorskip("torchtitan", reason="torchtitan not installed (ci/install_torchtitan.sh)")
    out = pytester.path / "out"
    run_inline(pytester, "--moe-ep-matrix=default", "--moe-ep-adapter=torchtitan-deepseek",
               "-k", MODEL_CELLS, f"--moe-ep-report={out}", "-p", "no:cacheprovider")
    cells = [c for c in json.loads((out / "moe-ep-conformance.json").read_text())["cells"]
             if c["status"] != "n/a"]
    assert cells and {c["status"] for c in cells} == {"pass"}, [c["detail"] for c in cells]
    assert any("hf_export, hf_import)" in c["detail"] for c in cells), cells
    for cell in cells:
        skipped = cell["skipped_checks"]
        if cell["num_experts"] == 5 and "hf_export" in skipped:
            assert "cannot split E=5 experts over ep=" in skipped["hf_export"], cell
        else:
            assert "hf_import" in cell["detail"], cell


def test_without_transformers_the_checks_say_why_they_did_not_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where they would run: a reason, not a silent pass; elsewhere: nothing to say."""
    from conformance.adapters.reference import ReferenceAdapter
    from conformance.checks.hf import applies
    from conformance.layout import ParallelLayout
    from conformance.matrix import Cell
    from conformance.members import members_of

    layout = ParallelLayout.for_world(4, 2)
    cell = Cell("packed", "packed", "model", False, layout, layout, 4)
    reference = ReferenceAdapter()
    reference.members = members_of(reference)  # type: ignore[attr-defined]
    assert applies(reference, cell) is None
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    why = applies(reference, cell)
    assert why and why.startswith("transformers is not installed") and "[hf]" in why, why
    assert applies(reference, dataclasses.replace(cell, state="model+optim")) == ""
    assert applies(reference, dataclasses.replace(cell, legacy=True)) == ""

    class NoHF:
        name, version, capabilities = "no-hf", "0", reference.capabilities
        build = save = load = expert_tensors = other_tensors = ReferenceAdapter.build

    plain = NoHF()
    plain.members = members_of(plain)  # type: ignore[attr-defined]
    assert applies(plain, cell) == ""  # no HF members: the checks are not asked


def test_not_applicable_said_by_one_rank_only_is_an_error_not_a_hang(
        pytester: pytest.Pytester) -> None:
    """The ranks agree on how an optional member went before any of them goes on: a NotApplicable
    on rank 0 alone is the adapter's broken contract, in every model cell (the ep=1 export is the
    release every cell is held to), within seconds."""
    cells = _run(pytester, "HFExportNotApplicableOnRankZero",
                 f"{MODEL_CELLS} and kind_packed and E5 and not fsdp")
    red = _red(cells)
    assert cells and set(red) == set(cells), sorted(red)
    for cell_id, first in red.items():
        assert cells[cell_id]["findings"] == ["error"], cells[cell_id]
        assert first.startswith("[hf_export] the adapter's export_hf() raised NotApplicable at "
                                "the ep=1 truth on rank(s) 0 only (rank 0 cannot write this "
                                "export); it must be raised on every rank alike"), first
        assert all(c["duration_s"] < 30 for c in cells.values()), cells

"""The fine-tuning cells' negative controls: each seeded bug of ``tests/seeded_finetune.py`` is red
in exactly the default tier's fine-tuning cells it reaches, with a first line that names the layer,
the expert and the tensor; the slice's other cells are its no-false-alarm controls (the reference's
own fine-tuning cells pass in ``test_matrix.py``'s default tier).

Each test runs ``pytest --moe-ep-matrix -k finetune...`` in-process on one seeded adapter, as
``tests/test_detection.py`` does for the other checks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from matrix_expectations import run_inline
from test_detection import failing, ran

pytestmark = pytest.mark.usefixtures("shared_fork_server")
SEEDED = (Path(__file__).parent / "seeded_finetune.py").read_text()


def run_slice(pytester: pytest.Pytester, adapter: str, select: str) -> dict[str, dict[str, Any]]:
    """The default tier's fine-tuning cells matching ``-k select`` on the seeded ``adapter``: the
    report's cells by id."""
    pytester.makepyfile(seeded_finetune=SEEDED)
    out = pytester.path / "out"
    result = run_inline(pytester, "--moe-ep-matrix=default",
                        f"--moe-ep-adapter=seeded_finetune:{adapter}", "-k", select,
                        f"--moe-ep-report={out}", "-p", "no:cacheprovider")
    doc = json.loads((out / "moe-ep-conformance.json").read_text())
    cells = {c["id"].removeprefix("moe-ep-matrix::checkpoint::"): c for c in doc["cells"]}
    assert cells and all(c["finetune"] for c in cells.values())
    assert result.ret == (pytest.ExitCode.TESTS_FAILED if failing(cells) else 0)
    return cells


def test_scales_left_in_place_while_their_blocks_move_are_caught_on_disk(
        pytester: pytest.Pytester) -> None:
    cells = run_slice(pytester, "ScalesLeftInPlace", "finetune and (mxfp4 or fp8)")
    moved = {i for i, c in ran(cells).items() if c["save_ep"] > 1}
    assert moved and set(failing(cells)) == moved, failing(cells)
    for cell_id, first in failing(cells).items():
        # what the saving side held is wrong (silent), and so is the checkpoint it wrote (on-disk)
        assert cells[cell_id]["findings"] == ["silent", "on-disk"], cells[cell_id]
        assert re.search(r"layer \d, expert \d, tensor '[\w.]+_scale(s|_inv)': as saved at ep=\d.*"
                         r"holds expert \d's values instead of expert \d's", first), first
        # the checkpoint's own finding, per packed key or per expert key
        assert re.search(r"\[checkpoint\] checkpoint: layer \d, key '[\w.]+_scale(s|_inv)', "
                         r"experts? \d.*(other experts' values|holds expert \d's values)",
                         cells[cell_id]["detail"]), cells[cell_id]["detail"]


def test_shared_expert_adapters_left_at_init_by_a_load_at_ep_above_one_are_named(
        pytester: pytest.Pytester) -> None:
    cells = run_slice(pytester, "SharedAdaptersLeftAtInit", "finetune")
    resharded = {i for i, c in ran(cells).items() if c["load_ep"] > 1}
    assert resharded and set(failing(cells)) == resharded, failing(cells)
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["findings"] == ["silent"], cells[cell_id]
        assert re.search(r"shared\.(gate|up|down)\.lora_[AB]", first), (cell_id, first)


def test_fp8_scales_cut_at_the_wrong_block_under_expert_tp_are_named(
        pytester: pytest.Pytester) -> None:
    cells = run_slice(pytester, "ScalesCutAtTheWrongBlock", "finetune and fp8")
    cut = {i for i, c in ran(cells).items() if ".etp" in c["load_layout"]}
    assert cut and set(failing(cells)) == cut, failing(cells)
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["findings"] == ["silent"], cells[cell_id]
        assert re.search(r"layer \d.*expert.*down(_w|\.weight)_scale_inv", first), (cell_id, first)


def test_a_merge_over_the_local_experts_only_is_caught_in_the_export(
        pytester: pytest.Pytester) -> None:
    cells = run_slice(pytester, "MergeOverLocalExpertsOnly", "finetune and not optim")
    # the export is made where a save is written, and its findings travel with that save
    gathered = {i for i, c in ran(cells).items() if c["save_ep"] > 1}
    assert gathered and set(failing(cells)) == gathered, failing(cells)
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["findings"] == ["on-disk"], cells[cell_id]
        # an expert of the second EP rank (E=4: 2, 3; E=5: 3, 4), named by layer, key and expert
        assert re.match(r"\[hf_export\] the export at ep=2.* differs from the ep=1 export: layer "
                        r"\d, key 'model\.layers\.\d\.mlp\.experts\.([234])\.(gate|up|down)"
                        r"_proj\.weight', expert \1: differ from the ep=1 export's", first), first


def test_a_merged_export_that_writes_the_base_is_caught_by_its_forward(
        pytester: pytest.Pytester) -> None:
    cells = run_slice(pytester, "MergedExportWritesTheBase", "finetune and not optim")
    # the same bytes at every layout as at ep=1: only the model transformers loads shows it
    assert ran(cells) and set(failing(cells)) == set(ran(cells)), failing(cells)
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["findings"] == ["on-disk"], cells[cell_id]
        assert re.match(r"\[hf_export\] Ernie4_5_MoeForCausalLM loaded from the export at ep=",
                        first), first


def test_an_expert_dim_squeezed_out_of_the_scales_is_refused_naming_key_and_shapes(
        pytester: pytest.Pytester) -> None:
    cells = run_slice(pytester, "SingletonExpertDimSqueezed", "finetune and (mxfp4 or fp8)")
    # one expert a rank: a packed or fused quantized layer loaded at ep=4
    one_each = {i for i, c in ran(cells).items()
                if c["load_ep"] == 4 and not c["kind"].endswith("unpacked")}
    assert one_each and set(failing(cells)) == one_each, failing(cells)
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["findings"] == ["refused"], cells[cell_id]
        assert re.search(r"raised QuantizedShapeError: layers\.\d\.moe\.\w+: the (mxfp4|fp8) "
                         r"scales do not match the blocks' grid: blocks \[[\d, ]+\], scales "
                         r"\[\d+\] \(expected scales \[[\d, ]+\]\)", first), first
        # and the values check names each squeezed tensor by layer, expert and shape
        assert any(p["check"] == "values" and re.match(
            r"rank \d, layer \d, expert \d+, tensor '\w+_scale(s|_inv)': shape \(\d+,\), "
            r"expected \(\d+, \d+\)", p["text"]) for p in cells[cell_id]["problems"]), cell_id

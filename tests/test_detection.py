"""Every check's negative control: a seeded-bug adapter (``tests/seeded_bugs.py``) the default tier catches.

Each test runs ``pytest --moe-ep-matrix`` (the default, covering tier) on one seeded bug in a
pytester subprocess and asserts which cells fail and that each failing cell's first line names the
check, the rank and the layer/expert (or the checkpoint key and experts).  The reference adapter
passes the same tier (``test_matrix.py``), so every failure here is the planted bug's.  About 20 s
per bug on 2 cores.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

SEEDED = (Path(__file__).parent / "seeded_bugs.py").read_text()


def run_default_tier(pytester: pytest.Pytester, adapter: str) -> dict[str, dict[str, Any]]:
    pytester.makepyfile(seeded_bugs=SEEDED)
    out = pytester.path / "out"
    result = pytester.runpytest_subprocess("--moe-ep-matrix", f"--moe-ep-adapter=seeded_bugs:{adapter}",
                                           f"--moe-ep-report={out}", "-p", "no:cacheprovider", timeout=900)
    doc = json.loads((out / "moe-ep-conformance.json").read_text())
    assert doc["tier"] == "default"
    cells = {c["id"].removeprefix("moe-ep-matrix::checkpoint::"): c for c in doc["cells"]}
    assert result.ret == (pytest.ExitCode.TESTS_FAILED if any(c["status"] in ("fail", "error")
                                                                for c in cells.values()) else 0)
    return cells


def failing(cells: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Failing cell -> the first line of its diagnosis."""
    return {i: c["detail"].splitlines()[0] for i, c in cells.items() if c["status"] in ("fail", "error")}


def ran(cells: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {i: c for i, c in cells.items() if c["status"] != "n/a"}


def test_an_unrestored_optimizer_step_is_caught_in_every_model_optim_cell(pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "StepNotRestored")
    optim = {i for i, c in ran(cells).items() if c["state"] == "model+optim" and not c["legacy"]}
    assert optim and set(failing(cells)) == optim
    for cell_id, first in failing(cells).items():
        assert re.match(r"\[scalars\] rank \d: optimizer scalar 'step' = \[3\.0\] after the load, expected \[2\.0\]",
                        first), (cell_id, first)


def test_experts_left_without_optimizer_state_are_named_per_replica(pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "MomentsDropped")
    optim = {i for i, c in ran(cells).items() if c["state"] == "model+optim" and not c["legacy"]}
    assert optim and set(failing(cells)) == optim
    for cell_id, first in failing(cells).items():
        assert re.match(r"\[missing\] after the load the ranks \[[\d, ]+\] \(one replica\) hold no "
                        r"'(gate|up|down)\.exp_avg(_sq)?' of layer \d, experts? [\d.]+", first), (cell_id, first)


def test_a_permutation_that_round_trips_is_caught_by_the_checkpoint_itself(pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "PermutedExperts")
    # Round-robin ids equal contiguous ones at ep=1 and at ep=E=4: only a side at ep=2 is wrong.
    wrong = {i for i, c in ran(cells).items() if 2 in (c["save_ep"], c["load_ep"]) and not c["legacy"]}
    assert wrong and set(failing(cells)) == wrong
    same_ep = {i for i in wrong if cells[i]["save_ep"] == cells[i]["load_ep"] == 2}
    assert same_ep, "the default tier has no cell that saves and loads at ep=2"
    for cell_id in same_ep:  # every value came back right: only the files are wrong
        detail = cells[cell_id]["detail"]
        assert detail.startswith("[checkpoint] checkpoint: layer ") and "ep=1 checkpoint" in detail, detail
        assert "first difference" not in detail, detail
    for cell_id, first in failing(cells).items():
        assert re.search(r"layer \d.*expert", first), (cell_id, first)


def test_the_global_rank_as_ep_rank_is_caught_where_ep_groups_are_strided(pytester: pytest.Pytester) -> None:
    """Also the layout check's negative control: the framework forms other EP groups than the cell's."""
    cells = run_default_tier(pytester, "GlobalRankAsEpRank")
    # At 4 ranks, ep=2: strided EP groups are ranks {0, 2} and {1, 3}, where rank % 2 is not the EP rank;
    # in consecutive groups ({0, 1}, {2, 3}) and at ep=1 or ep=4 it is, and the bug is invisible.
    strided = {i for i, c in ran(cells).items() if "ep2" in (c["save_layout"], c["load_layout"]) and not c["legacy"]}
    assert strided and set(failing(cells)) == strided
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["status"] == "error", cells[cell_id]
        assert re.search(r"raised LayoutMismatch: the (save|load) side's experts are not where the cell's layout "
                         r"puts them: the framework formed consecutive EP groups \[0, 1\], \[2, 3\]; the layout "
                         r"ep=2 \(strided EP groups\).* \(EP groups \[0, 2\], \[1, 3\]\) gives experts 0\.\.1 to "
                         r"ranks 0, 1", first), (cell_id, first)


def test_a_legacy_load_that_fails_without_a_declared_refusal_is_not_a_refusal(pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "LegacyNeverRefused")
    legacy = {i for i, c in ran(cells).items() if c["legacy"]}
    assert legacy and set(failing(cells)) == legacy
    for cell_id, first in failing(cells).items():
        assert first.startswith("legacy checkpoint not refused: the load "), (cell_id, first)
    assert any("failed with RuntimeError: load failed" in f for f in failing(cells).values())


def test_a_load_that_raises_still_names_the_layer_and_experts(pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "LayerDropped")
    checked = {i for i, c in ran(cells).items() if not c["legacy"]}
    assert checked and set(failing(cells)) == checked
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["status"] == "error", cells[cell_id]
        assert "raised LoadFailed: the checkpoint differs from an EP-invariant one: layer 1, " in first, \
            (cell_id, first)


# -- issue 19 -----------------------------------------------------------------------------------------------------
def test_expert_keys_no_pattern_knows_pass_every_cell(pytester: pytest.Pytester) -> None:
    """No false alarm: the checkpoint check learns the renamed keys from the ep=1 save's content."""
    cells = run_default_tier(pytester, "RenamedExpertKeys")
    assert ran(cells) and failing(cells) == {}
    checked = [c for c in ran(cells).values() if not c["legacy"]]
    assert checked and all("checkpoint" not in c.get("skipped_checks", {}) for c in checked)


def test_a_load_bug_after_a_correct_save_is_blamed_on_the_load_in_expert_terms(pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "PackedLocalRowLoad")
    ran_cells = ran(cells)
    wrong = {i for i, c in ran_cells.items() if c["load_ep"] > 1}
    assert wrong and set(failing(cells)) == wrong, failing(cells)
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["status"] == "error", cells[cell_id]
        assert "raised LoadFailed: the load at ep=" in first, (cell_id, first)
        assert re.search(r"rank \d, layer \d, 'model\.layers\.\d\.mlp\.(gate|up|down)_w': the model at ep=\d.* offers "
                         r"\d rows for the checkpoint's 4 experts: the load does not map the saved global rows to "
                         r"this rank's experts? \d", first), (cell_id, first)
        assert "the checkpoint differs" not in first and "so the load is wrong" in first, (cell_id, first)
        assert "Size mismatch between saved" in json.dumps(cells[cell_id].get("errors", {})), cells[cell_id]
    assert all(c["status"] == "pass" for i, c in ran_cells.items() if i not in wrong)


def test_training_state_beyond_the_optimizer_round_trips_and_is_checked(pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "WithScheduler")
    assert ran(cells) and failing(cells) == {}


def test_a_scheduler_the_load_does_not_restore_is_caught_by_scalars(pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "SchedulerNotRestored")
    optim = {i for i, c in ran(cells).items() if c["state"] == "model+optim" and not c["legacy"]}
    assert optim and set(failing(cells)) == optim
    for cell_id, first in failing(cells).items():
        assert re.match(r"\[scalars\] rank \d: optimizer scalar 'state\.scheduler\.(_last_lr|base_lrs|last_epoch|"
                        r"_step_count)' = .* after the load, expected ", first), (cell_id, first)

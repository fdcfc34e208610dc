"""Every check's negative control: a seeded-bug adapter (``tests/seeded_bugs.py``) the default tier
catches.

Each test runs ``pytest --moe-ep-matrix`` (the default, covering tier) on one seeded bug in a
pytester run in this process (``matrix_expectations.run_inline``) and asserts which cells fail and
that each failing cell's first line names the check, the rank and the layer/expert (or the
checkpoint key and experts). A test runs the slice of the default tier where its bug can show
(``-k`` on the cells' state, kind, layout or expert count: an optimizer bug the model+optimizer
cells, an expert-TP bug the cells around ``etp2``), so its cells are default-tier cells, the failing
ones are exactly those the bug reaches, and the slice's other cells are its no-false-alarm controls.
Outside the slice a seeded adapter runs the reference's own code, whose every default cell passes
(``test_matrix.py``). About 2-15 s per bug on 2 cores.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from matrix_expectations import run_inline

pytestmark = pytest.mark.usefixtures("shared_fork_server")
SEEDED = (Path(__file__).parent / "seeded_bugs.py").read_text()
#: the slice an optimizer bug can show in: the non-legacy model+optimizer cells.
OPTIM = "optim and not legacy"
#: the kinds a slice leaves out unless its selection names them: a fused gate/up weight and an MTP
#: layer go through the same save, load and optimizer paths as every other weight and layer, so a
#: bug planted in those paths reads the same there; the bugs of the fused and MTP layouts
#: themselves select their cells by name.
OWN_KINDS = ("fused", "mtp")


def narrowed(select: str, keep: tuple[str, ...] = ()) -> str:
    """``select`` without the :data:`OWN_KINDS` cells it does not name or ``keep``."""
    left_out = [k for k in OWN_KINDS if k not in keep and not re.search(rf"\b{k}\b", select)]
    return " and ".join((f"({select})", *(f"not {k}" for k in left_out)))


def run_default_tier(pytester: pytest.Pytester, adapter: str, select: str, *extra: str,
                     tier: str = "default",
                     keep: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """The default tier's cells (or ``tier``'s) matching ``-k select`` (:func:`narrowed`, which
    also keeps the kinds in ``keep``: where the only cells of a slice are MTP ones) on the seeded
    ``adapter``: the report's cells by id."""
    pytester.makepyfile(seeded_bugs=SEEDED)
    out = pytester.path / "out"
    result = run_inline(pytester, f"--moe-ep-matrix={tier}",
                        f"--moe-ep-adapter=seeded_bugs:{adapter}", "-k", narrowed(select, keep),
                        *extra, f"--moe-ep-report={out}", "-p", "no:cacheprovider")
    doc = json.loads((out / "moe-ep-conformance.json").read_text())
    assert doc["tier"] == tier
    cells = {c["id"].removeprefix("moe-ep-matrix::checkpoint::"): c for c in doc["cells"]}
    assert result.ret == (pytest.ExitCode.TESTS_FAILED if any(c["status"] in ("fail", "stopped")
                                                                for c in cells.values()) else 0)
    return cells


def failing(cells: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Failing cell -> the first line of its diagnosis after the findings it leads with (each
    checked here: a red cell says how bad it is, and a seeded bug's silent damage is ``silent``)."""
    found = {}
    for cell_id, cell in cells.items():
        if cell["status"] in ("fail", "stopped"):
            first, lead = cell["detail"].splitlines()[0], ", ".join(cell["findings"]) + ": "
            assert (cell["finding"] == cell["findings"][0]
                    and first.startswith(lead)), (cell_id, first)
            found[cell_id] = first[len(lead):]
    return found


def ran(cells: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {i: c for i, c in cells.items() if c["status"] != "n/a"}


def test_an_unrestored_optimizer_step_is_caught_in_every_model_optim_cell(
        pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "StepNotRestored", OPTIM)
    optim = {i for i, c in ran(cells).items() if c["state"] == "model+optim" and not c["legacy"]}
    assert optim and set(failing(cells)) == optim
    assert {cells[i]["finding"] for i in optim} == {"silent"}  # the load said nothing
    for cell_id, first in failing(cells).items():
        assert re.match(r"\[scalars\] rank \d: optimizer scalar 'step' = \[3\.0\] after the load, "
                        r"expected \[2\.0\]", first), (cell_id, first)


def test_experts_left_without_optimizer_state_are_named_per_replica(
        pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "MomentsDropped", OPTIM)
    optim = {i for i, c in ran(cells).items() if c["state"] == "model+optim" and not c["legacy"]}
    assert optim and set(failing(cells)) == optim
    assert {cells[i]["finding"] for i in optim} == {"silent"}
    for cell_id, first in failing(cells).items():
        assert re.match(r"\[missing\] after the load the ranks \[[\d, ]+\] \(one replica\) hold no "
                        r"'(gate|up|down)\.exp_avg(_sq)?' of layer \d, experts? [\d.]+",
                        first), (cell_id, first)


def test_a_permutation_that_round_trips_is_caught_by_the_checkpoint_itself(
        pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "PermutedExperts", "not legacy and not fsdp")
    # Round-robin ids equal contiguous ones at ep=1 and at ep=E=4: only a side at ep=2 is wrong.
    wrong = {i for i, c in ran(cells).items() if 2 in (c["save_ep"], c["load_ep"])
             and not c["legacy"]}
    assert wrong and set(failing(cells)) == wrong
    same_ep = {i for i in wrong if cells[i]["save_ep"] == cells[i]["load_ep"] == 2}
    assert same_ep, "the default tier has no cell that saves and loads at ep=2"
    for cell_id in same_ep:  # every value came back right: only the files are wrong
        # the trap for the next reader
        assert cells[cell_id]["findings"] == ["on-disk"], cells[cell_id]
        detail = cells[cell_id]["detail"]
        assert detail.split(": ", 1)[-1].startswith("[checkpoint] checkpoint: layer ") and \
            "ep=1 checkpoint" in detail, detail
        assert "first difference" not in detail, detail
    for cell_id, first in failing(cells).items():
        assert re.search(r"layer \d.*expert", first), (cell_id, first)


def test_the_global_rank_as_ep_rank_is_caught_where_ep_groups_are_strided(
        pytester: pytest.Pytester) -> None:
    """Also the layout check's negative control: the framework forms other EP groups than the
    cell's."""
    cells = run_default_tier(pytester, "GlobalRankAsEpRank", "not legacy and not optim")
    # At 4 ranks, ep=2: strided EP groups are ranks {0, 2} and {1, 3}, where rank % 2 is not the EP
    # rank; in consecutive groups ({0, 1}, {2, 3}) and at ep=1 or ep=4 it is, and the bug is
    # invisible.
    strided = {i for i, c in ran(cells).items() if "ep2" in (c["save_layout"], c["load_layout"])}
    assert strided and set(failing(cells)) == strided
    for cell_id, first in failing(cells).items():
        assert (cells[cell_id]["status"] == "stopped"
                and cells[cell_id]["finding"] == "error"), cells[cell_id]
        assert re.search(r"raised LayoutMismatch: the (save|load) side's experts are not where the "
                         r"cell's layout puts them: the framework formed consecutive EP groups "
                         r"\[0, 1\], \[2, 3\]; the layout ep2 \(strided EP groups \[0, 2\], \[1, "
                         r"3\]\) gives experts 0\.\.\d to ranks 0, 1; experts \d\.\.\d to ranks 2, "
                         r"3; the framework's ranks hold rank 0: 0\.\.\d, rank 1: \d\.\.\d",
                         first), (cell_id, first)


def test_a_legacy_load_that_fails_without_a_declared_refusal_is_not_a_refusal(
        pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "LegacyNeverRefused", "legacy")
    legacy = {i for i, c in ran(cells).items() if c["legacy"]}
    assert legacy and set(failing(cells)) == legacy
    for cell_id, first in failing(cells).items():
        assert first.startswith("legacy checkpoint not refused: the load "), (cell_id, first)
    assert any("failed with RuntimeError: load failed" in f for f in failing(cells).values())


def test_a_load_that_raises_still_names_the_layer_and_experts(pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "LayerDropped", "not legacy and not fsdp and not optim")
    checked = {i for i, c in ran(cells).items() if not c["legacy"]}
    assert checked and set(failing(cells)) == checked
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["status"] == "stopped", cells[cell_id]
        assert ("raised LoadFailed: the checkpoint differs from an EP-invariant one: layer 1, "
                in first), \
            (cell_id, first)


# -- blame by evidence, keys learned from content --------------------------------------------------
def test_expert_keys_no_pattern_knows_pass_every_cell(pytester: pytest.Pytester) -> None:
    """No false alarm: the checkpoint check learns the renamed keys from the ep=1 save's content."""
    cells = run_default_tier(pytester, "RenamedExpertKeys", "not legacy and not fsdp")
    assert ran(cells) and failing(cells) == {}
    checked = [c for c in ran(cells).values() if not c["legacy"]]
    assert checked and all("checkpoint" not in c.get("skipped_checks", {}) for c in checked)


def test_a_load_bug_after_a_correct_save_is_blamed_on_the_load_in_expert_terms(
        pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "PackedLocalRowLoad", "kind_packed and not legacy")
    ran_cells = ran(cells)
    wrong = {i for i, c in ran_cells.items() if c["load_ep"] > 1}
    assert wrong and set(failing(cells)) == wrong, failing(cells)
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["status"] == "stopped", cells[cell_id]
        assert "raised LoadFailed: the load at ep=" in first, (cell_id, first)
        assert re.search(r"rank \d, layer \d, 'model\.layers\.\d\.mlp\.(gate|up|down)_w': the "
                         r"model offers \d rows for the checkpoint's \d experts: the load does not "
                         r"map the saved global rows to this rank's experts? \d",
                         first), (cell_id, first)
        assert ("the checkpoint differs" not in first
                and "so the load is wrong" in first), (cell_id, first)
        assert ("Size mismatch between saved"
                in json.dumps(cells[cell_id].get("errors", {}))), cells[cell_id]
    assert all(c["status"] == "pass" for i, c in ran_cells.items() if i not in wrong)


def test_training_state_beyond_the_optimizer_round_trips_and_is_checked(
        pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "WithScheduler", "optim")
    assert ran(cells) and failing(cells) == {}


def test_a_scheduler_the_load_does_not_restore_is_caught_by_scalars(
        pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "SchedulerNotRestored", OPTIM)
    optim = {i for i, c in ran(cells).items() if c["state"] == "model+optim" and not c["legacy"]}
    assert optim and set(failing(cells)) == optim
    for cell_id, first in failing(cells).items():
        assert re.match(r"\[scalars\] rank \d: training state "
                        r"'state\.scheduler\.(_last_lr|base_lrs|last_epoch|"
                        r"_step_count)' = .* after the load, expected ", first), (cell_id, first)


def test_a_schedule_that_closes_over_its_configuration_is_no_false_alarm(
        pytester: pytest.Pytester) -> None:
    """Configuration is not state: the load side keeps the run's configuration, so an exact restore
    of a LambdaLR whose factor reads ``min_lr / init_lr`` passes every cell (it failed the resume
    check by 5.6e-9 when the load side was built with three times the lr)."""
    cells = run_default_tier(pytester, "ScheduleClosesOverConfig", "optim")
    assert ran(cells) and failing(cells) == {}


def test_an_lr_the_load_does_not_restore_is_caught_on_a_per_step_schedule(
        pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "LrNotRestored", OPTIM)
    optim = {i for i, c in ran(cells).items() if c["state"] == "model+optim" and not c["legacy"]}
    assert optim and set(failing(cells)) == optim
    assert {cells[i]["finding"] for i in optim} == {"silent"}
    for cell_id, first in failing(cells).items():
        assert re.match(r"\[scalars\] rank \d: (optimizer scalar 'param_groups\.0\.lr'|"
                        r"training state 'state\.scheduler\._last_lr') = "
                        r".* after the load, expected ", first), (cell_id, first)


# -- the bug classes the default tier must reach ---------------------------------------------------
@pytest.mark.parametrize(("adapter", "eps", "missing"), [
    # counts 2, 1, 1, 1 on rows 2, 2, 1, 0: rank 1's expert 3 is never saved
    ("FirstRanksGetOneMore", {4}, "[34]"),
    # E // ep experts per rank: at ep=2 rank 1 files experts 3, 4 as 2, 3
    ("FloorExpertsPerRank", {2, 4}, "[234]"),
    # row counts 2, 2, 1, 0 agree; rank 2 files expert 4 as 3
    ("BalancedStartChunkCount", {4}, "[34]"),
])
def test_uneven_split_placements_are_caught_by_the_default_tier(
        pytester: pytest.Pytester, adapter: str, eps: set[int], missing: str) -> None:
    """The default tier itself (no ``--moe-ep-experts``) reaches each placement: its uneven E=5 puts
    a partial chunk, an empty rank and the balanced split's silent mislabel in front of the
    framework."""
    cells = run_default_tier(pytester, adapter, "E5 and not legacy")
    uneven = {i for i, c in ran(cells).items() if not c["legacy"] and c["num_experts"] == 5
              and eps & {c["save_ep"], c["load_ep"]}}
    assert uneven and set(failing(cells)) == uneven
    assert any(cells[i]["kind"] == k for i in uneven
               for k in ("packed", "unpacked", "packed->unpacked"))
    for cell_id, first in failing(cells).items():
        assert re.search(rf"layer \d, .*expert.*\b{missing}\b", first), (cell_id, first)


def test_one_misfiled_expert_of_64_is_caught_and_named(pytester: pytest.Pytester) -> None:
    """At a real expert count the checks still find one expert among 64 and name it; the slice is
    the EP-only model cells with an unpacked side at ep=1 or ep=4, without stages (3 cells)."""
    cells = run_default_tier(pytester, "OneExpertOf64Misfiled",
                             "unpacked and not optim and not fsdp and not legacy "
                             "and not pipeline and (ep1 or ep4)", "--moe-ep-experts=64")
    assert len(ran(cells)) >= 3 and set(failing(cells)) == set(ran(cells))
    for cell_id, first in failing(cells).items():
        # experts 41 and 42 swapped: the ep=1 checkpoint's key of expert 41 holds the model's expert
        # 42, and the loaded values are right (the swap round-trips), so the checkpoint is all that
        # shows it
        assert re.match(r"\[checkpoint\] checkpoint: the ep=1 checkpoint: layer 1, key "
                        r"'model\.layers\.1\.moe\."
                        r"experts\.(4[12])\.(gate|up|down)\.weight', expert \1: holds the model's "
                        r"'\2' of layer 1, expert 4[12], not expert \1's", first), (cell_id, first)
        assert "[values]" not in cells[cell_id]["detail"], cells[cell_id]["detail"]


def test_an_optimizer_bug_only_under_hsdp_or_etp_is_caught(pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "MomentsKeptUnderHsdpOrEtp", OPTIM)
    wrong = {i for i, c in ran(cells).items() if c["state"] == "model+optim" and not c["legacy"]
             and ("hsdp" in c["load_layout"] or "etp" in c["load_layout"])}
    assert {cells[i]["load_layout"] for i in wrong} >= {"ep2.hsdp2", "ep2.etp2"}
    assert set(failing(cells)) == wrong
    for cell_id, first in failing(cells).items():
        assert re.match(r"first difference: rank \d, layer \d, expert \d, tensor "
                        r"'\w+\.exp_avg(_sq)?': still holds its pre-load", first), (cell_id, first)


def test_the_global_rank_as_ep_rank_under_expert_tp_is_a_layout_error(
        pytester: pytest.Pytester) -> None:
    """At ep2.etp2 the EP rank taken from the global rank puts experts 0..3 on the ranks of EP
    coordinate 0: the layout check stops the cell before a replica could hold one etp shard twice
    (or DCP refuse the save)."""
    cells = run_default_tier(pytester, "GlobalRankAsEpRankEtp", "not legacy and not optim")
    touched = {i for i, c in ran(cells).items()
               if {c["save_layout"], c["load_layout"]} & {"ep2", "ep2.etp2"}}
    assert touched and set(failing(cells)) == touched
    for cell_id, first in failing(cells).items():
        assert (cells[cell_id]["status"] == "stopped"
                and cells[cell_id]["finding"] == "error"), cells[cell_id]
        assert re.search(r"raised LayoutMismatch: the (save|load) side's experts are not where the "
                         r"cell's layout puts them: ", first), (cell_id, first)


def test_a_replica_missing_an_etp_shard_is_named() -> None:
    """No world needed: the ``missing`` check's coverage of one replica's regions names the absent
    etp shard."""
    from conformance.checks.missing import _gap

    assert (_gap((64, 32), [((0, 32), (0, 32)), ((0, 32), (0, 32))], 2)
            == "axis 0 rows 32..63 of 64: the expert-TP shard 1 of 2")
    assert _gap((64, 32), [((0, 32), (0, 32)), ((32, 64), (0, 32))], 2) == ""


def test_a_replica_whose_etp_peer_lost_its_shards_is_caught_by_missing(
        pytester: pytest.Pytester) -> None:
    """The world-level control of ``missing``'s expert-TP coverage: etp rank 1's expert weight
    shards are gone after the load, while every EP coordinate still holds its experts and etp rank
    0's shards are right."""
    cells = run_default_tier(pytester, "EtpPeerFreedAfterLoad", "not legacy and (etp2 or hsdp2)")
    wrong = {i for i, c in ran(cells).items() if c["load_layout"] == "ep2.etp2"}
    assert wrong and set(failing(cells)) == wrong
    for cell_id, first in failing(cells).items():
        assert re.match(r"\[missing\] after the load the ranks \[[\d, ]+\] \(one replica\) hold "
                        r"only part of '(gate|up|down)' of layer \d, experts [\d.]+: no rank holds "
                        r"axis \d rows \d+\.\.\d+ of \d+: the expert-TP shard 1 of 2",
                        first), (cell_id, first)


def test_an_etp_shard_on_the_wrong_axis_is_named(pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "EtpShardTransposed", "not legacy and (etp2 or hsdp2)")
    wrong = {i for i, c in ran(cells).items() if not c["legacy"] and c["load_layout"] == "ep2.etp2"}
    assert wrong and set(failing(cells)) == wrong
    for cell_id, first in failing(cells).items():
        assert re.match(r"first difference: rank \d, layer \d, expert \d, tensor '(gate|up|down)': "
                        r"holds a shard of its transposed weight .*\(its own shard, transposed\)",
                        first), (cell_id, first)


def test_the_value_diagnosis_names_another_etp_ranks_shard() -> None:
    """No world needed: ``diagnose`` on a shard that is the other etp rank's, or the other
    axis's."""
    import torch

    from conformance.checks.values import diagnose

    key = (0, 1, "up")
    full = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    own = (slice(0, 32), slice(0, 32))
    assert diagnose(key, full[32:].clone(), own, {key: full}, {}).startswith(
        "holds another expert-TP rank's shard (axis 0 rows 32..63, axis 1 rows 0..31)")
    square = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    assert "the shard of the other axis (axis 0 rows 0..63, axis 1 rows 0..31)" in diagnose(
        key, square[:, :32].clone(), (slice(0, 32), slice(0, 64)), {key: square}, {})


def test_a_refused_save_plan_is_read_in_expert_terms() -> None:
    """No world needed: ``diagnose`` on the chunks ranks offered -- uncovered rows, overlaps, shapes
    in dispute."""
    from conformance.checks.save_plan import Offer, diagnose

    key = "model.layers.0.moe.experts.1.gate.weight"
    half = [Offer(r, key, (64, 32), (0, 0), (32, 32)) for r in (0, 2)]  # the same etp shard twice
    (line,) = diagnose(half)
    assert line.startswith(f"layer 0, expert 1, key {key!r}: no rank offered axis 0 rows 32..63 of "
                           "64 (ranks [0, 2] offered axis 0 rows 0..31 of 64)"), line
    packed = "model.layers.1.moe.up_w"
    overlap = [Offer(0, packed, (6, 8, 4), (0, 0, 0), (3, 8, 4)),
               Offer(1, packed, (6, 8, 4), (2, 0, 0), (3, 8, 4))]
    (line,) = diagnose(overlap)
    assert line.startswith(f"layer 1, expert 5, key {packed!r}: no rank offered axis 0 rows 5 of "
                           "6; ranks [0] and [1] offered overlapping chunks"), line
    disputed = [Offer(0, packed, (3, 8, 4), (0, 0, 0), (3, 8, 4)),
                Offer(2, packed, (2, 8, 4), (0, 0, 0), (2, 8, 4))]
    (line,) = diagnose(disputed)
    assert line == (f"layer 1, key {packed!r}: the ranks disagree on its global shape: ranks [2] "
                    "say (2, 8, 4); ranks [0] say (3, 8, 4)"), line
    assert diagnose([Offer(r, key, (64, 32), (32 * r, 0), (32, 32)) for r in (0, 1)]) == []
    balanced = [Offer(0, packed, (5, 8, 4), (0, 0, 0), (2, 8, 4)),
                Offer(1, packed, (5, 8, 4), (2, 0, 0), (2, 8, 4)),
                Offer(2, packed, (5, 8, 4), (3, 0, 0), (1, 8, 4)),
                Offer(3, packed, (5, 8, 4), (4, 0, 0), (0, 8, 4))]
    # a rank with no expert offers an empty chunk: said as such, not as "rows 4..3"
    (line,) = diagnose(balanced)
    assert line.endswith("ranks [3] offered nothing (an empty chunk at axis 0 row 4))"), line


# -- a kernel's rounding is not a wrong value; re-keyed state is named as re-keyed -----------------
@pytest.mark.parametrize("adapter", ["PerShardRounding", "FusedAdamW"])
def test_an_optimizer_that_rounds_per_shard_is_no_false_alarm(
        pytester: pytest.Pytester, adapter: str) -> None:
    """A "fused" optimizer rounds each rank's shard on its own (seeded: one ulp on each shard's last
    element; real: torch's ``AdamW(fused=True)``): the saved state is within rounding of the truth,
    every load gives back exactly what was saved, and the pass line says how many tensors a kernel
    rounded."""
    cells = run_default_tier(pytester, adapter, OPTIM)
    # At E=5 FusedAdamW keeps the experts in their own param group, as trainers do; loaded at ep=4
    # into unpacked layers, rank 3 holds no expert, its group is empty, and after torch's DCP
    # optimizer load that group has lost its hyperparameters: the next step raises KeyError 'betas'
    # on that rank (a loud refusal).
    empty_group = {i for i, c in ran(cells).items() if adapter == "FusedAdamW" and c["num_experts"]
                   == 5 and c["load_ep"] == 4 and c["kind"].endswith("unpacked")}
    assert ran(cells) and set(failing(cells)) == empty_group
    for cell_id in empty_group:
        assert ("failed on rank(s) 3: rank 3 raised KeyError: 'betas'"
                in failing(cells)[cell_id]), failing(cells)
    assert all("equal what the checkpoint holds bit for bit" in c["detail"] for i, c
               in ran(cells).items() if i not in empty_group)
    # the fused kernel rounds in FSDP cells with an ep=1 side, which the default tier's
    if adapter == "FusedAdamW":
        # covering does not pick: one such cell of the full tier shows it
        cells = run_default_tier(
            pytester, adapter, "packed and optim and fsdp and E4 and save_ep1 and load_ep2 and not "
            "cross and not pipeline and not etp2 and not hsdp2 and not consecutive", tier="full")
    rounded = [c for c in cells.values() if "within a kernel's rounding" in c["detail"]]
    assert rounded, ("no cell saw a rounding difference: this control would pass without the "
                     "tolerance")


def test_one_expert_moment_off_by_far_more_than_rounding_is_named(
        pytester: pytest.Pytester) -> None:
    """Under EP one expert's moment is off by one part in ten thousand before the save; the load
    gives back what was saved, so only the saved state against the truth (``values``) and the
    checkpoint (``checkpoint``) see it."""
    cells = run_default_tier(pytester, "OneMomentOffUnderEp", OPTIM)
    saved_under_ep = {i for i, c in ran(cells).items() if c["save_ep"] > 1}
    assert saved_under_ep and set(failing(cells)) == saved_under_ep
    for cell_id, first in failing(cells).items():
        experts = cells[cell_id]["num_experts"]
        assert cells[cell_id]["findings"] == ["silent", "on-disk"], cell_id
        assert re.match(rf"first difference: rank \d, layer 1, expert {experts - 1}, tensor "
                        r"'up\.exp_avg': as saved at .* \(before any load\): values differ from "
                        r"the ep=1 ground truth and match no tensor of it: max abs diff .* \(8\d\d "
                        r"ulps\)", first), (cell_id, first)


def test_settings_re_keyed_under_ep_are_named_as_re_keyed(pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "SettingsPerParameterUnderEp", OPTIM)
    saved_under_ep = {i for i, c in ran(cells).items() if c["save_ep"] > 1}
    assert saved_under_ep and set(failing(cells)) == saved_under_ep
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["findings"] == ["on-disk", "refused"], cell_id
        # 7 of a group's 11 fields: its kernel choices (fused, foreach, ...) are configuration
        assert re.search(r"key 'optimizer\.param_groups\.0\.\*': re-keyed: its 7 field\(s\) "
                         r"\(amsgrad, .*\) are "
                         r"absent from the checkpoint, which holds them under \d+ other key\(s\) "
                         r"\('optimizer\.param_groups\.layers\..*; the values agree; absent with "
                         r"no counterpart: params", cells[cell_id]["problems"][0]["text"]), first
        assert first.startswith(
            "failed on rank(s) 0, 1, 2, 3: ranks 0, 1, 2, 3 raised LoadFailed: the checkpoint "
            "differs from an EP-invariant one: key 'optimizer.param_groups.0.*': re-keyed"), first


def test_a_training_state_whose_structure_changes_with_ep_is_not_missing(
        pytester: pytest.Pytester) -> None:
    """A dict of schedulers under EP for the truth's one scheduler, restored exactly: no scalar is
    "missing"."""
    cells = run_default_tier(pytester, "SchedulersPerGroupUnderEp", "optim")
    assert ran(cells) and failing(cells) == {}


# -- the layout right, a save DCP refuses, named in expert terms -----------------------------------
def test_an_etp_shard_offered_twice_is_named_by_layer_expert_key_and_rows(
        pytester: pytest.Pytester) -> None:
    """The layout check passes (every rank holds its own shard); the save offers etp rank 1's shard
    at etp rank 0's offsets, DCP refuses the plan, and every cell saved at ep2.etp2 names the rows
    no rank offered and who offered what; the cells that only load at ep2.etp2 pass."""
    cells = run_default_tier(pytester, "EtpShardOfferedTwice", "etp2 and not legacy")
    saved_etp = {i for i, c in ran(cells).items() if "etp2" in c["save_layout"]}
    assert saved_etp and set(failing(cells)) == saved_etp and len(ran(cells)) > len(saved_etp)
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["findings"] == ["refused"], cell_id
        assert re.match(r"failed on rank\(s\) 0, 1, 2, 3: ranks 0, 1, 2, 3 raised SaveRefused: DCP "
                        r"refused the save's global plan: layer \d, expert \d, key "
                        r"'model\.layers\.\d\.moe\.experts\.\d\.\w+\.weight': no rank offered axis "
                        r"\d rows \d+\.\.\d+ of \d+ \(ranks \[\d, \d\] offered axis \d rows "
                        r"0\.\.\d+", first), (cell_id, first)


# -- packed layers save the packed form; its own misfiling is caught and named ---------------------
def _row_swap_named(first: str, detail: str, experts: int) -> bool:
    """Whether a cell names the swapped rows: the ep=1 checkpoint's row of expert E-2 (or E-1) of
    layer 1's packed ``up_w`` (or a moment of it) holds the other expert's values."""
    a, b = experts - 2, experts - 1
    line = (r"\[checkpoint\] checkpoint: the ep=1 checkpoint: layer 1, key "
            r"'(model|optimizer\.state)\.layers\.1\.moe\."
            rf"up_w(\.exp_avg(_sq)?)?', expert ({a}|{b}): row \4: holds the model's "
            rf"'up(\.exp_avg(_sq)?)?' of layer 1, expert ({a}|{b}), not expert \4's")
    return bool(re.search(line, detail))


def test_two_packed_rows_swapped_are_caught_by_the_checkpoint_and_named(
        pytester: pytest.Pytester) -> None:
    """E=4: every cell saved packed is red and names the layer, the two experts and the packed key;
    the value damage shows wherever the swap does not round-trip (a load at ep=4 puts the two rows
    on two ranks)."""
    cells = run_default_tier(pytester, "PackedRowsSwapped",
                             "not legacy and not E5 and not kind_unpacked")
    saved_packed = {i for i, c in ran(cells).items() if c["kind"].startswith("packed")}
    # a packed load swaps back where one rank holds both rows (not at ep=4, nor where FSDP2 shards
    # the rows over dp_shard > 1): into a correct (unpacked) save's values
    def both_rows_on_a_rank(c: dict[str, Any]) -> bool:
        inner = c["load_ep"] * (2 if "etp2" in c["load_layout"]
                                else 1) * (2 if "hsdp2" in c["load_layout"] else 1)
        return c["load_ep"] < 4 and not (c["fsdp"] and 4 // inner > 1)

    swapped_on_load = {i for i, c in ran(cells).items() if c["kind"] == "unpacked->packed"
                       and both_rows_on_a_rank(c)}
    assert (saved_packed and swapped_on_load
            and set(failing(cells)) == saved_packed | swapped_on_load)
    for cell_id in saved_packed:
        assert "on-disk" in cells[cell_id]["findings"], cells[cell_id]
        assert _row_swap_named(failing(cells)[cell_id], cells[cell_id]["detail"],
                               4), cells[cell_id]["detail"]
    for cell_id in swapped_on_load:
        assert re.match(r"first difference: rank \d, layer 1, expert [23], tensor 'up': holds "
                        r"expert [23]'s values",
                        failing(cells)[cell_id]), (cell_id, failing(cells)[cell_id])


def test_two_packed_rows_of_256_swapped_round_trip_and_the_checkpoint_names_them(
        pytester: pytest.Pytester) -> None:
    """E=256: one rank holds experts 254 and 255 at every layout of the world, so every value
    round-trips and the checkpoint is all that shows the swap -- named by layer, key and experts
    (packed model and optimizer cells)."""
    cells = run_default_tier(pytester, "PackedRowsSwapped",
                             "kind_packed and not legacy and ep1 and ep4", "--moe-ep-experts=256",
                             keep=("mtp",))  # the packed optimizer cell there has an MTP layer
    assert len(ran(cells)) >= 2 and set(failing(cells)) == set(ran(cells))
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["findings"] == ["on-disk"], cells[cell_id]
        assert _row_swap_named(first, first, 256), (cell_id, first)
        assert "[values]" not in cells[cell_id]["detail"], cells[cell_id]["detail"]


def test_the_balanced_split_offering_packed_rows_is_refused_and_named(
        pytester: pytest.Pytester) -> None:
    """NeMo's uneven-split bug in the packed form: at E=5, ep=4 each rank offers its packed rows at
    the balanced split's first id; DCP refuses the plan (row 3 twice, row 4 never) and every cell
    saved packed at ep=4 names the layer, expert 4, the key and who offered what.  The E=5 cells
    that save otherwise pass."""
    cells = run_default_tier(pytester, "PackedBalancedStart", "E5 and not legacy")
    wrong = {i for i, c in ran(cells).items() if c["kind"].startswith("packed")
             and c["save_ep"] == 4}
    assert wrong and set(failing(cells)) == wrong and len(ran(cells)) > len(wrong)
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["findings"] == ["refused"], cell_id
        assert re.search(r"raised SaveRefused: DCP refused the save's global plan: layer \d, "
                         r"expert 4, key '(model|optimizer\.state)\.layers\.\d\.moe\.\w+_w[\w.]*': "
                         r"no rank offered axis 0 rows 4 of 5; ranks \[1\] and \[2\] offered "
                         r"overlapping chunks", first), (cell_id, first)


# -- pipeline stages name their layers by their global index ---------------------------------------
def test_stage_local_layer_names_are_caught_at_every_cell_with_stages(
        pytester: pytest.Pytester) -> None:
    """Each stage saves ``stage{s}.layers.{local}``: a pp=1 save and load round-trip (those cells
    pass); a save with stages is not the pp=1 checkpoint (``checkpoint``, named by layer and key), a
    load with stages cannot find its keys in a pp=1 save (refused)."""
    cells = run_default_tier(pytester, "StageLocalLayerNames",
                             "pipeline or (save_ep2 and load_ep2 and not legacy)")
    staged = {i for i, c in ran(cells).items() if "pp2" in c["save_layout"]
              or "pp2" in c["load_layout"]}
    assert staged and set(failing(cells)) == staged and len(ran(cells)) > len(staged)
    for cell_id, first in failing(cells).items():
        if "pp2" in cells[cell_id]["save_layout"]:
            assert "on-disk" in cells[cell_id]["findings"], (cell_id, first)
            # the stage-prefixed key leads (in a model+optim cell its param group's names come
            # first, values before keys), never a layer "missing" from one stage's prefix that
            # another stage's prefix holds
            assert re.search(r"checkpoint.*: (layer \d, key 'model\.stage1\.layers\.\d\.moe\.|"
                             r"key 'optimizer\.param_groups\.0\.params': lists \d+ parameter "
                             r"name\(s\) the ep=1 checkpoint's group does not, first \['stage1\.)",
                             first), (cell_id, first)
            assert "absent, but layers" not in first, (cell_id, first)
        else:
            assert cells[cell_id]["findings"] == ["refused"], (cell_id, first)


def test_a_stage_map_that_disagrees_on_load_is_caught_by_values(pytester: pytest.Pytester) -> None:
    """The load maps stages with the last stage the longer one: stage 1 loads layer 1's tensors into
    layer 2, silently, in every cell loaded with stages; a load at pp=1 is right."""
    cells = run_default_tier(pytester, "StageMapDisagreesOnLoad", "pipeline")
    loaded_staged = {i for i, c in ran(cells).items() if "pp2" in c["load_layout"]}
    assert loaded_staged and set(failing(cells)) == loaded_staged
    assert any("pp2" in c["save_layout"] and i not in loaded_staged for i, c in ran(cells).items())
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["findings"] == ["silent"], cell_id
        assert re.match(r"first difference: rank \d, layer 2, expert \d, tensor '[\w.]+': holds "
                        r"'[\w.]+' of layer 1, expert \d instead", first), (cell_id, first)


def test_stages_built_in_reverse_are_a_layout_error(pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "StagesReversed", "pipeline and kind_unpacked")
    assert ran(cells) and set(failing(cells)) == set(ran(cells))
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["findings"] == ["error"], cell_id
        assert re.search(r"raised StageMismatch: the (save|load) side's layers are not where the "
                         r"cell's pipeline stages put them: the ranks of pipeline stage 0 \(0, 1\) "
                         r"hold layers 2(\.\.3)?: not the contiguous range",  # 3: an MTP layer
                         first), (cell_id, first)


def test_param_groups_taken_from_another_stage_are_caught(pytester: pytest.Pytester) -> None:
    """The load takes each param group's ``params`` from the checkpoint, where DCP kept one stage's
    list: the other stage's ranks lose their hyperparameters, and the step after the load raises on
    them -- in every cell of the default tier that saves and loads with stages and the optimizer
    (each kind at each stage layout); a load at pp=1 finds its parameters in any stage's list."""
    # every pipeline cell with optimizer state has an MTP layer
    cells = run_default_tier(pytester, "ParamGroupsFromCheckpoint", "optim and pipeline",
                             keep=("mtp",))
    wrong = {i for i, c in ran(cells).items() if "pp2" in c["save_layout"]
             and "pp2" in c["load_layout"]}
    assert len(wrong) == 4 and set(failing(cells)) == wrong and len(ran(cells)) > len(wrong)
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["findings"] == ["refused"], cell_id
        assert re.search(r"ranks (0, 1|2, 3) raised KeyError: 'betas'", first), (cell_id, first)


# -- today's MoE state: the expert bias, fused gate/up weights, MTP layers -------------------------
BIAS = r"first difference: rank \d, layer \d, expert \d, tensor 'router\.expert_bias': "
#: slices of the default tier that each seeded bug can show in (a few cells each: the suite's time).
EP_ONLY_MODEL = "ep-only and model and not optim and not legacy and not mtp and not fused"


def test_buffers_zeroed_after_the_load_are_red_in_every_cell(pytester: pytest.Pytester) -> None:
    """The plant a green tier must not pass: the framework's own load, then every persistent
    floating-point buffer zeroed.  The reference's expert bias is non-zero from its build on, in
    model and model+optim cells."""
    cells = run_default_tier(pytester, "BuffersZeroedAfterLoad",
                             "not legacy and ep-only and not fused")
    assert len(ran(cells)) >= 20 and set(failing(cells)) == set(ran(cells))
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["findings"] == ["silent"], cell_id
        assert re.match(BIAS + "holds zeros where it should hold values", first), (cell_id, first)


def test_an_expert_bias_stepped_out_of_place_is_caught(pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "ExpertBiasOutOfPlace", f"{OPTIM} and ep-only and not fused")
    assert ran(cells) and set(failing(cells)) == set(ran(cells))
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["findings"] == ["silent"], cell_id
        assert re.match(BIAS + r"still holds its pre-load \(seed B\) values.*per-expert entries "
                        r"differ: expert \d: expected", first), (cell_id, first)


def test_an_expert_bias_the_ep_wrapper_drops_is_caught(pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "ExpertBiasDroppedByEpWrapper", EP_ONLY_MODEL)
    wrong = {i for i, c in ran(cells).items() if max(c["save_ep"], c["load_ep"]) > 1}
    assert wrong and set(failing(cells)) == wrong
    for cell_id in failing(cells):
        cell = cells[cell_id]
        if cell["save_ep"] > 1:  # the save held no bias: the file is wrong
            assert "on-disk" in cell["findings"], cell_id
            assert ("key 'model.layers.0.moe.router.expert_bias': absent from the checkpoint"
                    in cell["detail"])
        if cell["load_ep"] > 1:  # the load's model has none
            assert "silent" in cell["findings"], cell_id
            assert "hold no layer 0, tensor 'router.expert_bias'" in cell["detail"], cell["detail"]


@pytest.mark.parametrize(("bug", "reading"), [
    ("ExpertBiasSavedInBf16",
     r"holds the values of .* rounded to bfloat16: saved or loaded through bfloat16"),
    ("ExpertBiasNotLoaded",
     r"still holds its pre-load \(seed B\) values: the load did not write it"),
])
def test_an_expert_bias_the_load_gets_wrong_is_named_by_its_expert(
        pytester: pytest.Pytester, bug: str, reading: str) -> None:
    cells = run_default_tier(pytester, bug, EP_ONLY_MODEL)
    assert ran(cells) and set(failing(cells)) == set(ran(cells))
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["findings"] == ["silent"], cell_id
        assert re.match(BIAS + reading, first), (cell_id, first)


@pytest.mark.parametrize(("bug", "reading", "where"), [
    ("FusedHalvesSwapped",
     r"tensor 'gate': holds its up half's values instead: the fused gate/up weight's halves "
     r"swapped", "every"),
    ("InterleavedReadAsConcatenated",
     r"tensor '(gate|up)': holds rows of both halves of the fused weight: the interleaved gate/up "
     r"rows read as concatenated halves", "etp1"),
    ("FusedShardCutAcrossHalves",
     r"tensor '(gate|up)': holds its (gate|up) half's axis 0 rows \d+\.\.\d+.* instead of its own "
     r"(gate|up) rows: a shard of the fused gate/up dim cut across its two halves", "etp2"),
])
def test_a_fused_gate_up_weight_read_wrong_names_the_expert_and_the_half(
        pytester: pytest.Pytester, bug: str, reading: str, where: str) -> None:
    """The default tier's fused cells (``-k fused``): FSDP, expert TP and EP changes; each half is
    checked on its own, and the misreading is named."""
    cells = run_default_tier(pytester, bug, "fused")
    assert len(ran(cells)) >= 5 and all(c["kind"] == "fused" for c in ran(cells).values())
    etp = {i for i, c in ran(cells).items() if "etp2" in c["load_layout"]}
    wrong = etp if where == "etp2" else set(ran(cells))
    assert etp and set(failing(cells)) == wrong
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["findings"] == ["silent"], cell_id
        # under expert TP an interleaving reads another way
        if where != "etp1" or cell_id not in etp:
            assert re.match(r"first difference: rank \d, layer \d, expert \d, " + reading,
                            first), (cell_id, first)


@pytest.mark.parametrize(("bug", "findings"), [
    ("MtpExpertsNotMappedBack", ["silent"]),
    ("MtpLeftOutOfSave", ["silent", "on-disk"]),
])
def test_mtp_layers_a_checkpoint_loses_are_named_by_their_layer(pytester: pytest.Pytester, bug: str,
                                                                findings: list[str]) -> None:
    """The MTP layer is global layer 3 (after the pipeline cells' three layers), on the last
    stage."""
    cells = run_default_tier(pytester, bug, "mtp and ep-only")
    assert ran(cells) and all(c["mtp"] for c in ran(cells).values())
    assert set(failing(cells)) == set(ran(cells))
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["findings"] == findings, cell_id
        assert re.match(r"first difference: rank \d, layer 3, expert \d, tensor '(gate|up|down)': "
                        r"still holds its pre-load \(seed B\) values", first), (cell_id, first)
        if "on-disk" in findings:
            assert ("the ep=1 checkpoint: layer 3: no key holds any of its experts' tensors"
                    in cells[cell_id]["detail"])


def test_an_expert_weight_read_as_its_transpose_is_named(pytester: pytest.Pytester) -> None:
    """The reference's dims all differ (model 16, expert hidden 32), so no square shape hides a
    transpose."""
    cells = run_default_tier(pytester, "DownReadAsItsTranspose", EP_ONLY_MODEL)
    assert ran(cells) and set(failing(cells)) == set(ran(cells))
    for cell_id, first in failing(cells).items():
        assert re.match(r"first difference: rank \d, layer \d, expert \d, tensor 'down': holds "
                        r"(its transpose's elements in its own shape \(16, 32\)|a shard of its "
                        r"transposed weight \(axis 0 rows)", first), (cell_id, first)


def test_a_token_counter_in_the_checkpoint_is_named(pytester: pytest.Pytester) -> None:
    cells = run_default_tier(pytester, "TokenCounterSaved", "fused")
    assert ran(cells) and set(failing(cells)) == set(ran(cells))
    for cell_id, first in failing(cells).items():
        assert cells[cell_id]["findings"] == ["on-disk"], cell_id
        assert re.match(r"\[checkpoint\] checkpoint: the ep=1 checkpoint: key "
                        r"'model\.layers\.\d\.moe\.router\."
                        r"tokens_per_expert' holds the non-persistent buffer "
                        r"'layers\.\d\.moe\.router\.tokens_per_expert'", first), (cell_id, first)

"""The ``nemo_automodel`` adapter end to end: NeMo Automodel 0.7.0 through the matrix and the
functions suite.

Skipped unless NeMo Automodel is installed (``ci/install_nemo_automodel.sh`` installs the pinned
0.7.0 and transformers 5.18.0).  The model is NeMo's DeepSeek-V3 MoE: a sigmoid router whose expert
bias ``mlp.gate.e_score_correction_bias`` NeMo's ``Gate.update_bias`` steps on synthetic loads.
Both runs happen in pytester subprocesses and their outcome is asserted *as found*, cell by cell, so
a change in the harness or in NeMo that flips one is noticed:

* checkpoint matrix (``--moe-ep-adapter=nemo_automodel``): every packed E=4 model cell passes --
  EP-only and FSDP, every EP pair of 1, 2, 4, the expert bias included.  Every model+optimizer cell
  that loads is silent: NeMo's ``Gate`` keeps an fp32 copy of the bias outside the state dict
  (``e_score_correction_bias_master``), which the load leaves at the load side's values, and the
  first update after the load writes that copy plus one step over the loaded bias (``resume`` names
  the bias on every rank and layer, and ``forward`` differs after it; every other tensor resumes
  exactly).  Every E=5 cell that involves ep=4 errors on ranks 1 and 3 in NeMo's
  ``split_experts_weights_dtensor_aware`` ("Expected local tensor first dimension to be 1 (experts
  2:3), got 2" / "(experts 4:5), got 0"): its "first E % k ranks get one more" split disagrees with
  the ``Shard(0)`` rows its own ``ExpertParallel`` gave the ranks; E=5 at ep=2 (3, 2 under both
  splits) loads -- its model+optimizer cells have the bias's finding, its forward is n/a
  (``GroupedExperts.forward`` asserts E % ep == 0); unpacked, cross-kind and legacy cells are n/a
  (``GroupedExperts`` is packed; NeMo has no legacy save);
* functions suite (``--moe-ep-functions=nemo_automodel``): 17 of 108 records pass (``is_dtensor``
  everywhere, ``validate_dtensor_expert_sharding`` on five meshes); the rest disagree with the
  reference, each for the reason asserted below (``create_dtensor_from_local`` gives DTensors a
  global shape of k times the local rows; ``validate_dtensor_expert_sharding`` accepts DTensors
  built from the other split, exactly at the E where the splits differ; wrong inputs are accepted or
  refused with other error types).

The ``forward`` check (NeMo's own ``MoE.forward`` in every block, through the FSDP-wrapped modules)
equals the ep=1 truth in every E=4 model cell; its negative control (``seeded_forward``: the gate
rows of experts 0 and 1 swapped in the forward after a load) fails on ``forward`` only, in one
cell.  The bias finding is asserted in one cell of the matrix and, with its cause, in one process.

The two whole runs take about 87 s and 35 s on 2 cores (the first cell includes the world's
start-up).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from matrix_expectations import (
    BIT_FOR_BIT,
    E5,
    EVEN,
    ID,
    PACKED_ONLY_NOT_APPLICABLE,
    assert_as_expected,
    by_status,
    expectations_args,
)
from matrix_expectations import run_report as run

FORWARD_RAN = re.compile(r"\(checks: [a-z_, ]*\bforward\b[a-z_, ]*\)")

pytest.importorskip("nemo_automodel.components.moe.state_dict_utils",
                    reason="nemo_automodel is not installed (ci/install_nemo_automodel.sh installs "
                           "nemo-automodel==0.7.0)")
pytest.importorskip("nemo_automodel.components.models.qwen3_moe.state_dict_adapter",
                    reason="NeMo's Qwen3-MoE state-dict adapter cannot be imported (it needs "
                    "transformers; ci/install_nemo_automodel.sh installs transformers==5.18.0)")

#: NeMo's split puts experts 4:5 on rank 2 and 5:6 on rank 3; Shard(0) gave them rows 4:6 and none.
#: E=5 at ep=4: the balanced split gives ranks 1 and 3 one row each, Shard(0) two and none (rank 2's
#: rows agree in count, expert 4 against the balanced 3: NeMo raises on ranks 1 and 3 before that
#: mislabel lands).
E5_DIAGNOSIS = (
    "failed on rank(s) 1, 3: rank 1 raised ValueError: Expected local tensor first dimension to be "
    "1 (experts 2:3), got 2; rank 3 raised ValueError: Expected local tensor first dimension to be "
    "1 (experts 4:5), got 0"
)

FUNCTION_CELLS = ("ep::k1", "ep::k2", "ep::k3", "ep::k4", "dp,ep::k2", "ep_replicate,ep::k2",
                  "ep,dp_shard::k2", "dp_shard_cp::k3", "dp,dp_shard::k2", "ep+Shard(1)::k2",
                  "tp+Shard(2)::k4", "ep+Replicate::k3", "layout:ep2::k2", "layout:ep2c::k2",
                  "layout:ep2.etp2::k2")
FUNCTIONS = ("is_dtensor", "get_submesh", "_get_expert_mesh_dim_index", "get_expert_slice_for_rank",
             "split_experts_weights_dtensor_aware", "validate_dtensor_expert_sharding",
             "create_dtensor_from_local",
             "get_expert_range_for_rank_from_mesh", "should_load_expert_for_rank")
FUNCTIONS_PASSING = {(cell, "is_dtensor") for cell in FUNCTION_CELLS} | {
    (cell, "validate_dtensor_expert_sharding")
    for cell in ("ep::k1", "ep::k2", "dp,ep::k2", "ep_replicate,ep::k2", "ep+Replicate::k3")}
#: the first disagreement of each failing function, as found (a phrase of the record's detail).
#: meshes with a dim create_dtensor_from_local does not know (NeMo asserts; the reference raises
#: ValueError)
FOREIGN_MESH_DIMS = ("dp_shard_cp::k3", "dp,dp_shard::k2", "ep,dp_shard::k2", "tp+Shard(2)::k4",
                     "dp,ep::k2", "layout:ep2::k2", "layout:ep2c::k2", "layout:ep2.etp2::k2")
WHY_FUNCTIONS_FAIL: dict[str, str | tuple[str, ...]] = {
    "get_submesh": "get_submesh(mesh, ('no_such_dim',)): expected raises ValueError: mesh has no "
    "dim named 'no_such_dim'",
    "_get_expert_mesh_dim_index": "_get_expert_mesh_dim_index(plain tensor): expected raises "
    "TypeError: expected a DTensor, got Tensor; got raises AttributeError: 'Tensor' object has no "
    "attribute 'device_mesh'",
    # a DTensor of 1 expert with n_experts=2 is not refused
    "get_expert_slice_for_rank": ("get_expert_slice_for_rank(w, 2); w = "
                                  "distribute_tensor(arange(1, 4, 6), mesh, ",
                                  "expected n_experts=2; got returns (Tensor("),
    "split_experts_weights_dtensor_aware": "expected raises ValueError: experts_tensor has global "
    "shape (1, 4, 6): dim 0 holds 1 experts, expected n_experts=2; got returns ([",
    "get_expert_range_for_rank_from_mesh": "get_expert_range_for_rank_from_mesh(mesh, 0): expected "
    "raises ValueError: n_experts must be an int >= 1, got 0; got returns (0, 0)",
    "should_load_expert_for_rank": "should_load_expert_for_rank(1, mesh, 1): expected raises "
    "ValueError: expert_id must be an int in [0, 1), got 1; got returns False",
    # E=1 on k ranks: the DTensor claims k experts (from_local without shape=)
    "create_dtensor_from_local": ("create_dtensor_from_local(local, mesh); local = (1, {rows}, 6) "
                                  "rows by expert_range: expected returns DTensor(shape=(1, 4, 6), "
                                  "{placements}",
                                  "got returns DTensor(shape=({k}, 4, 6), {placements}"),
    "validate_dtensor_expert_sharding": "w has unsupported DTensor placement: S(1). Expected "
    "Shard(dim=0) or Replicate for expert parallelism.",
}
WHY_FUNCTIONS_FAIL_HERE: dict[tuple[str, str], str] = {
    ("dp,dp_shard::k2", "get_expert_range_for_rank_from_mesh"): "no 'ep' dim: cannot tell which "
    "dim partitions the experts; pass a mesh with an 'ep' dim or a 1-D mesh; "
                                                                "got raises RuntimeError",
    ("dp,dp_shard::k2", "should_load_expert_for_rank"): "no 'ep' dim: cannot tell which dim "
    "partitions the experts; pass a mesh with an 'ep' dim or a 1-D mesh; got raises "
                                                        "RuntimeError",
    ("ep::k1", "create_dtensor_from_local"): "expected raises TypeError: local_tensor is already a "
    "DTensor; pass this rank's local torch.Tensor; got raises RuntimeError",
    ("ep::k1", "split_experts_weights_dtensor_aware"): "experts_tensor has unsupported DTensor "
    "placement: Partial(sum).",
    ("ep+Replicate::k3", "split_experts_weights_dtensor_aware"): "expected returns "
    "([DTensor(shape=(4, 6), ('Replicate()',), mesh=('ep',), local=(4, 6) first=0 "
                                                                 "sum=276, view)], [0]); got "
    "returns ([Tensor((4, 6)", ("ep,dp_shard::k2",
                                "split_experts_weights_dtensor_aware"): "expected returns "
    "([Tensor((4, 6) first=0 sum=276, view)], [0]); got returns ([DTensor(shape=(4, 6), "
                                                                "('Replicate()',), "
    "mesh=('dp_shard',)", ("tp+Shard(2)::k4", "split_experts_weights_dtensor_aware"): "got returns "
    "([DTensor(shape=(4, 8), ('Shard(dim=1)',), mesh=('tp',)",
    ("ep,dp_shard::k2", "validate_dtensor_expert_sharding"): "(Shard(dim=1), Shard(dim=0))): "
    "expected raises ValueError: w has unsupported DTensor placement: "
                                                             "Shard(dim=1). The expert mesh dim 0 "
    "must use Shard(0) or Replicate(); got returns True",
    ("tp+Shard(2)::k4", "validate_dtensor_expert_sharding"): "w has unsupported DTensor placement: "
    "S(2).",
    # the matrix's 4-D layout meshes: an inner-axis shard on the ep dim is accepted
    **{(cell, "validate_dtensor_expert_sharding"): "expected raises ValueError: w has unsupported "
       "DTensor placement: Shard(dim=1). The expert mesh dim 1 must use Shard(0) or "
                                                   "Replicate(); got returns True"
       for cell in ("layout:ep2::k2", "layout:ep2c::k2")},
    # the reference refuses a DTensor built from the "first E % k ranks get one more" split; NeMo
    # accepts it
    ("ep::k3", "validate_dtensor_expert_sharding"): "validate_dtensor_expert_sharding(w, 4, 'w'); "
    "w = DTensor.from_local(arange[2:3], mesh, [Shard(0)], "
                                                    "shape=(4, 4, 6)): expected raises ValueError: "
    "w: the local tensor holds 1 expert rows but its placements (Shard(dim=0),) "
                                                    "give this rank 2 (rows 2:4 of 4)",
    ("ep::k4", "validate_dtensor_expert_sharding"): "validate_dtensor_expert_sharding(w, 5, 'w'); "
    "w = DTensor.from_local(arange[2:3], mesh, [Shard(0)], "
                                                    "shape=(5, 4, 6)): expected raises ValueError: "
    "w: the local tensor holds 1 expert rows but its placements (Shard(dim=0),) "
                                                    "give this rank 2 (rows 2:4 of 5)",
}
#: the expert counts where validate_dtensor_expert_sharding disagrees on 1-D ep meshes: exactly the
#: E where the two splits give some rank different rows.
VALIDATE_FAILS_AT = {"ep::k3": [4, 7, 10, 13, 16], "ep::k4": [5, 6, 9, 10, 13, 14]}
# cell -> (local rows of dim 1, placements text, global rows NeMo claims for E=1)
CREATE_DTENSOR_SHAPES = {
    "ep::k2": (4, "('Shard(dim=0)',), mesh=('ep',)", 2),
    "ep::k3": (4, "('Shard(dim=0)',), mesh=('ep',)", 3),
    "ep::k4": (4, "('Shard(dim=0)',), mesh=('ep',)", 4),
    "ep+Replicate::k3": (4, "('Shard(dim=0)',), mesh=('ep',)", 3),
    "ep_replicate,ep::k2": (4, "('Replicate()', 'Shard(dim=0)'), mesh=('ep_replicate', 'ep')", 2),
    "ep+Shard(1)::k2": (2, "('Shard(dim=0)', 'Shard(dim=1)'), mesh=('ep', 'ep_shard')", 2),
}


@pytest.mark.slow
def test_nemo_automodel_matrix_as_found(pytester: pytest.Pytester) -> None:
    """Model cells pass where NeMo's split is ``Shard(0)``'s, model+optimizer cells that load are
    silent on the expert bias, E=5 at ep=4 is refused."""
    result, doc = run(pytester, "--moe-ep-matrix=1,2,4", "--moe-ep-adapter=nemo_automodel",
                      *expectations_args("nemo_automodel"))
    assert doc["adapter"] == {"name": "nemo_automodel", "version": "0.7.0"}
    cells, statuses, na = by_status(doc)
    assert_as_expected(result, doc)  # held against ci/expectations/nemo_automodel.toml
    at_ep4 = {i for i, (s, t) in E5.items() if 4 in (s, t)}
    assert {cells[i]["finding"] for i in at_ep4} == {"refused"}
    model = {i for i, (state, *_) in EVEN.items() if state == "model"}
    silent = set(EVEN) - model | set(E5) - at_ep4  # at ep=2 the balanced split is the chunk's
    assert statuses.get("pass", set()) == model, {i: cells[i]["detail"]
                                                  for i in model ^ statuses["pass"]}
    assert statuses.get("fail", set()) == silent, {i: cells[i]["detail"]
                                                   for i in silent ^ statuses["fail"]}
    assert statuses.get("stopped", set()) == at_ep4, {i: cells[i]["detail"]
                                                    for i in at_ep4 ^ statuses["stopped"]}
    assert na == PACKED_ONLY_NOT_APPLICABLE
    assert doc["summary"] == {"pass": 18, "fail": 21, "stopped": 5, "n/a": 68}
    result.assert_outcomes(passed=18, xfailed=26, skipped=68)

    for cell_id in model:  # NeMo's forward after the load equals the truth's, with and without FSDP
        assert BIT_FOR_BIT in cells[cell_id]["detail"], cells[cell_id]
        assert (FORWARD_RAN.search(cells[cell_id]["detail"])
                and not cells[cell_id]["skipped_checks"]), cells[cell_id]
    for cell_id in silent:
        assert_only_the_bias_resumes_wrong(cells[cell_id])
        forward = cells[cell_id]["skipped_checks"].get("forward", "")  # asserts E % ep == 0
        assert ("NeMo's GroupedExperts.forward cannot run E=5 experts at ep=2: AssertionError"
                in forward) == \
            (cell_id in E5 and E5[cell_id][1] == 2), cells[cell_id]
    for cell_id in at_ep4:
        cell = cells[cell_id]
        s, t = E5[cell_id]
        assert (cell["save_ep"], cell["load_ep"], cell["num_experts"]) == (s, t, 5)
        if s == 4:  # NeMo's own split fails the save at ep=4
            assert E5_DIAGNOSIS in cell["detail"], cell["detail"]
        else:  # an EP-invariant save; the load at ep=4 is blamed, with NeMo's message
            assert ("raised LoadFailed: the load at ep=4, etp=1, dp_shard=1, dp_replicate=1 "
                    "raised: ValueError: Expected local tensor first dimension to be 1 (experts "
                    "2:3), got 2 (the checkpoint is EP-invariant, so the load is wrong; raised at "
                    "nemo_automodel/components/moe/state_dict_utils.py:138 in "
                    "split_experts_weights_dtensor_aware)" in cell["detail"]), cell["detail"]


def assert_only_the_bias_resumes_wrong(cell: dict[str, Any]) -> None:
    """A model+optimizer cell as found: every check but ``resume`` (and the ``forward`` after it)
    passed, and ``resume`` names only ``mlp.gate.e_score_correction_bias``, on every rank and
    layer."""
    assert cell["findings"] == ["silent"], cell["detail"][:500]
    passed = set(cell["checks_passed"])
    assert {"checkpoint", "values", "missing", "scalars"} <= passed, passed
    resumed = {(p["rank"], p["layer"]) for p in cell["problems"] if p["check"] == "resume"}
    assert resumed == {(r, i) for r in range(4) for i in range(2)}, resumed
    for problem in cell["problems"]:
        assert problem["check"] in ("resume", "forward"), problem
        if problem["check"] == "resume":
            assert problem["tensor"] == "mlp.gate.e_score_correction_bias", problem
            assert "after one more step: values differ from the ep=1 ground truth" in \
                problem["text"], problem


def test_nemo_automodel_bias_resumes_from_the_load_sides_copy(pytester: pytest.Pytester) -> None:
    """One model+optimizer cell of the matrix as found (ep2c -> ep4): NeMo's load restores every
    tensor, the bias included, and the next ``update_bias`` moves the bias from the load side's own
    copy: ``resume`` names the bias on every rank and layer, and nothing else."""
    result, doc = run(pytester, "--moe-ep-matrix", "--moe-ep-adapter=nemo_automodel",
                      "-k", "optim and not fsdp and save_ep2 and load_ep4 and E4 and not lora",
                      *expectations_args("nemo_automodel"))
    cells = assert_as_expected(result, doc)
    ran = {i: c for i, c in cells.items() if c["status"] != "n/a"}
    assert set(ran) == {ID.format(state="model+optim", mode="ep-only", pair="ep2c->ep4")}, set(ran)
    (cell,) = ran.values()
    assert_only_the_bias_resumes_wrong(cell)
    forward = {r for p in cell["problems"] if p["check"] == "forward" for r in p["ranks"]}
    assert forward == {0, 1, 2, 3}, cell["problems"]


def test_a_bias_update_after_a_load_starts_from_nemos_own_copy() -> None:
    """The finding's cause, in one process: a model that already stepped its bias loads another's
    state and steps once more: its bias follows its own fp32 copy
    (``e_score_correction_bias_master``), not the loaded values; with the copy dropped after the
    load it follows the loaded ones.  And each view is the tensor NeMo's DeepSeek-V3 state-dict
    adapter writes under that key in HF form."""
    import torch

    from conformance.adapter import Spec
    from conformance.adapters.nemo_automodel import BIAS, NemoAutomodelAdapter, _moe_layers

    adapter = NemoAutomodelAdapter()
    saved, saved_optimizer = adapter.build(Spec(optimizer_steps=2, kind="packed"), None, 1234)

    def resumed(drop_copy: bool) -> list[Any]:
        model, optimizer = adapter.build(Spec(optimizer_steps=3, kind="packed"), None, 5678)
        model.load_state_dict(saved.state_dict())
        optimizer.load_state_dict(saved_optimizer.state_dict())
        for _, moe in _moe_layers(model):
            assert moe.gate.e_score_correction_bias_master is not None  # made by the updates
            if drop_copy:
                moe.gate.e_score_correction_bias_master = None
        adapter.step(model, optimizer, 1234, 2)
        return [moe.gate.e_score_correction_bias.clone() for _, moe in _moe_layers(model)]

    kept_copy, dropped_copy = resumed(False), resumed(True)
    adapter.step(saved, saved_optimizer, 1234, 2)
    expected = [moe.gate.e_score_correction_bias for _, moe in _moe_layers(saved)]
    for kept, dropped, want in zip(kept_copy, dropped_copy, expected, strict=True):
        assert not torch.equal(kept, want) and torch.equal(dropped, want), (kept, dropped, want)

    hf = saved.state_dict_adapter.to_hf(saved.state_dict())
    views = {(e.layer, e.name): e.tensor for e in adapter.expert_tensors(saved, None)}
    assert {name for _, name in views} == {"gate", "up", "down"}
    for (layer, name), block in views.items():
        for g in range(4):
            key = f"model.layers.{layer}.mlp.experts.{g}.{name}_proj.weight"
            assert torch.equal(block[g], hf[key]), key
    for layer, _, name, tensor in adapter.other_tensors(saved, None):
        assert torch.equal(tensor, hf[f"model.layers.{layer}.{name}"]), name
    assert {name for *_, name, _ in adapter.other_tensors(saved, None)} >= {BIAS}


def test_nemo_automodel_forward_catches_gate_rows_swapped_after_the_load(
        pytester: pytest.Pytester) -> None:
    """The forward check's negative control: only ``forward`` sees it (the stored tensors are
    right)."""
    pytester.makepyfile(seeded_forward=(Path(__file__).parent / "seeded_forward.py").read_text())
    _, doc = run(pytester, "--moe-ep-matrix=1,2,4",
                 "--moe-ep-adapter=seeded_forward:NemoSwappedRouter",
                 "-k", "save_ep1 and load_ep2 and not fsdp and not optim")
    cells, statuses, _ = by_status(doc)
    cell_id = "moe-ep-matrix::checkpoint::packed::model::ep-only::ep1->ep2c"
    assert statuses == {"fail": {cell_id}, "n/a": statuses.get("n/a", set())}, statuses
    assert cells[cell_id]["findings"] == ["silent"], cells[cell_id]  # the forward alone sees it
    *lines, passed = cells[cell_id]["detail"].removeprefix("silent: ").splitlines()
    assert passed == "checks that passed: checkpoint, values, missing", passed
    assert len(lines) == 4 and all(
        line.startswith(f"[forward] rank {r}: the forward after the load differs from the "
                        "ground truth's") for r, line in enumerate(lines)), lines


def test_nemo_automodel_expert_bias_zeroed_after_the_load_is_named(
        pytester: pytest.Pytester) -> None:
    """The negative control of the expert bias on NeMo: NeMo's own load, then every router's bias
    zeroed (``seeded_nemo``).  ``values`` names ``mlp.gate.e_score_correction_bias`` as zeroed by
    the load on every rank and layer, and nothing but the bias (and the forward it routes) is
    wrong: a model cell that passes as found fails only because the bias is compared."""
    pytester.makepyfile(seeded_nemo=(Path(__file__).parent / "seeded_nemo.py").read_text())
    _, doc = run(pytester, "--moe-ep-matrix=1,2,4",
                 "--moe-ep-adapter=seeded_nemo:NemoExpertBiasZeroedAfterLoad",
                 "-k", "save_ep1 and load_ep2 and not fsdp and not optim")
    cells, statuses, _ = by_status(doc)
    cell_id = ID.format(state="model", mode="ep-only", pair="ep1->ep2c")
    assert statuses == {"fail": {cell_id}, "n/a": statuses.get("n/a", set())}, statuses
    cell = cells[cell_id]
    assert cell["findings"] == ["silent"], cell["detail"][:500]
    assert {p["check"] for p in cell["problems"]} <= {"values", "forward"}, cell["problems"]
    values = [p for p in cell["problems"] if p["check"] == "values"]
    assert {(p["rank"], p["layer"], p["tensor"]) for p in values} == {
        (r, i, "mlp.gate.e_score_correction_bias") for r in range(4) for i in range(2)}, values
    assert all("the load left it zeroed" in p["text"] for p in values), values


@pytest.mark.slow
def test_nemo_automodel_functions_suite_outcome(pytester: pytest.Pytester) -> None:
    result, doc = run(pytester, "--moe-ep-functions=nemo_automodel")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()[-3000:]
    records = {}
    for record in doc["cells"]:
        assert record["adapter"] == "nemo_automodel.components.moe.state_dict_utils", record
        _, _, mesh, k, function = record["id"].split("::")
        records[(f"{mesh}::{k}", function)] = record
    assert set(records) == {(cell, f) for cell in FUNCTION_CELLS for f in FUNCTIONS}
    passing = {key for key, record in records.items() if record["status"] == "pass"}
    assert passing == FUNCTIONS_PASSING, {key: records[key]["detail"]
                                          for key in passing ^ FUNCTIONS_PASSING}
    assert {r["status"] for key, r in records.items() if key not in passing} == {"fail"}
    assert doc["summary"] == {"pass": 20, "fail": 115, "stopped": 0, "n/a": 0}
    result.assert_outcomes(failed=15)

    for (cell, function), record in records.items():
        if (cell, function) in passing:
            continue
        detail = record["detail"]
        if (cell, function) in WHY_FUNCTIONS_FAIL_HERE:
            phrase = WHY_FUNCTIONS_FAIL_HERE[(cell, function)]
        elif function == "create_dtensor_from_local" and cell in FOREIGN_MESH_DIMS:
            phrase = ("got raises AssertionError: Expected mesh dimension names to contain only "
                      "'ep', 'ep_shard'")
        elif function == "create_dtensor_from_local":
            rows, placements, k = CREATE_DTENSOR_SHAPES[cell]
            phrase = tuple(p.format(rows=rows, placements=placements, k=k)
                           for p in WHY_FUNCTIONS_FAIL[function])
        else:
            phrase = WHY_FUNCTIONS_FAIL[function]
        for part in (phrase,) if isinstance(phrase, str) else phrase:
            assert part in detail, (cell, function, part, detail)
        if function == "validate_dtensor_expert_sharding" and cell in VALIDATE_FAILS_AT:
            assert record["failed_num_experts"] == VALIDATE_FAILS_AT[cell], record

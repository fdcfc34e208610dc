"""The functions suite judged by modules whose answers we know.

- the reference against itself passes every record of every cell;
- the balanced-split negative control fails exactly on the E where its split differs from
  ``torch.chunk``'s, in exactly the functions where the layout matters for that cell, and nowhere
  else;
- a copy where the reference returns a view, a silent return where it raises, a missing function and
  an unloadable module are each reported as what they are.

Cells run through the session's engine (``moe_ep_engine``), as the conformance items do: one world
call per cell, per-rank records merged in the controller.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

from conformance.adapters import balanced_functions
from conformance.functions.cells import (
    FUNCTIONS,
    NUM_EXPERTS,
    REFERENCE,
    FunctionsCell,
    functions_cells,
)
from conformance.functions.merge import merge_rank_records
from conformance.functions.rank import TEXT_LIMIT, TensorValue, check_functions, same
from pytest_moe_ep.world.engine import Engine
from reference_impl.layout import expert_counts

CELLS = functions_cells()
BALANCED = "conformance.adapters.balanced_functions"
WRONG = "functions_suite_wrong"  # tests/functions_suite_wrong.py, importable on ranks via sys.path
#: the functions whose answers depend on where rows sit (for a cell whose weight shards rows).
ROW_FUNCTIONS = ("get_expert_slice_for_rank", "split_experts_weights_dtensor_aware",
                 "validate_dtensor_expert_sharding")
MESH_FUNCTIONS = ("get_expert_range_for_rank_from_mesh", "should_load_expert_for_rank")
DISAGREEMENT_KEYS = {"function", "E", "k", "mesh", "placements", "rank", "inputs", "expected",
                     "got"}


def cell_named(node_name: str) -> FunctionsCell:
    return next(c for c in CELLS if c.node_name == node_name)


def run_cell(engine: Engine, module: str, cell: FunctionsCell) -> dict[str, dict[str, Any]]:
    """The merged records of one cell, by function, after checking their form."""
    per_rank = engine.run(check_functions, module, cell, world_size=cell.world_size, backend="gloo")
    assert len(per_rank) == cell.world_size
    records = merge_rank_records(per_rank)
    json.dumps(records)  # the report writes them as JSON
    assert [r["function"] for r in records] == list(FUNCTIONS)
    for r in records:
        assert r["suite"] == "functions" and r["ep"] == cell.k and r["mesh"] == cell.mesh
        assert r["placements"] == cell.placements and r["num_experts"] == list(NUM_EXPERTS)
        assert r["status"] == ("fail" if r["count"] else "pass"), r
        assert bool(r["detail"]) == bool(r["count"]) and "\n" not in r["detail"]
        assert len(r["disagreements"]) <= r["count"]
        for d in r["disagreements"]:
            assert d.keys() >= DISAGREEMENT_KEYS, d
            assert len(d["expected"]) <= TEXT_LIMIT and len(d["got"]) <= TEXT_LIMIT
    return {r["function"]: r for r in records}


# ------------------------------------------------------------------------- without a world


def test_cells_are_unique_readable_and_fit_this_machine() -> None:
    names = [c.node_name for c in CELLS]
    assert len(set(names)) == len(names)
    assert all(" " not in n and n.startswith("functions::") for n in names)
    assert {c.world_size for c in CELLS} == {1, 2, 3, 4}
    assert {c.k for c in CELLS} == {1, 2, 3, 4}
    kinds = {c.mesh for c in CELLS}
    assert {"ep", "dp,ep", "ep,dp_shard", "dp_shard_cp", "ep+Shard(1)", "ep+Replicate"} <= kinds
    assert (cell_named("functions::ep::k3")
            == pickle.loads(pickle.dumps(cell_named("functions::ep::k3"))))
    # the grid holds E < k, k dividing E and k not dividing E for every k
    for k in range(2, 5):
        assert {E % k == 0 for E in NUM_EXPERTS} == {True, False} and min(NUM_EXPERTS) < k


def test_the_grid_is_cheap_to_import() -> None:
    """Collection builds items from the grid; that must not import torch."""
    code = ("import sys; from conformance.functions.cells import functions_cells; "
            "functions_cells(); assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_merge_names_the_first_failing_rank_and_sums_counts() -> None:
    def record(rank: int, count: int, failed: list[int]) -> dict[str, Any]:
        d = {"function": "f", "E": failed[0] if failed else None, "rank": rank}
        return {"function": "f", "status": "fail" if count else "pass", "count": count,
                "detail": f"f: rank {rank} ..." if count else "", "disagreements": [d] * count,
                "failed_num_experts": failed, "ranks": [rank] if count else []}

    (merged,) = merge_rank_records([[record(0, 0, [])], [record(1, 2, [6])],
                                    [record(2, 7, [5, 6])]])
    assert merged["status"] == "fail" and merged["count"] == 9
    assert merged["detail"].startswith("f: rank 1 ") and "failing ranks: [1, 2]" in merged["detail"]
    assert merged["failed_num_experts"] == [5, 6] and merged["ranks"] == [1, 2]
    assert [d["rank"] for d in merged["disagreements"]] == [1, 1, 2, 2, 2]
    (passed,) = merge_rank_records([[record(0, 0, [])], [record(1, 0, [])]])
    assert passed["status"] == "pass" and passed["detail"] == "" and passed["count"] == 0


def test_same_compares_meaning_not_form() -> None:
    t = torch.arange(6.0).reshape(3, 2)
    view = TensorValue(False, (3, 2), (), None, t.clone(), aliases=True)
    copy = TensorValue(False, (3, 2), (), None, t.clone(), aliases=False)
    other = TensorValue(False, (3, 2), (), None, t + 1, aliases=True)
    assert same((view, 0, 3), [view, 0, 3])  # a list where a tuple is expected is the same answer
    assert not same(view, copy) and not same(view, other) and not same(view, 3)
    assert not same((0, 3), (0, 3, 4)) and not same(None, False) and same(True, True)
    assert "view" in repr(view) and "copy" in repr(copy)


# ------------------------------------------------------------------------------- in worlds


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.node_name)
def test_the_reference_agrees_with_itself(moe_ep_engine: Engine, cell: FunctionsCell) -> None:
    records = run_cell(moe_ep_engine, REFERENCE, cell)
    assert all(r["status"] == "pass"
               for r in records.values()), [r["detail"] for r in records.values()]


def splits_differ(k: int) -> set[int]:
    return {E for E in NUM_EXPERTS if expert_counts(E, k) != balanced_functions.expert_counts(E, k)}


def test_the_two_splits_differ_where_expected() -> None:
    """The premise of the next test, stated: k <= 2 never tells the splits apart, k = 3, 4
    sometimes."""
    assert splits_differ(1) == splits_differ(2) == set()
    assert splits_differ(3) == {4, 7, 10, 13, 16}
    assert splits_differ(4) == {5, 6, 9, 10, 13, 14}  # E=7 is uneven, yet 2, 2, 2, 1 either way


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.node_name)
def test_the_balanced_split_fails_exactly_where_the_splits_differ(moe_ep_engine: Engine,
                                                                  cell: FunctionsCell) -> None:
    records = run_cell(moe_ep_engine, BALANCED, cell)
    differ = splits_differ(cell.k)
    shards_rows = "Shard(0)" in cell.placements
    for name, r in records.items():
        layout_matters = (
            name in MESH_FUNCTIONS
            or (name in ROW_FUNCTIONS and shards_rows)
            or (name == "create_dtensor_from_local" and "ep" in cell.names)
        )
        expected = sorted(differ) if layout_matters else []
        assert r["failed_num_experts"] == expected, f"{name}: {r['detail']}"
        for d in r["disagreements"]:
            assert d["E"] % d["k"] != 0 and d["E"] in differ, d
            assert d["function"] == name and d["k"] == cell.k and d["mesh"] == cell.mesh
            assert d["rank"] in range(cell.world_size) and d["expected"] != d["got"], d
        if r["count"]:
            d = r["disagreements"][0]
            assert f"rank {d['rank']} E={d['E']} k={cell.k} mesh={cell.mesh}" in r["detail"]


def test_a_copy_and_a_silent_return_are_disagreements(moe_ep_engine: Engine) -> None:
    cell = cell_named("functions::ep::k3")
    records = run_cell(moe_ep_engine, WRONG, cell)
    failing = {name for name, r in records.items() if r["status"] == "fail"}
    assert failing == {"get_expert_slice_for_rank", "should_load_expert_for_rank"}

    copies = records["get_expert_slice_for_rank"]["disagreements"]
    assert all(", view" in d["expected"] and ", copy" in d["got"] for d in copies), copies
    # every rank, every E, both the DTensor and the plain tensor case (empty locals excepted)
    assert records["get_expert_slice_for_rank"]["failed_num_experts"] == list(NUM_EXPERTS)

    silent = records["should_load_expert_for_rank"]
    # ids E and -1, each E, each rank
    assert silent["count"] == 2 * len(NUM_EXPERTS) * cell.world_size
    for d in silent["disagreements"]:
        assert d["expected"].startswith("raises ValueError") and d["got"] == "returns False", d
        assert d["inputs"].startswith((f"should_load_expert_for_rank({d['E']}, ",
                                       "should_load_expert_for_rank(-1, "))


@pytest.mark.moe_ep_world(2, backend="gloo")
def test_a_missing_function_is_one_clear_failure_on_each_rank() -> None:
    """Run inside a marked test: check_functions works on any rank of a default process group."""
    records = {r["function"]: r for r in check_functions(f"{WRONG}:WITHOUT_VALIDATE",
                                                         cell_named("functions::ep::k2"))}
    missing = records.pop("validate_dtensor_expert_sharding")
    assert missing["status"] == "fail" and missing["count"] == 1
    assert (missing["detail"]
            == (f"validate_dtensor_expert_sharding: rank {dist.get_rank()}: missing: "
                f"'{WRONG}:WITHOUT_VALIDATE' has no function 'validate_dtensor_expert_sharding'"))
    assert all(r["status"] == "pass"
               for r in records.values()), [r["detail"] for r in records.values()]


def test_a_module_that_cannot_be_loaded_fails_every_function(moe_ep_engine: Engine) -> None:
    records = run_cell(moe_ep_engine, "no_such_module_for_the_functions_suite",
                       cell_named("functions::ep::k1"))
    for r in records.values():
        assert (r["status"] == "fail"
                and "missing: cannot load 'no_such_module_for_the_functions_suite'" in r["detail"])
        assert "ModuleNotFoundError" in r["detail"]

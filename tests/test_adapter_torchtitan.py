"""The ``torchtitan`` and ``torchtitan-local`` adapters end to end: torchtitan 0.3.0 through the whole matrix.

Skipped unless torchtitan is installed (``ci/install_torchtitan.sh`` installs the pinned 0.3.0).  Each
matrix runs in a pytester subprocess and its outcome is asserted *as found*, cell by cell, so a
change in the harness or in torchtitan that flips one is noticed:

* ``torchtitan`` (``spmd_backend="partial_dtensor"``): every packed cell passes -- EP-only and
  FSDP, model and model+optimizer, every EP pair, and E=6 at ep=4;
* ``torchtitan-local`` (``"spmd_types"``, torchtitan's default): EP-only passes only at ep=1 ->
  ep=1; a save at ep > 1 reloaded at the same ep silently gives ranks another rank's experts
  (fail); between different EP degrees DCP refuses the local shapes (error); E=6 at ep=4 cannot be
  built (error); every FSDP cell errors in ``parallelize_qwen3`` (torch 2.13's ``fully_shard``
  wants DTensors there);
* both: unpacked and cross-kind cells and legacy cells are n/a (``GroupedExperts`` is packed;
  torchtitan has no legacy save).

Each run takes about 50-80 s on 2 cores (the whole module about 2.5 min on a loaded machine).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from matrix_expectations import (
    BIT_FOR_BIT,
    E6,
    EVEN,
    PACKED_ONLY_NOT_APPLICABLE,
    assert_even_cells_pass,
    by_status,
    run_report,
)

pytest.importorskip("torchtitan", reason="torchtitan is not installed (ci/install_torchtitan.sh installs "
                                         "torchtitan==0.3.0)")


def run_matrix(pytester: pytest.Pytester, adapter: str) -> tuple[pytest.RunResult, dict[str, Any]]:
    result, doc = run_report(pytester, "--moe-ep-matrix=1,2,4", f"--moe-ep-adapter={adapter}")
    assert doc["adapter"] == {"name": adapter, "version": "0.3.0"}
    return result, doc


def test_torchtitan_partial_dtensor_passes_every_packed_cell(pytester: pytest.Pytester) -> None:
    result, doc = run_matrix(pytester, "torchtitan")
    cells, statuses, na = by_status(doc)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    passing = set(EVEN) | set(E6)
    assert statuses.get("pass", set()) == passing, {i: cells[i]["detail"] for i in passing - statuses["pass"]}
    assert na == PACKED_ONLY_NOT_APPLICABLE
    assert doc["summary"] == {"pass": 36 + 5, "fail": 0, "error": 0, "n/a": 65}
    assert_even_cells_pass(cells)
    for cell_id, (s, t) in E6.items():
        assert (cells[cell_id]["save_ep"], cells[cell_id]["load_ep"], cells[cell_id]["num_experts"]) == (s, t, 6)
        assert BIT_FOR_BIT in cells[cell_id]["detail"], cells[cell_id]


def test_torchtitan_local_shows_the_plain_local_expert_trap(pytester: pytest.Pytester) -> None:
    result, doc = run_matrix(pytester, "torchtitan-local")
    cells, statuses, na = by_status(doc)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()[-3000:]
    ep_only = {i: v for i, v in EVEN.items() if not v[1]}
    passing = {i for i, (_, _, s, t) in ep_only.items() if s == t == 1}
    silent = {i for i, (_, _, s, t) in ep_only.items() if s == t > 1}
    reshard = {i for i, (_, _, s, t) in ep_only.items() if s != t}
    fsdp = {i for i, v in EVEN.items() if v[1]}
    assert statuses.get("pass", set()) == passing, {i: cells[i]["detail"] for i in passing ^ statuses["pass"]}
    assert statuses.get("fail", set()) == silent, {i: cells[i]["detail"] for i in silent ^ statuses["fail"]}
    assert statuses.get("error", set()) == reshard | fsdp | set(E6)
    assert na == PACKED_ONLY_NOT_APPLICABLE
    assert doc["summary"] == {"pass": 2, "fail": 4, "error": 6 * 2 + 18 + 5, "n/a": 65}

    for cell_id in passing:
        assert BIT_FOR_BIT in cells[cell_id]["detail"], cells[cell_id]
    for cell_id in silent:
        # DCP kept one rank's E/ep rows of each expert tensor; the other ranks got them on reload.
        detail = cells[cell_id]["detail"]
        assert re.search(r"first difference: rank \d, layer \d, expert \d, tensor 'w[123]_E[FD][FD]': "
                         r"holds expert \d's values instead of expert \d's", detail), detail
    for cell_id in reshard:
        detail = cells[cell_id]["detail"]
        if EVEN[cell_id][2] > 1:  # a lossy save: the checkpoint's own problem leads, in expert terms
            assert "raised LoadFailed: the checkpoint differs from an EP-invariant one: layer " in detail
            assert "is a local count (what one of ep=" in detail, detail
        else:  # a sound ep=1 save that DCP refuses to load into local tensors
            assert "raised CheckpointException" in detail and "Size mismatch between saved" in detail, detail
    for cell_id in fsdp:
        detail = cells[cell_id]["detail"]
        assert "torchtitan parallelize_qwen3 failed (spmd_backend='spmd_types'" in detail, detail
        assert "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh" in detail, detail
    for cell_id in E6:
        detail = cells[cell_id]["detail"]
        assert "rank 3 raised RuntimeError: torchtitan gave ep rank 3 of 4 a plain expert tensor of 2 rows starting " \
               "at global expert 6, past the 6 experts" in detail, detail

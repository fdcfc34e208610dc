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

import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (ci/install_torchtitan.sh installs "
                                         "torchtitan==0.3.0)")

EPS = (1, 2, 4)
PAIRS = [(s, t) for s in EPS for t in EPS]
UNEVEN = [(s, t) for s, t in PAIRS if 6 % s or 6 % t]
STATES = ("model", "model+optim")
ID = "moe-ep-matrix::checkpoint::packed::{state}::{mode}::ep{s}->ep{t}"
ID_E6 = "moe-ep-matrix::checkpoint::packed::model+optim::ep-only::E6::ep{s}->ep{t}"
EVEN = {ID.format(state=state, mode=mode, s=s, t=t): (state, mode == "fsdp", s, t)
        for state in STATES for mode in ("ep-only", "fsdp") for s, t in PAIRS}
E6 = {ID_E6.format(s=s, t=t): (s, t) for s, t in UNEVEN}
NOT_APPLICABLE = {
    "adapter supports layer kinds packed, not unpacked": 59,
    "adapter has no save_legacy (its old, lossy save)": 6,
}
BIT_FOR_BIT = "equal the ep=1 ground truth bit for bit"


def run_matrix(pytester: pytest.Pytester, adapter: str) -> tuple[pytest.RunResult, dict[str, Any]]:
    out = pytester.path / "out"
    result = pytester.runpytest_subprocess("--moe-ep-matrix", f"--moe-ep-adapter={adapter}",
                                           f"--moe-ep-report={out}", "-p", "no:cacheprovider", timeout=900)
    doc = json.loads((Path(out) / "moe-ep-conformance.json").read_text())
    assert doc["adapter"] == {"name": adapter, "version": "0.3.0"}
    return result, doc


def by_status(doc: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, set[str]], dict[str, int]]:
    cells = {c["id"]: c for c in doc["cells"]}
    statuses: dict[str, set[str]] = {}
    for cell_id, cell in cells.items():
        statuses.setdefault(cell["status"], set()).add(cell_id)
    na: dict[str, int] = {}
    for cell_id in statuses.get("n/a", set()):
        na[cells[cell_id]["detail"]] = na.get(cells[cell_id]["detail"], 0) + 1
    return cells, statuses, na


def test_torchtitan_partial_dtensor_passes_every_packed_cell(pytester: pytest.Pytester) -> None:
    result, doc = run_matrix(pytester, "torchtitan")
    cells, statuses, na = by_status(doc)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    passing = set(EVEN) | set(E6)
    assert statuses.get("pass", set()) == passing, {i: cells[i]["detail"] for i in passing - statuses["pass"]}
    assert na == NOT_APPLICABLE
    assert doc["summary"] == {"pass": 36 + 5, "fail": 0, "error": 0, "n/a": 65}
    for cell_id, (state, fsdp, s, t) in EVEN.items():
        cell = cells[cell_id]
        assert (cell["kind"], cell["state"], cell["fsdp"], cell["save_ep"], cell["load_ep"], cell["num_experts"]) == (
            "packed", state, fsdp, s, t, 4)
        assert BIT_FOR_BIT in cell["detail"], cell
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
    assert na == NOT_APPLICABLE
    assert doc["summary"] == {"pass": 2, "fail": 4, "error": 6 * 2 + 18 + 5, "n/a": 65}

    for cell_id in passing:
        assert BIT_FOR_BIT in cells[cell_id]["detail"], cells[cell_id]
    for cell_id in silent:
        # DCP kept one rank's E/ep rows of each expert tensor; the other ranks got them on reload.
        detail = cells[cell_id]["detail"]
        assert re.search(r"first difference: rank \d, layer \d, expert \d tensor 'w[123]_E[FD][FD]': "
                         r"holds expert \d's values instead of expert \d's", detail), detail
    for cell_id in reshard:
        detail = cells[cell_id]["detail"]
        assert "raised CheckpointException" in detail and "Size mismatch between saved" in detail, detail
    for cell_id in fsdp:
        detail = cells[cell_id]["detail"]
        assert "torchtitan parallelize_qwen3 failed (spmd_backend='spmd_types'" in detail, detail
        assert "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh" in detail, detail
    for cell_id in E6:
        detail = cells[cell_id]["detail"]
        assert "rank 3 raised RuntimeError: torchtitan gave ep rank 3 of 4 a plain expert tensor of 2 rows starting " \
               "at global expert 6, past the 6 experts" in detail, detail

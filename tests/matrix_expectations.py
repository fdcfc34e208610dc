"""What the framework-adapter tests share: the default matrix's cell ids for packed-only adapters,
running the matrix in a pytester subprocess, grouping a report's cells by status, and each built-in
adapter's expectations file.

A framework test asserts its as-found outcomes the way a framework's CI would: through the adapter's
expectations file in ``ci/expectations/`` (:func:`expectations_args`, :func:`assert_as_expected`),
so a change that flips a cell is found by the mechanism users run.  ``MOE_EP_UPDATE_EXPECTATIONS=1``
makes those runs rewrite the files from what they found (each test's ``-k`` slice updates its own
cells only); ``git diff ci/expectations`` then shows what changed, and the reasons of the changed
entries say so until a person writes them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

EPS = (1, 2, 4)
PAIRS = [(s, t) for s in EPS for t in EPS]
UNEVEN = [(s, t) for s, t in PAIRS if 5 % s or 5 % t]
STATES = ("model", "model+optim")


def layout(ep: int) -> str:
    """The node-id fragment of ``--moe-ep-matrix=1,2,4`` at 4 ranks for an adapter whose EP groups
    are consecutive ranks (every framework adapter): ``ep2c``; ep=1 and ep=4 are the same ranks
    either way."""
    return f"ep{ep}c" if 1 < ep < 4 else f"ep{ep}"


def pair(s: int, t: int) -> str:
    return f"{layout(s)}->{layout(t)}"


ID = "moe-ep-matrix::checkpoint::packed::{state}::{mode}::{pair}"
ID_E5 = "moe-ep-matrix::checkpoint::packed::model+optim::ep-only::E5::{pair}"
#: every E=4 packed cell id -> (state, fsdp, save_ep, load_ep)
EVEN = {ID.format(state=state, mode=mode, pair=pair(s, t)): (state, mode == "fsdp", s, t)
        for state in STATES for mode in ("ep-only", "fsdp") for s, t in PAIRS}
#: every E=5 packed cell id -> (save_ep, load_ep): uneven at ep=2 (3, 2) and at ep=4 (2, 2, 1, 0)
E5 = {ID_E5.format(pair=pair(s, t)): (s, t) for s, t in UNEVEN}
#: the n/a reasons (and counts) of an adapter with packed layers only and no legacy save.
PACKED_ONLY_NOT_APPLICABLE = {
    "adapter supports layer kinds packed, not unpacked": 62,
    "adapter has no save_legacy (its old, lossy save)": 6,
}
BIT_FOR_BIT = "the ep=1 ground truth bit for bit"
#: the built-in adapters' expectations files (one per adapter name), and whether this run rewrites
#: them.
EXPECTATIONS = Path(__file__).resolve().parents[1] / "ci" / "expectations"
UPDATE_EXPECTATIONS = os.environ.get("MOE_EP_UPDATE_EXPECTATIONS") == "1"


def expectations_args(adapter: str) -> tuple[str, ...]:
    """The options that hold a run of ``adapter`` against its file in ``ci/expectations/`` (or
    rewrite it)."""
    path = EXPECTATIONS / f"{adapter}.toml"
    return (f"--moe-ep-expectations={path}",
            *(("--moe-ep-update-expectations",) if UPDATE_EXPECTATIONS else ()))


def assert_as_expected(result: pytest.RunResult, doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every cell that ran came back as its adapter's expectations file says, so the session is
    green; returns the cells by id."""
    cells = {c["id"]: c for c in doc["cells"]}
    unmet = {i: (c.get("expected"), c.get("finding") or c["status"], c["detail"][:300]) for i, c
             in cells.items() if c.get("expectation") == "unmet"}
    assert not unmet, unmet
    ran = [c for c in cells.values() if c["status"] != "n/a"]
    assert ran and all(c.get("expectation") in ("met", "updated") for c in ran), ran
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    return cells
#: where torch builds C++ extensions for this user (DeepSpeed's CPU shared-memory comm op, compiled
#: once by ci/install_deepspeed.sh), read at import, before pytester points HOME at a temporary
#: directory: a pytester subprocess must get it as TORCH_EXTENSIONS_DIR, or it compiles the op again
#: (about a minute on 2 cores).
TORCH_EXTENSIONS_DIR = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions")


def run_report(pytester: pytest.Pytester, *args: str, inline: bool = False,
               stages: bool = False) -> tuple[pytest.RunResult, dict[str, Any]]:
    """``pytest *args --moe-ep-report=...`` in a subprocess (or :func:`run_inline`); its result and
    the JSON report.  A ``-k`` selection leaves out the cells with pipeline stages unless
    ``stages``: the framework tests pin pp=1 cells by EP keywords (``save_ep1``), which ``pp2.ep1``
    carries too, and an adapter without stages has them all ``n/a`` for one reason
    (``test_matrix``); the pipeline cells a framework builds are pinned on their own."""
    if not stages and "-k" in args:
        at = args.index("-k") + 1
        args = (*args[:at], f"({args[at]}) and not pipeline", *args[at + 1:])
    out = pytester.path / "out"
    report = (f"--moe-ep-report={out}", "-p", "no:cacheprovider")
    result = (run_inline(pytester, *args, *report) if inline
              else pytester.runpytest_subprocess(*args, *report, timeout=900))
    return result, json.loads((Path(out) / "moe-ep-conformance.json").read_text())


def run_inline(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """``pytest *args`` in this process: no Python start, and the ranks fork from this session's
    fork server (the ``shared_fork_server`` fixture, which the calling module must use) instead of a
    new one that imports torch again -- 4-5 s less a run. Only for runs whose controller imports
    nothing new with C extensions (the reference adapter and adapters built on it): pytester drops
    the modules first imported during the run, and a C extension cannot be imported twice
    (``conftest.py`` imports what such a run may need first). A test of processes, signals or exit
    paths runs in a subprocess instead. The test's directory comes first on ``sys.path``, as a
    subprocess's working directory would.
    """
    pytester.syspathinsert()
    return pytester.runpytest_inprocess(*args)


def by_status(doc: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, set[str]],
                                            dict[str, int]]:
    """The report's cells by id, their ids by status, and the count of each n/a reason."""
    cells = {c["id"]: c for c in doc["cells"]}
    statuses: dict[str, set[str]] = {}
    for cell_id, cell in cells.items():
        statuses.setdefault(cell["status"], set()).add(cell_id)
    na: dict[str, int] = {}
    for cell_id in statuses.get("n/a", set()):
        na[cells[cell_id]["detail"]] = na.get(cells[cell_id]["detail"], 0) + 1
    return cells, statuses, na


def assert_even_cells_pass(cells: dict[str, dict[str, Any]]) -> None:
    """Every E=4 packed cell is in the report with its parameters and passed bit for bit."""
    for cell_id, (state, fsdp, s, t) in EVEN.items():
        cell = cells[cell_id]
        assert (cell["kind"], cell["state"], cell["fsdp"], cell["save_ep"], cell["load_ep"],
                cell["num_experts"]) == ("packed", state, fsdp, s, t, 4)
        assert BIT_FOR_BIT in cell["detail"], cell


def assert_slice_as_found(doc: dict[str, Any],
                          expected: dict[str, set[str]]) -> dict[str, dict[str, Any]]:
    """A ``-k`` slice of an as-found matrix: every cell that ran has the status the whole matrix's
    test expects of it (``expected``: status -> every cell id of the full run with that status), and
    the slice holds at least one cell of each status it was chosen for.  Returns the slice's cells
    by id."""
    cells, statuses, _ = by_status(doc)
    ran = set(cells) - statuses.get("n/a", set())
    for status, ids in expected.items():
        assert ids & ran, f"the slice holds no {status} cell: choose another -k"
        got = statuses.get(status, set())
        assert got == ids & ran, {i: (cells[i]["status"], cells[i]["detail"][:300])
                                  for i in got ^ (ids & ran)}
    return cells

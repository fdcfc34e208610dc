"""A hang costs seconds, is met once, and names its side (issue 62).

A seeded save that deadlocks (``tests/seeded_hang.py``: the ranks' collectives stop matching at
``unpacked::model::fsdp::E5::ep2.etp2``) in a slice of the default tier, run in this process
(``matrix_expectations.run_inline``): the cell that writes the save hangs until its deadline, which
the session derived from the cell before it (:mod:`conformance.deadlines`, its factor and floor
lowered here so the test takes seconds: the rule is the same), and names the save side, the call
and the collective each rank waited in; every other cell that loads the save stops at once,
naming the save and the cell it failed in, without asking the world; the save was tried once, the
healthy cell passes, and no rank of the run is left.
"""

from __future__ import annotations

import json
import multiprocessing.forkserver
import re
from pathlib import Path

import pytest
from matrix_expectations import run_inline

from conformance import deadlines
from pytest_moe_ep.world.supervisor import Supervisor

pytestmark = pytest.mark.usefixtures("shared_fork_server")
SEEDED = (Path(__file__).parent / "seeded_hang.py").read_text()
SAVE = "checkpoint::unpacked::model::fsdp::E5::ep2.etp2"
#: the five cells that load the deadlocking save, and one healthy cell that runs before them.
SLICE = ("unpacked and E5 and fsdp and not optim and not legacy and "
         "(save_etp2 or (save_pp2 and load_ep2 and not hsdp and not load_pp2))")


def _fork_server_children() -> set[int]:
    """The processes the fork server (this session's, which every run here forks from) runs."""
    pid = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return {int(c) for c in children}


def test_a_deadlocked_save_is_met_once_in_seconds_naming_its_side(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
        moe_ep_engine: Supervisor) -> None:
    monkeypatch.setattr(deadlines, "FACTOR", 4.0)
    monkeypatch.setattr(deadlines, "FLOOR_S", 3.0)
    pytester.makepyfile(seeded_hang=SEEDED)
    out = pytester.path / "out"
    result = run_inline(pytester, "--moe-ep-matrix", "--moe-ep-adapter=seeded_hang:SaveDeadlocks",
                        "-k", SLICE, f"--moe-ep-report={out}", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    cells = {c["id"].removeprefix("moe-ep-matrix::"): c
             for c in json.loads((out / "moe-ep-conformance.json").read_text())["cells"]}
    loading = {i: c for i, c in cells.items() if "::ep2.etp2->" in i}
    [healthy] = [c for i, c in cells.items() if i not in loading]
    assert len(loading) == 5 and healthy["status"] == "pass", cells.keys()

    # the healthy cell had the unmeasured deadline; the hang, one derived from the healthy cell
    assert (healthy["deadline_s"], healthy["deadline_from"]) == (deadlines.UNMEASURED_S,
                                                                  "unmeasured")
    [writer] = [c for c in loading.values() if "deadline_s" in c]
    slowest = healthy["timings"]["total"]
    assert writer["deadline_from"] == "measured"
    assert writer["deadline_s"] == pytest.approx(max(3.0, 4.0 * slowest), abs=0.051)
    first = writer["detail"].splitlines()[0]
    assert (writer["status"], writer["findings"]) == ("stopped", ["error"]), first
    # the side, the call, and where each rank waited, from its stack
    assert first.startswith(f"error: the save side's save() hung: passed its "
                            f"{writer['deadline_s']:g}s deadline with every rank waiting in a "
                            "collective (a deadlock): "), first
    assert re.search(r"ranks? [\d, ]+ in all_reduce \(torch/distributed/[^)]+\) from "
                     r"\S*seeded_hang\.py:\d+ in save", first), first
    assert re.search(r"ranks? [\d, ]+ in \w+ \(torch/distributed/[^)]+\) from "
                     r"\S*reference_impl/checkpoint\.py:\d+ in save", first), first
    assert writer["duration_s"] < writer["deadline_s"] + 8, writer["duration_s"]

    # met once: the other readers stop at once with the save's first line (what each would say run
    # alone), the next naming the save and the cell it failed in
    readers = [c for c in loading.values() if c is not writer]
    for reader in readers:
        said = reader["detail"].splitlines()
        assert (reader["status"], reader["findings"]) == ("stopped", ["error"]), reader
        assert said[0] == first and said[1].startswith(
            f"not tried again: its save at ep2.etp2 failed in {writer['id']}, "), said
        assert reader["duration_s"] < 1 and "timings" not in reader, reader
    assert SAVE in writer["id"]
    assert len((pytester.path / "save-attempts.log").read_text().splitlines()) == 1

    # nothing of the run is left: the fork server runs this session's own world only
    ours = {p.pid for world in moe_ep_engine.worlds.values() for p in world.processes}
    assert _fork_server_children() <= ours

"""``pytest --moe-ep-matrix`` end to end: reference, legacy, broken adapters, reports.

The runs are pytester runs in this process (``matrix_expectations.run_inline``: the ranks fork from
this session's fork server); the xdist run is a subprocess, as its workers are.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from matrix_expectations import run_inline

from conformance.adapter import Spec
from conformance.report import SCHEMA_VERSION, compare_reports

pytestmark = pytest.mark.usefixtures("shared_fork_server")

RAISES_IN_LOAD = """
import torch.distributed as dist
from conformance.adapters.reference import ReferenceAdapter

class RaisesInLoad(ReferenceAdapter):
    name = "raises-in-load"

    def load(self, model, optimizer, path):
        if dist.get_rank() == 1:
            raise RuntimeError("deliberate failure inside load on rank 1")
        super().load(model, optimizer, path)
"""

MISSING_LOAD = """
from conformance.adapter import Capabilities

class NoLoad:
    name = "no-load"
    version = "1"
    capabilities = Capabilities(kinds=("packed",), optimizer=False, fsdp=False, uneven=False,
                                max_ep=4, format="dcp")
    def build(self, spec, mesh, seed): ...
    def save(self, model, optimizer, path): ...
    def expert_tensors(self, model, optimizer): ...
"""

HOOK_CONFTEST = """
from conformance.adapters.reference import ReferenceAdapter

class FromHook(ReferenceAdapter):
    name = "from-hook"

def pytest_moe_ep_adapter(config):
    return FromHook()
"""


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return run_inline(pytester, "-p", "no:cacheprovider", *args)


def report(directory: Path) -> dict[str, Any]:
    doc = json.loads((directory / "moe-ep-conformance.json").read_text())
    assert doc["schema_version"] == SCHEMA_VERSION
    assert set(doc) >= {"schema_version", "adapter", "torch", "backend", "world_size", "created",
                        "summary", "cells"}
    assert set(doc["summary"]) == {"pass", "fail", "stopped", "n/a"}
    assert sum(doc["summary"].values()) == len(doc["cells"])
    for cell in doc["cells"]:
        assert {"id", "suite", "status", "detail", "duration_s"} <= set(cell), cell
        assert cell["status"] in ("pass", "fail", "stopped", "n/a")
        keys = ({"kind", "state", "fsdp", "save_ep", "load_ep", "num_experts"} if cell["suite"]
                == "checkpoint" else {"function", "num_experts", "ep", "mesh", "placements"})
        assert keys <= set(cell), cell
    return doc


def test_reference_passes_every_applicable_cell(pytester: pytest.Pytester) -> None:
    out, kept = pytester.path / "out", pytester.path / "kept"
    result = run(pytester, "--moe-ep-matrix", f"--moe-ep-report={out}",
                 f"--moe-ep-keep-checkpoints={kept}")
    assert result.ret == 0, result.stdout.str()[-3000:]
    doc = report(out)
    assert doc["adapter"] == {"name": "reference", "version": "0.1.0"}
    cells = doc["cells"]
    assert doc["summary"]["fail"] == doc["summary"]["stopped"] == 0
    # the reference supports every layout, kind and state: n/a only where no rank-local (legacy)
    # save can be written
    na = [c for c in cells if c["status"] == "n/a"]
    assert len(na) == doc["summary"]["n/a"] == 1
    assert "a legacy (rank-local) save cannot be written here" in na[0]["detail"]
    assert doc["summary"]["pass"] == len(cells) - 1 >= 40
    assert set(doc["coverage"]["uneven_classes"]) == {"partial", "empty", "miscount", "mislabel"}
    assert (doc["tier"] == "default"
            and doc["coverage"]["full_tier_cells"] > doc["coverage"]["cells"])
    # every layout is saved and loaded somewhere
    for fragment in ("ep2c", "ep2.hsdp2", "ep2.etp2", "ep4"):
        assert any(c["save_layout"] == fragment
                   for c in cells) and any(c["load_layout"] == fragment for c in cells)
    assert any(c["kind"] == "packed->unpacked"
               for c in cells) and any(c["kind"] == "unpacked->packed" for c in cells)
    assert any(c.get("shared_save") for c in cells), "no cell reused a save"
    assert any(c["num_experts"] == 5 and c["load_ep"] == 4 and c["status"] == "pass" for c in cells)
    assert any(c["load_layout"] == "ep2c" and c["status"] == "pass" for c in cells)
    legacy = [c for c in cells if c.get("legacy") and c["status"] != "n/a"]
    assert legacy and all(c["status"] == "pass" and "refused on every rank" in c["detail"]
                          for c in legacy)
    # the Hugging Face checks: the export where a model cell writes its save, the import in every
    # model cell
    model = [c for c in cells if c["state"] == "model" and not c.get("legacy")
             and not c["finetune"] and c["status"] == "pass"]
    assert model and all("hf_import)" in c["detail"] for c in model)
    # every fine-tuning setup passes too (LoRA in each: the quantized setups' cells cover the plain
    # one's); its merged export is checked where a model cell writes its save, and no import of it
    # is asked for (a fine-tuning run starts from the base's release), each cell saying so
    tuned = [c for c in cells if c["finetune"]]
    assert {c["finetune"] for c in tuned} == {"lora+mxfp4", "lora+fp8"}
    assert all(c["status"] == "pass" for c in tuned)
    tuned_model = [c for c in tuned if c["state"] == "model"]
    assert all("a merged export holds no adapters" in c["skipped_checks"]["hf_import"]
               for c in tuned_model)
    assert any("hf_export" in c["checks_passed"] for c in tuned_model)
    exported = [c for c in model if "hf_export" in c["detail"]]
    assert len(exported) >= 10 and not any(c.get("shared_save") for c in exported)
    # --moe-ep-keep-checkpoints keeps both exports a model cell checked beside its checkpoints
    from conformance.saves import kept_name

    for cell in exported:
        where = kept / kept_name(cell["id"].removeprefix("moe-ep-matrix::"))
        assert sorted(p.name for p in where.iterdir()) == ["ep1", "ep1-hf", "save", "save-hf"]
        for export in ("ep1-hf", "save-hf"):
            assert (where / export / "model.safetensors.index.json").is_file(), (where, export)
    assert not any("hf_" in c["detail"] for c in cells if c["state"] == "model+optim")
    md = (out / "moe-ep-conformance.md").read_text()
    assert "](moe-ep-conformance-grid-packed-model.svg)" in md and "## Environment" in md
    assert "Tier `default`" in md
    # A passing run's terminal summary is compact: counts per kind and state, the coverage, the
    # report's path; the save x load tables only with -v (and always in the Markdown report).
    result.stdout.fnmatch_lines(["*moe-ep conformance matrix*",
                                 "checkpoint cells by kind and state",
                                 "| kind * | state * | * pass | * silent | * on-disk | * refused | "
                                 "* error | * n/a |",
                                 f"- Tier default: {len(cells)} checkpoint cells of the full *",
                                 f"{len(cells) - 1} pass, 0 silent, 0 on-disk, 0 refused, 0 error, "
                                 "1 n/a (* more tables with -v; the report's pictures have them*",
                                 f"report: {out / 'moe-ep-conformance.md'} (and .json)"])
    summary = result.stdout.str().split("moe-ep conformance matrix")[-1]
    assert "| save ep" not in summary and len(summary.splitlines()) < 40, summary


def test_legacy_adapter_fails_exactly_where_it_saves_at_ep_above_one(
        pytester: pytest.Pytester) -> None:
    out = pytester.path / "out"
    result = run(pytester, "--moe-ep-matrix=1,2", "--moe-ep-adapter=legacy",
                 f"--moe-ep-report={out}", "-k", "kind_unpacked and not E5 and not consecutive")
    assert result.ret == 1
    cells = [c for c in report(out)["cells"] if c["status"] != "n/a"]
    saved_wide = [c for c in cells if c["save_ep"] > 1]
    saved_at_one = [c for c in cells if c["save_ep"] == 1]
    assert saved_wide and saved_at_one
    assert [c["id"] for c in saved_wide if c["status"] == "pass"] == []
    assert [c["id"] for c in saved_at_one if c["status"] != "pass"] == []
    # The classic bug is named: a rank holds another expert's values, or the checkpoint lacks
    # experts.
    same_ep = next(c for c in cells
                   if c["id"] == "moe-ep-matrix::checkpoint::unpacked::model::ep-only::ep2->ep2")
    assert same_ep["status"] in ("fail", "stopped")
    assert "expert" in same_ep["detail"]
    # Without -v the terminal shows the tables that hold a red cell, not the others.
    result.stdout.fnmatch_lines(["unpacked · model · ep-only · E=4", "|*load ep1*load ep2*|",
                                 "|*", "| save ep1 *pass*", "| save ep2 *"])


def test_verbose_terminal_summary_shows_every_table(pytester: pytest.Pytester) -> None:
    """With -v a passing run's summary adds every save x load table (one cell here, on a 2-rank
    world)."""
    result = run(pytester, "--moe-ep-matrix=1", "--moe-ep-world-size=2", "-v",
                 "-k", "kind_unpacked and not optim and ep-only")
    assert result.ret == 0, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines([
        "*moe-ep conformance matrix*", "checkpoint cells by kind and state", "*",
        "| unpacked*| model*|*1 |*0 |*0 |*0 |", "- Tier 1: 1 checkpoint cells of the full tier's *",
        "- A green run means: the plain layouts at those EP*",
        "A blank table cell is a (save, load) layout pair*",
        "unpacked · model · ep-only · E=4", "|*| load ep1 *|", "|*", "| save ep1 | pass *|",
        "1 pass, 0 silent, 0 on-disk, 0 refused, 0 error, 0 n/a"])
    assert "more table" not in result.stdout.str()


def test_adapter_raising_in_load_on_one_rank_fails_that_cell_only(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile(broken_adapter=RAISES_IN_LOAD)
    result = run(pytester, "--moe-ep-matrix=1,2", "--moe-ep-adapter=broken_adapter:RaisesInLoad",
                 "-k", "kind_unpacked and not optim and ep-only and not E5 and not consecutive",
                 "-p", "no:randomly")
    # every ep pair of the selection loads, and rank 1 raises in each
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines([
        "error: *failed on rank(s) 1: rank 1 raised LoadFailed: the load at ep=* raised: "
        "RuntimeError: deliberate failure inside load on rank 1 (the checkpoint is EP-invariant, "
        "so the load is wrong; raised at broken_adapter.py:* in load)",
        "*in load",
    ])


END_CELL = """
import os

import torch.distributed as dist
from conformance.adapters.reference import ReferenceAdapter

class EndsCells(ReferenceAdapter):
    name = "ends-cells"

    def load(self, model, optimizer, path):
        if dist.get_rank() == 1 and model.layers[0].moe.ep_world_size == 2:
            raise RuntimeError("deliberate failure inside load on rank 1")
        super().load(model, optimizer, path)

    def end_cell(self):
        with open(os.path.join({out!r}, f"rank{{dist.get_rank()}}"), "a") as f:
            f.write("ended\\n")
"""


def test_end_cell_is_called_on_every_rank_after_every_cell_failed_or_not(
        pytester: pytest.Pytester) -> None:
    """The optional ``end_cell`` (what Megatron's process groups need): once per cell on each rank,
    also on the rank whose part raised (the loads at ep=2 raise on rank 1).  The other ranks wait in
    the load's collective until the failed call replaces the world: their processes end, and their
    groups with them."""
    out = pytester.mkdir("ended")
    pytester.makepyfile(ends_cells=END_CELL.format(out=str(out)))
    result = run(pytester, "--moe-ep-matrix=1,2", "--moe-ep-adapter=ends_cells:EndsCells",
                 "-k", "kind_unpacked and not optim and ep-only and not E5 and not consecutive",
                 "-p", "no:randomly")
    result.assert_outcomes(passed=2, failed=2)  # the two loads at ep=2 raise on rank 1
    ended = {rank: (out / f"rank{rank}").read_text().count("ended") for rank in range(4)}
    assert ended == {0: 2, 1: 4, 2: 2, 3: 2}, ended


END_CELL_RAISES = """
import torch.distributed as dist
from conformance.adapters.reference import ReferenceAdapter

class EndRaises(ReferenceAdapter):
    name = "end-raises"

    def end_cell(self):
        if dist.get_rank() == 2:
            raise RuntimeError("deliberate failure in end_cell on rank 2")
"""


def test_an_end_cell_that_raises_after_green_checks_is_an_error_naming_it(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile(end_raises=END_CELL_RAISES)
    result = run(pytester, "--moe-ep-matrix=1", "--moe-ep-adapter=end_raises:EndRaises",
                 "-k", "kind_unpacked and not optim and ep-only and not E5 and not legacy")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["error: *rank 2 raised AdapterError: the cell's checks ran, then "
                                 "end_cell() raised RuntimeError: deliberate failure in end_cell "
                                 "on rank 2*"])


def test_adapter_missing_a_method_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(no_load=MISSING_LOAD)
    result = run(pytester, "--moe-ep-matrix", "--moe-ep-adapter=no_load:NoLoad")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*adapter 'no_load:NoLoad' is missing: load, other_tensors*"])


@pytest.mark.parametrize(("given", "message"), [
    ("no_such_module:Adapter",
     "cannot import adapter module 'no_such_module' (from 'no_such_module:Adapter')"),
    ("conformance.adapters.reference:Nope",
     "has no attribute 'Nope' (from 'conformance.adapters.reference:Nope')"),
    ("nonsense", "unknown adapter 'nonsense': give a built-in name"),
])
def test_bad_adapter_paths_are_usage_errors(pytester: pytest.Pytester, given: str,
                                            message: str) -> None:
    result = run(pytester, "--moe-ep-matrix", f"--moe-ep-adapter={given}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])


def test_ep_that_does_not_divide_the_world_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = run(pytester, "--moe-ep-matrix=1,3")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*EP degrees ?3? do not divide the world size 4*"])


def test_adapter_from_a_conftest_hook(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(HOOK_CONFTEST)
    out = pytester.path / "out"
    result = run(pytester, "--moe-ep-matrix=2", "-k",
                 "kind_unpacked and not optim and ep-only and not E5 and not consecutive",
                 f"--moe-ep-report={out}")
    result.assert_outcomes(passed=1)
    assert report(out)["adapter"]["name"] == "from-hook"


def test_xdist_merges_every_worker_into_one_report(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    out = pytester.path / "out"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "-p", "xdist",
                                           "--moe-ep-matrix=1,2", "-k",
                                           "ep-only and not E5 and not consecutive and not optim",
                                           f"--moe-ep-report={out}", timeout=600)
    assert result.ret == 0, result.stdout.str()[-3000:]
    doc = report(out)
    # packed, unpacked, fused x 4 ep pairs, model only: a world of 4 each
    assert len(doc["cells"]) == 3 * 4
    assert doc["summary"]["pass"] == len(doc["cells"])  # the reference declares cross_kind
    assert {c["status"] for c in doc["cells"]} <= {"pass", "n/a"}
    assert len({c["id"] for c in doc["cells"]}) == len(doc["cells"])


def test_functions_suite_on_the_reference_and_on_a_balanced_split(
        pytester: pytest.Pytester) -> None:
    good, bad = pytester.path / "good", pytester.path / "bad"
    result = run(pytester, "--moe-ep-functions=reference", f"--moe-ep-report={good}")
    assert result.ret == 0, result.stdout.str()[-3000:]
    assert all(c["status"] == "pass" for c in report(good)["cells"])
    result = run(pytester, "--moe-ep-functions=balanced", f"--moe-ep-report={bad}")
    assert result.ret == 1
    failed = [c for c in report(bad)["cells"] if c["status"] == "fail"]
    assert failed
    for record in failed:
        for case in record.get("disagreements", []):
            assert case["E"] % record["ep"] != 0, record
    result.stdout.fnmatch_lines(["*functions disagree with the reference*"])


def test_functions_suite_for_a_missing_framework_is_na(pytester: pytest.Pytester) -> None:
    pytest.importorskip("torch")
    try:
        import nemo_automodel  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("NeMo Automodel is installed here: its suite really runs")
    result = run(pytester, "--moe-ep-functions=nemo_automodel", "-rs")
    result.stdout.fnmatch_lines(["*n/a: nemo_automodel is not installed*"])
    assert result.ret == 0


def test_report_diff_prints_changed_cells(tmp_path: Path) -> None:
    old = {"schema_version": SCHEMA_VERSION,
           "cells": [{"id": "a", "status": "pass"}, {"id": "b", "status": "pass"}]}
    failed = {"id": "a", "status": "fail", "finding": "silent",
              "detail": "rank 1 holds expert 0's values"}
    new = {"schema_version": SCHEMA_VERSION, "cells": [failed, {"id": "b", "status": "pass"}]}
    assert [c.line() for c in compare_reports(old, new).changed] == [
        "a: pass -> silent  (rank 1 holds expert 0's values)"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    proc = subprocess.run([sys.executable, "-m", "conformance.report", str(tmp_path / "old.json"),
                           str(tmp_path / "new.json")], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [
        "newly failing (1):", "  a: pass -> silent  (rank 1 holds expert 0's values)",
        "newly passing (0):", "finding changed (0):",
        "1 newly failing, 0 newly passing, 0 finding changed, 0 other changes, 1 unchanged, "
        "0 only in the old report, 0 only in the new report",
        f"wrote {tmp_path / 'moe-ep-conformance-diff.md'}"]


def test_report_diff_tells_deselected_cells_from_changes_and_bad_input_from_either(
        tmp_path: Path) -> None:
    def diff(*names: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "conformance.report",
                               *(str(tmp_path / n) for n in names)],
                              capture_output=True, text=True)

    (tmp_path / "old.json").write_text(json.dumps({"schema_version": SCHEMA_VERSION, "cells": [
        {"id": "a", "status": "pass"}, {"id": "gone", "status": "pass"}]}))
    (tmp_path / "new.json").write_text(json.dumps({"schema_version": SCHEMA_VERSION, "cells": [
        {"id": "a", "status": "pass"}, {"id": "fresh", "status": "fail"}]}))
    (tmp_path / "bad.json").write_text("{not json")
    same = diff("old.json", "new.json")
    # cells present on one side only are not status changes
    assert same.returncode == 0, same.stdout
    assert same.stdout.splitlines()[3:-1] == [
        "only in the old report (1):", "  gone", "only in the new report (1):", "  fresh",
        "0 newly failing, 0 newly passing, 0 finding changed, 0 other changes, 1 unchanged, "
        "1 only in the old report, 1 only in the new report"]
    for args, message in ((("missing.json", "new.json"), "missing.json: cannot read it"),
                          (("bad.json", "new.json"), "bad.json: not a JSON report")):
        proc = diff(*args)
        assert (proc.returncode == 2 and message in proc.stderr
                and "Traceback" not in proc.stderr), proc.stderr


def test_expert_counts_are_a_choice(pytester: pytest.Pytester) -> None:
    out = pytester.path / "out"
    # E=5 at ep=4: the case where "the first E % k ranks get one extra" mislabels experts silently.
    result = run(pytester, "--moe-ep-matrix=1,4", "--moe-ep-experts=4,5", f"--moe-ep-report={out}",
                 "-k", "E5 and kind_packed and load_ep4 and not legacy")
    assert result.ret == 0, result.stdout.str()[-3000:]
    cells = report(out)["cells"]
    assert cells and all(c["num_experts"] == 5 and c["load_ep"] == 4 and c["status"] == "pass"
                         for c in cells)
    result = run(pytester, "--moe-ep-matrix", "--moe-ep-experts=0,x")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--moe-ep-experts (ini moe_ep_experts) takes expert counts >= "
                                 "1*'0,x'*"])


def test_an_eight_rank_world_runs_every_layout(pytester: pytest.Pytester) -> None:
    """Named full-tier cells, so that the covering's picks do not decide which layouts run."""
    out = pytester.path / "out"
    result = run(pytester, "--moe-ep-matrix=full", "--moe-ep-world-size=8",
                 f"--moe-ep-report={out}", "-k", "kind_packed and not optim and not legacy and not "
                 "finetune and not "
                 "E5 and ((not fsdp and save_ep8 and load_ep4c) or (not fsdp and save_pp2.ep4 and "
                 "load_pp2.ep2c) or (fsdp and save_hsdp2 and load_etp2))")
    assert result.ret == 0, result.stdout.str()[-3000:]
    doc = report(out)
    assert (doc["world_size"] == 8
            and doc["summary"]["pass"] == len(doc["cells"]) == 3), doc["summary"]
    layouts = {c["save_layout"] for c in doc["cells"]} | {c["load_layout"] for c in doc["cells"]}
    assert layouts == {"ep8", "ep4c", "pp2.ep4", "pp2.ep2c", "ep2.hsdp2", "ep2.etp2"}, layouts


def test_an_eight_rank_stage_whose_last_ep_rank_holds_no_expert_passes_on_the_reference(
        pytester: pytest.Pytester) -> None:
    """What only eight ranks reach, in every push: E=5 over ep=4 inside a pipeline stage, where the
    last EP rank holds no expert of its stage's layers (their routers only) -- the default tier's
    cells with such a side. The whole 8-rank tier runs nightly (below)."""
    out = pytester.path / "out"
    result = run(pytester, "--moe-ep-matrix", "--moe-ep-world-size=8", f"--moe-ep-report={out}",
                 "-k", "E5 and pp2.ep4")
    doc = report(out)
    ran = [c for c in doc["cells"] if c["status"] != "n/a"]
    red = {c["id"]: c["detail"][:300] for c in ran if c["status"] != "pass"}
    assert not red and result.ret == 0, red or result.stdout.str()[-3000:]
    assert len(ran) >= 5 and all("pp2.ep4" in (c["save_layout"], c["load_layout"]) for c in ran)
    assert any(c["id"].endswith("E5::ep8->pp2.ep4") for c in ran)


@pytest.mark.slow
def test_the_eight_rank_default_tier_passes_on_the_reference(pytester: pytest.Pytester) -> None:
    """The reference is the truth every framework is held to: a red reference cell is a false alarm
    on all of them. Its 156-cell default tier at eight ranks (about 70 s on 2 cores, so nightly:
    ``ci/test.sh --slow``) reaches what four ranks cannot: E=5 over ep=4 inside a pipeline stage,
    where the last EP rank holds no expert of its stage's layers (their routers only)."""
    out = pytester.path / "out"
    result = run(pytester, "--moe-ep-matrix", "--moe-ep-world-size=8", f"--moe-ep-report={out}")
    doc = report(out)
    red = {c["id"]: c["detail"][:300] for c in doc["cells"] if c["status"] not in ("pass", "n/a")}
    assert not red and result.ret == 0, red or result.stdout.str()[-3000:]
    assert doc["world_size"] == 8 and len(doc["cells"]) == 156, doc["summary"]
    assert doc["summary"]["n/a"] == 1, doc["summary"]
    assert any(c["id"].endswith("E5::ep8->pp2.ep4") for c in doc["cells"])


def test_a_packed_key_without_expert_in_its_name_is_still_checked(
        pytester: pytest.Pytester) -> None:
    """The reference's packed keys (``layers.N.moe.up_w``) hold experts although no "expert" is in
    the name."""
    out = pytester.path / "out"
    run(pytester, "--moe-ep-matrix=2", "--moe-ep-adapter=legacy", f"--moe-ep-report={out}",
        "-k", "kind_packed and ep-only and not optim and not E5 and not consecutive and not legacy")
    (cell,) = report(out)["cells"]
    assert cell["status"] == "stopped" and cell["save_ep"] == cell["load_ep"] == 2, cell
    assert ("raised LoadFailed: the checkpoint differs from an EP-invariant one: layer "
            in cell["detail"]), cell
    assert re.search(r"key 'model\.layers\.\d\.moe\.(gate|up|down)_w', experts 2\.\.3: its expert "
                     r"axis has 2 rows, expected 4 \(the global extent\): 2 is a local count",
                     cell["detail"]), cell["detail"]


# -- the default tier's composition (no world: the cells alone) ------------------------------------
def _default(world_size: int = 4, experts: tuple[int, ...] = (4, 5)) -> list[Any]:
    from conformance.adapters.reference import ReferenceAdapter
    from conformance.matrix import checkpoint_cells

    return checkpoint_cells(ReferenceAdapter.capabilities, None, world_size, experts)


@pytest.mark.parametrize("world_size", [4, 8])
def test_the_priced_covering_covers_all_the_full_tier_covers_and_keeps_no_redundant_cell(
        world_size: int) -> None:
    """The prices pick which cells carry the guarantee, never the guarantee: every pair the
    applicable full tier covers is covered, and each picked cell holds something no other pick does
    (the prune left none redundant)."""
    from collections import Counter

    from conformance.adapters.reference import ReferenceAdapter
    from conformance.covering import _pairs
    from conformance.matrix import checkpoint_cells

    everything = [c for c in checkpoint_cells(ReferenceAdapter.capabilities, "full", world_size,
                                              (4, 5)) if not c.na]
    picked = [c for c in _default(world_size) if not c.na]
    wanted = set().union(*(_pairs(c) for c in everything))
    assert set().union(*(_pairs(c) for c in picked)) == wanted
    held = Counter(pair for c in picked for pair in _pairs(c))
    assert all(any(held[pair] == 1 for pair in _pairs(c)) for c in picked)


def test_the_default_tier_is_deterministic_and_its_size_is_stated() -> None:
    from dataclasses import replace

    from conformance.adapters.reference import ReferenceAdapter
    from conformance.matrix import checkpoint_cells, full_size

    assert [c.node_name for c in _default()] == [c.node_name for c in _default()]
    # docs/matrix.md's Tiers paragraph
    assert (len(_default()), full_size(4, (4, 5))) == (103, 4332)
    assert (len(_default(8)), full_size(8, (4, 5))) == (163, 9140)
    without_stages = checkpoint_cells(replace(ReferenceAdapter.capabilities, pp=(1,)), None, 4,
                                      (4, 5))
    assert len(without_stages) == 87 and [c.na for c in without_stages if c.pipeline] == [
        "adapter supports no pipeline parallelism, not pp=2"]
    # an adapter that fine-tunes with nothing: one cell says so, in the default tier and the full
    without_finetune = replace(ReferenceAdapter.capabilities, finetune=())
    for tier in (None, "full"):
        tuned = [c for c in checkpoint_cells(without_finetune, tier, 4, (4, 5)) if c.finetune]
        assert [c.na for c in tuned] == ["adapter does not fine-tune (Capabilities.finetune: LoRA "
                                         "on the experts over a frozen, possibly quantized base)"]
    # the EP-list tier the framework adapters' own tests pin: E=5 is uneven at ep=2 too (8 uneven EP
    # pairs); an adapter without the fused kind gets no fused cells there
    assert len(checkpoint_cells(ReferenceAdapter.capabilities, "1,2,4", 4, (4, 5))) == 156
    split_only = replace(ReferenceAdapter.capabilities, kinds=("packed", "unpacked"))
    assert len(checkpoint_cells(split_only, "1,2,4", 4, (4, 5))) == 112


def test_the_ep_list_tier_has_uneven_cells_where_ep_alone_composes_with_fsdp() -> None:
    from dataclasses import replace

    from conformance.adapters.reference import ReferenceAdapter
    from conformance.matrix import checkpoint_cells

    caps = replace(ReferenceAdapter.capabilities, ep_only=False)
    uneven = [c for c in checkpoint_cells(caps, "1,2,4", 4, (4, 5)) if c.num_experts == 5]
    assert uneven and all(c.fsdp for c in uneven)
    assert {(c.save.ep, c.load.ep) for c in uneven
            if not c.na} >= {(1, 4), (4, 1), (4, 4), (2, 4), (1, 2), (2, 2)}
    assert len(checkpoint_cells(caps, "1,2,4", 4, (4, 5))) == 156  # the same cells, with FSDP2


@pytest.mark.parametrize("world_size", [4, 8])
def test_non_legacy_cells_cover_every_pair_among_themselves(world_size: int) -> None:
    """A legacy cell ends at the refusal: it must not stand in for a pair no value comparison
    tests."""
    import itertools

    from conformance.covering import _fused_pairs
    from conformance.matrix import full_product

    def values(c: Any) -> list[tuple[str, Any]]:
        return [("save", c.save), ("load", c.load), ("kind", c.kind), ("state", c.state),
                ("fsdp", c.fsdp), ("E", c.num_experts)]

    # a cell with stages: not its pair of layouts (see the next test)
    def pairs(cells: list[Any]) -> set[Any]:
        return {p for c in cells if not c.legacy and c.kind != "fused"
                for p in itertools.combinations(values(c), 2)
                if not (c.pipeline and p == tuple(values(c)[:2]))}

    chosen = _default(world_size)
    assert pairs(chosen) == pairs(full_product(world_size, (4, 5)))
    # a stratum of its own
    fused = [c for c in full_product(world_size, (4, 5)) if c.kind == "fused"]
    assert set().union(*map(_fused_pairs, (c for c in chosen if c.kind == "fused"))) == set().union(
        *map(_fused_pairs, fused))
    legacy = [c for c in chosen if c.legacy]
    for attr in ("save", "load", "kind", "num_experts"):  # legacy cells: their own stratum
        everything = {getattr(c, attr) for c in full_product(world_size, (4, 5)) if c.legacy}
        assert {getattr(c, attr) for c in legacy} == everything, attr


@pytest.mark.parametrize("world_size", [4, 8])
def test_the_default_tier_changes_stages_with_every_ep_change_and_trades_stages_for_ep_ranks(
        world_size: int) -> None:
    """pp 1 -> 2, 2 -> 1 and 2 -> 2, each with the EP degree the same, up and down; and Megatron-LM
    issue 1517's shape, stages traded for EP ranks in the same world (pp2.ep1 -> ep2) and back --
    all among cells that compare values."""
    chosen = [c for c in _default(world_size) if not c.legacy and not c.na]

    def change(c: Any) -> tuple[int, int, int]:
        return c.save.pp, c.load.pp, (c.load.ep > c.save.ep) - (c.load.ep < c.save.ep)

    assert {change(c) for c in chosen if c.pipeline} == {(a, b, d) for a in (1, 2) for b in (1, 2)
                                                         for d in (-1, 0, 1) if (a, b) != (1, 1)}
    names = {(c.save.fragment, c.load.fragment) for c in chosen}
    assert {("pp2.ep1", "ep2"), ("ep2", "pp2.ep1"), ("pp2.ep2", "ep4"), ("ep4", "pp2.ep2")} <= names
    assert all(c.spec(Spec(), side).num_layers == 3 for c in chosen if c.pipeline
               for side in ("save", "load"))


@pytest.mark.parametrize("experts", [(4, 6), (4, 5)])
def test_every_kind_splits_unevenly_at_ep_above_one_on_each_side(experts: tuple[int, ...]) -> None:
    chosen = [c for c in _default(4, experts) if not c.legacy and not c.na]
    for kind in ("packed", "unpacked", "packed->unpacked", "unpacked->packed"):
        for side in ("save", "load"):
            assert any(c.kind == kind and getattr(c, side).ep > 1 and c.num_experts
                       % getattr(c, side).ep for c in chosen), (kind, side)


@pytest.mark.parametrize("world_size", [4, 8])
def test_the_default_tier_reaches_every_uneven_class_for_every_kind_on_each_side(
        world_size: int) -> None:
    """At E=6 the default tier never put a silent mislabel (the seed's own NeMo bug) in front of a
    framework; its uneven count is chosen so that every class is reached, by cells that compare
    values."""
    from reference_impl.layout import UNEVEN_CLASSES, uneven_classes

    chosen = [c for c in _default(world_size) if not c.legacy and not c.na]
    for kind in ("packed", "unpacked", "packed->unpacked", "unpacked->packed"):
        for side in ("save", "load"):
            reached = {name for c in chosen if c.kind == kind
                       and c.num_experts % getattr(c, side).ep
                       for name in uneven_classes(c.num_experts, getattr(c, side).ep)}
            assert reached == set(UNEVEN_CLASSES), (kind, side, reached)
    old = {name for c in _default(world_size, (4, 6)) if not c.legacy
           for ep in (c.save.ep, c.load.ep) if c.num_experts % ep
           for name in uneven_classes(c.num_experts, ep)}
    assert "mislabel" not in old and "partial" not in old  # what E=6 missed


def test_the_coverage_list_names_the_uneven_classes_the_cells_reached() -> None:
    from conformance.covering import uneven_reach
    from conformance.report import build_report, render_markdown
    from conformance.report.cells import coverage_items

    def record(e: int, s: int, t: int, **extra: Any) -> dict[str, Any]:
        return {"id": f"moe-ep-matrix::checkpoint::packed::model::ep-only::E{e}::ep{s}->ep{t}",
                "suite": "checkpoint", "kind": "packed", "state": "model", "fsdp": False,
                "num_experts": e, "save_ep": s, "load_ep": t, "legacy": False, "status": "pass",
                "detail": "refused on every rank", **extra}

    records = [record(5, 2, 1), record(6, 1, 4), record(5, 4, 4, legacy=True),
               record(5, 1, 4, status="n/a")]
    reach = uneven_reach(records)
    assert reach == {"partial": ["E=5 at ep=2"], "empty": ["E=6 at ep=4"],
                     "miscount": ["E=6 at ep=4"]}
    report = build_report(records, backend="gloo", world_size=4, tier="default", full_cells=1096)
    assert report["coverage"]["uneven_classes"] == reach
    items = dict(coverage_items(report))
    assert items["Tier `default`: 4 checkpoint cells of the full tier's 1096"] == []
    reached = items["Uneven splits reached:"]
    assert reached[:2] == ["a rank holding a partial chunk: E=5 at ep=2",
                           "a rank holding no expert: E=6 at ep=4"]
    assert len(reached) == 3 and reached[2].endswith(": E=6 at ep=4"), reached
    [missed] = items["Not reached:"]
    assert missed.startswith("the balanced split's first ids disagreeing where the row counts")
    assert len(items["A green run means:"]) == 4  # the tier's guarantee, clause by clause
    markdown = render_markdown(report)
    assert "- Not reached:\n  - the balanced split's first ids" in markdown


def test_optimizer_state_goes_through_every_layout_family() -> None:
    optim = [c for c in _default() if c.state == "model+optim" and not c.legacy]
    layouts = {c.save.fragment for c in optim} | {c.load.fragment for c in optim}
    assert {"ep2", "ep2c", "ep2.hsdp2", "ep2.etp2", "ep4"} <= layouts
    assert any(c.save.ep < c.load.ep for c in optim) and any(c.save.ep > c.load.ep for c in optim)
    assert {c.kind for c in optim} == {"packed", "unpacked", "packed->unpacked", "unpacked->packed",
                                       "fused"}


def test_a_legacy_save_no_rank_local_save_can_write_is_na_with_the_reason() -> None:
    from conformance.adapters.reference import ReferenceAdapter
    from conformance.matrix import checkpoint_cells

    cells = checkpoint_cells(ReferenceAdapter.capabilities, "full", 4, (4, 5))
    na = {c.node_name: c.na for c in cells if c.na}
    assert set(na) == {f"checkpoint::legacy::packed::E5::ep2.etp2->{t}"
                       for t in ("ep1", "ep2", "ep2c", "ep4", "ep2.hsdp2", "ep2.etp2")}
    assert all("DCP refuses the global plan" in why and "E=5, ep=2, etp=2" in why
               for why in na.values())
    assert any(c.na for c in _default(4, (4, 5)))  # the default tier shows the reason once


def test_an_adapter_that_composes_ep_only_with_fsdp_gets_its_ep_only_cells_na() -> None:
    from conformance.adapter import Capabilities
    from conformance.matrix import checkpoint_cells
    from conformance.members import capabilities_of

    caps = Capabilities(kinds=("packed",), optimizer=True, fsdp=True, uneven=True, max_ep=4,
                        format="dcp", ep_orders=("consecutive",), ep_only=False)
    cells = [c for c in checkpoint_cells(caps, "1,2,4", 4, (4,), has_legacy=False)
             if c.kind == "packed"]
    assert {c.na for c in cells if not c.fsdp and not c.legacy} == {
        "adapter composes EP only with FSDP2 (no EP-only cells)"}
    assert [c for c in cells if c.fsdp] and all(not c.na for c in cells if c.fsdp)
    as_mapping = type("Adapter", (),
                      {"capabilities": {"kinds": ("packed",), "optimizer": True, "fsdp": True,
                                        "uneven": True, "max_ep": 4, "format": "dcp",
                                        "ep_only": False}})
    assert capabilities_of(as_mapping).ep_only is False
    assert caps.__class__(kinds=("packed",), optimizer=True, fsdp=True, uneven=True, max_ep=4,
                          format="dcp").ep_only


def test_names_as_users_type_them(pytester: pytest.Pytester) -> None:
    """``--moe-ep-adapter=olmo-core`` is ``olmo_core`` (``-`` and ``_`` alike, as pip compares
    names), and every name a node id shows is a ``-k`` keyword (``load_ep2c``,
    ``save_ep2.etp2``)."""
    from conformance.adapters import builtin_name

    assert (builtin_name("olmo-core") == "olmo_core"
            and builtin_name("Torchtitan_Local") == "torchtitan-local")
    assert builtin_name("mypkg.ckpt:Adapter") == "mypkg.ckpt:Adapter"
    result = run(pytester, "--moe-ep-matrix=full", "--co", "-q", "-k",
                 "load_ep2c and save_ep2.etp2")
    ids = [line for line in result.stdout.lines if line.startswith("moe-ep-matrix::")]
    assert ids and all(i.endswith("ep2.etp2->ep2c") for i in ids), ids


def test_each_cells_checkpoints_are_kept_for_reading_offline(pytester: pytest.Pytester) -> None:
    """``--moe-ep-keep-checkpoints=DIR``: the save and the ep=1 save of every cell, red ones
    included (a failed cell's save is emptied for the next writer after it is kept), and their
    Hugging Face exports, under the cell's id."""
    from conformance.inspection import inspect_checkpoint, read_checkpoint
    from conformance.saves import kept_name

    out, kept = pytester.path / "out", pytester.path / "kept"
    run(pytester, "--moe-ep-matrix=1,2", "--moe-ep-adapter=legacy", f"--moe-ep-report={out}",
        f"--moe-ep-keep-checkpoints={kept}",
        "-k", "kind_unpacked and not optim and ep-only and not E5 and not consecutive and load_ep2")
    cells = {c["id"]: c for c in report(out)["cells"] if c["status"] != "n/a"}
    red = {i for i, c in cells.items() if c["status"] != "pass"}
    assert red == {i for i, c in cells.items() if c["save_ep"] == 2} and len(cells) == 2, cells
    assert sorted(p.name for p in kept.iterdir()) == sorted(
        kept_name(i.removeprefix("moe-ep-matrix::")) for i in cells)
    for cell_id, cell in cells.items():
        where = kept / kept_name(cell_id.removeprefix("moe-ep-matrix::"))
        assert "::" not in where.name and ">" not in where.name
        assert read_checkpoint(where / "ep1").entries and read_checkpoint(where / "save").entries
        assert sorted(p.name for p in where.iterdir()) == ["ep1", "save"]  # legacy exports no HF
        local = [f.problem for f in inspect_checkpoint(where / "save", 4).findings]
        assert ("local_numbering" in local) == (cell["save_ep"] == 2), (cell_id, local)

"""The CI assets a framework copies: the GitHub workflow uses the commands README and docs/
document."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def documentation() -> str:
    """README and the docs/ pages it points to: what a user reads."""
    return "\n".join(p.read_text()
                     for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])


def test_workflow_runs_the_documented_commands() -> None:
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load((ROOT / "ci/github/moe-ep-conformance.yml").read_text())
    readme = documentation()
    assert set(workflow["jobs"]) == {"cpu", "gpu"}
    runs = {job: [step.get("run", "") for step in spec["steps"]]
            for job, spec in workflow["jobs"].items()}
    matrix_cpu = [r for r in runs["cpu"] if "--moe-ep-matrix" in r]
    matrix_gpu = [r for r in runs["gpu"] if "--moe-ep-matrix" in r]
    # gated on change, not on green: the expectations file
    gate = "--moe-ep-expectations=$EXPECTATIONS $UPDATE"
    assert matrix_cpu == [f"pytest --moe-ep-matrix --moe-ep-adapter=$ADAPTER {gate} "
                          "--moe-ep-report=moe-ep-report/cpu "
                          "--report-log=moe-ep-report/cpu/pytest-log.jsonl"]
    assert matrix_gpu == [
        f"pytest --moe-ep-matrix --moe-ep-adapter=$ADAPTER --moe-ep-backend=nccl {gate} "
        "--moe-ep-report=moe-ep-report/gpu --report-log=moe-ep-report/gpu/pytest-log.jsonl"]
    assert (workflow["env"]["UPDATE"]
            == "${{ inputs.update && '--moe-ep-update-expectations' || '' }}")
    assert ("--moe-ep-update-expectations"
            in workflow[True]["workflow_dispatch"]["inputs"]["update"]["description"]
        or workflow[True]["workflow_dispatch"]["inputs"]["update"]["type"] == "boolean")
    # A killed run's log (uploaded with the report, it lies in the report directory) rebuilds the
    # report, judged against the same file.
    for job in ("cpu", "gpu"):
        assert any(f"--from-log moe-ep-report/{job}/pytest-log.jsonl --out moe-ep-report/{job} "
                   "--expectations $EXPECTATIONS" in r for r in runs[job]), runs[job]
    assert "--from-log" in readme and "--report-log" in readme
    # The job summary gets the report's head, and (CPU) what changed since the latest release's.
    for job in ("cpu", "gpu"):
        [summary] = [r for r in runs[job] if "python -m conformance.report summary" in r]
        assert f"summary moe-ep-report/{job}/moe-ep-conformance.json" in summary, summary
        assert '>> "$GITHUB_STEP_SUMMARY"' in summary, summary
    [diff] = [r for r in runs["cpu"] if "gh release download" in r]
    command = (r"python -m conformance\.report moe-ep-baseline/cpu/moe-ep-conformance\.json \\\n\s*"
               r"moe-ep-report/cpu/moe-ep-conformance\.json --out moe-ep-report/cpu")
    assert re.search(command, diff), diff
    assert 'cat moe-ep-report/cpu/moe-ep-conformance-diff.md >> "$GITHUB_STEP_SUMMARY"' in diff
    assert diff.index("gh release download") < diff.index("python -m conformance.report")
    # Every option the workflow passes is one README documents.
    for option in set(re.findall(r"--moe-ep-[a-z-]+", " ".join(matrix_cpu + matrix_gpu))):
        assert option in readme, option
    uploads = [s for s in workflow["jobs"]["cpu"]["steps"]
               if "upload-artifact" in s.get("uses", "")]
    assert uploads and uploads[0]["with"]["path"] == "moe-ep-report/cpu"
    assert any("gh release upload" in r for r in runs["cpu"])
    # YAML reads the bare key `on` as True.
    assert "release" in workflow[True]


def test_ci_run_installs_pinned_cpu_torch_first_and_runs_the_readme_test_command() -> None:
    ci_run = (ROOT / ".ci/run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert ci_run.index("torch==2.13.0") < ci_run.index('-e ".[test]"')
    assert ("bash ci/test.sh" in ci_run
            and "bash ci/test.sh" in readme.split("## Quick start")[1].split("##")[0])
    # Chromium for the report page's browser test, before the suite, never a reason for CI to fail.
    [install] = [line for line in ci_run.splitlines() if "apt-get install" in line]
    assert "chromium" in install and ci_run.index(install) < ci_run.index("bash ci/test.sh")
    assert ci_run.split(install, 1)[1].lstrip().startswith("|| echo"), install


def test_readme_is_short_and_every_docs_page_it_names_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in re.findall(r"\]\((docs/[\w/.-]+)\)", readme):
        assert (ROOT / page).exists(), page


def test_the_status_index_says_which_tier_each_report_ran(tmp_path: Path) -> None:
    """ci/conformance.sh's table: a default-tier report must not read as the full tier's counts."""
    from conformance.report import INDEX_END, INDEX_START, write_index, write_report

    cell = {"id": "moe-ep-matrix::checkpoint::packed::model::ep-only::ep1->ep2", "status": "pass",
            "detail": "", "suite": "checkpoint", "adapter": "a"}
    write_report(tmp_path / "full", [cell], backend="gloo", world_size=4, tier="full")
    write_report(tmp_path / "default", [cell], backend="gloo", world_size=4, tier="default")
    page = tmp_path / "page.md"
    page.write_text(f"head\n{INDEX_START}\nold\n{INDEX_END}\ntail\n")
    text = write_index(tmp_path, page)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ") and "`" in line}
    assert [r[1] for r in rows.values()] == ["default", "full"], rows
    assert page.read_text().startswith("head\n") and "old" not in page.read_text()


def test_the_project_workflow_runs_the_slow_tests_on_a_schedule() -> None:
    """The tests kept out of every push (``slow``) still run somewhere: nightly, whole."""
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load((ROOT / "ci/github/pytest-moe-ep-tests.yml").read_text())
    runs = {job: [step["run"] for step in spec["steps"] if "run" in step]
            for job, spec in workflow["jobs"].items()}
    assert runs == {"suite": ["bash .ci/run"], "slow": ["bash .ci/run --slow"]}
    assert workflow[True]["schedule"] and "schedule" in workflow["jobs"]["slow"]["if"]
    ci_run, test_sh = (ROOT / ".ci/run").read_text(), (ROOT / "ci/test.sh").read_text()
    assert 'bash ci/test.sh "$@"' in ci_run and "--run-slow" in test_sh


def test_ci_runs_the_hf_tests_on_the_hf_extras_floor() -> None:
    """The ``[hf]`` extra's floor is tested, not just declared: ``.ci/run`` installs the release
    the extra names (the install script reads it from pyproject.toml) and runs the HF checks' tests
    on it."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["hf"]
    assert [r for r in extra if r.startswith("transformers>=")], extra
    ci_run = (ROOT / ".ci/run").read_text()
    install = "bash ci/install_transformers_floor.sh .overlay-transformers-floor"
    test = 'PYTHONPATH="$PWD/.overlay-transformers-floor" python -m pytest tests/test_hf.py'
    assert install in ci_run and test in ci_run and ci_run.index(install) < ci_run.index(test)
    assert "pyproject.toml" in (ROOT / "ci/install_transformers_floor.sh").read_text()

"""The ``deepspeed-autoep`` adapters on a stated subset of the matrix: DeepSpeed AutoEP + universal
checkpoints.

Skipped unless DeepSpeed is installed (``ci/install_deepspeed.sh`` installs the pinned 0.19.8).
Each run is ``pytest --moe-ep-matrix --moe-ep-adapter=conformance.adapters.deepspeed_autoep:<class>
-k ...`` in a pytester subprocess; the outcome is asserted *as found*, cell by cell (all E=4,
packed, EP only):

* ZeRO-1 (``DeepSpeedAutoEPAdapter``), ep2->ep4 and ep4->ep4: model+optimizer passes bit for bit
  through ``ds_to_universal`` + ``load_universal`` (2->4) and through the native load (4->4); the
  model-only save at 4 reloads at 4, but at 2->4 the conversion of a checkpoint saved before the
  first optimizer step raises (AutoEP experts have no Adam fragments yet) -- loud;
* ZeRO-2 (``DeepSpeedAutoEPZero2Adapter``), model+optimizer ep1->ep2 (universal) and ep2->ep2
  (native): both pass;
* bf16 (``DeepSpeedAutoEPBf16Adapter``, ``"bf16": {"enabled": true}``: bf16 weights, fp32 masters
  and moments), ZeRO-1, loads at ep=1 from ep=1 and ep=2: model+optimizer passes bit for bit at
  both, through ``ds_to_universal`` from ep=2 -- bf16 weights, fp32 masters (``<name>.master``) and
  moments; the model-only save at 2 is refused by the conversion as in fp32; ZeRO-2 bf16 (slow) as
  its fp32 counterpart; with ``grad_accum_dtype: fp32`` (``BF16_Optimizer``, slow) the step after a
  universal load 2->1 raises DeepSpeed's "expert parallel group is not initialized" (refused) while
  the native load 2->2 passes;
* the negative control (``DeepSpeedAutoEPNoConversionAdapter``: ``load_checkpoint`` at another EP
  without the conversion), ep4->ep2: model-only passes, model+optimizer fails -- DeepSpeed silently
  gives experts the fp32 masters and Adam moments of the saved layout ("holds expert 1's values
  instead of expert 2's"), and the matrix says so.

* DeepSeek-V3 (``deepspeed-autoep-deepseek_v3``: transformers' ``DeepseekV3ForCausalLM`` through
  AutoEP's ``deepseek_v3`` preset, its router's ``e_score_correction_bias`` with synthetic values),
  model+optimizer saved at ep=4: the native load 4->4 passes bit for bit, the bias included; the
  universal load 4->2c silently keeps the load side's bias (DeepSpeed's finding, expected in
  ``ci/expectations/deepspeed-autoep-deepseek_v3.toml``) and nothing else: 91-110 s at load
  40-190 on the shared 2-core machine, 19 s of it CPU (the fork server imports transformers'
  DeepSeek-V3 too).

The full matrix of each class (18 cells run, 88 n/a) is ``ci/conformance.sh``'s.  This module took
46 s on 2 cores at load average 10 (150 s at load 20): three sessions, most of each its fork server
importing torch, DeepSpeed and Transformers once; the cells themselves take 0.3-1 s each.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from matrix_expectations import (
    BIT_FOR_BIT,
    TORCH_EXTENSIONS_DIR,
    assert_as_expected,
    by_status,
    expectations_args,
    run_report,
)

# checked without importing DeepSpeed into this process
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (ci/install_deepspeed.sh installs deepspeed==0.19.8)",
                allow_module_level=True)

MODULE = "conformance.adapters.deepspeed_autoep"
ID = "moe-ep-matrix::checkpoint::packed::{state}::ep-only::ep{s}->ep{t}"
NO_STEP_CONVERSION = ("raised FrameworkRefusal: ds_to_universal failed: RuntimeError: Missing "
                      "AutoEP exp_avg fragments for model.layers.0.mlp.experts.w1, EP rank 0.")


@pytest.fixture(autouse=True)
def _deepspeed_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # the adapter sets it too; explicit for the rank fork server
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", TORCH_EXTENSIONS_DIR)  # see matrix_expectations


def run_cells(pytester: pytest.Pytester, cls: str,
              selection: str) -> tuple[dict[str, Any], dict[str, set[str]],
                                         dict[str, int]]:
    result, doc = run_report(pytester, "--moe-ep-matrix=1,2,4", f"--moe-ep-adapter={MODULE}:{cls}",
                             "-k", selection)
    assert doc["adapter"]["version"] == "0.19.8", doc["adapter"]
    cells, statuses, na = by_status(doc)
    failed = statuses.get("fail", set()) | statuses.get("stopped", set())
    assert result.ret == (pytest.ExitCode.TESTS_FAILED if failed
                          else pytest.ExitCode.OK), result.stdout.str()[-3000:]
    return cells, statuses, na


def test_zero1_universal_and_native_loads(pytester: pytest.Pytester) -> None:
    """Held against ``ci/expectations/deepspeed-autoep.toml``: the model-only conversion's loud
    failure is expected, so the session is green."""
    result, doc = run_report(pytester, "--moe-ep-matrix=1,2,4",
                             f"--moe-ep-adapter={MODULE}:DeepSpeedAutoEPAdapter",
                             "-k", "not unpacked and not fsdp and not E5 and load_ep4 and "
                             "(save_ep2 or save_ep4)", *expectations_args("deepspeed-autoep"))
    assert_as_expected(result, doc)
    cells, statuses, _ = by_status(doc)
    passing = {ID.format(state="model+optim", s=2, t=4), ID.format(state="model+optim", s=4, t=4),
               ID.format(state="model", s=4, t=4)}
    unconvertible = ID.format(state="model", s=2, t=4)
    assert statuses.get("pass", set()) == passing, {i: cells[i]["detail"] for i in cells}
    assert statuses.get("stopped", set()) == {unconvertible}
    assert (set(cells) - passing - {unconvertible}
            == {"moe-ep-matrix::checkpoint::legacy::packed::ep2->ep4"})
    for cell_id in passing:
        assert BIT_FOR_BIT in cells[cell_id]["detail"], cells[cell_id]
    detail = cells[unconvertible]["detail"]
    assert cells[unconvertible]["finding"] == "refused", cells[unconvertible]
    assert "load (saved at ep=2, loading at ep=4 through a universal checkpoint)" in detail, detail
    assert NO_STEP_CONVERSION in detail, detail


@pytest.mark.slow
def test_zero2_universal_and_native_loads(pytester: pytest.Pytester) -> None:
    cells, statuses, _ = run_cells(pytester, "DeepSpeedAutoEPZero2Adapter",
                                   "not unpacked and not fsdp and not E5 and not legacy and "
                                   "model+optim and load_ep2 and (save_ep1 or save_ep2)")
    passing = {ID.format(state="model+optim", s=1, t=2), ID.format(state="model+optim", s=2, t=2)}
    assert (set(cells) == passing
            and statuses.get("pass", set()) == passing), {i: cells[i]["detail"] for i in cells}
    for cell_id in passing:
        assert BIT_FOR_BIT in cells[cell_id]["detail"], cells[cell_id]


def test_load_without_conversion_is_silently_wrong_and_caught(pytester: pytest.Pytester) -> None:
    cells, statuses, _ = run_cells(pytester, "DeepSpeedAutoEPNoConversionAdapter",
                                   "not unpacked and not fsdp and not E5 and not legacy and "
                                   "save_ep4 and load_ep2")
    model, optim = ID.format(state="model", s=4, t=2), ID.format(state="model+optim", s=4, t=2)
    assert statuses.get("pass", set()) == {model}, {i: cells[i]["detail"] for i in cells}
    assert statuses.get("fail", set()) == {optim}, {i: cells[i]["detail"] for i in cells}
    detail = cells[optim]["detail"]
    assert detail.split(": ", 1)[-1].startswith("first difference: rank 0, layer 0, expert 0, "
                                                "tensor 'w2.exp_avg': values differ"), detail
    assert "other difference(s), on rank(s) 0, 1, 2, 3" in detail, detail


def _views_per_rank(state: str, layers: int = 2, experts: int = 4, dense_per_layer: int = 3) -> int:
    """The canonical tensors one rank compares at ep=1 (every expert local) on the matrix's default
    model: per parameter its weight and ``.master`` (plus two Adam moments with the optimizer), and
    the two groups' step counts.  DeepSpeed AutoEP's model: per layer 3 packed expert weights per
    expert and 3 dense parameters (the LayerNorm's weight and bias, the router)."""
    views = 4 if state == "model+optim" else 2
    return layers * (experts * 3 + dense_per_layer) * views + (2 if state == "model+optim" else 0)


def test_bf16_zero1_universal_load_compares_masters(pytester: pytest.Pytester) -> None:
    """Held against ``ci/expectations/deepspeed-autoep-bf16.toml``: under bf16 the universal load
    2->1 and the native load 1->1 pass bit for bit against the bf16-aware ep=1 truth, and the
    model-only conversion is refused as in fp32.  The fp32 masters are compared: a passing cell's
    count holds them (4 views per parameter with the optimizer, 2 without; 3 and 1 without
    masters)."""
    result, doc = run_report(pytester, "--moe-ep-matrix=1,2,4",
                             "--moe-ep-adapter=deepspeed-autoep-bf16", "-k",
                             "not unpacked and not fsdp and not E5 and not legacy and load_ep1 and "
                             "(save_ep1 or save_ep2)", *expectations_args("deepspeed-autoep-bf16"))
    assert doc["adapter"]["version"] == "0.19.8", doc["adapter"]
    assert_as_expected(result, doc)
    cells, statuses, _ = by_status(doc)
    passing = {ID.format(state="model+optim", s=2, t=1), ID.format(state="model+optim", s=1, t=1),
               ID.format(state="model", s=1, t=1)}
    unconvertible = ID.format(state="model", s=2, t=1)
    assert set(cells) == passing | {unconvertible}, sorted(cells)
    assert statuses.get("pass", set()) == passing, {i: cells[i]["detail"] for i in cells}
    for cell_id in passing:
        detail = cells[cell_id]["detail"]
        assert BIT_FOR_BIT in detail, detail
        assert ("resume" in detail) == (cells[cell_id]["state"] == "model+optim"), detail
        # 4 ranks, each with every expert at ep=1
        compared = 4 * _views_per_rank(cells[cell_id]["state"])
        assert detail.startswith(f"{compared} tensors on 4 ranks "), detail
    assert cells[unconvertible]["finding"] == "refused", cells[unconvertible]
    assert NO_STEP_CONVERSION in cells[unconvertible]["detail"], cells[unconvertible]["detail"]


@pytest.mark.slow
def test_bf16_zero2_universal_and_native_loads(pytester: pytest.Pytester) -> None:
    """``DeepSpeedAutoEPZero2Bf16Adapter`` as its fp32 counterpart: model+optimizer 1->2
    (universal), 2->2 pass."""
    result, doc = run_report(pytester, "--moe-ep-matrix=1,2,4",
                             "--moe-ep-adapter=deepspeed-autoep-zero2-bf16",
                             "-k", "not unpacked and not fsdp and not E5 and not legacy and "
                             "model+optim and load_ep2 and (save_ep1 or save_ep2)",
                             *expectations_args("deepspeed-autoep-zero2-bf16"))
    assert_as_expected(result, doc)
    cells, statuses, _ = by_status(doc)
    passing = {ID.format(state="model+optim", s=1, t=2), ID.format(state="model+optim", s=2, t=2)}
    assert (set(cells) == passing
            and statuses.get("pass", set()) == passing), {i: cells[i]["detail"] for i in cells}
    for cell_id in passing:
        assert BIT_FOR_BIT in cells[cell_id]["detail"], cells[cell_id]


@pytest.mark.slow
def test_bf16_optimizer_step_after_universal_load_is_refused(pytester: pytest.Pytester) -> None:
    """``deepspeed-autoep-bf16-fp32accum`` (ZeRO-1, ``BF16_Optimizer``): the universal load 2->1 is
    right, but the next step looks up the stale expert group name the load copied from the
    checkpoint -- refused, as found."""
    result, doc = run_report(pytester, "--moe-ep-matrix=1,2,4",
                             "--moe-ep-adapter=deepspeed-autoep-bf16-fp32accum",
                             "-k", "not unpacked and not fsdp and not E5 and not legacy and "
                             "model+optim and save_ep2 and (load_ep1 or load_ep2)",
                             *expectations_args("deepspeed-autoep-bf16-fp32accum"))
    assert_as_expected(result, doc)
    cells, statuses, _ = by_status(doc)
    native, universal = ID.format(state="model+optim", s=2,
                                  t=2), ID.format(state="model+optim", s=2, t=1)
    assert statuses.get("pass", set()) == {native}, {i: cells[i]["detail"] for i in cells}
    assert statuses.get("stopped", set()) == {universal}, {i: cells[i]["detail"] for i in cells}
    assert BIT_FOR_BIT in cells[native]["detail"], cells[native]
    cell = cells[universal]
    assert cell["finding"] == "refused", cell
    assert ("AssertionError: expert parallel group is not initialized"
            in cell["detail"]), cell["detail"]
    assert {(p["check"], p["raised_at"]) for p in cell["problems"]} == {
        ("step", "deepspeed/utils/groups.py:687 in _get_expert_parallel_group")}, cell["problems"]


#: ``deepspeed-autoep-deepseek_v3`` on a slice of the default tier: model+optimizer saved at ep=4,
#: loaded at ep=4 (the native load) and at ep=2 (``ds_to_universal`` + ``load_universal``).
DSV3_SLICE = "optim and save_ep4 and (load_ep4 or load_ep2c)"
DSV3_NATIVE = ID.format(state="model+optim", s=4, t=4)
DSV3_UNIVERSAL = "moe-ep-matrix::checkpoint::packed::model+optim::ep-only::ep4->ep2c"
BIAS = "mlp.router.e_score_correction_bias"
DROPPED = (f"silent: first difference: rank 0, layer 0, expert 0, tensor '{BIAS}': still holds its "
           "pre-load (seed B) values: the load did not write it")


def test_deepseek_v3_universal_load_drops_the_expert_bias(pytester: pytest.Pytester) -> None:
    """Held against ``ci/expectations/deepspeed-autoep-deepseek_v3.toml``: transformers' DeepSeek-V3
    through AutoEP's ``deepseek_v3`` preset.  The native load at the saved EP degree restores
    everything, the expert bias included (bit for bit, every check).  The universal load at another
    degree restores every weight, master, moment and step count, but not the router's
    ``e_score_correction_bias``: DeepSpeed skips ``load_module_state_dict`` under
    ``load_universal``, so each rank keeps the load side's own bias (seed B's), silently -- a
    finding about DeepSpeed, named as such: ``values`` and ``resume`` on that buffer in both layers
    on every rank, and the ``forward``, whose expert choices it changes."""
    adapter = "deepspeed-autoep-deepseek_v3"
    result, doc = run_report(pytester, "--moe-ep-matrix", f"--moe-ep-adapter={adapter}",
                             "-k", DSV3_SLICE, *expectations_args(adapter))
    assert doc["adapter"]["version"] == "0.19.8", doc["adapter"]
    cells = assert_as_expected(result, doc)
    ran = {i for i, c in cells.items() if c["status"] != "n/a"}
    assert ran == {DSV3_NATIVE, DSV3_UNIVERSAL}, sorted(cells)
    native, universal = cells[DSV3_NATIVE], cells[DSV3_UNIVERSAL]
    assert native["status"] == "pass" and BIT_FOR_BIT in native["detail"], native
    assert "forward" in native["detail"], native["detail"]
    assert universal["status"] == "fail" and universal["finding"] == "silent", universal
    first = universal["detail"].splitlines()[0]
    assert first.startswith(DROPPED), first
    found = {(p["check"], p.get("tensor"), p.get("layer")) for p in universal["problems"]}
    assert found == {(check, BIAS, layer) for check in ("values", "resume") for layer in (0, 1)} | {
        ("forward", None, None)}, found
    assert {p.get("rank") for p in universal["problems"] if p["check"] == "values"} == {0, 1, 2, 3}
    passed = set(universal["checks_passed"])
    assert passed == {"checkpoint", "missing", "scalars"}, passed

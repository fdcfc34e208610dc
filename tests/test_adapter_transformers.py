"""The ``transformers`` adapter end to end: transformers 5.24.0's own expert parallelism through the
matrix.

Skipped unless the transformers on the path has ``DistributedConfig(ep_size=...)`` (5.24.0 does;
5.18.0, which NeMo Automodel 0.7.0 pins and the shared environment keeps, does not):
``ci/install_transformers.sh`` installs 5.24.0 into an overlay and ``.ci/run`` runs this module with
it first on ``PYTHONPATH``.  Each run happens in a pytester subprocess and its outcome is asserted
*as found*, cell by cell.

A small stated subset of the full tier (``ci/conformance.sh`` runs all of it): packed,
model+optimizer, FSDP2, E=4 -- ep2c -> ep4, ep4 -> ep1 and HSDP ep2.hsdp2 -> ep4 pass bit for bit
with every check (``checkpoint``, ``values``, ``missing``, ``scalars``, ``resume``, ``forward``);
the EP-only, strided-order and expert-TP cells of the same pair are n/a, each with its reason; E=5
loaded at ep=4 is an ``error`` cell: transformers refuses to split 5 experts over 4 ranks.  The
negative control: the same adapter with the optimizer load left out (what a Trainer resume under
``DistributedConfig`` gives: the Trainer refuses to save optimizer state there) fails its cell on
``scalars`` and ``values``.

DeepSeek-V3 (``transformers-deepseek_v3``): model+optimizer ep4 -> ep2c passes bit for bit with its
expert bias compared on every rank, and E=5 at ep=4 is refused.  Its negative control (slow), a load
that then zeroes every persistent floating-point buffer, is red in every default-tier cell.
Measured on the shared 2-core machine: the DeepSeek-V3 slice 87 s at load ~200 (25 s of CPU), the
negative control 150 s at load 25-90 (60 s of CPU).

Cost: two rank worlds (one per run), and their start and the transformers import in each rank
dominate. Measured: 461 s for both on a 2-core machine at load average 100-400 (7 agents sharing
it). On that machine under lighter load, a world's first cell took 53 s and later cells 1-11 s, so
expect about 2 minutes on an idle 2-core CI machine.
"""

from __future__ import annotations

import dataclasses

import pytest
from matrix_expectations import BIT_FOR_BIT, assert_as_expected, by_status, expectations_args
from matrix_expectations import run_report as run

distributed = pytest.importorskip("transformers.distributed",
                                  reason="transformers is not installed "
                                  "(ci/install_transformers.sh installs transformers==5.24.0)")
if "ep_size" not in {f.name for f in dataclasses.fields(distributed.DistributedConfig)}:
    pytest.skip("the installed transformers has no DistributedConfig(ep_size=...) expert "
                "parallelism (5.18.0, NeMo "
                "Automodel's pin, does not); run with ci/install_transformers.sh's 5.24.0 overlay "
                "first on PYTHONPATH", allow_module_level=True)

CELL = "moe-ep-matrix::checkpoint::packed::model+optim::{mode}::{experts}{pair}"
PASSING = {CELL.format(mode="fsdp", experts="", pair=pair)
           for pair in ("ep2c->ep4", "ep4->ep1", "ep2.hsdp2->ep4")}
ALL_CHECKS = "(checks: checkpoint, values, missing, scalars, resume, forward)"
NOT_APPLICABLE = {
    CELL.format(mode="ep-only", experts="", pair="ep2c->ep4"): "adapter composes EP only with "
    "FSDP2 (no EP-only cells)", CELL.format(mode="fsdp", experts="", pair="ep2->ep4"): "adapter "
    "forms consecutive EP groups, not strided", CELL.format(mode="fsdp", experts="",
                                                            pair="ep2.etp2->ep4"): "adapter does "
    "not support expert tensor parallelism (etp > 1)",
}
#: E=5 loaded at ep=4: transformers' expert parallelism refuses to split the experts (a loud
#: refusal, as found).
UNEVEN = CELL.format(mode="fsdp", experts="E5::", pair="ep1->ep4")
UNEVEN_REFUSAL = "ValueError: Cannot evenly shard 5 experts across 4 expert-parallel ranks."
SUBSET = ("kind_packed and optim and E4 and fsdp and ((save_ep2 and load_ep4) or (save_ep4 and "
          "load_ep1)) or kind_packed and E5 and fsdp and optim and save_ep1 and load_ep4"
          " or kind_packed and optim and not fsdp and save_ep2 and save_consecutive and load_ep4")
SEEDED = '''
from conformance.adapters.transformers_ep import TransformersAdapter


class OptimizerNotLoaded(TransformersAdapter):
    """Seeded bug: the model is loaded and the optimizer is not (load_optimizer_distributed left
    out)."""

    name = "seeded-transformers-optimizer-not-loaded"

    def load(self, model, optimizer, path):
        from transformers.distributed import _load_model_checkpoint_distributed

        _load_model_checkpoint_distributed(model, path)
'''


def test_transformers_matrix_subset_passes_fsdp_and_hsdp_cells_and_names_what_is_not_applicable(
        pytester: pytest.Pytester) -> None:
    result, doc = run(pytester, "--moe-ep-matrix=full", "--moe-ep-adapter=transformers", "-k",
                      SUBSET, *expectations_args("transformers"))
    assert doc["adapter"] == {"name": "transformers", "version": "5.24.0"}, doc["adapter"]
    # held against ci/expectations/transformers.toml: the refusal is expected
    assert_as_expected(result, doc)
    cells, statuses, _ = by_status(doc)
    assert statuses.get("pass", set()) == PASSING, {i: c["detail"] for i, c in cells.items()
                                                    if c["status"] != "n/a"}
    for cell_id in PASSING:
        assert (BIT_FOR_BIT in cells[cell_id]["detail"]
                and ALL_CHECKS in cells[cell_id]["detail"]), cells[cell_id]
    na = {i: cells[i]["detail"] for i in statuses.get("n/a", set()) if i in NOT_APPLICABLE}
    assert na == NOT_APPLICABLE
    assert statuses.get("stopped", set()) == {UNEVEN}, statuses
    assert UNEVEN_REFUSAL in cells[UNEVEN]["detail"], cells[UNEVEN]["detail"]
    assert cells[UNEVEN]["finding"] == "refused", cells[UNEVEN]
    assert "fail" not in statuses


def test_a_skipped_optimizer_load_is_caught_through_the_transformers_adapter(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile(seeded_transformers=SEEDED)
    result, doc = run(pytester, "--moe-ep-matrix=full",
                      "--moe-ep-adapter=seeded_transformers:OptimizerNotLoaded",
                      "-k", "kind_packed and optim and E4 and fsdp and save_ep2 and "
                      "save_consecutive and load_ep4")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()[-3000:]
    [cell] = [c for c in doc["cells"] if c["status"] != "n/a"]
    assert cell["id"] == CELL.format(mode="fsdp", experts="", pair="ep2c->ep4")
    assert cell["status"] == "fail", cell
    assert ("[scalars]" in cell["detail"]
            and "'step' = [3.0] after the load, expected [2.0]" in cell["detail"]), cell


#: ``transformers-deepseek_v3`` on a slice of the default tier: one model+optimizer cell across EP
#: and one E=5 refusal.  The passing cell compares 380 tensors: 4 ranks x (25 dense parameters x
#: (weight + 2 Adam moments) + 2 expert biases + 2 layers x 1 local expert x (gate, up, down) x 3);
#: without the biases it would be 372.
DSV3_SLICE = "save_ep4 and ((optim and load_ep2c) or (E5 and load_ep4))"
DSV3_PASS = CELL.format(mode="fsdp", experts="", pair="ep4->ep2c")
DSV3_REFUSED = "moe-ep-matrix::checkpoint::packed::model::fsdp::E5::ep4->ep4"
SEEDED_BIAS = '''
from conformance.adapters.torch_native import persistent_buffers
from conformance.adapters.transformers_deepseek import TransformersDeepseekV3Adapter


class BuffersZeroedOnLoad(TransformersDeepseekV3Adapter):
    """Seeded bug: after the load, every persistent floating-point buffer (the expert biases) is
    zeroed."""

    name = "seeded-transformers-buffers-zeroed-on-load"

    def load(self, model, optimizer, path):
        import torch

        super().load(model, optimizer, path)
        with torch.no_grad():
            for _, buffer in persistent_buffers(model):
                if buffer.is_floating_point():
                    buffer.zero_()
'''


def test_deepseek_v3_keeps_its_expert_bias_across_ep(pytester: pytest.Pytester) -> None:
    """Held against ``ci/expectations/transformers-deepseek_v3.toml``: DeepSeek-V3's
    ``e_score_correction_bias`` (synthetic, seed-dependent) comes back bit for bit with the weights
    and moments at ep4 -> ep2c, and E=5 at ep=4 is transformers' refusal, as for Qwen3-MoE."""
    result, doc = run(pytester, "--moe-ep-matrix", "--moe-ep-adapter=transformers-deepseek_v3",
                      "-k", DSV3_SLICE, *expectations_args("transformers-deepseek_v3"))
    assert doc["adapter"]["version"] == "5.24.0", doc["adapter"]
    cells = assert_as_expected(result, doc)
    ran = {i for i, c in cells.items() if c["status"] != "n/a"}
    assert ran == {DSV3_PASS, DSV3_REFUSED}, sorted(ran)
    detail = cells[DSV3_PASS]["detail"]
    assert cells[DSV3_PASS]["status"] == "pass", detail
    assert detail.startswith("380 tensors on 4 ranks "), detail
    assert BIT_FOR_BIT in detail and ALL_CHECKS in detail, detail
    assert cells[DSV3_REFUSED]["finding"] == "refused", cells[DSV3_REFUSED]
    assert UNEVEN_REFUSAL in cells[DSV3_REFUSED]["detail"], cells[DSV3_REFUSED]["detail"]


@pytest.mark.slow
def test_a_load_that_zeroes_the_expert_bias_is_red_in_every_default_cell(
        pytester: pytest.Pytester) -> None:
    """The bias's negative control over the whole default tier of ``transformers-deepseek_v3``:
    every cell that builds is red, first naming a layer's ``e_score_correction_bias`` (``values``,
    ``resume`` and ``forward`` all see it); the cells it cannot build are the E=5 refusals; at least
    90% of the cells that ran are red."""
    pytester.makepyfile(seeded_bias=SEEDED_BIAS)
    _, doc = run(pytester, "--moe-ep-matrix", "--moe-ep-adapter=seeded_bias:BuffersZeroedOnLoad")
    cells, statuses, _ = by_status(doc)
    ran = {i: c for i, c in cells.items() if c["status"] != "n/a" and not c["legacy"]}
    red = {i for i, c in ran.items() if c["status"] in ("fail", "stopped")}
    assert len(red) >= 0.9 * len(ran), {i: c["status"] for i, c in ran.items()}
    assert statuses.get("fail") and not statuses.get("pass"), statuses
    for cell_id in statuses["fail"]:
        cell = cells[cell_id]
        first = cell["detail"].splitlines()[0]
        assert cell["finding"] == "silent" and "mlp.gate.e_score_correction_bias'" in first, first
        caught = {"values", "forward"} | ({"resume"} if cell["state"] == "model+optim" else set())
        assert caught <= {p["check"] for p in cell["problems"]}, cell["problems"]
    for cell_id in statuses.get("stopped", set()):
        cell = cells[cell_id]
        assert cell["num_experts"] == 5 and cell["finding"] == "refused", cell


@pytest.mark.moe_ep_world(4)
def test_a_second_build_of_a_layout_forms_no_new_process_groups() -> None:
    """Builds reuse the meshes transformers formed for the same shape (a full tier once reached ~250
    gloo threads per rank); a new shape still gets its own meshes, formed by transformers."""
    from torch.distributed.distributed_c10d import _world

    from conformance.adapter import Spec
    from conformance.adapters.transformers_ep import TransformersAdapter
    from conformance.layout import ParallelLayout

    adapter = TransformersAdapter()
    ep2 = ParallelLayout.for_world(4, 2, ep_order="consecutive")
    spec = Spec(kind="packed", num_experts=4, fsdp=True, layout=ep2)
    adapter.build(spec, ep2.build_mesh(), 0)
    groups = len(_world.pg_map)
    adapter.build(spec, ep2.build_mesh(), 1)
    assert len(_world.pg_map) == groups, ("the second build of the same layout formed new process "
                                          "groups")
    ep4 = ParallelLayout.for_world(4, 4)
    adapter.build(Spec(kind="packed", num_experts=4, fsdp=True, layout=ep4), ep4.build_mesh(), 0)
    assert len(_world.pg_map) > groups, "a new layout must get transformers' own meshes"


@pytest.mark.parametrize("adapter", ["transformers", "transformers-deepseek_v3"])
def test_the_hugging_face_export_and_import_pass_in_the_model_cells(
        pytester: pytest.Pytester, adapter: str) -> None:
    """``save_pretrained`` at every layout is the ep=1 export, transformers' loader takes it whole
    and computes the same forward; ``from_pretrained`` at the cell's layout gives the ep=1 state,
    the DeepSeek-V3 bias included."""
    _, doc = run(pytester, "--moe-ep-matrix", f"--moe-ep-adapter={adapter}", "-k",
                 "model and not optim and not legacy and not E5")
    cells, statuses, _ = by_status(doc)
    ran = {i: c for i, c in cells.items() if c["status"] != "n/a"}
    assert ran and set(statuses) <= {"pass", "n/a"}, {i: c["detail"] for i, c in ran.items()}
    assert all("hf_import)" in c["detail"] for c in ran.values()), ran
    assert any("hf_export, hf_import)" in c["detail"] for c in ran.values()), ran

"""The ``torchtitan`` and ``torchtitan-local`` adapters end to end: torchtitan 0.3.0 through the
whole matrix.

Skipped unless torchtitan is installed (``ci/install_torchtitan.sh`` installs the pinned 0.3.0).
Each matrix runs in a pytester subprocess and its outcome is asserted *as found*, cell by cell, so a
change in the harness or in torchtitan that flips one is noticed:

* ``torchtitan`` (``spmd_backend="partial_dtensor"``): every packed cell passes -- EP-only and
  FSDP, model and model+optimizer, every EP pair, and E=5 at ep=2 and ep=4;
* ``torchtitan-local`` (``"spmd_types"``, torchtitan's default): EP-only passes only at ep=1 ->
  ep=1; a save at ep > 1 reloaded at the same ep silently gives ranks another rank's experts (fail);
  between different EP degrees DCP refuses the local shapes (error); E=5 at ep=2 or 4 cannot be
  built (error); every FSDP cell errors in ``parallelize_qwen3`` (torch 2.13's ``fully_shard`` wants
  DTensors there);
* both: unpacked and cross-kind cells and legacy cells are n/a (``GroupedExperts`` is packed;
  torchtitan has no legacy save).

The ``forward`` check (torchtitan's own MoE forward with its token dispatcher): passes in every
``torchtitan`` cell that runs it; n/a where E=5 is loaded at ep=2 or 4 (the all-to-all dispatcher's
``view(ep, -1)`` of the token counts) and, for ``torchtitan-local``, at every ep > 1 (spmd_types'
list all_to_all of uneven chunks, which gloo refuses).  Its negative control: ``seeded_forward``'s
router rows of experts 0 and 1 swapped in the forward after a load fail only ``forward``, in one
cell.

Each run takes about 50-80 s on 2 cores (the whole module about 2.5 min on a loaded machine).
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
    PACKED_ONLY_NOT_APPLICABLE,
    assert_as_expected,
    assert_even_cells_pass,
    by_status,
    expectations_args,
    run_report,
)

pytest.importorskip("torchtitan",
                    reason="torchtitan is not installed (ci/install_torchtitan.sh installs "
                                         "torchtitan==0.3.0)")


def run_matrix(pytester: pytest.Pytester, adapter: str) -> tuple[pytest.RunResult, dict[str, Any]]:
    result, doc = run_report(pytester, "--moe-ep-matrix=1,2,4", f"--moe-ep-adapter={adapter}",
                             *expectations_args(adapter))
    assert doc["adapter"] == {"name": adapter, "version": "0.3.0"}
    # held against ci/expectations/<adapter>.toml: what is red there is expected
    assert_as_expected(result, doc)
    return result, doc


#: the forward check's n/a reasons, as found.
DISPATCHER_E5 = ("the framework's forward cannot run in this cell: torchtitan's "
                 "AllToAllTokenDispatcher cannot split the token counts of E=5 experts over "
                 "ep={ep} (_token_count_exchange: num_local_tokens_per_expert_E.view(ep, -1)): "
                 "RuntimeError: shape '[{ep}, -1]' is invalid for input of size 5")
GLOO_LIST_ALL_TO_ALL = "list all_to_all of uneven per-rank chunks, which ProcessGroupGloo refuses"
FORWARD_RAN = re.compile(r"\(checks: [a-z_, ]*\bforward\b[a-z_, ]*\)")


@pytest.mark.slow
def test_torchtitan_partial_dtensor_passes_every_packed_cell(pytester: pytest.Pytester) -> None:
    _, doc = run_matrix(pytester, "torchtitan")
    cells, statuses, na = by_status(doc)
    passing = set(EVEN) | set(E5)
    assert statuses.get("pass", set()) == passing, {i: cells[i]["detail"]
                                                    for i in passing - statuses["pass"]}
    assert na == PACKED_ONLY_NOT_APPLICABLE
    assert doc["summary"] == {"pass": 36 + 8, "fail": 0, "stopped": 0, "n/a": 68}
    assert_even_cells_pass(cells)
    for cell_id, (s, t) in E5.items():
        assert (cells[cell_id]["save_ep"], cells[cell_id]["load_ep"],
                cells[cell_id]["num_experts"]) == (s, t, 5)
        assert BIT_FOR_BIT in cells[cell_id]["detail"], cells[cell_id]
        if t > 1:  # the all-to-all dispatcher cannot split E=5 token counts over 2 or 4 ranks
            assert (cells[cell_id]["skipped_checks"]
                    == {"forward": DISPATCHER_E5.format(ep=t)}), cells[cell_id]
        else:
            assert FORWARD_RAN.search(cells[cell_id]["detail"]), cells[cell_id]
    # torchtitan's forward after the load equals the ep=1 truth's, with and without FSDP
    for cell_id in EVEN:
        assert (FORWARD_RAN.search(cells[cell_id]["detail"])
                and not cells[cell_id]["skipped_checks"]), cells[cell_id]


def test_torchtitan_forward_catches_router_rows_swapped_after_the_load(
        pytester: pytest.Pytester) -> None:
    """The forward check's negative control: only ``forward`` sees it (the stored tensors are
    right)."""
    pytester.makepyfile(seeded_forward=(Path(__file__).parent / "seeded_forward.py").read_text())
    _, doc = run_report(pytester, "--moe-ep-matrix=1,2,4",
                        "--moe-ep-adapter=seeded_forward:TorchtitanSwappedRouter",
                        "-k", "save_ep1 and load_ep2 and not fsdp and not optim")
    cells, statuses, _ = by_status(doc)
    cell_id = "moe-ep-matrix::checkpoint::packed::model::ep-only::ep1->ep2c"
    assert statuses == {"fail": {cell_id}, "n/a": statuses.get("n/a", set())}, statuses
    assert cells[cell_id]["findings"] == ["silent"], cells[cell_id]  # the forward alone sees it
    *lines, passed = cells[cell_id]["detail"].removeprefix("silent: ").splitlines()
    assert len(lines) == 4 and all(
        line.startswith(f"[forward] rank {r}: the forward after the load differs from the "
                        "ground truth's") for r, line in enumerate(lines)), lines
    assert passed == "checks that passed: checkpoint, values, missing", passed


@pytest.mark.slow
def test_torchtitan_local_shows_the_plain_local_expert_trap(pytester: pytest.Pytester) -> None:
    _, doc = run_matrix(pytester, "torchtitan-local")
    cells, statuses, na = by_status(doc)
    ep_only = {i: v for i, v in EVEN.items() if not v[1]}
    passing = {i for i, (_, _, s, t) in ep_only.items() if s == t == 1}
    silent = {i for i, (_, _, s, t) in ep_only.items() if s == t > 1}
    reshard = {i for i, (_, _, s, t) in ep_only.items() if s != t}
    fsdp = {i for i, v in EVEN.items() if v[1]}
    assert statuses.get("pass", set()) == passing, {i: cells[i]["detail"]
                                                    for i in passing ^ statuses["pass"]}
    assert statuses.get("fail", set()) == silent, {i: cells[i]["detail"]
                                                   for i in silent ^ statuses["fail"]}
    assert statuses.get("stopped", set()) == reshard | fsdp | set(E5)
    assert na == PACKED_ONLY_NOT_APPLICABLE
    assert doc["summary"] == {"pass": 2, "fail": 4, "stopped": 6 * 2 + 18 + 8, "n/a": 68}

    for cell_id in passing:
        assert BIT_FOR_BIT in cells[cell_id]["detail"], cells[cell_id]
        assert FORWARD_RAN.search(cells[cell_id]["detail"]), cells[cell_id]
    # How bad each red cell is: the same-EP reload hands ranks each other's experts without a word
    # (silent, and the save is lossy: on-disk); between EP degrees DCP refuses the local shapes
    # (refused, after on-disk where the save was at ep > 1); E=5 at ep=2 and 4 is torchtitan's own
    # split refusing; FSDP under spmd_types fails in torchtitan.
    assert {cells[i]["finding"] for i in silent} == {"silent"}
    assert all(cells[i]["findings"] == ["silent", "on-disk"] for i in silent)
    assert {cells[i]["finding"] for i in reshard if EVEN[i][2] > 1} == {"on-disk"}
    assert all("refused" in cells[i]["findings"] for i in reshard)
    assert {cells[i]["finding"] for i in reshard if EVEN[i][2] == 1} == {"refused"}
    assert {cells[i]["finding"] for i in fsdp} == {"refused"}
    assert all("refused" in cells[i]["findings"] for i in E5)
    # the forward at ep > 1 cannot run on gloo under spmd_types: the values finding stays
    for cell_id in silent:
        assert GLOO_LIST_ALL_TO_ALL in cells[cell_id]["skipped_checks"]["forward"], cells[cell_id]
        # DCP kept one rank's E/ep rows of each expert tensor; the other ranks got them on reload.
        detail = cells[cell_id]["detail"]
        assert re.search(r"first difference: rank \d, layer \d, expert \d, tensor "
                         r"'w[123]_E[FD][FD]': "
                         r"holds expert \d's values instead of expert \d's", detail), detail
    for cell_id in reshard:
        detail = cells[cell_id]["detail"]
        # a lossy save: the checkpoint's own problem leads, in expert terms
        if EVEN[cell_id][2] > 1:
            assert ("raised LoadFailed: the checkpoint differs from an EP-invariant one: layer "
                    in detail)
            assert "is a local count (what one of ep=" in detail, detail
        # a sound ep=1 save that DCP refuses to load into local tensors: the load is blamed, in
        # expert terms
        else:
            assert re.search(r"raised LoadFailed: the load at ep=\d.* raised: rank \d, layer \d, "
                             r"'layers\.\d\.moe\.routed_experts\.inner_experts\.w[123]_E[FD][FD]': "
                             r"the model offers \d rows for the checkpoint's 4 experts: the load "
                             r"does not map the saved global rows to this rank's experts? "
                             r"\d.*\(the checkpoint is EP-invariant, so the load is wrong",
                             detail), detail
    for cell_id in fsdp:
        detail = cells[cell_id]["detail"]
        assert "torchtitan parallelize_qwen3 failed (spmd_backend='spmd_types'" in detail, detail
        assert ("When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD "
                "mesh" in detail), detail
    for cell_id, (s, t) in E5.items():
        # the save side's build refuses first
        detail, ep = cells[cell_id]["detail"], s if s > 1 else t
        rank, experts = (1, r"\[3, 5\)") if ep == 2 else (2, r"\[4, 5\)")
        assert re.search(r"raised BuildFailed: the framework refused the (save|load) side's build "
                         rf"at ep={ep}\b.*FrameworkRefusal: 'w[123]_E[FD][FD]' of layer \d: ep "
                         rf"rank {rank} of {ep} holds a plain expert tensor of \d rows where "
                         r"Shard\(0\)'s chunk rule \(ceil\(E/ep\) per rank\) gives it experts "
                         rf"{experts} of E=5", detail), detail


def test_torchtitan_pipeline_stages_keep_their_layers_names(pytester: pytest.Pytester) -> None:
    """Issue 34, as found: torchtitan's own pipeline split (``_generate_llm_fqn_per_model_part``'s
    default stage names, ``_pipeline_module_split``: a ``ModuleDict`` keeps its keys) names each
    stage's layers globally, so every pipeline cell of the default tier passes -- stages changing
    alone and with the EP degree (pp2.ep1 -> ep2c and back), with FSDP2 and the optimizer; its
    forward runs stage by stage (n/a only where E=5 is loaded at ep > 1)."""
    _, doc = run_report(pytester, "--moe-ep-matrix", "--moe-ep-adapter=torchtitan", "-k",
                        "pipeline", *expectations_args("torchtitan"), stages=True)
    cells, statuses, _ = by_status(doc)
    assert set(statuses) == {"pass"} and len(statuses["pass"]) >= 10, statuses
    assert {c["save_layout"] + "->" + c["load_layout"]
            for c in cells.values()} >= {"pp2.ep1->ep2c", "ep2c->pp2.ep1"}
    for cell in cells.values():
        if cell["num_experts"] == 5 and cell["load_layout"] in ("pp2.ep2", "ep2c", "ep4"):
            assert "forward" in cell["skipped_checks"], cell
        else:
            assert FORWARD_RAN.search(cell["detail"]) and not cell["skipped_checks"], cell


#: the expert bias's negative controls: torchtitan's own adapter with one thing wrong.
BIAS_CONTROLS = '''
from conformance.adapters import _torchtitan_objects as objects
from conformance.adapters.torch_native import persistent_buffers
from conformance.adapters.torchtitan import TorchtitanAdapter


class ZeroedBuffers(TorchtitanAdapter):
    """The load then zeroes every persistent floating-point buffer (the expert bias): as a load
    whose state dict leaves buffers out, and an init that runs after it."""

    def load(self, model, optimizer, path):
        import torch

        super().load(model, optimizer, path)
        with torch.no_grad():
            for _, buffer in persistent_buffers(model):
                if buffer.is_floating_point():
                    buffer.zero_()


class UnreducedLoads(TorchtitanAdapter):
    """torchtitan's hook without its all-reduce: each rank steps its bias on the tokens it
    counted."""

    def build_optimizer(self, spec, model):
        optimizers = super().build_optimizer(spec, model)
        optimizers._optimizer_step_pre_hooks.clear()
        objects.register_load_balancing(optimizers, model, None)
        return optimizers
'''


@pytest.mark.moe_ep_world(2)
def test_the_expert_bias_is_seeded_stepped_on_the_all_reduced_load_and_routes() -> None:
    """What makes the bias checkable: the adapter's model-only and model+optim builds at ep=2 hold a
    non-zero bias that differs between seeds and moves with each step -- on every rank the ground
    truth's step on the whole load, which a hook without the all-reduce misses (each rank holds a
    share) -- and the bias changes the forward (it changes which experts tokens go to)."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from conformance.adapter import Spec
    from conformance.adapters import _torchtitan_objects as objects
    from conformance.adapters.torchtitan import TorchtitanAdapter
    from conformance.checks.truth import batch_for
    from conformance.layout import ParallelLayout

    namespace: dict[str, Any] = {}
    exec(BIAS_CONTROLS, namespace)  # the controls' module (a pytester file below), in this rank
    layout = ParallelLayout.for_world(2, 2, ep_order="consecutive")
    model_only = Spec(kind="packed", num_experts=4, layout=layout)
    trained = dataclasses.replace(model_only, optimizer_steps=2)

    def bias(adapter: Any, spec: Spec, seed: int, world: bool = True) -> Any:
        model = adapter.build(spec, layout.build_mesh() if world else None, seed)[0]
        return torch.stack([moe.expert_bias_E for _, moe in objects.moe_layers(model)]), model

    adapter = TorchtitanAdapter()
    (seed_a, _), (seed_b, _) = bias(adapter, model_only, 1), bias(adapter, model_only, 2)
    stepped, _ = bias(adapter, trained, 1)
    truth, truth_model = bias(adapter, trained, 1, world=False)
    assert bool((seed_a != 0).all()) and not torch.equal(seed_a, seed_b), (seed_a, seed_b)
    # two steps of torchtitan's rule, coeff * sign(mean - load) centred: at most 2 coeff an entry
    assert 0 < float((stepped - seed_a).abs().max()) <= 2 * 2 * 1e-3, stepped - seed_a
    assert torch.equal(stepped, truth), (dist.get_rank(), stepped, truth)

    unreduced, _ = bias(namespace["UnreducedLoads"](), trained, 1)
    ranks = [torch.empty_like(unreduced) for _ in range(dist.get_world_size())]
    dist.all_gather(ranks, unreduced)
    assert not all(torch.equal(r, truth) for r in ranks), "a hook without its all-reduce passed"

    batch = batch_for(trained)
    routed = adapter.forward(truth_model, batch)
    with torch.no_grad():
        for _, moe in objects.moe_layers(truth_model):
            moe.expert_bias_E.zero_()
    assert not torch.allclose(adapter.forward(truth_model, batch), routed, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_load_that_zeroes_the_buffers_is_red_in_the_default_tier(
        pytester: pytest.Pytester) -> None:
    """The negative control of the bias as a checked tensor: a load that then zeroes every
    persistent floating-point buffer is red (silent, on the bias) in at least 90% of the cells that
    run."""
    pytester.makepyfile(bias_controls=BIAS_CONTROLS)
    _, doc = run_report(pytester, "--moe-ep-matrix", "--moe-ep-adapter=bias_controls:ZeroedBuffers",
                        stages=True)
    ran = [c for c in doc["cells"] if c["status"] != "n/a" and "::legacy::" not in c["id"]]
    red = [c for c in ran if c["status"] != "pass"]
    assert len(ran) >= 20 and len(red) >= 0.9 * len(ran), [(c["id"], c["status"]) for c in ran]
    for cell in red:
        assert cell["findings"][0] == "silent" and "tensor 'expert_bias_E'" in cell["detail"], cell


@pytest.mark.moe_ep_world(2)
def test_deepseek_v3s_mtp_bias_is_never_stepped_as_found() -> None:
    """torchtitan's load-balancing hook walks ``model.layers`` only: DeepSeek-V3's MTP layer
    (``mtp_layers.0``, layer 2) keeps its initial bias through every step and its counter is never
    consumed, while the main layers' biases step to the ground truth's on every rank (ep=2).  Every
    layout and the truth agree on it, so no cell is red: the finding is this test's."""
    import dataclasses

    import torch

    from conformance.adapter import Spec
    from conformance.adapters import _torchtitan_objects as objects
    from conformance.adapters.torchtitan_deepseek import TorchtitanDeepSeekAdapter
    from conformance.layout import ParallelLayout

    adapter = TorchtitanDeepSeekAdapter()
    layout = ParallelLayout.for_world(2, 2, ep_order="consecutive")
    model_only = Spec(kind="packed", num_experts=4, layout=layout)
    trained = dataclasses.replace(model_only, optimizer_steps=2)
    initial = adapter.build(model_only, layout.build_mesh(), 1)[0]
    model = adapter.build(trained, layout.build_mesh(), 1)[0]
    truth = adapter.build(trained, None, 1)[0]
    layers = {layer: moe for layer, moe in objects.moe_layers(model)}
    before = {layer: moe.expert_bias_E for layer, moe in objects.moe_layers(initial)}
    after = {layer: moe.expert_bias_E for layer, moe in objects.moe_layers(truth)}
    assert sorted(layers) == [0, 1, 2] and len(model.layers) == 2, sorted(layers)
    for layer in (0, 1):
        assert not torch.equal(layers[layer].expert_bias_E, before[layer]), layer
        assert torch.equal(layers[layer].expert_bias_E, after[layer]), layer
        assert not bool(layers[layer].tokens_per_expert_E.any()), layer  # consumed by the hook
    assert torch.equal(layers[2].expert_bias_E, before[2]) and torch.equal(after[2], before[2])
    assert bool(layers[2].tokens_per_expert_E.any()), "the MTP layer's counter was consumed"


@pytest.mark.slow
def test_torchtitan_deepseek_passes_every_default_cell(pytester: pytest.Pytester) -> None:
    """DeepSeek-V3 with an MTP layer through the default tier: every cell that applies passes bit
    for bit (MTP's experts and bias included, with and without FSDP2, E=5); pipeline cells are n/a
    (torchtitan refuses PP with MTP), and the forward where E=5 is loaded at ep > 1."""
    result, doc = run_report(pytester, "--moe-ep-matrix", "--moe-ep-adapter=torchtitan-deepseek",
                             *expectations_args("torchtitan-deepseek"), stages=True)
    assert doc["adapter"] == {"name": "torchtitan-deepseek", "version": "0.3.0"}
    cells = assert_as_expected(result, doc)
    ran = {i: c for i, c in cells.items() if c["status"] != "n/a"}
    assert len(ran) >= 10 and {c["status"] for c in ran.values()} == {"pass"}, ran
    assert all(BIT_FOR_BIT in c["detail"] for c in ran.values()), ran
    na = {c["detail"] for c in cells.values() if c["status"] == "n/a"}
    assert "adapter supports no pipeline parallelism, not pp=2" in na, na
    for cell in ran.values():
        if cell["num_experts"] == 5 and cell["load_ep"] > 1:
            assert "forward" in cell["skipped_checks"], cell
        else:
            # torchtitan's Hugging Face export cannot split E=5 over ep > 1 (tests/test_hf.py)
            hf_only = cell["num_experts"] == 5 and set(cell["skipped_checks"]) <= {"hf_export"}
            assert FORWARD_RAN.search(cell["detail"]), cell
            assert hf_only or not cell["skipped_checks"], cell

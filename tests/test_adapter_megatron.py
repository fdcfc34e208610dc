"""The ``megatron`` adapter end to end: Megatron-Core's MoE checkpoint through the matrix, cell by
cell as found.

Skipped unless megatron-core is installed (``ci/install_megatron.sh`` installs the pinned 0.16.0).
The matrix runs in a pytester subprocess with ``-k "not save_ep4"`` -- every cell saved at ep 1 or 2
(70 of the default matrix's 106: 42 run, 28 n/a), which holds every outcome the full matrix has; the
cells saved at ep=4 mirror those saved at ep=2.  Measured on 2 cores shared with other runs (load
average 13-26): this subset 86 s, the full matrix (60 cells run) 72-119 s; the whole file about 130
s, of which about 40 s is importing megatron-core into the pytest process and a fresh world under
that load.  Found:

* model-only cells pass at every EP pair, for ``SequentialMLP`` (unpacked) and ``GroupedMLP``
  (packed);
* model+optimizer cells (Megatron's ``get_megatron_optimizer``) pass when both EP degrees are 1 or
  both are > 1 -- also between the layer kinds -- and error between ep=1 and ep > 1: Megatron gives
  expert parameters an optimizer of their own only when ``expert_model_parallel_size > 1``
  (``allreduce=False``), so the optimizer's checkpoint keys are ``optimizer.state.*`` at ep=1 and
  ``chained_{0,1}.optimizer.state.*`` at ep > 1, and ``dist_checkpointing.load`` raises a KeyError
  naming the missing key (loud, never wrong values);
* legacy cells (Megatron-LM's per-rank ``torch.save`` of a plain ``state_dict()``) are refused:
  ``CheckpointingException: ... is not a distributed checkpoint``;
* n/a: FSDP2 (Megatron has its own FSDP) and E % ep != 0 (``BaseMoELayer`` asserts it);
* expert tensor parallelism (``expert_tensor_parallel_size=2``, the full tier's ep2.etp2; a
  four-cell slice in ``test_megatron_expert_tensor_parallel_cells_as_found``) composes on CPU/gloo
  and shows the EP outcomes: model cells pass into and out of etp, model+optimizer cells fail on the
  ``chained_N.`` keys or error at ep=1 <-> ep > 1;
* the ``forward`` check runs Megatron's own ``MoELayer.forward`` (``SequentialMLP``, the
  ``allgather`` dispatcher) in every unpacked cell that reaches it and equals the ep=1 truth's, at
  every EP degree and under expert TP; for the packed kind (``GroupedMLP``) it is n/a
  (``grouped_gemm`` is CUDA-only).  Its negative control (``seeded_forward.MegatronSwappedRouter``:
  the router rows of experts 0 and 1 swapped while a loaded model's forward runs) is caught by
  ``forward`` alone;
* the router is DeepSeek-V3's (sigmoid scores, ``moe_router_enable_expert_bias``): each
  router's fp32 ``expert_bias``, given synthetic values and stepped by Megatron's
  ``_update_router_expert_bias`` on synthetic loads, comes back right in every cell -- saved, loaded
  at another EP degree and stepped again; its negative control
  (``seeded_megatron.ExpertBiasLeftAtLoad``: a load that leaves the bias at the load side's values)
  is named by ``values``.

The same run checks process hygiene: a distributed test before and after the passing cells counts
the live process groups in each rank process (those of the harness's device meshes aside) and must
find the same rank processes and the same count -- Megatron's ``destroy_model_parallel()`` alone
leaves most of the groups ``initialize_model_parallel()`` creates.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from matrix_expectations import (
    BIT_FOR_BIT,
    assert_as_expected,
    assert_slice_as_found,
    by_status,
    expectations_args,
    pair,
    run_report,
)

if (importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None):
    pytest.skip("megatron-core is not installed (ci/install_megatron.sh installs "
                "megatron-core==0.16.0)", allow_module_level=True)

from conformance.adapters.megatron import GROUPED_MLP_NOT_RUN

ADAPTER = "conformance.adapters.megatron:MegatronAdapter"
SUBSET = "not save_ep4"
SAVE_EPS, LOAD_EPS = (1, 2), (1, 2, 4)
PAIRS = [(s, t) for s in SAVE_EPS for t in LOAD_EPS]
ID = "moe-ep-matrix::checkpoint::{kind}::{state}::{mode}::{pair}"
KINDS = ("packed", "unpacked")
CROSS = ("packed->unpacked", "unpacked->packed")
MODEL = {ID.format(kind=k, state="model", mode="ep-only", pair=pair(s, t)) for k in KINDS
         for s, t in PAIRS}
#: model+optimizer cells by (kind, save_ep, load_ep).
OPTIM = {(k, s, t): ID.format(kind=k, state="model+optim", mode="ep-only", pair=pair(s, t))
         for k in KINDS + CROSS for s, t in PAIRS}
OPTIM_PASS = {cell_id for (_, s, t), cell_id in OPTIM.items() if s == t == 1}
#: saved and loaded at ep > 1: every value comes back, but the checkpoint is not the ep=1 one
#: (chained_N. keys).
OPTIM_FAIL = {cell_id for (_, s, t), cell_id in OPTIM.items() if s > 1 and t > 1}
OPTIM_ERROR = {cell_id: (s, t) for (_, s, t), cell_id in OPTIM.items() if (s == 1) != (t == 1)}
LEGACY = {f"moe-ep-matrix::checkpoint::legacy::{k}::{pair(2, t)}" for k in KINDS for t in LOAD_EPS}
NOT_APPLICABLE = {
    "adapter does not support FSDP2": 2 * 2 * len(PAIRS),
    # E=5 is uneven at ep=2 and 4: 5 pairs, both kinds
    "adapter does not support E % ep != 0 (E=5)": 5 * 2,
}

#: a distributed test run before and after the passing cells, in the same rank processes.
GROUPS_TEST = '''
import json, os
from pathlib import Path

import pytest

OUT = Path({out!r})


def _live_groups_outside_meshes():
    import gc

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.distributed_c10d import _world

    # a mesh dim over every rank reuses the default group: count it whether a mesh holds it or not.
    held = {{id(pg) for mesh in gc.get_objects() if isinstance(mesh, DeviceMesh)
             for pg in getattr(mesh, "_pg_registry", {{}}).values()}} - {{id(dist.group.WORLD)}}
    return dist.get_rank(), sorted(name for pg, name in _world.pg_names.items()
                                   if id(pg) not in held)


def _record(phase):
    from megatron.core import parallel_state

    rank, groups = _live_groups_outside_meshes()
    OUT.mkdir(exist_ok=True)
    (OUT / f"{{phase}}-rank{{rank}}.json").write_text(json.dumps(
        {{"pid": os.getpid(), "groups": groups,
          "megatron": parallel_state.model_parallel_is_initialized()}}))


@pytest.mark.moe_ep_world(4)
def test_groups_before():
    _record("before")


@pytest.mark.moe_ep_world(4)
def test_groups_after():
    _record("after")
'''

#: error cells first (a failing call replaces the world), then the group count, the other cells, the
#: count.
ORDER_CONFTEST = '''
ERRORS = {errors!r}


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.nodeid.rsplit("/", 1)[-1]
        if any(name.endswith(e) for e in ERRORS):
            return 0
        return {{"test_groups.py::test_groups_before": 1,
                 "test_groups.py::test_groups_after": 3}}.get(name, 2)

    items.sort(key=rank)
'''


@pytest.mark.slow
def test_megatron_matrix_as_found(pytester: pytest.Pytester) -> None:
    groups_dir = pytester.path / "groups"
    pytester.makepyfile(test_groups=GROUPS_TEST.format(out=str(groups_dir)))
    pytester.makeconftest(ORDER_CONFTEST.format(errors=sorted(OPTIM_ERROR)))
    result, doc = run_report(pytester, "test_groups.py", "--moe-ep-matrix=1,2,4",
                             f"--moe-ep-adapter={ADAPTER}",
                             "-k", f"({SUBSET}) or test_groups", *expectations_args("megatron"))
    cells, statuses, na = by_status(doc)
    assert doc["adapter"] == {"name": "megatron", "version": "0.16.0"}
    # the re-keyed and refused optimizer cells are in ci/expectations/megatron.toml
    assert_as_expected(result, doc)
    result.assert_outcomes(passed=2 + len(MODEL) + len(OPTIM_PASS) + len(LEGACY),
                           xfailed=len(OPTIM_ERROR) + len(OPTIM_FAIL),
                           skipped=sum(NOT_APPLICABLE.values()))
    assert {cells[i]["finding"] for i in OPTIM_FAIL} == {"on-disk"}

    passing = MODEL | OPTIM_PASS | LEGACY
    assert statuses.get("pass", set()) == passing, {i: cells[i]["detail"]
                                                    for i in passing ^ statuses["pass"]}
    assert statuses.get("stopped", set()) == set(OPTIM_ERROR)
    assert statuses.get("fail", set()) == OPTIM_FAIL
    assert na == NOT_APPLICABLE
    for cell_id in OPTIM_FAIL:  # Megatron's ChainedOptimizer at ep > 1 renames every optimizer key
        detail = cells[cell_id]["detail"]
        assert re.match(r"\[checkpoint\] checkpoint: layer 0, key "
                        r"'chained_\d\.optimizer\.state\.exp_avg\..*': "
                        r"re-keyed: holds the ep=1 checkpoint's 'optimizer\.state\.exp_avg\.",
                        detail.split(": ", 1)[-1]), detail
        assert "first difference" not in detail, detail  # every value came back
    for cell_id in MODEL | OPTIM_PASS:
        assert BIT_FOR_BIT in cells[cell_id]["detail"], cells[cell_id]
    # Megatron's forward runs where its experts are SequentialMLP
    for cell_id in MODEL | OPTIM_PASS | OPTIM_FAIL:
        if cell_id.split("::")[2].split("->")[-1] == "unpacked":
            assert "forward" not in cells[cell_id].get("skipped_checks", {}), cells[cell_id]
            assert cell_id in OPTIM_FAIL or "forward)" in cells[cell_id]["detail"], cells[cell_id]
        else:
            assert (cells[cell_id]["skipped_checks"]
                    == {"forward": "the framework's forward cannot run on the ep=1 "
                        f"ground truth: {GROUPED_MLP_NOT_RUN}"}), cells[cell_id]
    for cell_id in LEGACY:
        assert ("refused on every rank: refused by the load: CheckpointingException:"
                in cells[cell_id]["detail"]), \
            cells[cell_id]
        assert "is not a distributed checkpoint" in cells[cell_id]["detail"], cells[cell_id]
    for cell_id, (s, t) in OPTIM_ERROR.items():
        cell, detail = cells[cell_id], cells[cell_id]["detail"]
        assert (cell["state"], cell["fsdp"], cell["save_ep"],
                cell["load_ep"]) == ("model+optim", False, s, t)
        # The load asks for the optimizer keys of its own EP degree; the save wrote the other
        # degree's. Loading an ep > 1 checkpoint, the headline leads with what the checkpoint itself
        # lacks.
        if t > 1:
            assert ("KeyError: \"chained_0.optimizer.state.exp_avg.layers.0.mlp.router.weight from "
                    "model not in state dict" in detail), detail
        else:
            assert ("raised LoadFailed: the checkpoint differs from an EP-invariant one: "
                    in detail), detail

    records = {path.stem: json.loads(path.read_text()) for path in groups_dir.glob("*.json")}
    assert sorted(records) == sorted(f"{phase}-rank{r}" for phase in ("before", "after")
                                     for r in range(4))
    for r in range(4):
        before, after = records[f"before-rank{r}"], records[f"after-rank{r}"]
        assert before["pid"] == after["pid"], (f"rank {r}: the world was replaced between the "
                                               "group counts")
        assert after["groups"] == before["groups"], (f"rank {r}: process groups left behind: "
                                                     f"{after} vs {before}")
        assert not after["megatron"], f"rank {r}: Megatron's parallel state is still initialised"



@pytest.mark.slow
def test_megatron_cells_saved_at_ep2_as_found(pytester: pytest.Pytester) -> None:
    """A slice of the whole as-found run: saved at ep=2, loaded at ep 1 or 2 -- model cells pass,
    model+optimizer cells fail on the renamed (``chained_N.``) keys or error on the load, legacy
    refused.  ``slow`` since the expert-TP slice below shows the same three outcomes in the
    suite."""
    result, doc = run_report(pytester, "--moe-ep-matrix=1,2,4", f"--moe-ep-adapter={ADAPTER}",
                             "-k", "save_ep2 and not load_ep4", *expectations_args("megatron"))
    assert_as_expected(result, doc)
    cells = assert_slice_as_found(doc, {"pass": MODEL | OPTIM_PASS | LEGACY, "fail": OPTIM_FAIL,
                                        "stopped": set(OPTIM_ERROR)})
    for cell_id, cell in cells.items():
        if cell_id in OPTIM_FAIL:
            assert re.match(r"\[checkpoint\] checkpoint: layer 0, key "
                            r"'chained_\d\.optimizer\.state\..*': re-keyed",
                            cell["detail"].split(": ", 1)[-1]), cell
        elif cell_id in MODEL:
            assert BIT_FOR_BIT in cell["detail"], cell


#: expert tensor parallelism (``expert_tensor_parallel_size``; the full tier's ep2.etp2 layout), a
#: slice as found.
ETP_ID = "moe-ep-matrix::checkpoint::{kind}::{state}::ep-only::{pair}"
ETP_PASS = {ETP_ID.format(kind="unpacked", state="model", pair="ep1->ep2.etp2"),
            ETP_ID.format(kind="packed", state="model", pair="ep2.etp2->ep4")}
ETP_FAIL = {ETP_ID.format(kind="unpacked", state="model+optim", pair="ep2.etp2->ep2c")}
ETP_ERROR = {ETP_ID.format(kind="unpacked", state="model+optim", pair="ep1->ep2.etp2")}
ETP_SLICE = ("not fsdp and E4 and not legacy and not cross and ("
             "(kind_unpacked and not optim and save_ep1 and load_etp2) or "
             "(kind_packed and not optim and save_etp2 and load_ep4) or "
             "(kind_unpacked and optim and save_etp2 and load_ep2 and load_etp1 and "
             "load_consecutive) or (kind_unpacked and optim and save_ep1 and load_etp2))")


def test_megatron_expert_tensor_parallel_cells_as_found(pytester: pytest.Pytester) -> None:
    """Megatron's ``expert_tensor_parallel_size=2`` (ep2.etp2 on 4 ranks) composes on CPU/gloo: each
    expert's ``linear_fc1`` rows (gate and up alike) and ``linear_fc2`` columns split over the
    expert-TP group, compared shard by shard with the ep=1 truth.  The outcomes are the EP ones:
    model cells pass bit for bit into and out of etp, model+optimizer cells between ep > 1 layouts
    (an etp change included) load every value back but fail on the ``chained_N.`` keys, and ep=1 <->
    ep > 1 errors on the same KeyError."""
    result, doc = run_report(pytester, "--moe-ep-matrix=full", f"--moe-ep-adapter={ADAPTER}", "-k",
                             ETP_SLICE, *expectations_args("megatron"))
    # held against ci/expectations/megatron.toml: the session is green
    cells = assert_as_expected(result, doc)
    _, statuses, _ = by_status(doc)
    assert statuses == {"pass": ETP_PASS, "fail": ETP_FAIL, "stopped": ETP_ERROR}, \
        {i: c["detail"][:300] for i, c in cells.items()}
    # every value came back; the keys are re-keyed
    assert {cells[i]["finding"] for i in ETP_FAIL} == {"on-disk"}
    assert {cells[i]["finding"] for i in ETP_ERROR} == {"refused"}
    for cell_id in ETP_PASS:
        assert BIT_FOR_BIT in cells[cell_id]["detail"], cells[cell_id]
    for cell_id in ETP_FAIL:
        detail = cells[cell_id]["detail"]
        assert re.match(r"\[checkpoint\] checkpoint: layer 0, key "
                        r"'chained_\d\.optimizer\.state\..*': re-keyed",
                        detail.split(": ", 1)[-1]), detail
        # every value came back, etp shards included
        assert "first difference" not in detail, detail
    for cell_id in ETP_ERROR:
        assert ("KeyError: \"chained_0.optimizer.state.exp_avg.layers.0.mlp.router.weight from "
                "model not in state dict" in cells[cell_id]["detail"]), cells[cell_id]


SEEDED_ETP = '''
import torch

from conformance.adapters.megatron import MegatronAdapter


class GluHalvesSwappedAtLoad(MegatronAdapter):
    """Seeded bug: at etp > 1 each rank's linear_fc1 shard comes back with its gate and up rows
    swapped."""

    def load(self, model, optimizer, path):
        super().load(model, optimizer, path)
        if model.etp_mesh is not None:
            with torch.no_grad():
                for moe in model.moe_layers():
                    for expert in moe.experts.local_experts:
                        w = expert.linear_fc1.weight
                        w.copy_(torch.cat(w.chunk(2, 0)[::-1]))
'''


@pytest.mark.slow
def test_megatron_expert_tp_shards_are_compared_shard_by_shard(pytester: pytest.Pytester) -> None:
    """The negative control of the etp views: a rank's SwiGLU gate and up shards swapped after an
    ep2.etp2 load are named by ``values`` (each shard holds the other projection's rows)."""
    pytester.makepyfile(seeded_etp=SEEDED_ETP)
    _, doc = run_report(pytester, "--moe-ep-matrix=full",
                        "--moe-ep-adapter=seeded_etp:GluHalvesSwappedAtLoad", "-k", "kind_unpacked "
                        "and not cross and not optim and not fsdp and E4 and save_ep1 and "
                        "load_etp2")
    cells, statuses, _ = by_status(doc)
    cell_id = ETP_ID.format(kind="unpacked", state="model", pair="ep1->ep2.etp2")
    assert statuses == {"fail": {cell_id}}, statuses
    detail = cells[cell_id]["detail"]
    assert "tensor 'linear_fc1.gate'" in detail and "linear_fc1.up" in detail, detail


def _live_groups() -> set[object]:
    from torch.distributed.distributed_c10d import _world

    return set(_world.pg_map)


@pytest.mark.moe_ep_world(4)
def test_tear_down_destroys_what_megatron_leaves() -> None:
    """The negative control of the group count: Megatron's own tear-down leaves groups; the
    adapter's does not."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from conformance.adapters import megatron_cpu

    start = _live_groups()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2,
                                             create_gloo_process_groups=False)
    parallel_state.destroy_model_parallel()
    leaked = _live_groups() - start
    for group in leaked:  # this rank process serves later tests
        dist.destroy_process_group(group)
    assert leaked, ("destroy_model_parallel() now destroys its groups: the adapter's clean-up may "
                    "be moot")

    megatron_cpu.set_up(2)
    assert parallel_state.model_parallel_is_initialized() and len(_live_groups()) > len(start)
    megatron_cpu.tear_down()
    assert _live_groups() == start and not parallel_state.model_parallel_is_initialized()


def test_cuda_bypasses_are_scoped_to_the_adapters_calls() -> None:
    """Each patch is in place inside the adapter's context only, and restored when the call
    raises."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async, state_dict_saver
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.transformer.moe import grouped_gemm_util

    from conformance.adapters.megatron_cpu import megatron_on_cpu

    watched = [(filesystem_async, "torch"), (state_dict_saver, "torch"),
               (megatron_optimizer, "torch"), (filesystem_async, "_results_queue"),
               (grouped_gemm_util, "assert_grouped_gemm_is_available")]
    before = [getattr(module, name) for module, name in watched]
    with pytest.raises(RuntimeError, match="inside"), megatron_on_cpu():
        inside = [getattr(module, name) for module, name in watched]
        assert all(a is not b for a, b in zip(inside, before, strict=True)), inside
        # outside it raises without grouped_gemm
        grouped_gemm_util.assert_grouped_gemm_is_available()
        raise RuntimeError("inside")
    assert all(getattr(module, name) is value
               for (module, name), value in zip(watched, before, strict=True))


def test_ground_truth_is_built_without_parallel_state() -> None:
    """build(spec, None, seed): a one-rank view, no parallel_state; both layer kinds hold the same
    model."""
    import torch
    from megatron.core import parallel_state

    from conformance.adapter import Spec
    from conformance.adapters.megatron import MegatronAdapter

    adapter = MegatronAdapter()
    views = {}
    for kind in ("unpacked", "packed"):
        model, optimizer = adapter.build(Spec(kind=kind, optimizer_steps=2), None, 1234)
        views[kind] = {(layer, g, name): t for source in (adapter.expert_tensors(model, optimizer),
                                                          adapter.other_tensors(model, optimizer))
                       for layer, g, name, t in source}
        assert not parallel_state.model_parallel_is_initialized()
        assert adapter.scalars(model, optimizer) == {"step": [2.0], "lr": [0.01],
                                                     "betas": [(0.9, 0.999)],
                                                     "weight_decay": [0.01], "eps": [1e-08]}
    unpacked, packed = views["unpacked"], views["packed"]
    # per layer: 4 experts x 3 views x (weight, 2 moments), 3 dense weights x 3, the expert bias
    assert set(unpacked) == set(packed) and len(unpacked) == 2 * (4 * 3 * 3 + 3 * 3 + 1)
    assert all(torch.equal(unpacked[key], packed[key]) for key in unpacked)
    assert {g for _, g, _ in unpacked if g is not None} == {0, 1, 2, 3}


def test_the_expert_bias_is_stepped_by_megatrons_update_on_synthetic_loads() -> None:
    """The truth's expert bias after two steps is its synthetic start plus Megatron's rule
    (``bias += rate * sign(mean(load) - load)``) on each step's synthetic load: the adapter's counts
    reach ``_update_router_expert_bias``, and the bias is what ``other_tensors`` yields."""
    import torch

    from conformance import synthetic_load, synthetic_weight
    from conformance.adapter import Spec
    from conformance.adapters.megatron import BIAS_SCALE, BIAS_UPDATE_RATE, MegatronAdapter

    adapter = MegatronAdapter()
    model, optimizer = adapter.build(Spec(kind="unpacked", optimizer_steps=2), None, 1234)
    biases = {layer: t for layer, _, name, t in adapter.other_tensors(model, optimizer)
              if name == "router.expert_bias"}
    routers = [moe.router for moe in model.moe_layers()]
    assert all(biases[layer] is router.expert_bias for layer, router in enumerate(routers))
    for layer, bias in biases.items():
        want = synthetic_weight(1234, layer, None, "router.expert_bias", (4,), scale=BIAS_SCALE)
        for step in range(2):
            load = synthetic_load(1234, step, layer, 4)
            want = want + torch.sign(load.sum() / 4 - load) * BIAS_UPDATE_RATE
        assert bias.dtype == torch.float32 and torch.equal(bias, want), (layer, bias, want)
        assert not model.moe_layers()[layer].router.local_tokens_per_expert.any()  # reset after use


def test_an_expert_bias_left_at_its_pre_load_values_is_named(pytester: pytest.Pytester) -> None:
    """The negative control of the expert bias's views: a load that leaves every router's bias at
    the load side's values fails ``values`` on the bias alone (its pre-load values, on every rank
    and layer), and ``forward``; every other tensor comes back."""
    pytester.makepyfile(seeded_megatron=(Path(__file__).parent / "seeded_megatron.py").read_text())
    _, doc = run_report(pytester, "--moe-ep-matrix=1,2,4",
                        "--moe-ep-adapter=seeded_megatron:ExpertBiasLeftAtLoad",
                        "-k",
                        "kind_unpacked and not cross and not optim and not legacy and not fsdp"
                        " and save_ep2 and load_ep4")
    cells, statuses, _ = by_status(doc)
    cell_id = ID.format(kind="unpacked", state="model", mode="ep-only", pair=pair(2, 4))
    assert statuses == {"fail": {cell_id}}, statuses
    cell = cells[cell_id]
    assert cell["findings"] == ["silent"], cell["detail"][:500]
    assert {p["check"] for p in cell["problems"]} == {"values", "forward"}, cell["problems"]
    values = [p for p in cell["problems"] if p["check"] == "values"]
    assert {(p["rank"], p["layer"], p["tensor"]) for p in values} == {
        (r, i, "router.expert_bias") for r in range(4) for i in range(2)}, values
    assert all("pre-load (seed B) values" in p["text"] for p in values), values


def test_a_swapped_router_after_the_load_is_caught_by_megatrons_forward(
        pytester: pytest.Pytester) -> None:
    """The forward check's negative control on Megatron: experts 0 and 1 swap router rows while a
    loaded model's forward runs (the stored tensors stay right).  Every unpacked model cell of the
    slice fails on ``forward`` alone, naming the layer; the ground truth, never loaded, is
    unswapped."""

    pytester.makepyfile(seeded_forward=(Path(__file__).parent / "seeded_forward.py").read_text())
    _, doc = run_report(pytester, "--moe-ep-matrix=1,2,4",
                        "--moe-ep-adapter=seeded_forward:MegatronSwappedRouter", "-k",
                        "kind_unpacked and not optim and not legacy and not fsdp and load_ep4")
    cells, statuses, _ = by_status(doc)
    assert (statuses.get("fail")
            and set(statuses) == {"fail"}), {i: c["detail"][:300] for i, c in cells.items()}
    for cell in cells.values():
        assert cell["findings"] == ["silent"], cell
        assert re.search(r"\[forward\] rank \d: .*layers\.\d\.mlp", cell["detail"]), cell["detail"]
        assert "first difference" not in cell["detail"], cell["detail"]

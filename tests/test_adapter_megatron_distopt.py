"""The ``megatron-distopt*`` adapters: Megatron's DDP + DistributedOptimizer in bf16, one per
format, as found.

Skipped unless megatron-core is installed.  Each test runs a ``-k`` slice of one adapter's matrix in
a pytester subprocess, held against its expectations file
(``ci/expectations/megatron-distopt*.toml``, written from the full tier), and asserts what the slice
shows (docs/frameworks/megatron.md, "The distributed optimizer"):

* model cells pass bit for bit at every EP layout, Megatron's bf16 forward included (held to bf16's
  precision);
* every format, after any load, leaves the optimizer's Adam step wrong (torch's AdamW path,
  megatron-core without Transformer Engine or Apex): ``DistributedOptimizer.load_state_dict`` gives
  every parameter's state one shared ``step`` tensor, which AdamW then advances once per parameter;
  ``dp_reshardable`` also keeps the loading run's own step;
* ``dp_reshardable`` (Megatron-LM's default) saves the optimizer in data-parallel buffer space: its
  checkpoint is not EP-invariant, an EP change that keeps the optimizer count loads the flat buffers
  into other parameters silently (ep2.etp2 -> ep4), one that changes it (ep=1 <-> ep > 1) is
  refused;
* ``fully_reshardable``'s checkpoint is EP-invariant and every value loads back between ep > 1
  layouts; ep=1 <-> ep > 1 is refused on the chained optimizer's structure;
* ``fully_sharded_model_space`` (the method's own default) cannot save in 0.16.0;
* ``dp_zero_gather_scatter`` has ``dp_reshardable``'s outcomes but keeps the checkpoint's step;
* the seeded bug (``seeded_megatron.MainWeightMisfiledOnSave``: two experts' fp32 main weights trade
  places on save and load) is named by ``checkpoint`` and, after an EP change, by ``values``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from matrix_expectations import (
    BIT_FOR_BIT,
    assert_as_expected,
    by_status,
    expectations_args,
    run_report,
)

if (importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None):
    pytest.skip("megatron-core is not installed (ci/install_megatron.sh installs "
                "megatron-core==0.16.0)", allow_module_level=True)

ID = "moe-ep-matrix::checkpoint::unpacked::{state}::ep-only::{pair}"
MODEL_EP2C_EP4 = ID.format(state="model", pair="ep2c->ep4")
OPTIM_EP1_EP1 = ID.format(state="model+optim", pair="ep1->ep1")
OPTIM_EP1_EP2C = ID.format(state="model+optim", pair="ep1->ep2c")
OPTIM_ETP2_EP4 = ID.format(state="model+optim", pair="ep2.etp2->ep4")
OPTIM_EP2C_EP4 = ID.format(state="model+optim", pair="ep2c->ep4")
UNPACKED_E4 = "kind_unpacked and not cross and not fsdp and not legacy and E4"
SLICE_DP_RESHARDABLE = (f"{UNPACKED_E4} and ((not optim and save_ep2 and save_consecutive and "
                        "load_ep4) or (optim and save_ep1 and load_ep1) or (optim and save_ep1 and "
                        "load_ep2 and load_consecutive and load_etp1) or (optim and save_etp2 and "
                        "load_ep4))")
SLICE_FULLY_RESHARDABLE = (f"{UNPACKED_E4} and optim and ((save_ep1 and load_ep2 and "
                           "load_consecutive and load_etp1) "
                           "or (save_ep2 and save_consecutive and save_etp1 and load_ep4))")


def _problems(cell: dict, check: str) -> list[str]:
    return [p["text"] for p in cell.get("problems", []) if p["check"] == check]


def test_megatron_distopt_dp_reshardable_as_found(pytester: pytest.Pytester) -> None:
    """``megatron-distopt`` (``dp_reshardable``, Megatron-LM's default): a model cell passes with
    Megatron's bf16 forward; the optimizer cells are silent at the same layout (the step), silent
    after ep2.etp2 -> ep4 (the flat buffers land on other parameters) and refused at ep=1 ->
    ep=2."""
    result, doc = run_report(pytester, "--moe-ep-matrix=full", "--moe-ep-adapter=megatron-distopt",
                             "-k", SLICE_DP_RESHARDABLE, *expectations_args("megatron-distopt"))
    cells = assert_as_expected(result, doc)
    assert doc["adapter"] == {"name": "megatron-distopt", "version": "0.16.0"}
    _, statuses, _ = by_status(doc)
    assert statuses == {"pass": {MODEL_EP2C_EP4}, "fail": {OPTIM_EP1_EP1, OPTIM_ETP2_EP4},
                        "stopped": {OPTIM_EP1_EP2C}}, {i: c["detail"][:300]
                                                       for i, c in cells.items()}
    model = cells[MODEL_EP2C_EP4]
    assert (BIT_FOR_BIT in model["detail"]
            and "forward" not in model.get("skipped_checks", {})), model

    same = cells[OPTIM_EP1_EP1]  # nothing moved: every value loads back, the step does not
    assert same["findings"] == ["silent"] and not _problems(same, "values"), same["detail"][:500]
    assert ("rank 0: optimizer scalar 'step' = [3.0] after the load, expected [2.0]"
            in _problems(same, "scalars"))

    # the same optimizer count, another buffer layout: loaded into other parameters
    moved = cells[OPTIM_ETP2_EP4]
    assert "silent" in moved["findings"], moved["detail"][:500]
    assert any("tensor 'linear_fc1.gate.exp_avg': values differ from what the checkpoint holds"
               in text for text in _problems(moved, "values")), moved["detail"][:500]
    assert any("key 'optimizer.distributed.dp_group_idx_" in text
               for text in _problems(moved, "checkpoint"))

    refused = cells[OPTIM_EP1_EP2C]
    assert refused["findings"] == ["refused"], refused["detail"][:500]
    assert ("KeyError: \"chained_0.optimizer.distributed.dp_group_idx_0.gbuf_idx_0."
            in refused["detail"]), refused


@pytest.mark.slow
def test_megatron_distopt_fully_reshardable_as_found(pytester: pytest.Pytester) -> None:
    """``fully_reshardable``: the checkpoint is EP-invariant and ep2c -> ep4 loads every value back
    -- only the shared step is wrong after the load; ep=1 -> ep=2 is refused on the chained
    optimizer's structure.  ``slow``: the seeded bug's test below runs this format in the suite."""
    result, doc = run_report(pytester, "--moe-ep-matrix=full",
                             "--moe-ep-adapter=megatron-distopt-fully_reshardable",
                             "-k", SLICE_FULLY_RESHARDABLE,
                             *expectations_args("megatron-distopt-fully_reshardable"))
    cells = assert_as_expected(result, doc)
    _, statuses, _ = by_status(doc)
    assert statuses == {"fail": {OPTIM_EP2C_EP4}, "stopped": {OPTIM_EP1_EP2C}}, \
        {i: c["detail"][:300] for i, c in cells.items()}
    moved = cells[OPTIM_EP2C_EP4]
    assert moved["findings"] == ["silent"], moved["detail"][:500]
    assert (not _problems(moved, "checkpoint") and not _problems(moved, "values")
            and not _problems(moved, "scalars"))
    steps = [text for text in _problems(moved, "resume") if "optimizer scalar 'step'" in text]
    assert steps and all(text.endswith("after one more step, expected [3.0]")
                         for text in steps), steps
    assert ("Expected 2 entries in state dict, but got 4"
            in cells[OPTIM_EP1_EP2C]["detail"]), cells[OPTIM_EP1_EP2C]


@pytest.mark.slow
def test_megatron_distopt_dp_zero_gather_scatter_as_found(pytester: pytest.Pytester) -> None:
    """``dp_zero_gather_scatter``: ``dp_reshardable``'s outcomes on the same slice -- silent at ep=1
    -> 1 (the shared step; its own step comes back), silent after ep2.etp2 -> ep4 (another layout's
    buffers), refused at ep=1 -> ep=2.  ``slow``: the dp_reshardable slice shows the same in the
    suite."""
    result, doc = run_report(pytester, "--moe-ep-matrix=full",
                             "--moe-ep-adapter=megatron-distopt-dp_zero_gather_scatter", "-k",
                             SLICE_DP_RESHARDABLE,
                             *expectations_args("megatron-distopt-dp_zero_gather_scatter"))
    cells = assert_as_expected(result, doc)
    _, statuses, _ = by_status(doc)
    assert statuses == {"pass": {MODEL_EP2C_EP4}, "fail": {OPTIM_EP1_EP1, OPTIM_ETP2_EP4},
                        "stopped": {OPTIM_EP1_EP2C}}, {i: c["detail"][:300]
                                                       for i, c in cells.items()}
    assert not _problems(cells[OPTIM_EP1_EP1], "scalars"), cells[OPTIM_EP1_EP1]["detail"][:500]
    assert any("values differ from what the checkpoint holds" in text
               for text in _problems(cells[OPTIM_ETP2_EP4],
                                     "values")), cells[OPTIM_ETP2_EP4]["detail"][:500]
    assert cells[OPTIM_EP1_EP2C]["findings"] == ["refused"], cells[OPTIM_EP1_EP2C]["detail"][:500]


@pytest.mark.slow
def test_megatron_distopt_fully_sharded_model_space_cannot_save(pytester: pytest.Pytester) -> None:
    """The format ``DistributedOptimizer.sharded_state_dict`` picks without metadata: refused at the
    save.  ``slow`` (14 s): every optimizer cell of its full tier is this one refusal, held by its
    expectations file."""
    result, doc = run_report(pytester, "--moe-ep-matrix=full",
                             "--moe-ep-adapter=megatron-distopt-fully_sharded_model_space",
                             "-k", f"{UNPACKED_E4} and optim and save_ep1 and load_ep1",
                             *expectations_args("megatron-distopt-fully_sharded_model_space"))
    cells = assert_as_expected(result, doc)
    (cell,) = cells.values()
    assert cell["findings"] == ["refused"], cell
    assert (_problems(cell, "save")
            and "ShardedTensor.flattened_range is not supported." in cell["detail"]), cell


def test_an_experts_fp32_main_weight_misfiled_on_save_is_named(pytester: pytest.Pytester) -> None:
    """The negative control of the main weights: layer 0's experts 0 and 1 trade fp32 main
    ``linear_fc2`` weights in every save and load (bf16 weights and moments right).  At ep=1 it
    round-trips and ``checkpoint`` names it; after ep2c -> ep4 (the save misfiled, the load not)
    ``values`` names the expert holding the other's main weight."""
    pytester.makepyfile(seeded_megatron=(Path(__file__).parent / "seeded_megatron.py").read_text())
    _, doc = run_report(pytester, "--moe-ep-matrix=full",
                        "--moe-ep-adapter=seeded_megatron:MainWeightMisfiledOnSave", "-k",
                        f"{UNPACKED_E4} and optim and ((save_ep1 and load_ep1) or (save_ep2 and "
                        "save_consecutive and save_etp1 and load_ep4))")
    cells, _, _ = by_status(doc)
    assert set(cells) == {OPTIM_EP1_EP1, OPTIM_EP2C_EP4}, set(cells)
    key = "key 'optimizer.state.param.layers.0.mlp.experts.experts.linear_fc2.weight'"
    for cell in cells.values():
        assert "on-disk" in cell["findings"], cell["detail"][:500]
        assert (f"the ep=1 checkpoint: layer 0, {key}, expert 0: row 0: holds the model's "
                "'linear_fc2.master' of layer 0, expert 1, not expert "
                "0's") in "\n".join(_problems(cell, "checkpoint")), cell["detail"][:800]
    assert not _problems(cells[OPTIM_EP1_EP1], "values")  # its own mistake read back
    assert ("rank 0, layer 0, expert 0, tensor 'linear_fc2.master': holds expert 1's values "
            "instead of expert 0's" in _problems(cells[OPTIM_EP2C_EP4], "values"))


def test_patches_of_a_class_attribute_restore_the_inherited_one() -> None:
    """``Tensor.cuda`` is patched on the class for the distributed optimizer's save: afterwards the
    class holds no attribute of its own again (torch's inherited method is the one found), also
    after a raise."""
    import torch

    from conformance.adapters.megatron_cpu import _patched

    assert "cuda" not in vars(torch.Tensor)
    with pytest.raises(RuntimeError,
                       match="inside"), _patched([(torch.Tensor, "cuda", lambda self: self)]):
        assert torch.zeros(1).cuda().device.type == "cpu"
        raise RuntimeError("inside")
    assert "cuda" not in vars(torch.Tensor)


def test_parameters_report_a_cuda_type_only_while_the_optimizer_is_built() -> None:
    import torch

    from conformance.adapters.megatron_distopt import _bf16_as_cuda

    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    with _bf16_as_cuda([p]):
        assert (p.type() == "torch.cuda.BFloat16Tensor"
                and p.type(torch.float32).dtype == torch.float32)
    assert p.type() == "torch.BFloat16Tensor" and "type" not in vars(p)

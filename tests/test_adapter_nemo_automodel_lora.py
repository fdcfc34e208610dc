"""NeMo Automodel 0.7.0's own LoRA on experts through the matrix's fine-tuning cells, as found.

The ``nemo_automodel`` adapter applies NeMo's ``apply_lora_to_linear_modules`` (routed
``GroupedExpertsLoRA``, shared-expert ``LinearLoRA``) before EP and FSDP, as NeMo's infrastructure
does, with every adapter drawn from the seed by global expert id.  The default tier's three
``lora`` cells (E=5 ep1 -> ep2c, FSDP2 ep2c -> ep1, model+optim ep4 -> ep4) are all silent, for one
reason: NeMo's load leaves every routed expert's adapters at the load side's own values on every
rank and layer, because ``_recombine_lora_expert_keys`` (``moe/state_dict_mixin.py:690``) only
recombines the per-expert HF LoRA keys into the packed ``lora_*`` parameters when the rank's state
dict holds all ``n_routed_experts`` experts -- under EP or FSDP a rank holds fewer, and the keys are
dropped.  Everything else loads: the frozen base, the shared expert's adapters, the adapters' Adam
moments (``save_optimizer`` does not go through the HF conversion); the checkpoint itself holds
every adapter under its global expert id.  ``lora+mxfp4`` and ``lora+fp8`` are n/a
(docs/frameworks/nemo_automodel.md, "LoRA experts").

The run takes about 20 s on 2 cores.  Not held against ``ci/expectations/nemo_automodel.toml``: the
red cells are asserted here, finding and first line, cell by cell.
"""

from __future__ import annotations

import pytest
from matrix_expectations import by_status
from matrix_expectations import run_report as run

pytest.importorskip("nemo_automodel.components.moe.state_dict_utils",
                    reason="nemo_automodel is not installed (ci/install_nemo_automodel.sh installs "
                           "nemo-automodel==0.7.0)")

LORA = "moe-ep-matrix::checkpoint::packed::lora::"
#: the default tier's LoRA cells for nemo_automodel -> (E, saved at, loaded at), as found: silent.
SILENT = {
    f"{LORA}model::ep-only::E5::ep1->ep2c": (5, "ep=1", "ep=2 (consecutive EP groups)"),
    f"{LORA}model::fsdp::ep2c->ep1": (4, "ep=2 (consecutive EP groups)", "ep=1"),
    f"{LORA}model+optim::ep-only::ep4->ep4": (4, "ep=4", "ep=4"),
}
NOT_APPLICABLE = {
    "moe-ep-matrix::checkpoint::packed::lora+fp8::model::ep-only::ep1->ep1":
        "adapter fine-tunes with lora, not lora+fp8",
    "moe-ep-matrix::checkpoint::packed::lora+mxfp4::model::ep-only::ep1->ep1":
        "adapter fine-tunes with lora, not lora+mxfp4",
}
#: the views of the routed experts' packed adapters: the tensors NeMo's load does not write.
ROUTED_ADAPTERS = {"gate_up.lora_A", "gate.lora_B", "up.lora_B", "down.lora_A", "down.lora_B"}
FIRST_LINE = ("silent: first difference: rank 0, layer 0, expert 0, tensor 'down.lora_A': still "
              "holds its pre-load (seed B) values: the load did not write it (E={e}, saved at {s}")


def test_nemo_lora_routed_adapters_are_not_loaded_under_ep_or_fsdp(
        pytester: pytest.Pytester) -> None:
    """Every LoRA cell of the default tier is silent, and only on the routed experts' adapters:
    ``values`` names each of them on every rank and layer (``resume`` too where the optimizer is
    saved, beside NeMo's known expert-bias finding); the base, the shared expert's adapters and the
    adapters' moments load right, and the checkpoint check passes."""
    result, doc = run(pytester, "--moe-ep-matrix", "--moe-ep-adapter=nemo_automodel", "-k", "lora")
    cells, statuses, _ = by_status(doc)
    assert statuses == {"fail": set(SILENT), "n/a": set(NOT_APPLICABLE)}, statuses
    assert {i: cells[i]["detail"] for i in NOT_APPLICABLE} == NOT_APPLICABLE
    result.assert_outcomes(failed=3, skipped=2)
    for cell_id, (experts, saved, loaded) in SILENT.items():
        cell = cells[cell_id]
        assert cell["findings"] == ["silent"], cell["detail"][:500]
        first = cell["detail"].splitlines()[0]
        assert first.startswith(FIRST_LINE.format(e=experts, s=saved)), first
        assert f"loaded at {loaded}" in first, first
        assert {"checkpoint", "missing"} <= set(cell["checks_passed"]), cell["checks_passed"]
        values = {(p["rank"], p["layer"], p["tensor"]) for p in cell["problems"]
                  if p["check"] == "values"}
        assert values == {(r, i, t) for r in range(4) for i in range(2)
                          for t in ROUTED_ADAPTERS}, sorted(values)
        resumed = {p["tensor"] for p in cell["problems"] if p["check"] == "resume"}
        optim = "model+optim" in cell_id
        assert resumed == (ROUTED_ADAPTERS | {"mlp.gate.e_score_correction_bias"}
                           if optim else set()), resumed
        assert ("scalars" in cell["checks_passed"]) == optim, cell["checks_passed"]
        assert {p["check"] for p in cell["problems"]} <= {"values", "resume", "forward"}
        # E=5 at ep=2: NeMo's forward asserts E % ep == 0 (the plain cells' n/a)
        forward = cell["skipped_checks"].get("forward", "")
        assert ("cannot run E=5 experts at ep=2" in forward) == (experts == 5), forward


def test_nemo_lora_drops_a_partial_ranks_adapter_keys() -> None:
    """The cause, in one process: NeMo's DeepSeek-V3 state-dict adapter turns the per-expert HF LoRA
    keys back into the packed ``lora_*`` parameters when all experts are there, and leaves them
    per-expert -- keys no parameter has -- when the state dict holds one expert, as a rank under
    EP does.  And each adapter view is the tensor NeMo writes under its per-expert key."""
    import torch

    from conformance.adapter import Spec
    from conformance.adapters.nemo_automodel import NemoAutomodelAdapter

    adapter = NemoAutomodelAdapter()
    model, _ = adapter.build(Spec(kind="packed", finetune="lora"), None, 1234)
    to_hf = model.state_dict_adapter
    hf = to_hf.to_hf(model.state_dict())
    lora = {k: v for k, v in hf.items() if ".experts." in k and "lora" in k}
    packed = {k for k in to_hf._recombine_lora_expert_keys(dict(lora)) if "layers.0." in k}
    assert packed == {f"model.layers.0.mlp.experts.lora_{n}" for n in
                      ("gate_and_up_A", "gate_and_up_B", "down_A", "down_B")}, packed
    one = {k: v for k, v in lora.items() if ".experts.2." in k}
    assert to_hf._recombine_lora_expert_keys(dict(one)).keys() == one.keys()

    views = {(e.layer, e.name): e.tensor for e in adapter.expert_tensors(model, None)}
    for (layer, name), block in views.items():
        if "lora" not in name:
            continue
        linear, _, factor = name.partition(".")
        for g in range(4):
            projs = ("gate", "up") if linear == "gate_up" else (linear,)
            for proj in projs:
                key = f"model.layers.{layer}.mlp.experts.{g}.{proj}_proj.{factor}.weight"
                assert torch.equal(block[g], hf[key]), key

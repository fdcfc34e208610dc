"""LoRA on the reference's experts (reference_impl.lora, reference_impl.peft_export): the adapters
each kind holds, a zero B that changes nothing, merge equal to the forward, a frozen base, adapters
following their global expert at every layout (and split on the hidden axis under expert TP), and
the adapter export PEFT's own loader reads.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from conformance.layout import ParallelLayout
from reference_impl.hf import (
    HF_CLASS,
    hf_config,
    read_safetensors,
    to_hf,
    write_safetensors,
    write_safetensors_file,
)
from reference_impl.layout import expert_range
from reference_impl.lora import (
    adapter_factors,
    apply_lora,
    keep_expert_rows,
    merge,
    merged_experts,
    quantize_experts,
)
from reference_impl.model import fused_half
from reference_impl.moe import MoEConfig, MoEModel, apply_expert_parallel, build_model
from reference_impl.peft_export import ADAPTER_CONFIG, ADAPTER_FILE, export_peft, peft_state
from reference_impl.regions import local_region

KINDS = ["packed", "unpacked", "fused"]


def _config(kind: str, **kw: Any) -> MoEConfig:
    fields: dict[str, Any] = {"kind": kind, "num_experts": 5, "dim": 16, "hidden": 24,
                              "top_k": 2, **kw}
    return MoEConfig(**fields)


def _batch(dim: int = 16, tokens: int = 9) -> torch.Tensor:
    return torch.randn(tokens, dim, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_holds_its_adapters(kind: str) -> None:
    """Packed and fused layers hold NeMo's GroupedExpertsLoRA names and orientation (A [E, in, r],
    B [E, r, out]); unpacked experts and the shared expert PEFT's per-module lora_A/lora_B."""
    model = apply_lora(build_model(_config(kind), 1), 4, 8.0)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if ".lora_" in f".{k}"}
    shared = {f"layers.0.moe.shared.{n}.lora_{f}.weight": s
              for n, a, b in (("gate", 16, 24), ("up", 16, 24), ("down", 24, 16))
              for f, s in (("A", (4, a)), ("B", (b, 4)))}
    if kind == "packed":
        routed = {"layers.0.moe.lora_gate_A": (5, 16, 4), "layers.0.moe.lora_gate_B": (5, 4, 24),
                  "layers.0.moe.lora_up_A": (5, 16, 4), "layers.0.moe.lora_up_B": (5, 4, 24),
                  "layers.0.moe.lora_down_A": (5, 24, 4), "layers.0.moe.lora_down_B": (5, 4, 16)}
    elif kind == "fused":
        routed = {"layers.0.moe.lora_gate_and_up_A": (5, 16, 4),
                  "layers.0.moe.lora_gate_and_up_B": (5, 4, 48),
                  "layers.0.moe.lora_down_A": (5, 24, 4), "layers.0.moe.lora_down_B": (5, 4, 16)}
    else:
        routed = {f"layers.0.moe.experts.{g}.{k[len('layers.0.moe.shared.'):]}": s
                  for g in range(5) for k, s in shared.items()}
    assert shapes == {**routed, **shared}
    assert "layers.0.moe.router.weight" in model.state_dict()  # the base keeps its keys


@pytest.mark.parametrize("quant", [None, "mxfp4", "fp8"])
@pytest.mark.parametrize("kind", KINDS)
def test_zero_b_changes_nothing_and_merge_is_the_forward(kind: str, quant: str | None) -> None:
    if kind == "fused" and quant == "fp8":
        return
    config = _config(kind)
    x = _batch()
    base = build_model(config, 1, seed=1)
    if quant:
        quantize_experts(base, quant, 8)
    before = base(x)
    assert torch.equal(apply_lora(base, 4, 8.0)(x), before)  # PEFT's start: B = 0
    model = build_model(config, 1, seed=1)
    if quant:
        quantize_experts(model, quant, 8)
    apply_lora(model, 4, 8.0, b_init="synthetic", seed=2)
    out = model(x)
    assert not torch.allclose(out, before, atol=1e-5)
    plain = build_model(config, 1, seed=9)
    plain.load_state_dict(merge(model))
    assert torch.equal(plain(x), out)


def test_merge_is_base_plus_alpha_over_r_b_a() -> None:
    model = apply_lora(build_model(_config("packed"), 1, seed=1), 4, 6.0, b_init="synthetic")
    plain = build_model(_config("packed"), 1, seed=1).layers[0].moe
    moe = model.layers[0].moe
    merged = {(g, linear): w for _, g, linear, w in merged_experts(model)}
    for g in range(5):
        want = plain.up_w[g] + 1.5 * (moe.lora_up_B[g].mT @ moe.lora_up_A[g].mT)
        torch.testing.assert_close(merged[(g, "up")], want, rtol=0, atol=1e-7)
    shared = plain.shared.down.weight + 1.5 * (moe.shared.down.lora_B.weight
                                               @ moe.shared.down.lora_A.weight)
    torch.testing.assert_close(merged[(None, "down")], shared, rtol=0, atol=1e-7)


@pytest.mark.parametrize("quant", [None, "mxfp4"])
@pytest.mark.parametrize("kind", KINDS)
def test_only_the_adapters_train(kind: str, quant: str | None) -> None:
    model = build_model(_config(kind), 2)
    if quant:
        quantize_experts(model, quant, 8)
    apply_lora(model, 4, 8.0, b_init="synthetic")
    model(_batch()).square().sum().backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert trained and all(".lora_" in f".{n}" for n in trained), trained
    assert frozen and not any(".lora_" in f".{n}" for n in frozen)
    assert "layers.0.moe.router.weight" in frozen and "layers.1.moe.shared.up.weight" in frozen
    assert not any(b.requires_grad for b in model.buffers())


def test_an_expert_gets_the_same_adapter_in_every_kind_and_slice() -> None:
    """Adapters are drawn per (seed, layer, global expert) in PEFT's orientation: packed and
    unpacked experts get the same deltas, and an EP slice (keep_expert_rows, or apply_lora on
    the slice) holds the whole model's rows."""
    packed = apply_lora(build_model(_config("packed"), 1), 4, 8.0, b_init="synthetic")
    unpacked = apply_lora(build_model(_config("unpacked"), 1), 4, 8.0, b_init="synthetic")
    a = {(g, n): w for _, g, n, w in merged_experts(packed)}
    b = {(g, n): w for _, g, n, w in merged_experts(unpacked)}
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-8, msg=str(key))
    moe = packed.layers[0].moe
    whole = {n: t.detach().clone() for n, t in moe.named_parameters(recurse=False)}
    keep_expert_rows(moe, 3, 5)
    for name, t in moe.named_parameters(recurse=False):
        if name != "router.weight":
            assert torch.equal(t, whole[name][3:5]), name
            assert t.requires_grad == name.startswith("lora_"), name
    sliced = build_model(_config("packed"), 1)
    smoe = sliced.layers[0].moe
    keep_expert_rows(smoe, 3, 5)
    smoe.local_expert_start, smoe.num_local_experts = 3, 2
    apply_lora(sliced, 4, 8.0, b_init="synthetic")
    for name, t in smoe.named_parameters(recurse=False):
        assert torch.equal(t, getattr(moe, name)), name


def test_apply_lora_refuses_twice_and_bad_arguments() -> None:
    model = apply_lora(build_model(_config("packed"), 1), 2, 4.0)
    with pytest.raises(ValueError, match="already holds LoRA"):
        apply_lora(model, 2, 4.0)
    with pytest.raises(ValueError, match="r >= 1"):
        apply_lora(build_model(_config("packed"), 1), 0, 4.0)


@pytest.mark.parametrize("kind", KINDS)
def test_the_peft_export_orders_a_expert_major_and_b_rank_major(kind: str, tmp_path: Any
                                                                ) -> None:
    model = apply_lora(build_model(_config(kind, fused_order="interleaved"), 1), 2, 4.0,
                       b_init="synthetic")
    export_peft(model, tmp_path)
    tensors = read_safetensors(tmp_path)
    assert (tmp_path / ADAPTER_FILE).exists()
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert config["target_parameters"][:2] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config["r"] == 2 and config["lora_alpha"] == 4.0
    rank = 2 if kind == "fused" else 4  # separate gate and up: one block-diagonal adapter of 2r
    assert config["rank_pattern"] == ({} if kind == "fused" else
                                      {"mlp.experts.gate_up_proj": 4})
    prefix = "base_model.model.model.layers.0.mlp.experts"
    a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]  # down_proj
    assert a.shape == (5 * 2, 24) and b.shape == (16, 2 * 5)
    assert tensors[f"{prefix}.base_layer.lora_A.weight"].shape == (5 * rank, 16)
    assert tensors[f"{prefix}.base_layer.lora_B.weight"].shape == (48, rank * 5)
    factors = {(g, n): (fa, fb) for _, g, n, fa, fb in adapter_factors(model)}
    for g in range(5):
        fa, fb = factors[(g, "down")]
        assert torch.equal(a.reshape(5, 2, 24)[g], fa)           # expert-major
        assert torch.equal(b.reshape(16, 2, 5)[:, :, g], fb)     # rank-major
    with pytest.raises(ValueError, match=r"experts \[3, 4\] of 5 are missing"):
        peft_state([f for f in adapter_factors(model) if f[1] is None or f[1] < 3], 5)


def _native_per_expert(model: MoEModel) -> dict[str, torch.Tensor]:
    """A plain model's state with its packed rows as per-expert keys (what reference_impl.hf's
    to_hf reads)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        head, _, last = key.rpartition(".")
        if last in ("gate_w", "up_w", "down_w", "gate_up_w"):
            halves = ([(ln, fused_half(value, model.config.fused_order, i))
                       for i, ln in enumerate(("gate", "up"))] if last == "gate_up_w"
                      else [(last[:-2], value)])
            for linear, rows in halves:
                out.update({f"{head}.experts.{g}.{linear}.weight": rows[g]
                            for g in range(rows.shape[0])})
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("form", ["param_wrapper", "per_expert"])
@pytest.mark.parametrize(("kind", "order"), [("fused", "interleaved"), ("packed", "concatenated"),
                                             ("unpacked", "concatenated")])
def test_peft_reads_the_export_and_computes_the_same_forward(kind: str, order: str, form: str,
                                                             tmp_path: Any) -> None:
    """PEFT 0.21's own loader on transformers' Ernie4_5_Moe: the adapter's forward is the
    reference's, bit for bit; B written expert-major (unsloth #6930's misreading) is not."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    peft = pytest.importorskip("peft", reason="peft (0.21) is not installed")
    transformers = pytest.importorskip("transformers")
    config = _config(kind, fused_order=order, dim=32, hidden=16)
    base = build_model(config, 2, seed=3)
    write_safetensors(to_hf(_native_per_expert(base), config, 2), tmp_path / "base",
                      hf_config(config, 2))
    model = apply_lora(base, 4, 8.0, b_init="synthetic", seed=5)
    export_peft(model, tmp_path / "adapter", form)
    fields = dict(hf_config(config, 2))
    hf_conf = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)

    def hf() -> Any:
        return getattr(transformers, HF_CLASS).from_pretrained(
            tmp_path / "base", config=hf_conf, local_files_only=True,
            generation_config=transformers.GenerationConfig()).eval()

    x = _batch(32, 7)
    with torch.no_grad():
        peft_model = peft.PeftModel.from_pretrained(hf(), tmp_path / "adapter").eval()
        got = peft_model.base_model.model.model(inputs_embeds=x[None]).last_hidden_state[0]
        assert torch.equal(got, model(x))
    if form == "param_wrapper":  # B read expert-major: every expert gets scrambled deltas
        path = tmp_path / "adapter" / ADAPTER_FILE
        tensors = read_safetensors(tmp_path / "adapter")
        key = "base_model.model.model.layers.0.mlp.experts.lora_B.weight"
        tensors[key] = tensors[key].reshape(32, 5, 4).transpose(1, 2).reshape(32, 20)
        write_safetensors_file(tensors, path)
        with torch.no_grad():
            wrong = peft.PeftModel.from_pretrained(hf(), tmp_path / "adapter").eval()
            bad = wrong.base_model.model.model(inputs_embeds=x[None]).last_hidden_state[0]
        assert not torch.allclose(bad, got, atol=1e-6)


# ---------------------------------------------------------------- a 4-rank world

WORLD = 4


@pytest.mark.moe_ep_world(WORLD)
def test_adapters_follow_their_expert_and_the_hidden_split() -> None:
    """ep2.etp2, every kind: each rank's adapters are its experts' rows of the ep=1 ones (B split
    on gate/up's hidden rows, A on down's hidden columns, the other read whole), and the forward
    and every adapter gradient are the ep=1 model's."""
    spec = ParallelLayout.for_world(WORLD, 2, etp=2)
    coords = spec.coordinates(dist.get_rank())
    start, end = expert_range(5, 2, coords["ep"])
    x, weight = _batch(16, 8), torch.randn(8, 16, generator=torch.Generator().manual_seed(4))
    for kind in KINDS:
        config = _config(kind, fused_order="interleaved")
        ref = apply_lora(build_model(config, 1, seed=4), 2, 4.0, b_init="synthetic")
        ref_out = ref(x)
        (ref_out * weight).sum().backward()
        grads = {n: p.grad for n, p in ref.named_parameters()}
        model = apply_lora(build_model(config, 1, seed=4), 2, 4.0, b_init="synthetic")
        apply_expert_parallel(model, spec.build_mesh())
        out = model(x)
        (out * weight).sum().backward()
        where = f"{kind} rank {dist.get_rank()} {coords}"
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, w=where: f"{w}: {m}")
        for name, p in model.named_parameters():
            if ".lora_" not in f".{name}" or ".shared." in name:
                assert ".lora_" not in f".{name}" or p.grad is not None, (where, name)
                continue
            parts = name.split(".")
            if kind == "unpacked":
                parts[4] = str(start + int(parts[4]))
            full_name = ".".join(parts)
            want = grads[full_name]
            rows = want if kind == "unpacked" else want[start:end]
            value, region = local_region(p)
            full = dict(ref.named_parameters())[full_name]
            whole = (full if kind == "unpacked" else full[start:end]).reshape(p.shape)
            mine = region if region is not None else tuple(slice(0, n) for n in p.shape)
            assert torch.equal(value, whole[mine]), f"{where}: {name} values"
            assert p.grad is not None, f"{where}: {name} got no gradient"
            got, _ = local_region(p.grad)
            torch.testing.assert_close(got, rows.reshape(p.shape)[mine], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, w=where: f"{w}: gradient of {n}: {m}")

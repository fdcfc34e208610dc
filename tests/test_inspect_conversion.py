"""``moe-ep-inspect TRAINING --compare EXPORT --values``: a training checkpoint against its Hugging
Face export, expert by expert (:mod:`conformance.inspection.conversion`).

The checkpoints are the reference's own: a DCP save of the model (the packed form for packed and
fused layers, per expert for unpacked ones, optimizer state included) and the export
:func:`reference_impl.hf.export_hf` writes, made here in one process by the same functions
(:func:`~reference_impl.hf.to_hf`, :func:`~reference_impl.hf.write_safetensors`) from the model's
whole state -- no world is needed to read either.  Each seeded corruption edits the export's
safetensors as a broken converter would.  One test has ranks write both (a 4-rank world: EP, expert
TP, FSDP2), as a training run at EP > 1 and its converter do.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from conformance.inspection import read_checkpoint
from conformance.inspection.atoms import role_of
from conformance.inspection.conversion import compare_conversion
from reference_impl import checkpoint, hf
from reference_impl.moe import MoEConfig, build_model
from reference_impl.regions import set_deterministic_grads

LAYERS, E = 2, 4
KINDS = ("packed", "unpacked", "fused")
ROOT = Path(__file__).resolve().parents[1]


def _export(model: Any, config: MoEConfig, path: Path) -> dict[str, torch.Tensor]:
    """What :func:`reference_impl.hf.export_hf` writes, from the model's whole state in this
    process: the model's per-expert state, renamed by :func:`~reference_impl.hf.to_hf`."""
    # the per-expert form of packed and fused layers, as the reference's own save writes it
    native = path.parent / f"{path.name}-native"
    checkpoint.save(model, None, native, per_expert=True)
    whole = {k.removeprefix("model."): v for k, v in hf._whole(str(native)).items()}
    return hf.to_hf(whole, config, LAYERS)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any],
                                                                     dict[str, Any]]]:
    """Per kind: the training checkpoint (DCP, one AdamW step taken), the export's tensors and its
    config."""
    out = {}
    root = tmp_path_factory.mktemp("conversion")
    for kind in KINDS:
        config = MoEConfig(num_experts=E, kind=kind, expert_bias=True)  # type: ignore[arg-type]
        model = build_model(config, LAYERS, seed=1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        set_deterministic_grads(model, 3, 0)
        optimizer.step()
        training = root / f"train-{kind}"
        checkpoint.save(model, optimizer, training)
        out[kind] = (training, _export(model, config, root / f"hf-{kind}"),
                     hf.hf_config(config, LAYERS))
    return out


def export(made: dict[str, Any], kind: str, path: Path,
           edit: Callable[[dict[str, torch.Tensor]], None] | None = None) -> Path:
    tensors = dict(made[kind][1])
    if edit is not None:
        edit(tensors)
    hf.write_safetensors(tensors, path, made[kind][2])
    return path


def compare(made: dict[str, Any], kind: str, path: Path, **kwargs: Any) -> Any:
    return compare_conversion(read_checkpoint(made[kind][0]), read_checkpoint(path), **kwargs)


def codes(report: Any) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for f in report.problems:
        out.setdefault(f.problem, []).append(f)
    return out


# -- the seeded corruptions -----------------------------------------------------------------------
EXPERTS = "model.layers.1.mlp.experts."


def swap_experts(t: dict[str, torch.Tensor]) -> None:
    """Layer 1's experts 0 and 1 filed under each other's ids."""
    if EXPERTS + "gate_up_proj" in t:
        for name in ("gate_up_proj", "down_proj"):
            w = t[EXPERTS + name].clone()
            w[[0, 1]] = w[[1, 0]]
            t[EXPERTS + name] = w
        return
    for name in ("gate_proj", "up_proj", "down_proj"):
        a, b = f"{EXPERTS}0.{name}.weight", f"{EXPERTS}1.{name}.weight"
        t[a], t[b] = t[b], t[a]


def one_rank(t: dict[str, torch.Tensor]) -> None:
    """The export of rank 0's experts only (ep=2): experts 2..3 of every layer left out."""
    for key in list(t):
        if ".mlp.experts." not in key:
            continue
        if key.endswith("_proj"):
            t[key] = t[key][:E // 2].clone()
        elif int(key.split(".")[5]) >= E // 2:
            del t[key]


def transpose_down(t: dict[str, torch.Tensor]) -> None:
    """Every routed expert's down projection written transposed."""
    for key in list(t):
        if ".mlp.experts." in key and "down_proj" in key:
            t[key] = t[key].transpose(-1, -2).contiguous()


def swap_halves(t: dict[str, torch.Tensor]) -> None:
    """The fused gate/up weight written up half first."""
    for key in list(t):
        if key.endswith("gate_up_proj"):
            gate, up = t[key].chunk(2, dim=1)
            t[key] = torch.cat([up, gate], 1)


def shared_as_routed(t: dict[str, torch.Tensor]) -> None:
    """Layer 1's shared expert written in the place of routed expert 0."""
    for name in ("gate_proj", "up_proj", "down_proj"):
        t[f"{EXPERTS}0.{name}.weight"] = t[f"model.layers.1.mlp.shared_experts.{name}.weight"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_faithful_export_is_the_same_and_every_expert_is_compared(
        made: dict[str, Any], kind: str, tmp_path: Path) -> None:
    report = compare(made, kind, export(made, kind, tmp_path / "hf"))
    assert report.problems == [], [str(f) for f in report.problems]
    # every routed expert's gate, up and down (a fused row counts once), and the shared expert
    assert report.atoms == LAYERS * (E * (2 if kind == "fused" else 3) + 3)
    assert report.cast is None
    assert any("self_attn" in n and "only in the export" in n for n in report.notes), report.notes
    assert any("optimizer state" in n for n in report.notes), report.notes
    right = ".mlp.experts.gate_up_proj[e]" if kind == "fused" else ".mlp.experts.*.gate_proj"
    assert any(right in line for line in report.mapping), report.mapping


@pytest.mark.parametrize("kind", KINDS)
def test_two_experts_swapped_are_named_by_expert(made: dict[str, Any], kind: str,
                                                 tmp_path: Path) -> None:
    found = codes(compare(made, kind, export(made, kind, tmp_path / "hf", swap_experts)))
    assert set(found) == {"export_holds_other"}, found
    held = {(f.layer, f.experts, f.message.split(":")[1].strip()) for f in found[
        "export_holds_other"]}
    assert (1, (0,), "holds expert 1's values, not its own (the training checkpoint's") in {
        (a, b, c.split(" '")[0]) for a, b, c in held}, held
    assert {f.layer for f in found["export_holds_other"]} == {1}


@pytest.mark.parametrize("kind", ["packed", "fused"])
def test_one_ranks_experts_only_are_missing_experts(made: dict[str, Any], kind: str,
                                                    tmp_path: Path) -> None:
    found = codes(compare(made, kind, export(made, kind, tmp_path / "hf", one_rank)))
    assert set(found) == {"export_missing"}, found
    assert [(f.layer, f.experts) for f in found["export_missing"]] == [(0, (2, 3)), (1, (2, 3))]
    assert "experts 2..3 missing from the export" in found["export_missing"][0].message


@pytest.mark.parametrize("kind", ["unpacked", "fused"])
def test_a_transposed_down_projection_is_named(made: dict[str, Any], kind: str,
                                               tmp_path: Path) -> None:
    found = codes(compare(made, kind, export(made, kind, tmp_path / "hf", transpose_down)))
    assert set(found) == {"export_transposed"}, found
    assert {(f.layer, f.experts) for f in found["export_transposed"]} == {
        (0, tuple(range(E))), (1, tuple(range(E)))}
    assert all("down_proj" in f.key for f in found["export_transposed"])


def test_fused_halves_swapped_are_named_by_projection(made: dict[str, Any],
                                                      tmp_path: Path) -> None:
    found = codes(compare(made, "fused", export(made, "fused", tmp_path / "hf", swap_halves)))
    assert set(found) == {"export_holds_other"}, found
    texts = {f.message for f in found["export_holds_other"]}
    assert texts == {
        "gate_up_proj (its gate half, concatenated): holds the up projection's values, not its own",
        "gate_up_proj (its up half, concatenated): holds the gate projection's values, not its own",
    }


def test_the_shared_expert_filed_as_a_routed_one(made: dict[str, Any], tmp_path: Path) -> None:
    found = codes(compare(made, "unpacked", export(made, "unpacked", tmp_path / "hf",
                                                   shared_as_routed)))
    # and routed expert 0's own values, which it replaced, are nowhere in the export
    assert set(found) == {"export_holds_other", "export_missing"}, found
    assert all("the shared expert filed as routed expert 0" in f.message
               and (f.layer, f.experts) == (1, (0,)) for f in found["export_holds_other"])
    assert [(f.layer, f.experts) for f in found["export_missing"]] == [(1, (0,))]


@pytest.mark.parametrize("kind", ["packed", "fused"])
def test_a_bf16_export_of_fp32_training_is_clean_after_the_same_cast(
        made: dict[str, Any], kind: str, tmp_path: Path) -> None:
    def bf16(t: dict[str, torch.Tensor]) -> None:
        t.update({k: v.to(torch.bfloat16) for k, v in t.items() if v.is_floating_point()})

    path = export(made, kind, tmp_path / "hf", bf16)
    report = compare(made, kind, path)
    assert report.problems == [], [str(f) for f in report.problems]
    assert report.cast == ("the training checkpoint's float32 values cast to bfloat16, as the "
                           "export holds them")
    # one expert off by more than the cast: named, with how far

    def nudge(t: dict[str, torch.Tensor]) -> None:
        bf16(t)
        if kind == "fused":
            w = t["model.layers.0.mlp.experts.down_proj"].clone()
            w[1] += 0.5
            t["model.layers.0.mlp.experts.down_proj"] = w
        else:
            t["model.layers.0.mlp.experts.1.down_proj.weight"] = t[
                "model.layers.0.mlp.experts.1.down_proj.weight"] + 0.5

    found = codes(compare(made, kind, export(made, kind, tmp_path / "nudged", nudge)))
    assert set(found) == {"export_values_differ"}, found
    assert [(f.layer, f.experts) for f in found["export_values_differ"]] == [(0, (1,))]
    assert "max abs diff 0.5" in found["export_values_differ"][0].message


def test_roles_from_framework_names() -> None:
    assert [role_of(k) for k in (
        "model.layers.0.moe.gate_w", "layers.0.moe.experts.w1", "model.layers.3.mlp.experts.17."
        "down_proj.weight", "model.layers.0.mlp.experts.gate_up_proj", "decoder.layers.0.mlp."
        "experts.linear_fc1.weight0", "layers.1.moe.experts.w3", "model.layers.0.mlp.gate.weight"
    )] == ["gate", "gate", "down", "gate_up", "gate_up", "up", "gate"]


def cli(*args: str) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, "-m", "conformance.inspect", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr


def test_cli_exit_codes_mapping_and_json(made: dict[str, Any], tmp_path: Path) -> None:
    training = str(made["fused"][0])
    good = str(export(made, "fused", tmp_path / "good"))
    bad = str(export(made, "fused", tmp_path / "bad", swap_experts))
    code, out, err = cli(training, "--compare", good, "--values", "-v")
    assert code == 0, out + err
    assert "compared with its Hugging Face export" in out and ": the same" in out
    assert ("model.layers.#.moe.gate_up_w[e] -> model.layers.#.mlp.experts.gate_up_proj[e] "
            "(8 matrices)") in out
    code, out, err = cli(training, "--compare", bad, "--values", "--json")
    assert code == 1, out + err
    report = json.loads(out)
    assert report["exit_code"] == 1 and report["problems"] == 4
    assert {f["problem"] for f in report["compare"]["findings"]} == {"export_holds_other"}
    assert report["compare"]["conversion"]["atoms"] == LAYERS * (2 * E + 3)
    # the export named first and the training checkpoint second: the same comparison
    code, out, err = cli(bad, "--compare", training, "--values")
    assert code == 1 and "compared with the training checkpoint it was exported from" in out
    code, out, err = cli(training, "--compare", str(tmp_path / "nothing"), "--values")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err


def test_every_conversion_problem_code_is_documented() -> None:
    from conformance.inspection import PROBLEMS
    from conformance.inspection.conversion import ORDER

    assert set(ORDER) <= set(PROBLEMS)


def test_transformers_save_pretrained_against_its_training_state(tmp_path: Path) -> None:
    """A real framework's export: transformers' own ``save_pretrained`` (the built-in adapter's
    ``export_hf``) against the model's state saved with DCP -- clean, and with two experts swapped
    in the export named by layer and expert."""
    pytest.importorskip("transformers")
    import torch.distributed.checkpoint as dcp

    from conformance.adapter import Spec
    from conformance.adapters.transformers_ep import TransformersAdapter

    adapter = TransformersAdapter()
    model, _ = adapter.build(Spec(kind="packed", num_experts=E), None, 0)
    dcp.save({k: v.detach() for k, v in model.state_dict().items()},
             checkpoint_id=str(tmp_path / "train"), no_dist=True)
    adapter.export_hf(model, str(tmp_path / "hf"))
    training = read_checkpoint(tmp_path / "train")
    report = compare_conversion(training, read_checkpoint(tmp_path / "hf"))
    assert report.problems == [] and report.atoms, [str(f) for f in report.problems]
    tensors = hf.read_safetensors(tmp_path / "hf")
    swap_experts(tensors)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf.write_safetensors(tensors, tmp_path / "bad", config)
    found = codes(compare_conversion(training, read_checkpoint(tmp_path / "bad")))
    assert set(found) == {"export_holds_other"}, found
    assert {(f.layer, f.experts) for f in found["export_holds_other"]} == {(1, (0,)), (1, (1,))}


# -- ties: experts whose values are equal, so values cannot say which is which --------------------
@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any],
                                                                     dict[str, Any]]]:
    """Per kind: a training checkpoint whose layer 1 experts 0 and 1 hold equal values (every
    projection), and its faithful export: the values match two experts each."""
    out = {}
    root = tmp_path_factory.mktemp("ties")
    for kind in KINDS:
        config = MoEConfig(num_experts=E, kind=kind, expert_bias=True)  # type: ignore[arg-type]
        model = build_model(config, LAYERS, seed=1)
        with torch.no_grad():
            params = dict(model.named_parameters())
            for name, p in params.items():
                if name.startswith("layers.1.moe.") and name.endswith("_w"):
                    p[1] = p[0]
                elif name.startswith("layers.1.moe.experts.1."):
                    p.copy_(params[name.replace("experts.1.", "experts.0.")])
        training = root / f"train-{kind}"
        checkpoint.save(model, None, training)
        out[kind] = (training, _export(model, config, root / f"hf-{kind}"),
                     hf.hf_config(config, LAYERS))
    return out


def second_into_third(t: dict[str, torch.Tensor]) -> None:
    """Layer 1's expert 0 (equal to expert 1) written in expert 2's place as well."""
    if EXPERTS + "down_proj" in t:
        for name in ("gate_up_proj", "down_proj"):
            if EXPERTS + name in t:
                w = t[EXPERTS + name].clone()
                w[2] = w[0]
                t[EXPERTS + name] = w
        return
    for name in ("gate_proj", "up_proj", "down_proj"):
        t[f"{EXPERTS}2.{name}.weight"] = t[f"{EXPERTS}0.{name}.weight"]


@pytest.mark.parametrize("kind", KINDS)
def test_equal_experts_are_paired_by_name_and_said_so(tied: dict[str, Any], kind: str,
                                                      tmp_path: Path) -> None:
    report = compare(tied, kind, export(tied, kind, tmp_path / "hf"))
    assert report.problems == [], [str(f) for f in report.problems]
    # both experts' matrices (gate/up or their fused halves, and down), paired by name
    assert report.tied == 2 * (2 if kind == "fused" else 3), report.mapping
    assert any(line.endswith("paired by the names both sides parse: their values equal)")
               for line in report.mapping), report.mapping


@pytest.mark.parametrize("kind", KINDS)
def test_a_tie_does_not_hide_a_misfiled_third_expert(tied: dict[str, Any], kind: str,
                                                     tmp_path: Path) -> None:
    found = codes(compare(tied, kind, export(tied, kind, tmp_path / "hf", second_into_third)))
    assert set(found) == {"export_holds_other", "export_missing"}, found
    assert {(f.layer, f.experts) for f in found["export_holds_other"]} == {(1, (2,))}
    assert all("holds the values expert 0 and expert 1 share" in f.message
               for f in found["export_holds_other"]), found
    assert [(f.layer, f.experts) for f in found["export_missing"]] == [(1, (2,))]


def test_ties_paired_by_transformers_names(tied: dict[str, Any], tmp_path: Path) -> None:
    """With the class's keys (``--hf-model``), its names pair the tie; a key the class does not
    have vouches for nothing, so the tied value under it is named."""
    path = export(tied, "unpacked", tmp_path / "hf")
    keys = set(hf.read_safetensors(path))
    report = compare(tied, "unpacked", path, hf_names=("Ernie4_5_MoeForCausalLM", keys))
    assert report.problems == [] and report.tied == 6, [str(f) for f in report.problems]
    assert report.tie_names == "transformers' Ernie4_5_MoeForCausalLM names"
    unknown = keys - {f"{EXPERTS}1.down_proj.weight"}
    found = codes(compare(tied, "unpacked", path, hf_names=("Ernie4_5_MoeForCausalLM", unknown)))
    assert {(f.layer, f.experts) for f in found["export_holds_other"]} == {(1, (1,))}, found
    assert "has no such key" in found["export_holds_other"][0].message


def test_cli_ties_with_hf_model(tied: dict[str, Any], tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    good = str(export(tied, "fused", tmp_path / "good"))
    code, out, err = cli(str(tied["fused"][0]), "--compare", good, "--values", "-v",
                         "--hf-model", "Ernie4_5_MoeForCausalLM")
    assert code == 0, out + err
    assert ("4 matrices whose values equal another's paired by transformers' "
            "Ernie4_5_MoeForCausalLM names instead") in out
    assert "paired by transformers' Ernie4_5_MoeForCausalLM names: their values equal)" in out


# -- a training checkpoint saved by ranks --------------------------------------------------------
@pytest.mark.moe_ep_world(4)
@pytest.mark.parametrize(("kind", "layout", "fsdp"), [("packed", "ep2.etp2", False),
                                                      ("unpacked", "ep2", True),
                                                      ("fused", "ep2.etp2", False)])
def test_a_training_checkpoint_saved_by_ranks_against_its_export(
        kind: str, layout: str, fsdp: bool, moe_ep_shared_dir: Path) -> None:
    """The check reads a DCP save each rank wrote its own experts and expert-TP shards of (or FSDP2
    shards, with the optimizer's moments) as global tensors: the export the same split model writes
    (:func:`reference_impl.hf.export_hf`, gathered) compares clean against it, and two of its
    experts swapped are named by layer and expert -- as at ep=1, in one process, above."""
    import torch.distributed as dist

    from conformance.layout import ParallelLayout
    from reference_impl.moe import apply_expert_parallel, apply_fsdp

    ep, _, etp = layout.removeprefix("ep").partition(".etp")
    mesh = ParallelLayout.for_world(4, int(ep), etp=int(etp or 1)).build_mesh()
    config = MoEConfig(num_experts=E, kind=kind, expert_bias=True)  # type: ignore[arg-type]
    model = build_model(config, LAYERS, seed=1)
    apply_expert_parallel(model, mesh)
    if fsdp:
        apply_fsdp(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    set_deterministic_grads(model, 3, 0)
    optimizer.step()
    training, exported = moe_ep_shared_dir / "train", moe_ep_shared_dir / "hf"
    checkpoint.save(model, optimizer, training)
    hf.export_hf(model, exported)
    if dist.get_rank() != 0:
        return
    clean = compare_conversion(read_checkpoint(training), read_checkpoint(exported))
    assert clean.problems == [], [str(f) for f in clean.problems]
    assert clean.atoms == LAYERS * (E * (2 if kind == "fused" else 3) + 3)
    tensors = hf.read_safetensors(exported)
    swap_experts(tensors)
    hf.write_safetensors(tensors, moe_ep_shared_dir / "swapped", hf.hf_config(config, LAYERS))
    found = codes(compare_conversion(read_checkpoint(training),
                                     read_checkpoint(moe_ep_shared_dir / "swapped")))
    assert set(found) == {"export_holds_other"}, found
    assert {(f.layer, f.experts) for f in found["export_holds_other"]} == {(1, (0,)), (1, (1,))}

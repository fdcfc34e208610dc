"""The checkpoint inspector: real checkpoints clean at every ep, every lossy pattern named, bad
input refused.

Reference and legacy checkpoints are written by real 4-rank gloo worlds (one world, several saves
per test); the inspection itself runs on rank 0 with no collective.  Hand-made checkpoints (a
permuted expert, a dropped layer, missing moments, holes) are real DCP saves of edited ep=1 state
dicts, or ``.metadata`` written directly where DCP would refuse to write the defect.

The reference saves packed layers in the packed form (``layers.N.moe.up_w`` ``[E, ...]``, as
torchtitan names them) and unpacked ones, and packed ones with ``per_expert=True``, in the
per-expert form (``layers.N.moe.experts.G.up.weight``); the lossy packed keys come from
:func:`reference_impl.checkpoint.save_legacy` of packed layers at ep > 1: one rank's rows.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from conformance.inspect import main
from conformance.inspection import (
    CheckpointError,
    CheckpointProblem,
    classify_keys,
    compare_indexes,
    index_state_dict,
    inspect_index,
    pattern,
    read_checkpoint,
    read_dcp,
    read_safetensors,
)
from reference_impl import checkpoint
from reference_impl.moe import MoEConfig, apply_expert_parallel, apply_fsdp, build_model
from reference_impl.regions import set_deterministic_grads

WORLD, LAYERS, E = 4, 2, 6
ROOT = Path(__file__).resolve().parents[1]


def trained(kind: str, ep: int, fsdp: bool = False) -> tuple[Any, Any]:
    """The reference model at ``ep`` on this world (or alone at ep=0), one AdamW step taken."""
    config = MoEConfig(num_experts=E, kind=kind)  # type: ignore[arg-type]
    model = build_model(config, LAYERS, seed=1)
    if ep:
        from pytest_moe_ep.world.meshes import device_mesh

        mesh = device_mesh((ep, WORLD // ep), ("ep", "dp_shard"))
        apply_expert_parallel(model, mesh)
        if fsdp:
            apply_fsdp(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    set_deterministic_grads(model, 3, 0)
    optimizer.step()
    return model, optimizer


def problems(found: Sequence[CheckpointProblem]) -> dict[str, list[CheckpointProblem]]:
    out: dict[str, list[CheckpointProblem]] = {}
    for f in found:
        out.setdefault(f.problem, []).append(f)
    return out


# -- real worlds ----------------------------------------------------------------------------------
@pytest.mark.moe_ep_world(WORLD)
def test_reference_checkpoints_are_clean_and_ep_invariant(moe_ep_shared_dir: Path) -> None:
    """Both forms of the reference's checkpoints -- packed layers packed, or per expert, and
    unpacked layers per expert -- read clean at every ep and compare equal to the ep=1 save of the
    same form."""
    saved = {}
    forms = (("packed", False), ("packed", True), ("unpacked", False))
    for kind, per_expert in forms:
        for ep, fsdp in ((1, False), (2, False), (4, False), (2, True)):
            path = (moe_ep_shared_dir / f"{kind}{'-per-expert' if per_expert else ''}-ep{ep}"
                    f"{'-fsdp' if fsdp else ''}")
            checkpoint.save(*trained(kind, ep, fsdp), path, per_expert=per_expert)
            saved[(kind, per_expert, ep, fsdp)] = path
    dist.barrier()
    if dist.get_rank() != 0:
        return
    for (kind, per_expert, ep, fsdp), path in saved.items():
        index = read_dcp(path)
        result = inspect_index(index)
        case = f"{kind}{' per expert' if per_expert else ''} saved at ep={ep} fsdp={fsdp}"
        assert result.findings == (), f"{case}: {[str(f) for f in result.findings]}"
        assert (result.num_experts, result.moe_layers) == (E, (0, 1)), case
        assert result.num_experts_source.startswith("router"), case
        stats = {g.stat for g in result.groups}
        assert {None, "exp_avg",
                "exp_avg_sq"} <= stats, f"{case}: optimizer state not recognised: {stats}"
        assert all(g.experts == tuple(range(E)) for g in result.groups), case
        # one chunk per rank's rows, whatever E is (E=6 at ep=4: rank 3's
        if kind == "packed" and not per_expert:
            # is empty, and DCP records it)
            assert not [k for k in index.entries if ".experts." in k], case
            chunks = len(index.entries["model.layers.0.moe.up_w"].chunks)
            assert chunks == ep * (WORLD // ep if fsdp else 1), (case, chunks)
        else:
            chunks = len(index.entries["model.layers.0.moe.experts.0.up.weight"].chunks)
            # FSDP splits each expert's weight into chunks over dp_shard
            if fsdp and kind == "unpacked":
                assert chunks == WORLD // ep, case
            elif fsdp:  # a packed row under FSDP is whole on the rank that holds it
                assert chunks == 1, case
        truth = read_dcp(saved[(kind, per_expert, 1, False)])
        assert compare_indexes(index, truth, values=True, memory_bytes=64 << 10) == [], case


@pytest.mark.moe_ep_world(WORLD)
def test_legacy_checkpoints_show_every_lossy_pattern(moe_ep_shared_dir: Path) -> None:
    saved = {}
    for kind in ("packed", "unpacked"):
        for ep in (2, 4):
            saved[(kind, ep)] = moe_ep_shared_dir / f"legacy-{kind}-ep{ep}"
            checkpoint.save_legacy(*trained(kind, ep), saved[(kind, ep)])
    truth, packed_truth = moe_ep_shared_dir / "truth", moe_ep_shared_dir / "packed-truth"
    # every rank the whole model: the ep=1 truth
    checkpoint.save(*trained("packed", 0), truth, per_expert=True)
    checkpoint.save(*trained("packed", 0), packed_truth)  # the same in the packed [E, ...] form
    dist.barrier()
    if dist.get_rank() != 0:
        return
    for (kind, ep), path in saved.items():
        result = inspect_index(read_dcp(path))
        found = problems(result.findings)
        local = -(-E // ep)  # ceil: what rank 0 holds
        assert result.num_experts == E, "the router, not the lossy expert keys, gives E"
        code = "local_extent" if kind == "packed" else "local_numbering"
        assert set(found) == {code}, f"{kind} ep={ep}: {[str(f) for f in result.findings]}"
        keys = {f.key for f in found[code]}
        if kind == "packed":  # bug class 6: 'layers.N.moe.up_w' has no 'expert' in its name
            assert {f"model.layers.{n}.moe.{w}_w" for n in (0, 1)
                    for w in ("up", "gate", "down")} <= keys
            assert {f"optimizer.state.layers.0.moe.up_w.{m}"
                    for m in ("exp_avg", "exp_avg_sq")} <= keys
        else:
            assert "model.layers.1.moe.experts.*.up.weight" in keys
            assert "optimizer.state.layers.1.moe.experts.*.up.weight.exp_avg" in keys
            assert all(f.experts == tuple(range(local, E)) for f in found[code]), found[code][0]
            assert f"numbered 0..{local - 1} only" in found[code][0].message
        assert all(f.layer in (0, 1) and f.experts for f in found[code])
    assert inspect_index(read_dcp(packed_truth)).findings == (), (
        "the ep=1 packed form holds every row")
    diffs = problems(compare_indexes(read_dcp(saved[("packed", 2)]), read_dcp(packed_truth),
                                     values=True, names=("ep=2 checkpoint", "ep=1 checkpoint")))
    assert ("shape_differs" in diffs
            and "its expert axis has 3 rows" in diffs["shape_differs"][0].message)
    diffs = problems(compare_indexes(read_dcp(saved[("unpacked", 2)]), read_dcp(truth), values=True,
                                     names=("ep=2 checkpoint", "ep=1 checkpoint")))
    gone = {(f.key, f.experts) for f in diffs["key_missing"]}
    assert ("model.layers.1.moe.experts.*.up.weight", (3, 4, 5)) in gone, diffs


# -- hand-made checkpoints ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def truths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """ep=1 checkpoints, written in this process, and their flat state dicts: both kinds in the
    per-expert form (``packed`` saved with ``per_expert=True``), and ``packed_form``, packed layers
    in the packed form (``up_w`` ``[E, ...]``, what the reference saves for them)."""
    out = {}
    for kind in ("packed", "unpacked", "packed_form"):
        path = tmp_path_factory.mktemp("truth") / kind
        model, optimizer = trained(kind.removesuffix("_form"), 0)
        checkpoint.save(model, optimizer, path, per_expert=kind != "packed_form")
        nested = dcp.state_dict_loader._load_state_dict_from_keys(checkpoint_id=str(path))
        out[kind] = (path, flatten_state_dict(nested)[0])
    return out


def edited(truths: dict[str, Any], kind: str, path: Path, edit: Any) -> Path:
    """A real DCP checkpoint of the ep=1 state with ``edit(flat_state)`` applied."""
    state = dict(truths[kind][1])
    edit(state)
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def test_permuted_experts_are_named(truths: dict[str, Any], tmp_path: Path) -> None:
    def permute(state: dict[str, Any]) -> None:
        w = state["model.layers.1.moe.up_w"]
        state["model.layers.1.moe.up_w"] = torch.cat([w[2:4], w[0:2], w[4:]])

    got = read_dcp(edited(truths, "packed_form", tmp_path / "perm", permute))
    assert inspect_index(got).findings == (), ("a permutation keeps every row: the metadata cannot "
                                               "see it")
    found = compare_indexes(got, read_dcp(truths["packed_form"][0]), values=True)
    assert [f.problem for f in found] == ["rows_are_other_experts"], [str(f) for f in found]
    assert found[0].key == "model.layers.1.moe.up_w" and found[0].experts == (0, 1, 2, 3)
    assert "rows 0..1 are experts 2..3, rows 2..3 are experts 0..1" in found[0].message
    assert compare_indexes(got, read_dcp(truths["packed_form"][0]), values=True,
                           ignore=[r"\.up_w$"]) == []

    # the same permutation in the per-expert form
    def permute_experts(state: dict[str, Any]) -> None:
        key = "model.layers.1.moe.experts.{}.up.weight".format
        w = [state[key(g)] for g in range(4)]
        for g, src in enumerate((2, 3, 0, 1)):
            state[key(g)] = w[src]

    got = read_dcp(edited(truths, "packed", tmp_path / "perm-experts", permute_experts))
    assert inspect_index(got).findings == (), ("a permutation keeps every key: the metadata cannot "
                                               "see it")
    found = compare_indexes(got, read_dcp(truths["packed"][0]), values=True)
    assert ({(f.problem, f.key, f.other_key) for f in found} == {
        ("holds_other_key", f"model.layers.1.moe.experts.{g}.up.weight",
         f"model.layers.1.moe.experts.{s}.up.weight")
        for g, s in enumerate((2, 3, 0, 1))}), [str(f) for f in found]
    assert "holds expert 2's values instead of expert 0's" in found[0].message

    def nudge(state: dict[str, Any]) -> None:  # values that match nothing: the max abs diff, where
        state["model.layers.0.moe.down_w"] = state["model.layers.0.moe.down_w"].clone()
        state["model.layers.0.moe.down_w"][4] += 0.25
        state["model.norm.weight"] = state["model.norm.weight"] * 2

    found = compare_indexes(read_dcp(edited(truths, "packed_form", tmp_path / "nudge", nudge)),
                            read_dcp(truths["packed_form"][0]), values=True)
    assert [(f.problem, f.key, f.experts) for f in found] == [
        ("values_differ", "model.layers.0.moe.down_w", (4,)),
        ("values_differ", "model.norm.weight", ())], found
    assert ("row 4 of its expert axis differ from the other checkpoint's (max abs diff 0.25)"
            in found[0].message)

    def swap(state: dict[str, Any]) -> None:
        a, b = ("model.layers.0.moe.experts.0.gate.weight",
                "model.layers.0.moe.experts.1.gate.weight")
        state[a], state[b] = state[b], state[a]
        state["optimizer.param_groups.0.lr"] = 0.5

    found = compare_indexes(read_dcp(edited(truths, "unpacked", tmp_path / "swap", swap)),
                            read_dcp(truths["unpacked"][0]), values=True,
                            names=("ep=4 checkpoint", "truth"))
    text = {f.key: f for f in found}
    assert ("holds expert 1's values instead of expert 0's"
            in text["model.layers.0.moe.experts.0.gate.weight"].message)
    assert (text["model.layers.0.moe.experts.1.gate.weight"].other_key
            == "model.layers.0.moe.experts.0.gate.weight")
    assert text["optimizer.param_groups.0.lr"].problem == "value_differs"
    assert "is 0.5, the truth's is 0.01" in text["optimizer.param_groups.0.lr"].message


@pytest.mark.parametrize("kind", ["packed", "packed_form"])
def test_dropped_layer_and_missing_moments(kind: str, truths: dict[str, Any],
                                           tmp_path: Path) -> None:
    """Every expert key of layer 1 (weights and moments) gone, in either form; its router (and
    shared expert) stay, and the router is what says it was an MoE layer."""
    def drop_layer(state: dict[str, Any]) -> None:
        for key in [k for k in state if ".layers.1.moe.experts." in k
                    or (".layers.1.moe." in k and "_w" in k)]:
            del state[key]

    path = edited(truths, kind, tmp_path / "drop", drop_layer)
    assert "model.layers.1.moe.router.weight" in read_dcp(path).entries
    found = problems(inspect_index(read_dcp(path)).findings)
    assert set(found) == {"layer_missing"}, found
    assert (found["layer_missing"][0].layer == 1
            and found["layer_missing"][0].experts == tuple(range(E)))
    assert "has a router but none of the 12 expert tensors" in found["layer_missing"][0].message
    diff = compare_indexes(read_dcp(path), read_dcp(truths[kind][0]))
    assert [(f.problem, f.layer) for f in diff] == [("key_missing", 1)], [str(f) for f in diff]
    # (weight, exp_avg, exp_avg_sq, step) x 3 linears, per expert
    keys = 12 * E if kind == "packed" else 12
    assert (f"all {keys} expert keys of layer 1" in diff[0].message
            and diff[0].experts == tuple(range(E)))
    if kind == "packed_form":  # the moments below are per-expert keys, the reference's form
        return

    def drop_moments(state: dict[str, Any]) -> None:
        for key in [k for k in state if k.startswith("optimizer.state.layers.0.moe.experts.4.")]:
            del state[key]

    found = problems(inspect_index(read_dcp(edited(truths, "unpacked", tmp_path / "mom",
                                                   drop_moments))).findings)
    assert set(found) == {"optimizer_missing", "missing_experts"}, found
    assert {(f.layer, f.experts) for f in found["optimizer_missing"]} == {(0, (4,))}
    assert {f.key for f in found["optimizer_missing"]} == {
        f"model.layers.0.moe.experts.*.{w}.weight" for w in ("gate", "up", "down")}


def write_metadata(path: Path, chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> Path:
    """A ``.metadata`` whose packed key has the given chunks (DCP itself would not write holes)."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    def tensor(size: tuple[int, ...], pieces: Any = None) -> TensorStorageMetadata:
        pieces = pieces or [((0,) * len(size), size)]
        return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size),
                                     [ChunkStorageMetadata(torch.Size(o), torch.Size(s))
                                      for o, s in pieces])

    path.mkdir()
    md = Metadata({"layers.0.moe.router.weight": tensor((E, 8)),
                   "layers.0.moe.up_w": tensor((E, 4, 8), chunks)})
    (path / ".metadata").write_bytes(pickle.dumps(md))
    return path


def test_chunk_holes_and_duplicates(tmp_path: Path) -> None:
    path = write_metadata(tmp_path / "holes",
                          [((0, 0, 0), (2, 4, 8)), ((1, 0, 0), (2, 4, 8)), ((4, 0, 0), (1, 4, 4))])
    found = problems(inspect_index(read_dcp(path)).findings)
    assert set(found) == {"missing_experts", "duplicate_experts"}, found
    assert (found["missing_experts"][0].experts == (3, 4, 5)
            and found["duplicate_experts"][0].experts == (1,))


# -- bad input, CLI -------------------------------------------------------------------------------
def cli(*args: str, cwd: Path | None = None) -> tuple[int, str, str]:
    """The real command line, in a subprocess: exit status, stdout, stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "conformance.inspect", *args], capture_output=True,
                         text=True, env=env, timeout=120, cwd=cwd)
    return run.returncode, run.stdout, run.stderr


def test_metadata_inspection_imports_no_torch(truths: dict[str, Any]) -> None:
    """Reading and inspecting metadata runs no code from the file and needs no torch (fast
    start)."""
    code = ("import sys; from conformance.inspection import read_checkpoint, inspect_index; "
            f"r = inspect_index(read_checkpoint({str(truths['unpacked'][0])!r})); "
            "assert r.clean and r.num_experts == 6, r; assert 'torch' not in sys.modules; "
            "print('ok')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.stdout.strip() == "ok", run.stderr


def test_cli_exit_codes_json_and_no_writes(truths: dict[str, Any], tmp_path: Path) -> None:
    good = truths["packed"][0]
    before = sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in good.iterdir())
    code, out, err = cli(str(good), "--compare", str(good), "--values")
    assert (code, err) == (0, ""), err
    assert "OK: every expert of every MoE layer" in out and "the same" in out
    lossy = edited(truths, "packed_form", tmp_path / "lossy", lambda s: s.update(
        {"model.layers.0.moe.up_w": s["model.layers.0.moe.up_w"][:3]}))
    code, out, _ = cli(str(lossy), "--json")
    report = json.loads(out)
    assert code == 1 and report["exit_code"] == 1 and report["problems"] == 1
    [finding] = report["inspection"]["findings"]
    assert (finding["problem"], finding["layer"],
            finding["experts"]) == ("local_extent", 0, [3, 4, 5])
    assert sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size)
                  for p in good.iterdir()) == before
    # in process too: the console script's entry point
    assert main([str(good), "--experts", "6"]) == 0


class _RunsCode:
    def __reduce__(self) -> Any:
        return (os.system, ("touch ran-code",))


@pytest.mark.parametrize("case", ["missing", "empty_dir", "a_file", "truncated", "garbage",
                                  "metadata_is_dir", "missing_data_file", "bad_regex", "runs_code"])
def test_bad_input_is_one_line_and_exit_2(case: str, truths: dict[str, Any],
                                          tmp_path: Path) -> None:
    target, extra, expect = tmp_path / "ckpt", [], ""
    if case == "empty_dir":
        target.mkdir()
        expect = "holds neither a .metadata file nor"
    elif case == "a_file":
        target.write_text("hello")
        expect = "is a file"
    elif case in ("truncated", "garbage", "metadata_is_dir", "missing_data_file"):
        shutil.copytree(truths["unpacked"][0], target)
        meta = target / ".metadata"
        if case == "truncated":
            meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
            expect = "is truncated"
        elif case == "garbage":
            meta.write_bytes(b"\x00not a pickle" * 10)
            expect = "is corrupt"
        elif case == "metadata_is_dir":
            meta.unlink()
            meta.mkdir()
            expect = "cannot be read"
        else:
            for data in target.glob("*.distcp"):
                data.unlink()
            extra, expect = ["--compare", str(truths["unpacked"][0]), "--values"], "failed"
    elif case == "runs_code":  # a .metadata that would run a command under pickle.load
        target.mkdir()
        (target / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
        expect = "refers to posix.system, which DCP metadata never does"
    elif case == "bad_regex":
        target, extra, expect = truths["packed"][0], ["--expert-key",
                                                      "experts.(?P<expert"], "not a valid regular"
    else:
        expect = "does not exist"
    code, out, err = cli(str(target), *extra, cwd=tmp_path)
    assert not (tmp_path / "ran-code").exists(), "the .metadata ran a command"
    assert code == 2 and out == "", (code, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and expect in err, err
    if case not in ("bad_regex", "missing_data_file"):
        with pytest.raises(CheckpointError) as info:
            read_checkpoint(target)
        assert info.value.path and info.value.problem and info.value.expected


# -- safetensors, key patterns --------------------------------------------------------------------
def write_safetensors(directory: Path, shards: dict[str, dict[str, torch.Tensor]]) -> Path:
    """A Hugging Face checkpoint: files with an 8-byte header length + JSON header + data, and the
    index."""
    directory.mkdir()
    names = {torch.float32: "F32", torch.bfloat16: "BF16"}
    weight_map = {}
    for file, tensors in shards.items():
        header, blobs, offset = {}, [], 0
        for key, t in tensors.items():
            data = t.contiguous().view(torch.uint8).numpy().tobytes()
            header[key] = {"dtype": names[t.dtype], "shape": list(t.shape),
                           "data_offsets": [offset, offset + len(data)]}
            blobs.append(data)
            offset += len(data)
            weight_map[key] = file
        text = json.dumps(header).encode()
        (directory / file).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def hf_shards(skip: tuple[int, int] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for layer in range(2):
        file = f"model-0000{layer + 1}-of-00002.safetensors"
        shards[file] = {f"model.layers.{layer}.mlp.gate.weight": torch.zeros(4, 8),
                        f"model.layers.{layer}"
                        ".mlp.shared_experts.up_proj.weight": torch.zeros(16, 8)}
        for g in range(4):
            if (layer, g) != skip:
                for w in ("gate_proj", "up_proj", "down_proj"):
                    shards[file][f"model.layers.{layer}.mlp.experts.{g}.{w}.weight"] = torch.full(
                        (16, 8), float(g), dtype=torch.bfloat16)
    return shards


def test_safetensors_index_with_a_missing_expert(tmp_path: Path) -> None:
    good = read_safetensors(write_safetensors(tmp_path / "good", hf_shards()))
    assert inspect_index(good).findings == () and good.format == "safetensors"
    bad = read_checkpoint(write_safetensors(tmp_path / "bad", hf_shards(skip=(1, 3))))
    found = problems(inspect_index(bad).findings)
    assert set(found) == {"missing_experts"} and len(found["missing_experts"]) == 3
    assert {(f.layer, f.experts) for f in found["missing_experts"]} == {(1, (3,))}
    assert ("model.layers.1.mlp.experts.*.up_proj.weight"
            in {f.key for f in found["missing_experts"]})
    diff = compare_indexes(bad, good, values=True)
    assert {(f.problem, f.key, f.experts)
            for f in diff} == {("key_missing", f"model.layers.1.mlp.experts.*.{w}"
                                ".weight", (3,))
                               for w in ("gate_proj", "up_proj", "down_proj")}
    (tmp_path / "bad" / "model-00001-of-00002.safetensors").write_bytes(b"\x10\x00")
    code, _, err = cli(str(tmp_path / "bad"))
    assert code == 2 and "is truncated" in err, err


def test_key_patterns_of_each_framework() -> None:
    keys = {
        "layers.3.moe.experts.w1": ("packed", 3, None),  # torchtitan
        # torchtitan, recent
        "layers.3.moe.routed_experts.inner_experts.w2_EDF": ("packed", 3, None),
        # DeepSpeed
        "layers.3.moe.deepspeed_moe.experts.deepspeed_experts.7.up.weight": ("per_expert", 3, 7),
        # torchtitan's shared expert
        "model.layers.3.moe.shared_experts.w1.weight": (None, 3, None),
        "model.layers.3.mlp.experts.gate_and_up_projs": ("packed", 3, None),  # NeMo Automodel
        "model.layers.3.mlp.experts.gate_up_proj": ("packed", 3, None),  # DeepSpeed AutoEP, HF
        # Megatron dist
        "decoder.layers.3.mlp.experts.experts.linear_fc1.weight": ("packed", 3, None),
        "decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.weight": ("per_expert", 3, 7),
        "decoder.layers.3.mlp.experts.linear_fc1.weight7": ("per_expert", 3, 7),  # TEGroupedMLP
        "model.layers.3.mlp.experts.7.gate_proj.weight": ("per_expert", 3, 7),  # Hugging Face
        "optim.state.model.layers.3.mlp.experts.7.gate_proj.weight.exp_avg": ("per_expert", 3, 7),
        "model.layers.3.mlp.shared_experts.gate_proj.weight": (None, 3, None),  # dense
        # dense, whatever follows
        "model.layers.3.mlp.shared_expert.experts.0.weight": (None, 3, None),
        "model.layers.3.moe.shared.up.weight": (None, 3, None),
    }
    infos = classify_keys(keys)
    assert {k: (i.kind, i.layer, i.expert) for k, i in infos.items()} == keys
    opt = infos["optim.state.model.layers.3.mlp.experts.7.gate_proj.weight.exp_avg"]
    assert (opt.param, opt.stat) == ("model.layers.3.mlp.experts.7.gate_proj.weight", "exp_avg")
    assert infos["decoder.layers.3.mlp.experts.linear_fc1.weight7"].family.endswith(
        "linear_fc1.weight*")
    # Megatron's distributed optimizer, fully_reshardable format: the fp32 main parameter is the
    # state ``param``
    main = classify_keys(
        ["optimizer.state.param.layers.0.mlp.experts.experts.linear_fc2.weight",
         "chained_1.optimizer.state.exp_avg.layers.0.mlp.experts.experts.linear_fc2.weight"])
    assert [(i.kind, i.layer, i.param, i.stat) for i in main.values()] == [
        ("packed", 0, "layers.0.mlp.experts.experts.linear_fc2.weight", stat)
        for stat in ("param", "exp_avg")]
    routers = classify_keys(
        ["layers.0.moe.router.gate.weight", "layers.0.moe.deepspeed_moe.gate.wg.weight",
         "model.layers.0.mlp.gate.weight", "layers.0.moe.router.weight",
         "layers.0.moe.shared.gate.weight", "model.layers.0.mlp.gate_proj.weight"])
    assert [i.role for i in routers.values()] == ["router"] * 4 + ["dense"] * 2
    mine = classify_keys(["blk.2.ffn_up_exps", "blk.2.ffn.e5.w"],
                         (pattern(r"ffn_up_exps$"), pattern(r"\.e(?P<expert>\d+)\.")))
    assert [(i.kind, i.expert) for i in mine.values()] == [("packed", None), ("per_expert", 5)]
    with pytest.raises(ValueError, match="not a valid regular expression"):
        pattern("(")


def test_in_memory_index_and_no_expert_keys() -> None:
    state = {"layers.0.moe.router.weight": torch.zeros(4, 2),
             "layers.0.moe.up_w": torch.zeros(2, 3, 2)}
    found = problems(inspect_index(index_state_dict(state)).findings)
    assert [(f.experts) for f in found["local_extent"]] == [(2, 3)]
    state = {"model.layers.0.moe.router.weight": torch.zeros(2, 2),
             "model.layers.0.moe.up_w": torch.zeros(2, 3, 2),
             "optimizer.state.layers.0.moe.experts.1.up.weight.exp_avg": torch.zeros(3, 2)}
    found = problems(inspect_index(index_state_dict(state)).findings)
    # moments under per-expert names
    assert set(found) == {"optimizer_orphan", "missing_experts"}, found
    assert found["optimizer_orphan"][0].experts == (1,)
    found = problems(inspect_index(index_state_dict({"w": torch.zeros(2)})).findings)
    assert set(found) == {"no_expert_keys"}, ("a checkpoint nothing was checked in must not read "
                                              "clean")
    assert "so no expert was checked" in found["no_expert_keys"][0].message
    # every expert dropped
    routers_only = {f"layers.{n}.moe.router.weight": torch.zeros(4, 2) for n in (0, 1)}
    result = inspect_index(index_state_dict(routers_only))
    assert [f.problem
            for f in result.findings] == ["no_expert_keys"] and result.moe_layers == (0, 1)
    assert "layer(s) 0..1 have a router: their experts are missing" in result.findings[0].message


def test_a_layer_another_prefix_holds_is_not_missing_from_this_one() -> None:
    """Stage-prefixed names (stage 0 holds layers 0 and 1, stage 1 holds layer 2 as its own 0) or a
    second stack number their own layers: no prefix is "missing" a layer another prefix holds that
    tensor of; a layer no prefix holds it of still is."""
    def experts(prefix: str, layer: int,
                weights: tuple[str, ...] = ("up", "down")) -> dict[str, torch.Tensor]:
        return {f"{prefix}layers.{layer}.moe.experts.{e}.{w}.weight": torch.zeros(3, 2)
                for e in range(2) for w in weights}

    staged = {**experts("stage0.", 0), **experts("stage0.", 1), **experts("stage1.", 0)}
    assert "layer_missing" not in problems(inspect_index(index_state_dict(staged)).findings)
    dropped = {**experts("stage0.", 0), **experts("stage0.", 1, ("up",)), **experts("stage1.", 0)}
    found = problems(inspect_index(index_state_dict(dropped)).findings)["layer_missing"]
    assert ("stage0.layers.1.moe.experts.*.down.weight",
            1) in [(f.key, f.layer) for f in found], found


def test_saved_objects_that_nest_tensors_compare_by_structure_and_values() -> None:
    """A non-tensor entry holding tensors (Megatron's ``dp_zero_gather_scatter`` param state) equals
    an identical one: ``==`` on such a dict raises on the tensors' truth value, which once read as
    "differs"."""
    import copy

    from conformance.inspection.compare import _same_value

    saved = [{"buckets_coalesced": True,
              0: {(torch.bfloat16, torch.float32): {"param": torch.arange(4.0)}}}]
    assert _same_value(saved, copy.deepcopy(saved))
    other = copy.deepcopy(saved)
    other[0][0][(torch.bfloat16, torch.float32)]["param"][1] = 9.0
    assert not _same_value(saved, other)
    assert not _same_value(saved, [{**saved[0], "extra": 1}]) and not _same_value((1, 2), [1, 2])


@pytest.mark.parametrize("make",
                         [lambda: torch.randn(5, 3, 4), lambda: torch.randn(4, 6).bfloat16(),
                          lambda: torch.rand(3, 2) > 0.5, lambda: torch.randn(6, 4).t(),
                          lambda: torch.randn(3), lambda: torch.empty(2, 0)],
                         ids=["f32", "bf16", "bool", "transposed", "1-d", "empty-rows"])
def test_a_packed_tensors_row_digests_are_each_rows_own_digest(make: Any) -> None:
    from conformance.inspection.digests import _row_digests, digest

    t = make()
    want = [digest(t.contiguous()[r]) for r in range(t.shape[0])]
    assert _row_digests(t) == want
    if t.dtype != torch.bool and t.numel():
        assert len(set(want)) == len(want)  # distinct rows, distinct digests

"""ExpertLayout: global names and shapes without copying, exact undo, and the legacy-checkpoint
guard.

Single-process tests cover :func:`moe_layers` under wrappers and :func:`check_saved_experts` on
hand-made DCP metadata; the 4-rank tests cover what needs a real EP split: storage identity of
every translated tensor, DTensor placement agreeing with FSDP2's uneven shards, the errors, and
that a load into the translated dict writes the model and the optimizer moments in place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, Shard

from pytest_moe_ep.world.meshes import device_mesh
from reference_impl import checkpoint
from reference_impl.expert_layout import (
    ExpertLayout,
    check_saved_experts,
    expert_key,
    expert_layout,
    moe_layers,
    saved_packed_layers,
)
from reference_impl.moe import (
    MoEConfig,
    MoEMLP,
    apply_expert_parallel,
    apply_fsdp,
    build_model,
)
from reference_impl.regions import global_regions, local_region, set_deterministic_grads

WORLD = 4


# ---------------------------------------------------------------- moe_layers


def _prefixes_in(state: dict[str, Any]) -> set[str]:
    return {k.rsplit(".router.weight", 1)[0] for k in state if k.endswith("router.weight")}


def test_moe_layers_names_are_state_dict_prefixes() -> None:
    model = build_model(MoEConfig(), 3)
    assert [(name, type(m)) for name, m in moe_layers(model)] == [
        (f"layers.{i}.moe", MoEMLP) for i in range(3)]
    only = MoEMLP(MoEConfig())
    assert [name for name, _ in moe_layers(only)] == [""]


def test_moe_layers_leave_out_checkpoint_and_compile_wrappers() -> None:
    model = build_model(MoEConfig(), 3)
    model.layers[0] = checkpoint_wrapper(model.layers[0])            # wraps the block
    model.layers[1].moe = checkpoint_wrapper(model.layers[1].moe)    # wraps the MoE layer itself
    # lazy: nothing is compiled here
    compiled = torch.compile(model)
    names = [name for name, _ in moe_layers(compiled)]
    assert names == ["layers.0.moe", "layers.1.moe", "layers.2.moe"]
    raw = [name for name, m in compiled.named_modules() if isinstance(m, MoEMLP)]
    assert raw[0] == "_orig_mod.layers.0._checkpoint_wrapped_module.moe", raw
    assert _prefixes_in(get_model_state_dict(compiled)) == set(names)
    assert [m for _, m in moe_layers(compiled)] == [m for _, m in compiled.named_modules()
                                                     if isinstance(m, MoEMLP)]


def test_no_layout_where_names_are_already_canonical() -> None:
    assert expert_layout(build_model(MoEConfig(), 2)) is None  # whole unpacked layers
    assert expert_layout(torch.nn.Linear(2, 2)) is None
    # packed rows become experts
    assert expert_layout(build_model(MoEConfig(kind="packed"), 2)) is not None


# ---------------------------------------------------------------- check_saved_experts


def _tensor_md(*size: int) -> TensorStorageMetadata:
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size),
                                 [ChunkStorageMetadata(torch.Size([0] * len(size)),
                                                       torch.Size(size))])


def _unpacked_md(experts: range, prefix: str = "model.") -> dict[str, Any]:
    md: dict[str, Any] = {f"{prefix}layers.0.moe.router.weight": _tensor_md(6, 32)}
    for g in experts:
        for linear in ("gate", "up", "down"):
            md[f"{prefix}layers.0.moe.experts.{g}.{linear}.weight"] = _tensor_md(64, 32)
            md[f"optimizer.state.layers.0.moe.experts.{g + 10}.{linear}"
               ".weight.exp_avg"] = _tensor_md(64, 32)
    md["optimizer.param_groups.0.params"] = BytesStorageMetadata()
    return md


def test_check_saved_experts_refuses_a_legacy_unpacked_checkpoint() -> None:
    model = build_model(MoEConfig(kind="unpacked"), 1)
    with pytest.raises(ValueError) as info:
        check_saved_experts(model, _unpacked_md(range(3)), where="/ckpt/step-100")
    message = str(info.value)
    for part in ("/ckpt/step-100", "'layers.0.moe'", "holds 3 experts", "the model has 6"):
        assert part in message, f"{part!r} not in {message!r}"
    check_saved_experts(model, _unpacked_md(range(6)), where="x")               # complete: fine
    # un-nested names too
    check_saved_experts(model, _unpacked_md(range(6), prefix=""), where="x")
    with pytest.raises(ValueError, match="holds 2 experts"):
        check_saved_experts(model, _unpacked_md(range(2), prefix=""), where="x")


def test_check_saved_experts_refuses_a_legacy_packed_checkpoint() -> None:
    model = MoEMLP(MoEConfig(kind="packed", activation="gelu"))  # the model is the layer: name ""
    saved = {"model.up_w": _tensor_md(3, 64, 32), "model.down_w": _tensor_md(3, 32, 64),
             "model.router.weight": _tensor_md(6, 32)}
    with pytest.raises(ValueError,
                       match=r"^here: the checkpoint holds 3 experts of MoE layer '<model>'"):
        check_saved_experts(model, saved, where="here")
    check_saved_experts(model, {**saved, "model.up_w": _tensor_md(6, 64, 32),
                                "model.down_w": _tensor_md(6, 32, 64)}, where="here")


def test_check_saved_experts_reads_both_forms_for_both_kinds() -> None:
    """The per-expert form and the packed form (either kind's checkpoint), into a packed or an
    unpacked model."""
    packed, unpacked = build_model(MoEConfig(kind="packed"),
                                   1), build_model(MoEConfig(kind="unpacked"), 1)
    for model in (packed, unpacked):
        check_saved_experts(model, _unpacked_md(range(6)), where="x")  # per expert, complete
        with pytest.raises(ValueError, match=r"holds 4 experts of MoE layer 'layers\.0\.moe', but "
                           r"the model has 6"):
            check_saved_experts(model, _unpacked_md(range(4)), where="x")
        legacy_packed = {"model.layers.0.moe.up_w": _tensor_md(3, 64, 32),
                         "model.layers.0.moe.down_w": _tensor_md(3, 32, 64)}
        with pytest.raises(ValueError, match="holds 3 experts"):
            check_saved_experts(model, legacy_packed, where="x")
    whole_packed = {"model.layers.0.moe.up_w": _tensor_md(6, 64, 32),
                    "model.layers.0.moe.down_w": _tensor_md(6, 32, 64)}
    assert saved_packed_layers(packed, whole_packed, where="x") == {"layers.0.moe"}
    assert saved_packed_layers(packed, _unpacked_md(range(6)), where="x") == set()
    # an unpacked model loads the packed form too (through a copy: ExpertLayout stacks its experts)
    assert saved_packed_layers(unpacked, whole_packed, where="/ckpt") == {"layers.0.moe"}


def test_check_saved_experts_leaves_a_layer_it_holds_nothing_of_to_the_load() -> None:
    model = build_model(MoEConfig(kind="packed"), 2)
    check_saved_experts(model, {"model.layers.0.moe.router.weight": _tensor_md(6, 32)}, where="x")
    check_saved_experts(model, {}, where="x")


# ---------------------------------------------------------------- 4-rank worlds


def _mesh(ep: int) -> Any:
    return device_mesh((ep, WORLD // ep), ("ep", "dp_shard"))


def _trained(config: MoEConfig, ep: int, fsdp: bool,
             seed: int = 1) -> tuple[Any, torch.optim.Optimizer]:
    model = apply_expert_parallel(build_model(config, 2, seed), _mesh(ep))
    if fsdp:
        apply_fsdp(model, _mesh(ep))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for step in range(2):
        set_deterministic_grads(model, 3, step)
        optimizer.step()
    return model, optimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _shared(view: torch.Tensor, base: torch.Tensor) -> bool:
    """``view`` lies in ``base``'s memory (a row of it, or all of it)."""
    return _local(view).untyped_storage().data_ptr() == _local(base).untyped_storage().data_ptr()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = _local(a), _local(b)
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.data_ptr() == b.data_ptr())


def _held_experts(model: Any) -> dict[str, set[int]]:
    """Global expert ids this rank holds (a row or a shard of), per layer, by the ep=1 oracle."""
    held: dict[str, set[int]] = {}
    for piece in global_regions(model):
        layer, _, rest = piece.name.partition(".moe.")
        if rest.startswith("experts."):
            held.setdefault(f"{layer}.moe", set()).add(int(rest.split(".")[1]))
        elif rest.endswith("_w"):
            held.setdefault(f"{layer}.moe",
                            set()).update(range(piece.region[0].start, piece.region[0].stop))
    return held


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize(("num_experts", "ep"), [(6, 1), (6, 2), (6, 4), (3, 2), (2, 2)])
@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp"])
@pytest.mark.parametrize("kind", ["unpacked", "packed"])
def test_to_global_gives_both_kinds_per_expert_names_without_copying(
        kind: str, fsdp: bool, num_experts: int, ep: int) -> None:
    config = MoEConfig(num_experts=num_experts, kind=kind)  # type: ignore[arg-type]
    model, optimizer = _trained(config, ep, fsdp)
    layout = expert_layout(model)
    rank = dist.get_rank()
    where = f"{kind} E={num_experts} ep={ep} fsdp={fsdp} rank {rank}"
    if kind == "unpacked" and ep == 1:
        assert layout is None, f"{where}: a whole unpacked model is already in the per-expert form"
        return
    assert layout is not None, where
    state = checkpoint.state_dict(model, optimizer)
    state["never_stepped"] = {name: False for name in state["model"]}
    before = {k: dict(v) for k, v in state.items() if k != "optimizer"}
    before_optim = {k: dict(v) for k, v in state["optimizer"]["state"].items()}
    out = layout.to_global(state)

    # The input is left as it is.
    assert {k: dict(v) for k, v in state.items() if k != "optimizer"} == before, where
    assert all(state["optimizer"]["state"][k] == v for k, v in before_optim.items()), where

    # Names: exactly the experts this rank holds, under their global ids, in both kinds; the rest
    # unchanged.
    held = _held_experts(model)
    linears = ("gate", "up", "down")
    expected_experts = {expert_key(layer, g, linear) for layer, ids in held.items() for g in ids
                        for linear in linears}
    others = {k for k in state["model"] if ".experts." not in k and not k.endswith("_w")}
    assert set(out["model"]) == expected_experts | others, (
        f"{where}: differs in {sorted(set(out['model']) ^ (expected_experts | others))}")
    assert set(out["never_stepped"]) == set(out["model"]), where
    assert set(out["optimizer"]["state"]) == set(out["model"]), where
    assert set(out["optimizer"]["param_groups"][0]["params"]) == set(out["model"]), where

    # Tensors: every per-expert tensor views its parameter's (or moment's) memory, holding that
    # expert.
    params = dict(model.named_parameters())
    optim_by_name = {name: optimizer.state[p] for name, p in params.items()}
    ref_model, ref_optimizer = _trained(config, 1, False)  # ep=1 on this rank alone
    ref_params = dict(ref_model.named_parameters())
    for key, got in out["model"].items():
        if key in others:
            assert got is state["model"][key], f"{where}: {key} was replaced"
            continue
        layer, _, rest = key.partition(".moe.")
        g, linear = int(rest.split(".")[1]), rest.split(".")[2]
        if kind == "unpacked":
            start = model.get_submodule(f"{layer}.moe").local_expert_start
            source, ref_name, row = f"{layer}.moe.experts.{g - start}.{linear}.weight", key, ()
        else:
            source, ref_name, row = f"{layer}.moe.{linear}_w", f"{layer}.moe.{linear}_w", (g,)
        entry = out["optimizer"]["state"][key]
        ref, ref_entry = (ref_params[ref_name].detach()[row],
                          ref_optimizer.state[ref_params[ref_name]])
        for name, tensor, expected, original in [
                ("weight", got, ref, params[source]),
                *((m, entry[m], ref_entry[m][row], optim_by_name[source][m])
                  for m in ("exp_avg", "exp_avg_sq"))]:
            assert _shared(tensor, original), f"{where}: {key} {name} was copied"
            local, region = local_region(tensor)
            assert torch.equal(local, expected[region] if region else expected), (
                f"{where}: {key} {name} holds another expert's values")
        assert entry["step"] is optim_by_name[source]["step"], f"{where}: {key} step was replaced"

    # to_local undoes it exactly: the very same tensor objects, this rank's names, in this rank's
    # order.
    back = layout.to_local(out)
    assert list(back["model"]) == list(state["model"]), where
    assert all(back["model"][k] is v for k, v in state["model"].items()), where
    for key, entry in state["optimizer"]["state"].items():
        assert all(back["optimizer"]["state"][key][n] is t
                   for n, t in entry.items()), f"{where}: {key}"
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"], where
    assert back["never_stepped"] == state["never_stepped"], where


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize("kind", ["unpacked", "packed"])
def test_to_global_refuses_what_it_cannot_place(kind: str) -> None:
    model, optimizer = _trained(MoEConfig(kind=kind), 2, False)  # type: ignore[arg-type]
    layout = expert_layout(model)
    assert layout is not None
    state = checkpoint.state_dict(model, optimizer)
    key = "layers.1.moe.experts.2.down.weight" if kind == "unpacked" else "layers.1.moe.down_w"
    lacking = {**state, "model": {k: v for k, v in state["model"].items() if k != key}}
    with pytest.raises(ValueError, match=rf"lacks 1 expert weight.*{key}"):
        layout.to_global(lacking)
    with pytest.raises(ValueError, match="no 'model' entry"):
        layout.to_global({"optimizer": state["optimizer"]})
    if kind == "packed":  # a factored moment (Adafactor-like) cannot be placed row-wise
        optim_state = dict(state["optimizer"]["state"])
        optim_state[key] = {**optim_state[key], "exp_avg_sq": torch.zeros(3, 32)}
        bad = {**state, "optimizer": {**state["optimizer"], "state": optim_state}}
        with pytest.raises(ValueError) as info:
            layout.to_global(bad)
        message = str(info.value)
        for part in (repr(key), "'exp_avg_sq'", "(3, 32)", "(3, 32, 64)"):
            assert part in message, f"{part!r} not in {message!r}"


@pytest.mark.moe_ep_world(WORLD)
@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp"])
@pytest.mark.parametrize(("kind", "per_expert"),
                         [("unpacked", False), ("packed", False), ("packed", True)],
                         ids=["unpacked", "packed", "packed-per-expert"])
def test_a_load_into_to_global_writes_in_place(kind: str, per_expert: bool, fsdp: bool,
                                               moe_ep_shared_dir: Path) -> None:
    """dcp.load alone restores weights, moments and steps; only the param-group settings need set_*.

    Saved at ep=2 in either form, loaded at ep=4 (rank 3 holds no experts).  In the per-expert form
    a packed weight with no rows on the rank has no per-expert entry to load its step from: to_local
    gives it its param group's step (the packed form's step is one entry every rank loads).
    """
    config = MoEConfig(kind=kind)  # type: ignore[arg-type]
    saved_model, saved_optimizer = _trained(config, 2, fsdp)
    path = moe_ep_shared_dir / "ckpt"
    checkpoint.save(saved_model, saved_optimizer, path, per_expert=per_expert)

    ref_model, ref_optimizer = _trained(config, 1, False)   # ep=1, this rank alone
    ref = {name: p for name, p in ref_model.named_parameters()}

    model = apply_expert_parallel(build_model(config, 2, seed=9), _mesh(4))
    if fsdp:
        apply_fsdp(model, _mesh(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, foreach=False)
    # what a load of that form presents
    layout = checkpoint.save_layout(model, per_expert=per_expert)
    assert layout is not None
    state = layout.to_global(checkpoint.state_dict(model, optimizer))
    dcp.load(state, checkpoint_id=str(path))
    rank = dist.get_rank()
    for piece in global_regions(model):
        where = f"{kind} fsdp={fsdp} rank {rank}: {piece.name}"
        assert torch.equal(piece.local,
                           ref[piece.name].detach()[piece.region]), f"{where}: weight not loaded"
        moments, ref_moments = optimizer.state[piece.param], ref_optimizer.state[ref[piece.name]]
        assert torch.equal(_local(moments["exp_avg"]), ref_moments["exp_avg"][piece.region]), where
        if piece.local.numel():
            assert float(moments["step"]) == 2.0, f"{where}: step {float(moments['step'])}"
    # DCP put the saved lr into the dict, not the optimizer
    assert optimizer.param_groups[0]["lr"] == 0.5

    local = layout.to_local(state)
    assert local["optimizer"]["param_groups"][0]["lr"] == 1e-2
    assert local["optimizer"]["param_groups"][0]["params"] == [
        name for name in checkpoint.state_dict(model, None)["model"]]
    set_optimizer_state_dict(model, optimizer, local["optimizer"])
    assert optimizer.param_groups[0]["lr"] == 1e-2
    for piece in global_regions(model):  # and set_* left every loaded value as it was
        assert torch.equal(
            _local(optimizer.state[piece.param]["exp_avg_sq"]),
            ref_optimizer.state[ref[piece.name]]["exp_avg_sq"][piece.region]), piece.name
        step = float(optimizer.state[piece.param]["step"])
        assert step == 2.0, (f"{kind} fsdp={fsdp} rank {rank}: {piece.name} step {step} after "
                             "to_local")


@pytest.mark.moe_ep_world(WORLD)
def test_moe_layers_under_ddp() -> None:
    """DDP's ``module.`` is left out too, as get_model_state_dict leaves it out."""
    model = build_model(MoEConfig(), 2)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    names = [name for name, _ in moe_layers(ddp)]
    assert names == ["layers.0.moe", "layers.1.moe"]
    assert _prefixes_in(get_model_state_dict(ddp)) == set(names)


def test_layout_object_is_reusable_for_one_round() -> None:
    with pytest.raises(ValueError, match="to_global"):
        ExpertLayout([]).to_local({"model": {},
                                   "optimizer": {"state": {}, "param_groups": [{"params": []}]}})


# ---------------------------------------------------------------- one definition, no circle


def test_reference_impl_has_no_import_circle_and_one_wrapper_list() -> None:
    """Every import between reference_impl modules, function-level ones included, points one way."""
    import ast

    import reference_impl

    root = Path(reference_impl.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        graph[path.stem] = {node.module.rsplit(".", 1)[-1] for node in ast.walk(tree)
                            if isinstance(node, ast.ImportFrom) and node.module
                            and node.module.startswith("reference_impl.")}
        graph[path.stem] |= {alias.name for node in ast.walk(tree)
                             if isinstance(node, ast.ImportFrom)
                             and node.module == "reference_impl" for alias in node.names}

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        return any(n == target or (n not in seen and reaches(n, target, seen | {n}))
                   for n in graph.get(start, ()))

    circles = [m for m in graph if reaches(m, m, set())]
    assert not circles, f"import circle through {circles}: {graph}"
    defining = [p.stem for p in root.glob("*.py")
                if '"_checkpoint_wrapped_module"' in p.read_text()]
    assert defining == ["model"], f"the wrapper-name list is written in {defining}"


@pytest.mark.moe_ep_world(WORLD)
def test_local_region_is_dtensors_own_placement() -> None:
    from torch.distributed.tensor import Partial, distribute_tensor

    from reference_impl.regions import RegionError, local_region

    plain = torch.arange(6.0)
    assert local_region(plain) == (plain, None)
    full = torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5)
    mesh = device_mesh((2, 2), ("ep", "etp"))
    t = distribute_tensor(full, mesh, [Shard(0), Shard(1)], src_data_rank=None)
    local, region = local_region(t)
    assert local.data_ptr() == t.to_local().data_ptr()
    assert region is not None and torch.equal(full[region],
                                              local), f"rank {dist.get_rank()}: {region}"
    with pytest.raises(ValueError, match="partial sums"):
        local_region(DTensor.from_local(torch.zeros(6, 5), mesh, [Partial(), Shard(0)]))
    wrong = DTensor.from_local(torch.zeros(2, 5), mesh, [Shard(0), Shard(1)], shape=full.shape,
                               stride=full.stride())
    with pytest.raises(RegionError) as info:
        local_region(wrong)
    assert info.value.local_shape == (2, 5) and info.value.placed_shape[0] == 3, str(info.value)

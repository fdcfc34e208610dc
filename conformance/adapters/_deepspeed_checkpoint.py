"""Read a DeepSpeed checkpoint directory in global form (key -> tensor or value) for the
``checkpoint`` check.

Two readers, one per MoE path; both read only what the engine wrote (``torch.load`` of DeepSpeed's
own files) and leave every EP-rank-local layout out of the keys, so a save at any EP degree gives
the keys of the ep=1 save:

* :func:`read_native` (``deepspeed``): ``mp_rank_00_model_states.pt``'s dense ``module`` weights,
  one ``layer_<l>_expert_<g>_...`` file per layer and global expert (keys as saved, with the global
  id), and the optimizer of every ``expp_rank_<r>_..._optim_states.pt`` file: a positional
  ``torch.optim`` state dict, mapped to parameter names the way DeepSpeed's own load consumes it (a
  rank's parameters in module order, dense group then expert group, that rank's experts
  ``r * E_local + i``), as ``optimizer.state.<param>.<stat>``.
* :func:`read_autoep` (``deepspeed-autoep*``): the same model-states and per-expert files (AutoEP's
  ``...experts.w1.<g>`` keys named ``...experts.<g>.w1``: the per-expert form the inspection
  recognises), the ZeRO files' hyperparameters, and the optimizer as DeepSpeed itself puts it in
  global form: ``ds_to_universal``
  (``<tag>_universal/zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt``), converted here once per
  checkpoint (the load at another EP degree reuses it).  A packed universal expert parameter
  (``[E, ...]``, the expert axis first) is given row by row under the per-expert weight's key, its
  step count with each, so weights and optimizer state name the same per-expert parameters.  A
  checkpoint ``ds_to_universal`` refuses (saved before the first optimizer step) has no optimizer
  keys, and ``universal_checkpoint`` says why.

Scalars (steps, sample counts, the DeepSpeed version, the config, each param group's
hyperparameters) are kept under their own names.  What legitimately depends on the EP degree is
listed in :data:`NATIVE_EP_DEPENDENT` and :data:`AUTOEP_EP_DEPENDENT`, the adapters'
``ep_dependent_keys``.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable
from typing import Any

__all__ = ["AUTOEP_EP_DEPENDENT", "NATIVE_EP_DEPENDENT", "read_autoep", "read_native"]

#: the expert param group's name is ``ep_size_<ep>`` (dense first, so expert groups are 1, 2, ...);
#: the model states' ``optimizer`` is rank 0's positional state dict (its local experts only), which
#: a MoE load never reads (it reads the ``expp_rank`` files).
NATIVE_EP_DEPENDENT = (r"^optimizer\.param_groups\.[1-9]\d*\.name$",
                       r"^mp_rank_00_model_states\.optimizer$")
#: also: the configured AutoEP degree, each layer's placement record as global rank 0 wrote it (its
#: local count, EP size and group name, rank -> experts, affine maps, its expert-data-parallel size,
#: its last expert), and the ZeRO param shapes of the expert group (local expert counts); and the
#: EP-group order the save used (``use_data_before_expert_parallelism``: the ep=1 truth is saved
#: with strided groups, the same ranks as consecutive ones at ep=1).
AUTOEP_EP_DEPENDENT = (
    r"^optimizer\.param_groups\.[1-9]\d*\.name$", r"^ds_config\.expert_parallel\.autoep_size$",
    r"^ds_autoep_layers\.\d+\.(?:num_local_experts|ep_size|ep_group_name|expert_placement|"
    r"affine_maps|expert_data_parallel_world_size|global_expert_end)$",
    r"^param_shapes\.[1-9]\d*$", r"^ds_config\.use_data_before_expert_parallelism$")
#: model-states entries compared as values (the rest: the module, the optimizer, ZeRO's partition
#: layout).
SCALARS = ("global_steps", "skipped_steps", "global_samples", "dp_world_size", "mp_world_size",
           "ds_version", "num_experts", "buffer_names", "checkpoint_parallel_dimensions")
EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt$")
OPTIM_FILE = re.compile(r"(?:expp|zero_pp)_rank_(\d+)_mp_rank_00_optim_states\.pt$")
AUTOEP_EXPERT_KEY = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<name>w[123])\.(?P<expert>\d+)$")
AUTOEP_PACKED_KEY = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<name>w[123])$")


def _load(file: str) -> Any:
    import torch

    # DeepSpeed's files hold its own classes
    return torch.load(file, map_location="cpu", weights_only=False)


def tag_dir(path: str) -> str:
    with open(os.path.join(path, "latest")) as fd:
        return os.path.join(path, fd.read().strip())


def _numbered(directory: str, pattern: re.Pattern[str]) -> list[tuple[tuple[int, ...], str]]:
    found = []
    for file in glob.glob(os.path.join(directory, "*.pt")):
        m = pattern.search(os.path.basename(file))
        if m:
            found.append((tuple(int(g) for g in m.groups()), file))
    return sorted(found)


def _flat(out: dict[str, Any], prefix: str, value: Any, depth: int = 8) -> None:
    """``value`` under ``prefix``; a plain dict or a list of dicts one key per entry (``a.b``,
    ``a.0.b``), down to ``depth`` levels (a deeper value is one entry)."""
    if depth > 0 and type(value) is dict:
        for k, v in value.items():
            _flat(out, f"{prefix}.{k}", v, depth - 1)
    elif depth > 0 and isinstance(value, list) and value and all(type(v) is dict for v in value):
        for i, v in enumerate(value):
            _flat(out, f"{prefix}.{i}", v, depth - 1)
    else:
        out[prefix] = list(value) if isinstance(value, tuple) else value


def _model_states(directory: str, out: dict[str, Any]) -> dict[str, Any]:
    """The model-states file's scalars and config into ``out``; the file's content is returned."""
    states = _load(os.path.join(directory, "mp_rank_00_model_states.pt"))
    for name in SCALARS:
        if name in states:
            out[name] = states[name]
    _flat(out, "ds_config", states.get("ds_config") or {})
    return states


def _groups(out: dict[str, Any], groups: Iterable[dict[str, Any]], names: list[list[str]],
            rank: int) -> None:
    """Each param group's hyperparameters (a rank that disagrees with the first gets its own keys)
    and the union of its parameters' names over ranks."""
    for i, group in enumerate(groups):
        for field, value in group.items():
            if field == "params":
                key = f"optimizer.param_groups.{i}.params"
                out[key] = sorted(set(out.get(key, [])) | set(names[i]))
                continue
            key = f"optimizer.param_groups.{i}.{field}"
            value = list(value) if isinstance(value, tuple) else value
            if key in out and out[key] != value:
                key = f"{key}@rank{rank}"
            out.setdefault(key, value)


def read_native(path: str) -> dict[str, Any]:
    """The global form of a native-MoE engine checkpoint (see the module docstring)."""
    directory = tag_dir(path)
    out: dict[str, Any] = {}
    states = _model_states(directory, out)
    buffers = set(states.get("buffer_names") or ())
    out.update(states["module"])
    out["mp_rank_00_model_states.optimizer"] = states.get("optimizer")
    experts: dict[tuple[int, int], list[str]] = {}
    for (layer, g), file in _numbered(directory, EXPERT_FILE):
        expert_state = _load(file)
        experts[(layer, g)] = list(expert_state)
        out.update(expert_state)
    dense = [k for k in states["module"] if k not in buffers]
    files = _numbered(directory, OPTIM_FILE)
    for (rank,), file in files:
        optimizer = _load(file).get("optimizer")
        if optimizer is None:
            continue
        names = _native_names(optimizer["param_groups"], dense, experts, states.get("num_experts")
                              or [], len(files), rank, file)
        positions = {index: name
                     for group, group_names in zip(optimizer["param_groups"], names, strict=True)
                     for index, name in zip(group["params"], group_names, strict=True)}
        for index, state in optimizer["state"].items():
            for stat, value in state.items():
                _check_shape(out, positions[index], stat, value, file)
                out[f"optimizer.state.{positions[index]}.{stat}"] = value
        _groups(out, optimizer["param_groups"], names, rank)
    return out


def _native_names(groups: list[dict[str, Any]], dense: list[str],
                  experts: dict[tuple[int, int], list[str]],
                  num_experts: list[int], ep: int, rank: int, file: str) -> list[list[str]]:
    """The parameter names of each param group of EP rank ``rank``'s optimizer, in DeepSpeed's
    positional order: ``configure_moe_param_groups`` over ``model.parameters()`` keeps module order
    within the dense and the expert group, and EP rank ``r`` holds experts ``r * E_local ...`` of
    each layer (DeepSpeed's own rule)."""
    mine = [key for layer, count in enumerate(num_experts) for local in range(count // ep)
            for key in experts.get((layer, rank * (count // ep) + local), [])]
    names = [mine if group.get("moe") else dense for group in groups]
    for group, group_names in zip(groups, names, strict=True):
        if len(group["params"]) != len(group_names):
            raise ValueError(f"{file}: param group {group.get('name')!r} lists "
                             f"{len(group['params'])} parameters, expected {len(group_names)} (the "
                             f"{'expert' if group.get('moe') else 'dense'} parameters of EP rank "
                             f"{rank} of {ep})")
    return names


def _check_shape(out: dict[str, Any], param: str, stat: str, value: Any, file: str) -> None:
    weight = out.get(param)
    shape = getattr(value, "shape", None)
    if (stat != "step" and weight is not None and shape is not None
        and tuple(shape) != tuple(weight.shape)):
        raise ValueError(
            f"{file}: the optimizer's {stat!r} for {param!r} has shape {tuple(shape)}, the "
            f"parameter's is {tuple(weight.shape)}: the positional mapping does not hold")


def read_autoep(path: str) -> dict[str, Any]:
    """The global form of an AutoEP (ZeRO-1/2) engine checkpoint and its universal checkpoint."""
    from conformance.adapters._deepspeed_universal import convert_locked

    directory = tag_dir(path)
    out: dict[str, Any] = {}
    states = _model_states(directory, out)
    out.update(states["module"])
    for i, shapes in enumerate(states.get("param_shapes") or []):
        out[f"param_shapes.{i}"] = [[name, list(shape)] for name, shape in shapes.items()]
    _flat(out, "ds_autoep_layers", states.get("ds_autoep_layers") or [], depth=2)
    info = dict(states.get("universal_checkpoint_info") or {})
    info.pop("ds_autoep_layers", None)  # a copy of the model states' own
    _flat(out, "universal_checkpoint_info", info)
    for _, file in _numbered(directory, EXPERT_FILE):
        for key, value in _load(file).items():
            m = AUTOEP_EXPERT_KEY.match(key)
            out[f"{m['prefix']}.{m['expert']}.{m['name']}" if m else key] = value
    for (rank,), file in _numbered(directory, OPTIM_FILE):
        zero = _load(file)["optimizer_state_dict"]
        for field in ("dynamic_loss_scale", "overflow", "clip_grad"):
            out.setdefault(field, zero.get(field))
        out.setdefault("zero_stage", int(zero.get("zero_stage", 0)))
        groups = zero["base_optimizer_state"]["param_groups"]
        _groups(out, groups, [[] for _ in groups], rank)
    for key in [k for k in out if k.endswith(".params")
                and k.startswith("optimizer.param_groups.")]:
        # a ZeRO group's params are its flat partitions' positions; the universal keys name them
        del out[key]
    try:
        convert_locked(path)
    except Exception as exc:  # DeepSpeed's refusal is content: both sides of the comparison show it
        out["universal_checkpoint"] = (f"ds_to_universal failed: {type(exc).__name__}: "
                                       f"{' '.join(str(exc).split())}")
        return out
    out["universal_checkpoint"] = "converted"
    zero_dir = os.path.join(f"{directory}_universal", "zero")
    for param in sorted(os.listdir(zero_dir)):
        m = AUTOEP_PACKED_KEY.match(param)
        for file in sorted(glob.glob(os.path.join(zero_dir, param, "*.pt"))):
            value = _load(file)
            stat = os.path.basename(file)[:-3]
            tensor = value["param"] if isinstance(value, dict) else value
            if m is None:
                out[f"optimizer.state.{param}.{stat}"] = tensor
                continue
            experts = int(value.get("ep_num_experts", 0)) if isinstance(value, dict) else 0
            # the expert axis is dim 0 (cat_dim)
            for g in range(experts or int(states["num_experts"][0])):
                out[f"optimizer.state.{m['prefix']}.{g}.{m['name']}.{stat}"] = (
                    tensor[g] if tensor.dim() else tensor)
    return out

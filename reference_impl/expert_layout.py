"""Expert-parallel experts under their global identity in a DCP state dict.

After :func:`reference_impl.moe.apply_expert_parallel` every EP rank names and shapes its experts
as if they were the layer's only ones: unpacked experts are ``experts.0 ..`` on every rank, and a
packed weight has ``num_local_experts`` rows under the same name on every rank.
torch.distributed.checkpoint (DCP) writes one copy per name and offset, so a checkpoint of those
state dicts keeps one rank's experts in place of all of them: loading at the same ep silently
hands every rank that rank's experts, and at another ep the load fails.

:class:`ExpertLayout` translates the state dict DCP sees, on the way out and back in:

- an unpacked local expert ``i`` is renamed to its global index ``local_expert_start + i``;
- a packed weight becomes a DTensor whose global shape covers all ``num_experts`` rows, sharded
  ``Shard(0)`` over the ep mesh, or ``(Shard(0), Shard(0))`` over ``(ep, dp_shard)`` when FSDP2
  already shards the rank's rows.  DTensor's uneven rule for nested ``Shard(0)`` is
  ``torch.chunk`` on each mesh dimension in turn, which is exactly the layout rule
  (:func:`reference_impl.layout.expert_range`) followed by FSDP2's own ``torch.chunk`` split, so
  the DTensor describes the rows the rank really holds; :meth:`ExpertLayout.to_global` checks
  that and refuses a tensor it would misplace.

The checkpoint then holds every expert once, exactly as an ep=1 run saves it, and DCP reshards
it to any ep on load.  Every tensor of the translated dict is the original or a view of it, so
nothing is copied, and a load into it writes straight into the model and the optimizer.

:func:`check_saved_experts` refuses checkpoints written the old way, before they do harm.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from reference_impl.moe import WRAPPER_PARTS, MoEMLP, moe_layers
from reference_impl.regions import local_region

__all__ = ["ExpertLayout", "check_saved_experts", "expert_layout", "moe_layers"]

def expert_layout(model: nn.Module) -> ExpertLayout | None:
    """The layout of ``model``'s expert-parallel layers; ``None`` when no layer splits its experts."""
    layers = [(name, moe) for name, moe in moe_layers(model) if moe.ep_world_size > 1]
    return ExpertLayout(layers) if layers else None


def _prefix(name: str) -> str:
    return f"{name}." if name else ""


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def _root_mesh(mesh: Any) -> Any:
    get_root = getattr(mesh, "_get_root_mesh", None)
    return get_root() if get_root is not None else mesh


class ExpertLayout:
    """Translates a DCP state dict between one EP rank's experts and all of the layer's.

    :meth:`to_global` translates the ``"model"`` and ``"optimizer"`` entries of a state dict, and
    the names in every other entry that maps parameter names to values (a record of never-stepped
    parameters, say).  :meth:`to_local` undoes it once a load has filled the result; it needs the
    record :meth:`to_global` kept, so one layout serves one save or one load.

    ``layers`` are the split :class:`MoEMLP` layers with their names, as :func:`moe_layers` gives.
    """

    def __init__(self, layers: list[tuple[str, MoEMLP]]) -> None:
        self.layers = list(layers)
        #: local FQN -> global FQN of every unpacked expert parameter, and back.
        self._to_global: dict[str, str] = {}
        #: packed weight FQN -> its layer.
        self._packed: dict[str, MoEMLP] = {}
        for name, moe in self.layers:
            pre = _prefix(name)
            if moe.kind == "unpacked":
                for i, expert in enumerate(moe.experts):
                    g = moe.local_expert_start + i
                    for pname, _ in expert.named_parameters():
                        pname = ".".join(p for p in pname.split(".") if p not in WRAPPER_PARTS)
                        self._to_global[f"{pre}experts.{i}.{pname}"] = f"{pre}experts.{g}.{pname}"
            else:
                for weight in moe.packed_weights():
                    self._packed[f"{pre}{weight}"] = moe
        self._to_local = {v: k for k, v in self._to_global.items()}
        self._nested_meshes: dict[int, Any] = {}
        #: what to_global made: id(DTensor) -> (the DTensor, the tensor it wraps).
        self._made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: this rank's parameter names per optimizer param group, as to_global found them.
        self._local_groups: list[list[str]] | None = None

    # ---------------------------------------------------------------- packed weights as DTensors

    def _nested_mesh(self, moe: MoEMLP, fsdp_mesh: Any) -> Any:
        """The ``(ep, dp_shard)`` mesh: ep first, because the EP split happened first."""
        mesh = self._nested_meshes.get(id(fsdp_mesh))
        if mesh is None:
            root = _root_mesh(moe.ep_mesh)
            if _root_mesh(fsdp_mesh) is not root:
                raise ValueError(f"the FSDP mesh {fsdp_mesh} and the ep mesh {moe.ep_mesh} of MoE layer "
                                 f"{moe.name!r} do not come from one device mesh")
            mesh = root[(moe.ep_mesh.mesh_dim_names[0], fsdp_mesh.mesh_dim_names[0])]
            self._nested_meshes[id(fsdp_mesh)] = mesh
        return mesh

    def _globalize(self, key: str, moe: MoEMLP, value: torch.Tensor) -> torch.Tensor:
        """``value`` (this rank's rows) as a DTensor over all ``num_experts`` rows; no copy."""
        from torch.distributed.tensor import DTensor, Shard

        global_shape = (moe.num_experts, *value.shape[1:])
        local, region = local_region(value)
        if isinstance(value, DTensor):  # FSDP2 already shards the rank's rows over dp_shard
            if value.device_mesh.ndim != 1 or tuple(value.placements) != (Shard(0),):
                raise ValueError(f"{key!r} is a DTensor placed {tuple(value.placements)} on "
                                 f"{value.device_mesh}; only FSDP2's Shard(0) on one mesh dim is supported")
            row, mesh, placements = region[0].start, self._nested_mesh(moe, value.device_mesh), (Shard(0), Shard(0))
        else:
            row, mesh, placements = 0, moe.ep_mesh, (Shard(0),)
        with torch.no_grad():
            wrapped = DTensor.from_local(local, mesh, placements, run_check=False,
                                         shape=torch.Size(global_shape), stride=_contiguous_stride(global_shape))
        # DCP places the data by the DTensor's computed local shape and offset, never the local
        # tensor's, so they must be what this rank holds or the checkpoint silently mixes rows up.
        first = moe.local_expert_start + row
        try:
            _, placed = local_region(wrapped)
        except ValueError as exc:
            raise ValueError(f"{key!r}: this rank holds rows {first}.. of shape {tuple(local.shape)}, "
                             f"but {exc}") from None
        if local.shape[0] and placed is not None and placed[0].start != first:
            raise ValueError(f"{key!r}: this rank holds rows {first}.. of shape {tuple(local.shape)}, but DTensor "
                             f"{placements} on {mesh} places them at row {placed[0].start}")
        self._made[id(wrapped)] = (wrapped, value)
        return wrapped

    def _unwrap(self, value: Any) -> Any:
        made = self._made.get(id(value))
        if made is not None and made[0] is value:
            return made[1]
        return value

    # ---------------------------------------------------------------- the two directions

    def to_global(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` with each rank's experts placed among all of the layer's experts.

        Returns a new dict and leaves ``state`` as it is.  Each tensor in the result is the one it
        replaces or a view of it, so a load into the result loads them.

        Raises ValueError when the model state lacks the expert weights of a split layer, or the
        optimizer holds a tensor for a packed weight in a shape other than the weight's: the
        checkpoint could not hold every rank's experts.
        """
        model = state.get("model")
        if not isinstance(model, Mapping):
            raise ValueError("the state has no 'model' entry; ExpertLayout needs the model's expert weights")
        missing = [k for k in (*self._to_global, *self._packed) if k not in model]
        if missing:
            raise ValueError(f"the model state lacks {len(missing)} expert weight(s) of split MoE layers, "
                             f"first {missing[:3]}; was it taken from another model or filtered?")
        self._made.clear()
        out = dict(state)
        out["model"] = {self._to_global.get(k, k): self._globalize(k, self._packed[k], v)
                        if k in self._packed else v for k, v in model.items()}
        optimizer = state.get("optimizer")
        if optimizer is not None:
            out["optimizer"] = self._optimizer_to_global(optimizer, model)
        for key, value in state.items():
            if key not in ("model", "optimizer") and isinstance(value, Mapping):
                out[key] = self._rename(value, self._to_global)
        return out

    def _optimizer_to_global(self, optimizer: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
        states: dict[str, Any] = {}
        for key, entry in optimizer.get("state", {}).items():
            moe = self._packed.get(key)
            if moe is None:
                states[self._to_global.get(key, key)] = dict(entry) if isinstance(entry, Mapping) else entry
                continue
            expected = tuple(model[key].shape)
            new_entry = {}
            for name, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:  # scalars such as `step` stay
                    if tuple(value.shape) != expected:
                        raise ValueError(f"optimizer state {key!r}[{name!r}] has shape {tuple(value.shape)}, "
                                         f"expected {expected} (the packed weight's); it cannot be placed "
                                         f"among all {moe.num_experts} experts")
                    value = self._globalize(f"{key}.{name}", moe, value)
                new_entry[name] = value
            states[key] = new_entry
        groups = optimizer.get("param_groups", [])
        self._local_groups = [list(group["params"]) for group in groups]
        out = dict(optimizer)
        out["state"] = states
        out["param_groups"] = [{**group, "params": [self._to_global.get(p, p) for p in group["params"]]}
                               for group in groups]
        return out

    @staticmethod
    def _rename(mapping: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
        return {names.get(k, k) if isinstance(k, str) else k: v for k, v in mapping.items()}

    def to_local(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Undo :meth:`to_global` on the state dict that a load filled.

        Names go back to this rank's, and each view :meth:`to_global` made goes back to the tensor
        it views, which holds what the load wrote.  Each optimizer param group lists this rank's
        parameters again and keeps the loaded settings (lr, betas, ...).
        """
        out = dict(state)
        if isinstance(state.get("model"), Mapping):
            out["model"] = {self._to_local.get(k, k): self._unwrap(v) for k, v in state["model"].items()}
        optimizer = state.get("optimizer")
        if optimizer is not None:
            groups = optimizer.get("param_groups", [])
            if self._local_groups is None or len(self._local_groups) != len(groups):
                raise ValueError(f"the optimizer state has {len(groups)} param groups, but to_global of this "
                                 f"layout saw {self._local_groups and len(self._local_groups)}; call to_local "
                                 f"on the dict to_global returned")
            out["optimizer"] = {
                **optimizer,
                "state": {self._to_local.get(k, k): {n: self._unwrap(v) for n, v in entry.items()}
                          if isinstance(entry, Mapping) else entry
                          for k, entry in optimizer.get("state", {}).items()},
                "param_groups": [{**group, "params": list(params)}
                                 for group, params in zip(groups, self._local_groups, strict=True)],
            }
        for key, value in state.items():
            if key not in ("model", "optimizer") and isinstance(value, Mapping):
                out[key] = self._rename(value, self._to_local)
        return out


# ---------------------------------------------------------------- legacy checkpoints

_UNPACKED_KEY = re.compile(r"^(.*?)experts\.(\d+)\.")


def check_saved_experts(model: nn.Module, saved: Mapping[str, Any], where: str) -> None:
    """Refuse a checkpoint whose MoE layers hold fewer experts than ``model``'s.

    ``saved`` is the checkpoint's DCP index, its ``Metadata.state_dict_metadata``; its keys are
    the flattened names (``"model.layers.0.moe.up_w"``; a bare ``"layers.0.moe.up_w"`` is read
    too).  A checkpoint saved with ep > 1 before the experts had a global identity holds
    ``num_experts / ep`` experts of each layer: every EP rank wrote its own under the same names
    and the checkpoint kept one rank's.  Loading it at the same ep would give every rank that
    rank's experts, and at another ep it fails on the experts it lacks, so it is refused here with
    what it holds.  A layer the checkpoint holds no expert of is left to the load.
    """
    unpacked: dict[str, set[int]] = {}
    for key in saved:
        match = _UNPACKED_KEY.match(key)
        if match:
            unpacked.setdefault(match.group(1), set()).add(int(match.group(2)))
    for name, moe in moe_layers(model):
        pre = _prefix(name)
        held: int | None = None
        for candidate in (f"model.{pre}", pre):
            if moe.kind == "unpacked":
                if candidate in unpacked:
                    held = len(unpacked[candidate])
            else:
                rows = [saved[f"{candidate}{w}"].size[0] for w in moe.packed_weights()
                        if hasattr(saved.get(f"{candidate}{w}"), "size")]
                if rows:
                    held = min(rows)
            if held is not None:
                break
        if held is not None and held < moe.num_experts:
            raise ValueError(
                f"{where}: the checkpoint holds {held} experts of MoE layer {name or '<model>'!r}, but the "
                f"model has {moe.num_experts}. It was probably saved with expert parallelism before experts "
                f"had a global identity (every EP rank wrote its experts under the same names and the "
                f"checkpoint kept one rank's), so it cannot restore every expert; refusing to load it")

"""Experts under their global identity in a DCP state dict: the packed form and the per-expert form.

After :func:`reference_impl.parallelize.apply_expert_parallel` every EP rank names and shapes its experts
as if they were the layer's only ones: unpacked experts are ``experts.0 ..`` on every rank, and a
packed weight has ``num_local_experts`` rows under the same name on every rank.
torch.distributed.checkpoint (DCP) writes one copy per name and offset, so a checkpoint of those
state dicts keeps one rank's experts in place of all of them: loading at the same ep silently
hands every rank that rank's experts, and at another ep the load fails.

:class:`ExpertLayout` translates the state dict DCP sees, on the way out and back in, into one of two
**global checkpoint forms**, each holding every expert of every layer once under its global id:

- the **packed form** (seed 001's, what :func:`reference_impl.checkpoint.save` writes for packed
  layers): ``layers.N.moe.up_w`` ``[E, ...]`` and its moments, row ``G`` expert ``G``.  A packed layer
  presents its weight as a DTensor whose rows cover all experts (``Shard(0)`` over ``ep``, nested with
  the FSDP/HSDP and ``etp`` placements the weight already has; no copy), so a rank's rows sit at their
  global offset.  It is one DCP item per weight and moment per rank's chunk whatever E is.
- the **per-expert form** (what unpacked layers save, and packed ones with ``per_expert=True``):
  ``layers.N.moe.experts.G.{gate,up,down}.weight`` with the expert's full shape (``[hidden, dim]``,
  ``[dim, hidden]``), and its optimizer state under the same name
  (``optimizer.state.layers.N.moe.experts.G.up.weight.exp_avg`` ...): an unpacked local expert ``i`` is
  renamed to its global index ``local_expert_start + i``; a packed weight (and each moment) is cut into
  its rows, row ``i`` presented as expert ``local_expert_start + i`` -- a view of the row, or, under
  expert tensor parallelism, a DTensor over the ``etp`` mesh on the view (:func:`expert_rows`).

DCP reshards either form exactly (a whole tensor, or the ``ep``/FSDP/``etp`` shards of one), so a
checkpoint saved at any (ep, etp, kind, FSDP/HSDP) loads at any other; optimizer moments follow their
weights.  Each form loads into either kind (``packed_form`` names the layers a checkpoint holds packed):

- per-expert into packed, and either form into its own kind: every tensor of the translated dict is
  the original or a view of it, so nothing is copied and a load writes straight into the model and the
  optimizer;
- packed into unpacked: an unpacked layer's experts are separate tensors that no DTensor can present as
  one ``[E, ...]``, so they are **copied**: this rank's experts are stacked into one staging tensor per
  weight and moment (each expert's placements one dim further in), presented as a packed layer's are,
  loaded, and copied back into each expert and its moments by :meth:`ExpertLayout.to_local` (one copy of
  this rank's expert weights and moments each way; ``benchmarks/bench_layout.py`` measures it).  A save
  never needs it: unpacked layers save per expert.

:func:`check_saved_experts` refuses checkpoints written the old, lossy way, before they do harm.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from reference_impl.meshes import sliced
from reference_impl.model import PACKED_WEIGHTS, WRAPPER_PARTS, MoEMLP, moe_layers
from reference_impl.regions import contiguous_stride, local_region, packed_rows

__all__ = ["ExpertLayout", "check_saved_experts", "expert_key", "expert_layout", "expert_rows", "moe_layers",
           "packed_layers", "saved_packed_layers"]


def expert_layout(model: nn.Module, packed_form: Collection[str] = ()) -> ExpertLayout | None:
    """The layout of ``model``'s MoE layers; ``None`` when no layer needs translating.

    Every packed layer and every split unpacked layer is translated to the per-expert form; whole
    unpacked layers already are in it.  ``packed_form`` names layers (either kind) to present in the
    packed ``[E, ...]`` form instead: a save's packed layers (:func:`packed_layers`), a load's whatever
    its checkpoint holds packed (:func:`saved_packed_layers`).
    """
    layers = [(name, moe) for name, moe in moe_layers(model)
              if moe.kind == "packed" or moe.ep_world_size > 1 or name in packed_form]
    return ExpertLayout(layers, packed_form) if layers else None


def packed_layers(model: nn.Module) -> set[str]:
    """The names of ``model``'s packed MoE layers: what :func:`reference_impl.checkpoint.save` keeps packed."""
    return {name for name, moe in moe_layers(model) if moe.kind == "packed"}


def expert_key(layer: str, expert: int, linear: str) -> str:
    """The canonical name of global expert ``expert``'s ``linear`` weight in MoE layer ``layer``."""
    return f"{_prefix(layer)}experts.{expert}.{linear}.weight"


def _prefix(name: str) -> str:
    return f"{name}." if name else ""


def _root_mesh(mesh: Any) -> Any:
    get_root = getattr(mesh, "_get_root_mesh", None)
    return get_root() if get_root is not None else mesh


def expert_rows(moe: MoEMLP, tensor: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """The rows of a packed weight (or moment) this rank holds, each with its global expert id: the one row rule
    (:func:`reference_impl.regions.packed_rows`), from the layer's first local expert.  Nothing is copied."""
    return packed_rows(tensor, moe.local_expert_start, where=f"MoE layer {moe.name!r}: a packed weight")


class ExpertLayout:
    """Translates a DCP state dict between one rank's experts and the global checkpoint forms.

    :meth:`to_global` translates the ``"model"`` and ``"optimizer"`` entries of a state dict, and
    the names in every other entry that maps parameter names to values (a record of never-stepped
    parameters, say).  :meth:`to_local` undoes it once a load has filled the result; it needs the
    record :meth:`to_global` kept, so one layout serves one save or one load.

    ``layers`` are the :class:`MoEMLP` layers to translate with their names, as :func:`moe_layers`
    gives; ``packed_form`` names the layers (either kind) to present in the packed ``[E, ...]`` form, the
    others are presented per expert.
    """

    def __init__(self, layers: list[tuple[str, MoEMLP]], packed_form: Collection[str] = ()) -> None:
        self.layers = list(layers)
        #: local FQN -> global FQN of every unpacked expert parameter.
        self._to_global: dict[str, str] = {}
        #: packed weight FQN -> (its layer, its layer's name, linear): saved per expert.
        self._split: dict[str, tuple[MoEMLP, str, str]] = {}
        #: packed weight FQN -> its layer: presented in the packed form (split layers only).
        self._packed: dict[str, MoEMLP] = {}
        #: packed-form FQN of an unpacked layer -> (its layer, its local experts' FQNs): loaded through a stack.
        self._staged: dict[str, tuple[MoEMLP, list[str]]] = {}
        #: an unpacked expert's FQN -> the packed-form FQN it is staged under.
        self._members: dict[str, str] = {}
        #: what to_global stacked, for to_local: (the stack, the tensors it copied), in that order.
        self._stacks: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        for name, moe in self.layers:
            pre = _prefix(name)
            if moe.kind == "unpacked":
                for i, expert in enumerate(moe.experts):
                    g = moe.local_expert_start + i
                    for pname, _ in expert.named_parameters():
                        pname = ".".join(p for p in pname.split(".") if p not in WRAPPER_PARTS)
                        self._to_global[f"{pre}experts.{i}.{pname}"] = f"{pre}experts.{g}.{pname}"
                if name in packed_form and len(moe.experts):
                    for weight in PACKED_WEIGHTS:
                        if hasattr(moe.experts[0], weight[:-2]):
                            members = [f"{pre}experts.{i}.{weight[:-2]}.weight" for i in range(len(moe.experts))]
                            self._staged[f"{pre}{weight}"] = (moe, members)
                            self._members.update(dict.fromkeys(members, f"{pre}{weight}"))
            else:
                for weight in moe.packed_weights():
                    if name not in packed_form:
                        self._split[f"{pre}{weight}"] = (moe, name, weight[:-2])
                    elif moe.ep_world_size > 1:
                        self._packed[f"{pre}{weight}"] = moe
        #: what to_global made: id(DTensor) -> (the DTensor, the tensor it wraps).
        self._made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: what to_global saw, for to_local: the state, and each packed weight's per-expert names.
        self._seen: dict[str, Any] = {}
        self._expert_keys: dict[str, list[str]] = {}
        #: this rank's parameter names per optimizer param group, as to_global found them.
        self._local_groups: list[list[str]] | None = None

    # ---------------------------------------------------------------- the packed form

    def _globalize(self, key: str, moe: MoEMLP, value: torch.Tensor) -> torch.Tensor:
        """``value`` (this rank's rows) as a DTensor over all ``num_experts`` rows; no copy.

        The mesh is the ``ep`` dim with the dims ``value`` is already placed on (FSDP/HSDP, etp), in
        the root mesh's order; ``ep`` must come before any dim that splits rows again, because the
        EP split happened first and DTensor applies nested ``Shard(0)`` in mesh order.
        """
        from torch.distributed.tensor import DTensor, Shard

        from reference_impl.regions import RegionError

        global_shape = (moe.num_experts, *value.shape[1:])
        local, region = local_region(value)
        ep_name = moe.ep_mesh.mesh_dim_names[0]
        if isinstance(value, DTensor):
            # Torch may hand out one cached submesh for equal rank groups of different root meshes, so
            # "the same device mesh" is checked by dim names and ranks, not by object identity.
            root, names = _root_mesh(moe.ep_mesh), tuple(value.device_mesh.mesh_dim_names or ())
            order = root.mesh_dim_names or ()
            if (not names or any(n not in order for n in names)
                    or sliced(root, names).mesh.tolist() != value.device_mesh.mesh.tolist()):
                raise ValueError(f"{key!r}: its mesh {value.device_mesh} and the ep mesh {moe.ep_mesh} of MoE "
                                 f"layer {moe.name!r} do not come from one device mesh with named dims")
            placement_of = {**dict(zip(names, value.placements, strict=True)), ep_name: Shard(0)}
            split_rows = {n for n, p in placement_of.items() if isinstance(p, Shard) and p.dim == 0}
            early = [n for n in names if order.index(n) < order.index(ep_name) and n in split_rows]
            if early:
                raise ValueError(f"{key!r}: mesh dims {early} split the expert rows but come before {ep_name!r} in "
                                 f"the device mesh {order}; DTensor would nest them first")
            dims = tuple(sorted({ep_name, *names}, key=order.index))
            mesh = sliced(root, dims)
            row, placements = region[0].start if region else 0, tuple(placement_of[d] for d in dims)
        else:
            row, mesh, placements = 0, moe.ep_mesh, (Shard(0),)
        with torch.no_grad():
            wrapped = DTensor.from_local(local, mesh, placements, run_check=False,
                                         shape=torch.Size(global_shape), stride=contiguous_stride(global_shape))
        # DCP places the data by the DTensor's computed local shape and offset, never the local
        # tensor's, so they must be what this rank holds or the checkpoint silently mixes rows up.
        first = moe.local_expert_start + row
        count = local.shape[0]
        held = (f"rows {first}..{first + count - 1}" if count else f"no rows (from {first})") + \
            f" of {global_shape[0]}"
        try:
            _, placed = local_region(wrapped)
        except RegionError as exc:  # what differs, once: the rows held, the shard placed
            raise ValueError(f"{key!r}: this rank holds {held} (local shape "
                             f"{exc.local_shape}), but DTensor {placements} on {mesh} gives it "
                             f"shape {exc.placed_shape} at offset {exc.offset}: a split other "
                             "than Shard(0)'s, whose rows DCP would misplace") from None
        except ValueError as exc:
            raise ValueError(f"{key!r}: this rank holds {held} (local shape {tuple(local.shape)}): "
                             f"{exc}") from None
        if local.shape[0] and placed is not None and (placed[0].start != first or (
                region is not None and placed[1:] != region[1:])):
            at = f"rows {placed[0].start}..{placed[0].stop - 1}"
            if region is not None and placed[1:] != region[1:]:
                at += f" and {placed[1:]} of the inner dims, not {region[1:]}"
            raise ValueError(f"{key!r}: this rank holds {held} (local shape {tuple(local.shape)}), "
                             f"but DTensor {placements} on {mesh} places them at {at}")
        self._made[id(wrapped)] = (wrapped, value)
        return wrapped

    def _stack(self, key: str, moe: MoEMLP, values: list[torch.Tensor]) -> torch.Tensor:
        """This rank's experts' ``values`` as one packed tensor of its rows among all experts: a copy (see the
        module docstring), each DTensor placement of an expert ``Shard(d)`` becoming ``Shard(d + 1)``."""
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        first = values[0]
        with torch.no_grad():
            if isinstance(first, DTensor):
                shape = torch.Size((len(values), *first.shape))
                # a new outer dim: every shard (FSDP's over etp's is strided) splits the same rows one dim further in
                placements = [_StridedShard(p.dim + 1, split_factor=p.split_factor) if isinstance(p, _StridedShard)
                              else Shard(p.dim + 1) if isinstance(p, Shard) else p for p in first.placements]
                stacked: torch.Tensor = DTensor.from_local(
                    torch.stack([local_region(v)[0] for v in values]), first.device_mesh, placements, run_check=False,
                    shape=shape, stride=contiguous_stride(tuple(shape)))
            else:
                stacked = torch.stack(list(values))
        self._stacks.append((stacked, values))
        return self._globalize(key, moe, stacked) if moe.ep_world_size > 1 else stacked

    def _copy_back(self) -> None:
        """Each stacked expert's loaded rows into the expert (and moment) they were copied from."""
        with torch.no_grad():
            for stacked, values in self._stacks:
                rows = local_region(stacked)[0]
                for i, value in enumerate(values):
                    local_region(value)[0].copy_(rows[i])

    def _unwrap(self, value: Any) -> Any:
        made = self._made.get(id(value))
        if made is not None and made[0] is value:
            return made[1]
        return value

    # ---------------------------------------------------------------- the two directions

    def to_global(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` with each rank's experts in the global form, among all of the layer's experts.

        Returns a new dict and leaves ``state`` as it is.  Each tensor in the result is the one it
        replaces or a view of it, so a load into the result loads them.

        Raises ValueError when the model state lacks the expert weights of a translated layer, or the
        optimizer holds a tensor for a packed weight in a shape other than the weight's: the
        checkpoint could not hold every rank's experts.
        """
        model = state.get("model")
        if not isinstance(model, Mapping):
            raise ValueError("the state has no 'model' entry; ExpertLayout needs the model's expert weights")
        missing = [k for k in (*self._to_global, *self._split, *self._packed) if k not in model]
        if missing:
            raise ValueError(f"the model state lacks {len(missing)} expert weight(s) of split MoE layers, "
                             f"first {missing[:3]}; was it taken from another model or filtered?")
        self._made.clear()
        self._stacks.clear()
        self._seen = {"state": state}
        self._expert_keys = {}
        out = dict(state)
        out["model"] = {}
        for key, value in model.items():
            if key in self._split:
                moe, layer, linear = self._split[key]
                rows = expert_rows(moe, value)
                self._expert_keys[key] = [expert_key(layer, g, linear) for g, _ in rows]
                out["model"].update((expert_key(layer, g, linear), row) for g, row in rows)
            elif key in self._packed:
                out["model"][key] = self._globalize(key, self._packed[key], value)
            elif key not in self._members:
                out["model"][self._to_global.get(key, key)] = value
        for key, (moe, members) in self._staged.items():
            out["model"][key] = self._stack(key, moe, [model[m] for m in members])
        optimizer = state.get("optimizer")
        if optimizer is not None:
            out["optimizer"] = self._optimizer_to_global(optimizer, model)
        for key, value in state.items():
            if key not in ("model", "optimizer") and isinstance(value, Mapping):
                out[key] = self._names_to_global(value)
        return out

    def _names_to_global(self, mapping: Mapping[Any, Any]) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for key, value in mapping.items():
            if key in self._members:
                out[self._members[key]] = value
                continue
            for new in self._expert_keys.get(key, [self._to_global.get(key, key)] if key not in self._split else []):
                out[new] = value
        return out

    def _optimizer_to_global(self, optimizer: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
        states: dict[str, Any] = {}
        for key, entry in optimizer.get("state", {}).items():
            if key in self._members:
                continue
            if key not in self._split and key not in self._packed:
                states[self._to_global.get(key, key)] = dict(entry) if isinstance(entry, Mapping) else entry
                continue
            moe = self._split[key][0] if key in self._split else self._packed[key]
            expected = tuple(model[key].shape)
            tensors: dict[str, Any] = {}
            for name, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:  # scalars such as `step` stay
                    if tuple(value.shape) != expected:
                        raise ValueError(f"optimizer state {key!r}[{name!r}] has shape {tuple(value.shape)}, "
                                         f"expected {expected} (the packed weight's); it cannot be placed "
                                         f"among all {moe.num_experts} experts")
                    tensors[name] = value
            if key in self._packed:
                states[key] = {n: self._globalize(f"{key}.{n}", moe, v) if n in tensors else v
                               for n, v in entry.items()}
                continue
            rows = {name: expert_rows(moe, value) for name, value in tensors.items()}
            for i, new in enumerate(self._expert_keys[key]):
                states[new] = {n: rows[n][i][1] if n in rows else v for n, v in entry.items()}
        for key, (moe, members) in self._staged.items():
            entries = [optimizer.get("state", {}).get(m) for m in members]
            if all(e is None for e in entries):
                continue
            if any(e is None or set(e) != set(entries[0]) for e in entries):
                raise ValueError(f"the optimizer holds state for some experts of MoE layer {moe.name!r} only (or "
                                 f"different entries for them): {members}; they cannot be stacked into {key!r}")
            states[key] = {n: self._stack(f"{key}.{n}", moe, [e[n] for e in entries])
                           if isinstance(v, torch.Tensor) and v.dim() > 0 else v for n, v in entries[0].items()}
        groups = optimizer.get("param_groups", [])
        self._local_groups = [list(group["params"]) for group in groups]
        out = dict(optimizer)
        out["state"] = states
        out["param_groups"] = [{**group, "params": list(self._names_to_global(dict.fromkeys(group["params"])))}
                               for group in groups]
        return out

    def to_local(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Undo :meth:`to_global` on the state dict that a load filled.

        Names go back to this rank's, and each view :meth:`to_global` made goes back to the tensor
        it views, which holds what the load wrote.  Each optimizer param group lists this rank's
        parameters again and keeps the loaded settings (lr, betas, ...).  A packed weight's scalar
        state (AdamW's ``step``) comes from its first expert's entry; a rank that holds no row of
        it has no entry to load it from, so it takes the step of its param group's first parameter whose
        state was loaded (AdamW steps a group's parameters together), or, in a group of such weights alone (the
        experts in a group of their own on a rank that holds none), another group's.
        """
        seen = self._seen.get("state")
        if seen is None:
            raise ValueError("to_local needs the record of to_global; call it on the dict to_global returned")
        self._copy_back()
        out = dict(state)
        if isinstance(state.get("model"), Mapping):
            out["model"] = self._names_to_local(state["model"], seen["model"], self._unwrap)
        optimizer = state.get("optimizer")
        if optimizer is not None:
            groups = optimizer.get("param_groups", [])
            if self._local_groups is None or len(self._local_groups) != len(groups):
                raise ValueError(f"the optimizer state has {len(groups)} param groups, but to_global of this "
                                 f"layout saw {self._local_groups and len(self._local_groups)}; call to_local "
                                 f"on the dict to_global returned")
            out["optimizer"] = {
                **optimizer,
                "state": self._optimizer_state_to_local(optimizer.get("state", {}),
                                                        (seen.get("optimizer") or {}).get("state", {})),
                "param_groups": [{**group, "params": list(params)}
                                 for group, params in zip(groups, self._local_groups, strict=True)],
            }
        for key, value in state.items():
            if key not in ("model", "optimizer") and isinstance(value, Mapping):
                before = seen.get(key)
                out[key] = self._names_to_local(value, before if isinstance(before, Mapping) else {},
                                                lambda v: v)
        return out

    def _names_to_local(self, loaded: Mapping[Any, Any], before: Mapping[Any, Any], back: Any) -> dict[Any, Any]:
        """``loaded`` under this rank's names, in this rank's order; a packed weight's entry is the one it
        had before to_global (the load wrote into it through the per-expert views)."""
        to_local = {v: k for k, v in self._to_global.items()}
        per_expert = {new for news in self._expert_keys.values() for new in news} | set(self._staged)
        found = {to_local.get(k, k): back(v) for k, v in loaded.items() if k not in per_expert}
        found.update((key, before[key]) for key in (*self._split, *self._members) if key in before)
        out = {key: found.pop(key) for key in before if key in found}
        out.update(found)
        return out

    def _optimizer_state_to_local(self, loaded: Mapping[str, Any], before: Mapping[str, Any]) -> dict[str, Any]:
        out = self._names_to_local(
            loaded, before,
            lambda entry: {n: self._unwrap(v) for n, v in entry.items()} if isinstance(entry, Mapping) else entry)
        empty = []
        for key in self._split:
            if key not in before:
                continue
            entry = out[key] = dict(before[key])
            firsts = [loaded[k] for k in self._expert_keys.get(key, []) if k in loaded]
            scalars = [n for n, v in entry.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)]
            if firsts:
                entry.update((n, firsts[0][n]) for n in scalars if n in firsts[0])
            elif scalars:
                empty.append((key, scalars))
        for key, staged in self._members.items():  # the stack's scalars (AdamW's step) into each expert's own
            if key in before and staged in loaded:
                entry = out[key] = dict(before[key])
                for n, v in loaded[staged].items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        continue
                    if isinstance(entry.get(n), torch.Tensor) and isinstance(v, torch.Tensor):
                        with torch.no_grad():
                            entry[n].copy_(v)
                    else:
                        entry[n] = v
        rowless = {key for key, _ in empty}
        for key, scalars in empty:
            # the group's first parameter whose state the load wrote; a group of only this rank's row-less packed
            # weights (the experts in a group of their own, on a rank that holds no expert) takes another group's
            group = next((g for g in self._local_groups or [] if key in g), [])
            others = [p for g in self._local_groups or [] if g is not group for p in g]
            donor = next((out[p] for p in (*group, *others) if p in out and p not in rowless), None)
            for name in scalars:
                if donor is None or name not in donor:
                    continue
                mine, theirs = out[key][name], donor[name]
                if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and mine.shape == theirs.shape:
                    with torch.no_grad():
                        mine.copy_(theirs)
                else:
                    out[key][name] = theirs
        return out


# ---------------------------------------------------------------- what a checkpoint holds

_EXPERT_KEY = re.compile(r"^(.*?)experts\.(\d+)\.")


def _held(model: nn.Module, saved: Mapping[str, Any]) -> Iterator[tuple[str, MoEMLP, str | None, int | None]]:
    """Each MoE layer with the form its checkpoint entries take ("per-expert", "packed" or None) and
    how many experts they hold.  Model entries are ``model.<name>``; bare ``<name>`` is read too."""
    per_expert: dict[str, set[int]] = {}
    for key in saved:
        match = _EXPERT_KEY.match(key)
        if match:
            per_expert.setdefault(match.group(1), set()).add(int(match.group(2)))
    for name, moe in moe_layers(model):
        pre = _prefix(name)
        form, held = None, None
        for candidate in (f"model.{pre}", pre):
            rows = [saved[f"{candidate}{w}"].size[0] for w in PACKED_WEIGHTS
                    if hasattr(saved.get(f"{candidate}{w}"), "size")]
            if candidate in per_expert:
                form, held = "per-expert", len(per_expert[candidate])
            elif rows:
                form, held = "packed", min(rows)
            if form is not None:
                break
        yield name, moe, form, held


def check_saved_experts(model: nn.Module, saved: Mapping[str, Any], where: str) -> None:
    """Refuse a checkpoint whose MoE layers hold fewer experts than ``model``'s.

    ``saved`` is the checkpoint's DCP index, its ``Metadata.state_dict_metadata``; its keys are
    the flattened names (``"model.layers.0.moe.experts.3.up.weight"``, ``"model.layers.0.moe.up_w"``;
    bare names are read too).  Either form counts, whatever the model's kind.  A checkpoint saved
    with ep > 1 before the experts had a global identity holds ``num_experts / ep`` experts of each
    layer: every EP rank wrote its own under the same names and the checkpoint kept one rank's.
    Loading it at the same ep would give every rank that rank's experts, and at another ep it
    fails on the experts it lacks, so it is refused here with what it holds.  A layer the
    checkpoint holds no expert of is left to the load.
    """
    for name, moe, _, held in _held(model, saved):
        if held is not None and held < moe.num_experts:
            raise ValueError(
                f"{where}: the checkpoint holds {held} experts of MoE layer {name or '<model>'!r}, but the "
                f"model has {moe.num_experts}. It was probably saved with expert parallelism before experts "
                f"had a global identity (every EP rank wrote its experts under the same names and the "
                f"checkpoint kept one rank's), so it cannot restore every expert; refusing to load it")


def saved_packed_layers(model: nn.Module, saved: Mapping[str, Any], where: str) -> set[str]:
    """The MoE layers of ``model`` (either kind) whose checkpoint holds them in the packed ``[E, ...]`` form.

    ``where`` names the checkpoint in errors (kept for callers; the form itself is never an error: an
    unpacked layer loads the packed form through a copy, see the module docstring).
    """
    return {name for name, _, form, _ in _held(model, saved) if form == "packed"}

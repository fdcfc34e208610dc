"""Experts under their global identity in a DCP state dict: the packed, fused and per-expert forms.

After :func:`reference_impl.parallelize.apply_expert_parallel` every EP rank names and shapes its
experts as if they were the layer's only ones: unpacked experts are ``experts.0 ..`` on every rank,
and a packed weight has ``num_local_experts`` rows under the same name on every rank.
torch.distributed.checkpoint (DCP) writes one copy per name and offset, so a checkpoint of those
state dicts keeps one rank's experts in place of all of them: loading at the same ep silently hands
every rank that rank's experts, and at another ep the load fails.

:class:`ExpertLayout` translates the state dict DCP sees, on the way out and back in, into one of
three **global checkpoint forms**, each holding every expert of every layer once under its global
id:

- the **packed form** (seed 001's, what :func:`reference_impl.checkpoint.save` writes for packed
  layers): ``layers.N.moe.up_w`` ``[E, ...]`` and its moments, row ``G`` expert ``G``.  A packed
  layer presents its weight as a DTensor whose rows cover all experts (``Shard(0)`` over ``ep``,
  nested with the FSDP/HSDP and ``etp`` placements the weight already has; no copy), so a rank's
  rows sit at their global offset.  It is one DCP item per weight and moment per rank's chunk
  whatever E is.
- the **fused form** (what fused layers save): the packed form with ``gate_up_w`` ``[E, 2, h, dim]``
  (gate at ``[:, 0]``, up at ``[:, 1]``, whatever the layer's row order) in place of ``gate_w`` and
  ``up_w``: :func:`~reference_impl.fused.canonical_fused` says why this shape.
- the **per-expert form** (what unpacked layers save, and packed or fused ones with
  ``per_expert=True``): ``layers.N.moe.experts.G.{gate,up,down}.weight`` with the expert's full
  shape (``[hidden, dim]``, ``[dim, hidden]``), and its optimizer state under the same name
  (``optimizer.state.layers.N.moe.experts.G.up.weight.exp_avg`` ...): an unpacked local expert ``i``
  is renamed to its global index ``local_expert_start + i``; a packed weight (and each moment) is
  cut into its rows, row ``i`` presented as expert ``local_expert_start + i`` -- a view of the row,
  or, under expert tensor parallelism, a DTensor over the ``etp`` mesh on the view
  (:func:`expert_rows`); a fused weight is cut into its gate and up halves first
  (:func:`~reference_impl.fused.fused_halves`), views too.

DCP reshards every form exactly (a whole tensor, or the ``ep``/FSDP/``etp`` shards of one), so a
checkpoint saved at any (ep, etp, kind, FSDP/HSDP) loads at any other; optimizer moments follow
their weights.  Each form loads into each kind (``packed_form`` and ``fused_form`` name the layers a
checkpoint holds packed and fused):

- into a layer of its own kind, the per-expert form into any kind, and the packed form into fused
  layers (their halves are a packed layer's ``gate_w`` and ``up_w``): every tensor of the translated
  dict is the original or a view of it, so nothing is copied and a load writes straight into the
  model and the optimizer;
- the packed form into unpacked layers, and the fused form into packed or unpacked ones: no DTensor
  presents separate tensors as one, so they are **copied** into staging tensors and back
  (:mod:`reference_impl.staging`; ``benchmarks/bench_layout.py`` measures it). A save never copies.

A router's ``expert_bias`` buffer is whole (``[E]``) on every rank under its global name, so it
passes through as it is, and its ``tokens_per_expert`` counter is non-persistent:
:meth:`ExpertLayout.to_global` refuses a state that holds it.  :func:`check_saved_experts` refuses
checkpoints written the old, lossy way, before they do harm.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import Any

import torch
from torch import nn

from reference_impl.fused import canonical_fused, fused_halves
from reference_impl.lora import has_tuning_state
from reference_impl.meshes import sliced
from reference_impl.model import FUSED_WEIGHT, PACKED_WEIGHTS, WRAPPER_PARTS, MoEMLP, moe_layers
from reference_impl.regions import contiguous_stride, local_region, packed_rows
from reference_impl.saved import (
    check_saved_experts,
    saved_forms,
    saved_fused_layers,
    saved_packed_layers,
)
from reference_impl.staging import Staged, StagedKey, copy_back, stack
from reference_impl.tuned_checkpoint import _same, tuned_parts

__all__ = ["ExpertLayout", "check_saved_experts", "expert_key", "expert_layout", "expert_rows",
           "layer_form", "moe_layers", "packed_layers", "saved_forms", "saved_fused_layers",
           "saved_packed_layers"]


def layer_form(name: str, moe: MoEMLP, packed_form: Collection[str],
               fused_form: Collection[str] | None) -> str:
    """The form layer ``name`` is presented in: ``"per-expert"`` unless ``packed_form`` names it,
    then ``"fused"`` where ``fused_form`` names it (``None``: where the layer is fused) and
    ``"packed"`` elsewhere."""
    if name not in packed_form:
        return "per-expert"
    fused = moe.kind == "fused" if fused_form is None else name in fused_form
    return "fused" if fused else "packed"


def expert_layout(model: nn.Module, packed_form: Collection[str] = (),
                  fused_form: Collection[str] | None = None) -> ExpertLayout | None:
    """The layout of ``model``'s MoE layers; ``None`` when no layer needs translating.

    Every packed or fused layer and every split unpacked layer is translated to the per-expert form;
    whole unpacked layers already are in it.  ``packed_form`` names layers (any kind) to present in
    a packed ``[E, ...]`` form instead, and of those ``fused_form`` the ones in the fused form
    (``None``: the fused layers): a save's packed and fused layers (:func:`packed_layers`), a load's
    whatever its checkpoint holds packed and fused (:func:`saved_packed_layers`,
    :func:`saved_fused_layers`).
    """
    layers = [(name, moe) for name, moe in moe_layers(model)
              if moe.kind != "unpacked" or moe.ep_world_size > 1 or name in packed_form]
    return ExpertLayout(layers, packed_form, fused_form) if layers else None


def packed_layers(model: nn.Module) -> set[str]:
    """The names of ``model``'s packed and fused MoE layers: what
    :func:`reference_impl.checkpoint.save` keeps in a packed form (each its own)."""
    return {name for name, moe in moe_layers(model) if moe.kind != "unpacked"}


def expert_key(layer: str, expert: int, linear: str) -> str:
    """The canonical name of global expert ``expert``'s ``linear`` weight in MoE layer ``layer``."""
    return f"{_prefix(layer)}experts.{expert}.{linear}.weight"


def _prefix(name: str) -> str:
    return f"{name}." if name else ""


def _root_mesh(mesh: Any) -> Any:
    get_root = getattr(mesh, "_get_root_mesh", None)
    return get_root() if get_root is not None else mesh


def expert_rows(moe: MoEMLP, tensor: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """The rows of a packed weight (or moment) this rank holds, each with its global expert id: the
    one row rule (:func:`reference_impl.regions.packed_rows`), from the layer's first local expert.
    Nothing is copied."""
    return packed_rows(tensor, moe.local_expert_start,
                       where=f"MoE layer {moe.name!r}: a packed weight")


def _half(order: str, half: int, where: str, t: torch.Tensor) -> torch.Tensor:
    return fused_halves(t, order, where)[half]


@dataclass(frozen=True)
class _View:
    """How one of a translated layer's packed weights is presented: each part ``(name, view)`` is
    ``view`` of the weight (and of each of its moments), cut into its experts' rows named
    ``experts.G.{name}.weight`` when ``per_expert``, else presented whole, among all of the layer's
    experts, under the key ``name``."""

    moe: MoEMLP
    layer: str
    parts: tuple[tuple[str, Callable[[torch.Tensor], torch.Tensor]], ...]
    per_expert: bool


class ExpertLayout:
    """Translates a DCP state dict between one rank's experts and the global checkpoint forms.

    :meth:`to_global` translates the ``"model"`` and ``"optimizer"`` entries of a state dict, and
    the names in every other entry that maps parameter names to values (a record of never-stepped
    parameters, say).  :meth:`to_local` undoes it once a load has filled the result; it needs the
    record :meth:`to_global` kept, so one layout serves one save or one load.

    ``layers`` are the :class:`MoEMLP` layers to translate with their names, as :func:`moe_layers`
    gives; each is presented in the form :func:`layer_form` gives for ``packed_form`` and
    ``fused_form``.
    """

    def __init__(self, layers: list[tuple[str, MoEMLP]], packed_form: Collection[str] = (),
                 fused_form: Collection[str] | None = None) -> None:
        self.layers = list(layers)
        #: local FQN -> global FQN of every unpacked expert parameter.
        self._to_global: dict[str, str] = {}
        #: packed (or fused) weight FQN -> how it is presented, through views of it.
        self._views: dict[str, _View] = {}
        #: FQN presented in a packed form through a staging copy -> what is stacked into it.
        self._staged: dict[str, StagedKey] = {}
        #: a staged member's FQN -> the FQN it is staged under.
        self._members: dict[str, str] = {}
        #: the layers' non-persistent buffers (the expert-bias counter): never in a state dict.
        self._transient: set[str] = set()
        #: what to_global stacked, for to_local: (the stack, each tensor it copied with its index in
        #: the stack).
        self._stacks: list[Staged] = []
        for name, moe in self.layers:
            form, pre = layer_form(name, moe, packed_form, fused_form), _prefix(name)
            transient = moe.router._non_persistent_buffers_set
            self._transient.update(f"{pre}router.{b}" for b in transient)
            tuned = tuned_parts(name, moe, form) if has_tuning_state(moe) else None
            if tuned is not None:  # adapters, blocks, scales: reference_impl.tuned_checkpoint
                self._views.update((k, _View(moe, name, p, False)) for k, p in tuned.items())
            if moe.kind == "unpacked":
                self._unpacked(name, moe, form)
            if moe.kind == "unpacked" or tuned is not None:
                continue
            for weight in moe.packed_weights():
                key, part = f"{pre}{weight}", (weight[:-2], _same)
                if weight == FUSED_WEIGHT:
                    where = f"MoE layer {moe.name!r}: {weight}"
                    order = moe.fused_order
                    halves = tuple((w, partial(_half, order, i, where))
                                   for i, w in enumerate(("gate", "up")))
                    if form == "fused":
                        canonical = partial(canonical_fused, order=order, where=where)
                        self._views[key] = _View(moe, name, ((key, canonical),), False)
                    elif form == "packed":
                        parts = tuple((f"{pre}{w}_w", v) for w, v in halves)
                        self._views[key] = _View(moe, name, parts, False)
                    else:
                        self._views[key] = _View(moe, name, halves, True)
                elif form == "per-expert":
                    self._views[key] = _View(moe, name, (part,), True)
                elif form == "fused" and weight in ("gate_w", "up_w"):
                    members = (f"{pre}gate_w", f"{pre}up_w")
                    self._stage(f"{pre}{FUSED_WEIGHT}", moe, members, "halves")
                elif moe.ep_world_size > 1:  # a packed weight's packed form: its rows among all
                    self._views[key] = _View(moe, name, ((key, _same),), False)
        #: what to_global saw, for to_local: the state, and the keys each translated FQN is
        #: presented under.
        self._seen: dict[str, Any] = {}
        self._shown: dict[str, list[str]] = {}
        #: this rank's parameter names per optimizer param group, as to_global found them.
        self._local_groups: list[list[str]] | None = None

    def _unpacked(self, name: str, moe: MoEMLP, form: str) -> None:
        """An unpacked layer: its experts under their global ids, and staged into the packed or
        fused form."""
        pre = _prefix(name)
        for i, expert in enumerate(moe.experts):
            g = moe.local_expert_start + i
            for pname, _ in chain(expert.named_parameters(), expert.named_buffers()):
                pname = ".".join(p for p in pname.split(".") if p not in WRAPPER_PARTS)
                self._to_global[f"{pre}experts.{i}.{pname}"] = f"{pre}experts.{g}.{pname}"
        if form == "per-expert" or not len(moe.experts):
            return
        count = range(len(moe.experts))
        linears = [w[:-2] for w in PACKED_WEIGHTS if hasattr(moe.experts[0], w[:-2])]
        if form == "fused":
            members = tuple(f"{pre}experts.{i}.{w}.weight" for i in count for w in ("gate", "up"))
            self._stage(f"{pre}{FUSED_WEIGHT}", moe, members, "expert-halves")
            linears = ["down"]
        for linear in linears:
            experts = tuple(f"{pre}experts.{i}.{linear}.weight" for i in count)
            self._stage(f"{pre}{linear}_w", moe, experts, "experts")

    def _stage(self, key: str, moe: MoEMLP, members: tuple[str, ...], how: str) -> None:
        self._staged[key] = StagedKey(moe, members, how)
        self._members.update(dict.fromkeys(members, key))

    # ---------------------------------------------------------------- the packed forms

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
            # Torch may hand out one cached submesh for equal rank groups of different root meshes,
            # so "the same device mesh" is checked by dim names and ranks, not by object identity.
            root, names = _root_mesh(moe.ep_mesh), tuple(value.device_mesh.mesh_dim_names or ())
            order = root.mesh_dim_names or ()
            if (not names or any(n not in order for n in names)
                    or sliced(root, names).mesh.tolist() != value.device_mesh.mesh.tolist()):
                raise ValueError(
                    f"{key!r}: its mesh {value.device_mesh} and the ep mesh {moe.ep_mesh} of MoE "
                    f"layer {moe.name!r} do not come from one device mesh with named dims")
            placement_of = {**dict(zip(names, value.placements, strict=True)), ep_name: Shard(0)}
            split_rows = {n for n, p in placement_of.items() if isinstance(p, Shard) and p.dim == 0}
            early = [n for n in names if order.index(n) < order.index(ep_name) and n in split_rows]
            if early:
                raise ValueError(f"{key!r}: mesh dims {early} split the expert rows but come "
                                 f"before {ep_name!r} in the device mesh {order}; DTensor would "
                                 "nest them first")
            dims = tuple(sorted({ep_name, *names}, key=order.index))
            mesh = sliced(root, dims)
            row, placements = region[0].start if region else 0, tuple(placement_of[d] for d in dims)
        else:
            row, mesh, placements = 0, moe.ep_mesh, (Shard(0),)
        with torch.no_grad():
            wrapped = DTensor.from_local(local, mesh, placements, run_check=False,
                                         shape=torch.Size(global_shape),
                                         stride=contiguous_stride(global_shape))
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
        return wrapped

    def _present(self, key: str, value: torch.Tensor,
                 suffix: str = "") -> list[tuple[str, torch.Tensor]]:
        """What ``value`` (the weight ``key``, or its moment ``suffix``) is presented as: ``(key,
        view)`` each."""
        view = self._views[key]
        out: list[tuple[str, torch.Tensor]] = []
        for part, make in view.parts:
            shown = make(value)
            if view.per_expert:
                rows = expert_rows(view.moe, shown)
                out.extend((expert_key(view.layer, g, part), row) for g, row in rows)
            elif view.moe.ep_world_size > 1:
                out.append((part, self._globalize(f"{part}{suffix}", view.moe, shown)))
            else:
                out.append((part, shown))
        return out

    def _stack(self, key: str, stage: StagedKey, values: list[torch.Tensor]) -> torch.Tensor:
        """This rank's ``values`` stacked as ``stage.how`` says, among all experts: a copy
        (:func:`reference_impl.staging.stack`)."""
        staged = stack(values, stage.how)
        self._stacks.append(staged)
        stacked = staged[0]
        return self._globalize(key, stage.moe, stacked) if stage.moe.ep_world_size > 1 else stacked

    # ---------------------------------------------------------------- the two directions

    def to_global(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` with each rank's experts in the global form, among all of the layer's experts.

        Returns a new dict and leaves ``state`` as it is.  Each tensor in the result is the one it
        replaces or a view of it, so a load into the result loads them (a staging copy is copied
        back by :meth:`to_local`).

        Raises ValueError when the model state lacks the expert weights of a translated layer, holds
        a non-persistent buffer (the expert-bias counter: a checkpoint must not), or the optimizer
        holds a tensor for a packed weight in a shape other than the weight's: the checkpoint could
        not hold every rank's experts.
        """
        model = state.get("model")
        if not isinstance(model, Mapping):
            raise ValueError("the state has no 'model' entry; ExpertLayout needs the model's "
                             "expert weights")
        missing = [k for k in (*self._to_global, *self._views, *self._members) if k not in model]
        if missing:
            raise ValueError(f"the model state lacks {len(missing)} expert weight(s) of split MoE "
                             f"layers, first {missing[:3]}; was it taken from another model or "
                             "filtered?")
        transient = sorted(self._transient & set(model))
        if transient:
            raise ValueError(f"the model state holds the non-persistent buffer(s) "
                             f"{transient[:3]}: a per-step token count, which a checkpoint must "
                             f"not hold (take the state with get_model_state_dict or state_dict(), "
                             f"which leave them out)")
        self._stacks.clear()
        self._seen = {"state": state}
        self._shown = {}
        out = dict(state)
        out["model"] = {}
        for key, value in model.items():
            if key in self._views:
                shown = self._present(key, value)
                self._shown[key] = [new for new, _ in shown]
                out["model"].update(shown)
            elif key not in self._members:
                out["model"][self._to_global.get(key, key)] = value
        for key, stage in self._staged.items():
            out["model"][key] = self._stack(key, stage, [model[m] for m in stage.members])
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
            unshown = [] if key in self._views else [self._to_global.get(key, key)]
            for new in self._shown.get(key, unshown):
                out[new] = value
        return out

    def _optimizer_to_global(self, optimizer: Mapping[str, Any],
                             model: Mapping[str, Any]) -> dict[str, Any]:
        states: dict[str, Any] = {}
        for key, entry in optimizer.get("state", {}).items():
            if key in self._members:
                continue
            if key not in self._views:
                states[self._to_global.get(key, key)] = (dict(entry) if isinstance(entry, Mapping)
                                                         else entry)
                continue
            moe, expected = self._views[key].moe, tuple(model[key].shape)
            shown: dict[str, list[tuple[str, torch.Tensor]]] = {}
            for name, value in entry.items():
                # scalars such as `step` stay
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    if tuple(value.shape) != expected:
                        raise ValueError(f"optimizer state {key!r}[{name!r}] has shape "
                                         f"{tuple(value.shape)}, expected {expected} (the packed "
                                         "weight's); it cannot be placed among all "
                                         f"{moe.num_experts} experts")
                    shown[name] = self._present(key, value, f".{name}")
            for i, new in enumerate(self._shown[key]):
                states[new] = {n: shown[n][i][1] if n in shown else v for n, v in entry.items()}
        for key, stage in self._staged.items():
            entries = [optimizer.get("state", {}).get(m) for m in stage.members]
            if all(e is None for e in entries):
                continue
            if any(e is None or set(e) != set(entries[0]) for e in entries):
                raise ValueError(f"the optimizer holds state for some of {list(stage.members)} "
                                 f"of MoE layer {stage.moe.name!r} only (or different entries for "
                                 f"them); they cannot be stacked into {key!r}")
            states[key] = {n: self._stack(f"{key}.{n}", stage, [e[n] for e in entries])
                           if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                           for n, v in entries[0].items()}
        groups = optimizer.get("param_groups", [])
        self._local_groups = [list(group["params"]) for group in groups]
        out = dict(optimizer)
        out["state"] = states
        out["param_groups"] = [
            {**group, "params": list(self._names_to_global(dict.fromkeys(group["params"])))}
            for group in groups]
        return out

    def to_local(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Undo :meth:`to_global` on the state dict that a load filled.

        Names go back to this rank's, and each weight :meth:`to_global` presented through views goes
        back to itself, which holds what the load wrote (a staged copy is copied back into its
        members first).  Each optimizer param group lists this rank's parameters again and keeps the
        loaded settings (lr, betas, ...).  A presented weight's scalar state (AdamW's ``step``)
        comes from the entry of its first presented key; a rank that holds no row of it has none in
        the per-expert form, so it takes the step of its param group's first parameter whose state
        was loaded (AdamW steps a group's parameters together), or, in a group of such weights alone
        (the experts in a group of their own on a rank that holds none), another group's.
        """
        seen = self._seen.get("state")
        if seen is None:
            raise ValueError("to_local needs the record of to_global; call it on the dict "
                             "to_global returned")
        copy_back(self._stacks)
        out = dict(state)
        if isinstance(state.get("model"), Mapping):
            out["model"] = self._names_to_local(state["model"], seen["model"])
        optimizer = state.get("optimizer")
        if optimizer is not None:
            groups = optimizer.get("param_groups", [])
            if self._local_groups is None or len(self._local_groups) != len(groups):
                raise ValueError(f"the optimizer state has {len(groups)} param groups, but "
                                 "to_global of this layout saw "
                                 f"{self._local_groups and len(self._local_groups)}; call to_local "
                                 "on the dict to_global returned")
            out["optimizer"] = {
                **optimizer,
                "state": self._optimizer_state_to_local(optimizer.get("state", {}),
                                                        (seen.get("optimizer")
                                                         or {}).get("state", {})),
                "param_groups": [{**group, "params": list(params)}
                                 for group, params in zip(groups, self._local_groups, strict=True)],
            }
        for key, value in state.items():
            if key not in ("model", "optimizer") and isinstance(value, Mapping):
                before = seen.get(key)
                before = before if isinstance(before, Mapping) else {}
                out[key] = self._names_to_local(value, before)
        return out

    def _names_to_local(self, loaded: Mapping[Any, Any],
                        before: Mapping[Any, Any]) -> dict[Any, Any]:
        """``loaded`` under this rank's names, in this rank's order; a presented weight's (and a
        staged member's) entry is the one it had before to_global (the load wrote into it through
        the views, or the copy back)."""
        to_local = {v: k for k, v in self._to_global.items()}
        presented = {new for news in self._shown.values() for new in news} | set(self._staged)
        found = {to_local.get(k, k): v for k, v in loaded.items() if k not in presented}
        found.update((key, before[key]) for key in (*self._views, *self._members) if key in before)
        out = {key: found.pop(key) for key in before if key in found}
        out.update(found)
        return out

    def _optimizer_state_to_local(self, loaded: Mapping[str, Any],
                                  before: Mapping[str, Any]) -> dict[str, Any]:
        out = self._names_to_local(loaded, before)
        empty = []
        for key in self._views:
            if key not in before:
                continue
            entry = out[key] = dict(before[key])
            firsts = [loaded[k] for k in self._shown.get(key, []) if k in loaded]
            scalars = [n for n, v in entry.items()
                       if not (isinstance(v, torch.Tensor) and v.dim() > 0)]
            if firsts:
                entry.update((n, firsts[0][n]) for n in scalars if n in firsts[0])
            elif scalars:
                empty.append((key, scalars))
        # the stack's scalars (AdamW's step) into each expert's own
        for key, staged in self._members.items():
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
            # the group's first parameter whose state the load wrote; a group of only this rank's
            # row-less packed weights (the experts in a group of their own, on a rank that holds no
            # expert) takes another group's
            group = next((g for g in self._local_groups or [] if key in g), [])
            others = [p for g in self._local_groups or [] if g is not group for p in g]
            donor = next((out[p] for p in (*group, *others) if p in out and p not in rowless), None)
            for name in scalars:
                if donor is None or name not in donor:
                    continue
                mine, theirs = out[key][name], donor[name]
                if (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor)
                    and mine.shape == theirs.shape):
                    with torch.no_grad():
                        mine.copy_(theirs)
                else:
                    out[key][name] = theirs
        return out

"""What a DCP checkpoint holds of a model's MoE layers, read from its index alone: the form and how
many experts.

Each layer's checkpoint entries take one of three global forms
(:mod:`reference_impl.expert_layout`): ``per-expert`` (``experts.G.{gate,up,down}.weight``),
``packed`` (``gate_w``/``up_w``/``down_w`` ``[E, ...]``) or ``fused`` (``gate_up_w`` ``[E, 2, h,
dim]`` and ``down_w``).  :func:`saved_forms` says which, so a load presents the model in the form
its checkpoint holds, and :func:`check_saved_experts` refuses a checkpoint that holds fewer experts
of a layer than the model has -- in its expert weights, or in its router's expert bias.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

from reference_impl.model import FUSED_WEIGHT, PACKED_WEIGHTS, MoEMLP, moe_layers

__all__ = ["check_saved_experts", "saved_forms", "saved_fused_layers", "saved_packed_layers"]

_EXPERT_KEY = re.compile(r"^(.*?)experts\.(\d+)\.")
#: a router's persistent expert bias, after the layer's prefix.
EXPERT_BIAS = "router.expert_bias"


def _size(saved: Mapping[str, Any], key: str) -> int | None:
    """Dim 0 of the tensor ``saved`` indexes under ``key``; None where it holds none."""
    size = getattr(saved.get(key), "size", None)
    return int(size[0]) if size else None


def _held(model: nn.Module, saved: Mapping[str, Any]
          ) -> Iterator[tuple[str, MoEMLP, str | None, int | None, int | None]]:
    """Each MoE layer with the form its checkpoint entries take ("per-expert", "packed", "fused" or
    None), how many experts they hold, and how many entries its router's expert bias holds (None: no
    bias saved).  Model entries are ``model.<name>``; bare ``<name>`` is read too."""
    per_expert: dict[str, set[int]] = {}
    for key in saved:
        match = _EXPERT_KEY.match(key)
        if match:
            per_expert.setdefault(match.group(1), set()).add(int(match.group(2)))
    for name, moe in moe_layers(model):
        pre = f"{name}." if name else ""
        form, held, bias = None, None, None
        for candidate in (f"model.{pre}", pre):
            names = dict.fromkeys((*PACKED_WEIGHTS, FUSED_WEIGHT, *moe.packed_weights()))
            sizes = {w: _size(saved, f"{candidate}{w}") for w in names}  # blocks, adapters too
            rows = {w: n for w, n in sizes.items() if n is not None}
            bias = _size(saved, f"{candidate}{EXPERT_BIAS}") if bias is None else bias
            if candidate in per_expert:
                form, held = "per-expert", len(per_expert[candidate])
            elif rows:
                form, held = "fused" if FUSED_WEIGHT in rows else "packed", min(rows.values())
            if form is not None:
                break
        yield name, moe, form, held, bias


def check_saved_experts(model: nn.Module, saved: Mapping[str, Any], where: str) -> None:
    """Refuse a checkpoint whose MoE layers hold fewer experts than ``model``'s.

    ``saved`` is the checkpoint's DCP index, its ``Metadata.state_dict_metadata``; its keys are the
    flattened names (``"model.layers.0.moe.experts.3.up.weight"``, ``"model.layers.0.moe.up_w"``,
    ``"model.layers.0.moe.gate_up_w"``; bare names are read too).  Any form counts, whatever the
    model's kind. A checkpoint saved with ep > 1 before the experts had a global identity holds
    ``num_experts / ep`` experts of each layer: every EP rank wrote its own under the same names and
    the checkpoint kept one rank's. Loading it at the same ep would give every rank that rank's
    experts, and at another ep it fails on the experts it lacks, so it is refused here with what it
    holds.  A router's expert bias is one entry per expert too, and one split by EP rank and saved
    the same way holds fewer: refused alike.  A layer the checkpoint holds no expert of is left to
    the load.
    """
    for name, moe, _, held, bias in _held(model, saved):
        layer = name or "<model>"
        if held is not None and held < moe.num_experts:
            raise ValueError(
                f"{where}: the checkpoint holds {held} experts of MoE layer {layer!r}, but the "
                f"model has {moe.num_experts}. It was probably saved with expert parallelism "
                f"before experts had a global identity (every EP rank wrote its experts under the "
                f"same names and the checkpoint kept one rank's), so it cannot restore every "
                f"expert; refusing to load it")
        if bias is not None and bias < moe.num_experts:
            raise ValueError(
                f"{where}: the checkpoint's {EXPERT_BIAS} of MoE layer {layer!r} holds {bias} "
                f"entries, but the model has {moe.num_experts} experts. An expert bias split by "
                f"EP rank and saved under one name keeps one rank's entries, so it cannot restore "
                f"every expert's; refusing to load it")


def saved_forms(model: nn.Module, saved: Mapping[str, Any]) -> dict[str, str]:
    """The global form (``"per-expert"``, ``"packed"`` or ``"fused"``) in which the checkpoint
    indexed by ``saved`` holds each MoE layer of ``model`` it holds experts of (any form loads into
    any kind)."""
    return {name: form for name, _, form, _, _ in _held(model, saved) if form is not None}


def saved_packed_layers(model: nn.Module, saved: Mapping[str, Any], where: str) -> set[str]:
    """The MoE layers of ``model`` (any kind) whose checkpoint holds them in a packed ``[E, ...]``
    form, the packed or the fused one.

    ``where`` names the checkpoint in errors (kept for callers; the form itself is never an error:
    an unpacked layer loads the packed form through a copy, see
    :mod:`reference_impl.expert_layout`).
    """
    return {name for name, form in saved_forms(model, saved).items() if form in ("packed", "fused")}


def saved_fused_layers(model: nn.Module, saved: Mapping[str, Any]) -> set[str]:
    """The MoE layers of ``model`` whose checkpoint holds them in the fused form (``gate_up_w``)."""
    return {name for name, form in saved_forms(model, saved).items() if form == "fused"}

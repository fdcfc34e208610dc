"""A small, real MoE model whose checkpoints this project tests: its layers, its weights, its names.

:class:`MoEMLP` routes each token to ``top_k`` of ``num_experts`` experts (plus an optional shared
expert every token uses).  Its experts come in the three forms frameworks use:

- **unpacked**: ``experts`` is a ``ModuleList`` of small MLPs,
  ``experts.{i}.{up,gate,down}.weight``;
- **packed**: one Parameter per weight with a leading expert axis, ``up_w``/``gate_w`` ``[E, hidden,
  dim]`` and ``down_w`` ``[E, dim, hidden]``, so ``up_w[g]`` is unpacked ``experts[g].up.weight``;
- **fused**: packed, with gate and up in one Parameter ``gate_up_w`` ``[E, 2 * hidden, dim]``
  (transformers 5's ``gate_up_proj``, Megatron-Core's fused ``linear_fc1``, NeMo's
  ``gate_and_up_projs``, GPT-OSS), its rows in the order ``MoEConfig.fused_order`` names:
  ``"concatenated"`` (all gate rows, then all up rows) or ``"interleaved"`` (gate row 0, up row 0,
  gate row 1, ...).  :func:`fused_frame` views it with an explicit half axis, where gate and up are
  plain slices (:func:`fused_half`).

Weights are a pure function of ``(seed, layer name, expert, weight name)``
(:mod:`reference_impl.weights`), so a model built for any expert-parallel degree, in any form, holds
the same global expert ``g``: that is what lets a test compare a load at ``ep=4`` with a save at
``ep=2`` bit for bit, with no communication.

Each layer's router (:mod:`reference_impl.router`) may keep DeepSeek-V3's expert bias; a model may
end in multi-token-prediction layers (:class:`MTPLayer`, ``mtp.{i}``), MoE layers with global index
``num_layers + i``.

How the model is split over ranks (expert and expert tensor parallelism, FSDP) is
:mod:`reference_impl.parallelize`, as a training framework keeps its model apart from its
parallelization; the forward only needs the groups that split sets on each layer, and crosses them
with :mod:`reference_impl.collectives`.  :func:`named_modules`, :func:`named_parameters` and
:func:`moe_layers` name modules and parameters as their state-dict entries are named.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast, overload

import torch
import torch.nn.functional as F
from torch import nn

from reference_impl.collectives import CopyToGroup, ReduceOverGroup
from reference_impl.router import Router
from reference_impl.weights import fill, fill_rows, stable_seed

__all__ = ["FUSED_ORDERS", "FUSED_WEIGHT", "PACKED_WEIGHTS", "WRAPPER_PARTS", "ExpertMLP",
           "MTPLayer", "MoEBlock", "MoEConfig", "MoEMLP", "MoEModel", "build_model", "fused_frame",
           "fused_half", "moe_layers", "moe_modules", "mtp_inputs", "named_modules",
           "named_parameters", "stable_seed"]

#: the packed expert weights, in the order :class:`MoEMLP` registers them (gate only for SwiGLU).
PACKED_WEIGHTS = ("gate_w", "up_w", "down_w")
#: a fused layer's gate and up weight (its other expert weight is ``down_w``).
FUSED_WEIGHT = "gate_up_w"
#: the row orders of a fused weight: halves concatenated (``[gate; up]``) or rows interleaved
#: (GPT-OSS).
FUSED_ORDERS = ("concatenated", "interleaved")
#: in a fused weight's frame (:func:`fused_frame`), per order: the axis of the halves (gate 0, up
#: 1), and the hidden axis, the one expert tensor parallelism splits.
HALF_AXIS = {"concatenated": 1, "interleaved": 2}
FUSED_HIDDEN_AXIS = {"concatenated": 2, "interleaved": 1}


@dataclass(frozen=True)
class MoEConfig:
    """Shape and flavour of every MoE layer of a model (and its multi-token-prediction depth,
    ``mtp_layers``).

    The defaults of the fields after ``init_std`` leave a model as it is without them, value for
    value: ``shared_hidden=None`` is ``hidden``, ``expert_bias=False`` routes on the scores alone,
    ``mtp_layers=0`` adds no layer, and ``fused_order`` is read by fused layers only.
    """

    num_experts: int = 6
    dim: int = 32
    hidden: int = 64
    kind: Literal["packed", "unpacked", "fused"] = "unpacked"
    activation: Literal["swiglu", "gelu"] = "swiglu"
    top_k: int = 2
    shared_expert: bool = True
    dtype: torch.dtype = torch.float32
    init_std: float = 0.02
    #: the row order of a fused layer's ``gate_up_w`` (:data:`FUSED_ORDERS`).
    fused_order: Literal["concatenated", "interleaved"] = "concatenated"
    #: the shared expert's hidden size (``None``: ``hidden``); another value keeps every dimension
    #: distinct.
    shared_hidden: int | None = None
    #: DeepSeek-V3's auxiliary-loss-free balancing: each router keeps an ``expert_bias``
    #: (reference_impl.router).
    expert_bias: bool = False
    #: multi-token-prediction layers after the main stack: ``mtp.{i}``, MoE layer
    #: ``num_layers + i``.
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("packed", "unpacked", "fused"):
            raise ValueError(f"kind must be 'packed', 'unpacked' or 'fused', got {self.kind!r}")
        if self.activation not in ("swiglu", "gelu"):
            raise ValueError(f"activation must be 'swiglu' or 'gelu', got {self.activation!r}")
        if self.kind == "fused" and self.activation != "swiglu":
            raise ValueError(f"kind='fused' fuses the gate and up weights, so it needs "
                             f"activation='swiglu' (a GELU expert has no gate), got "
                             f"activation={self.activation!r}")
        if self.fused_order not in FUSED_ORDERS:
            raise ValueError(f"fused_order must be one of {FUSED_ORDERS}, got {self.fused_order!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, {self.num_experts}], got {self.top_k}")
        for name in ("mtp_layers", "shared_hidden"):
            value = getattr(self, name)
            wrong = isinstance(value, bool) or not isinstance(value, int) or value < 0
            if value is not None and wrong:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def fused_frame(t: torch.Tensor, order: str) -> torch.Tensor:
    """A fused weight's local rows ``[n, 2h, dim]`` (or a tensor of its shape) in its frame, a view:
    ``[n, 2, h, dim]`` for ``"concatenated"``, ``[n, h, 2, dim]`` for ``"interleaved"``
    (:data:`HALF_AXIS`).  A tensor already 4-D (expert tensor parallelism keeps the weight in its
    frame) is returned as it is."""
    if t.dim() == 4:
        return t
    n, rows, dim = t.shape
    if rows % 2:
        raise ValueError(f"a fused gate/up weight has an even number of rows per expert, got "
                         f"shape {tuple(t.shape)}")
    return t.view(n, 2, rows // 2, dim) if order == "concatenated" else t.view(n, rows // 2, 2, dim)


def fused_half(t: torch.Tensor, order: str, half: int) -> torch.Tensor:
    """The gate (``half=0``) or up (``half=1``) rows of a fused weight's local rows, ``[n, h,
    dim]``: a view (strided for ``"interleaved"``), so it reads and writes the fused weight
    itself."""
    return fused_frame(t, order).select(HALF_AXIS[order], half)


def _act(up: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """SwiGLU when the expert has a gate, GELU otherwise."""
    return F.gelu(up) if gate is None else F.silu(gate) * up


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (differentiable: its gradient comes back as a DTensor), else
    ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class ExpertMLP(nn.Module):
    """One expert (or the shared expert): ``down(act(up(x)))``, SwiGLU adding a ``gate``."""

    def __init__(self, dim: int, hidden: int, activation: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.activation = activation
        if activation == "swiglu":
            self.gate = nn.Linear(dim, hidden, bias=False, dtype=dtype)
        self.up = nn.Linear(dim, hidden, bias=False, dtype=dtype)
        self.down = nn.Linear(hidden, dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Local weights: under expert tensor parallelism they are this rank's shard of the hidden
        # axis, and the output a partial sum that MoEMLP reduces over etp.
        gate = F.linear(x, _local(self.gate.weight)) if self.activation == "swiglu" else None
        return F.linear(_act(F.linear(x, _local(self.up.weight)), gate), _local(self.down.weight))


class MoEMLP(nn.Module):
    """Router over all experts, optional shared expert, and this rank's routed experts.

    ``name`` is the layer's name in its model; with ``seed`` it fixes every weight, so the same
    ``(seed, name)`` gives the same global experts at every EP degree and in every form.

    After :func:`~reference_impl.parallelize.apply_expert_parallel` the module holds experts
    ``local_expert_start`` to ``local_expert_start + num_local_experts`` of ``num_experts``.  Its
    forward then computes those experts' share and sums it over the EP group, which is the layer's
    output (and the backward the ep=1 gradients) when every EP rank sees the same tokens.  Real EP
    frameworks all-to-all the tokens instead; this reference only needs a forward that is right, not
    fast.
    """

    def __init__(self, config: MoEConfig, name: str = "", seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.name = name
        #: the layer's global index in its model (a pipeline stage's first block may be layer 2).
        self.layer = 0
        self.kind = config.kind
        #: a fused layer's row order (read by fused layers only).
        self.fused_order = config.fused_order
        self.activation = config.activation
        self.top_k = config.top_k
        self.num_experts = config.num_experts
        self.ep_world_size = 1
        self.ep_rank = 0
        self.local_expert_start = 0
        self.num_local_experts = config.num_experts
        self.ep_mesh: Any = None
        #: expert tensor parallelism: each expert's hidden axis split over ``etp_mesh``.
        self.etp_world_size = 1
        self.etp_mesh: Any = None
        #: fine-tuning's weights (LoRA, a quantized base: reference_impl.lora), where set:
        #: ``hook(self, i, linear)``, local expert ``i``'s or (``None``) the shared expert's.
        self.weight_hook: Callable[[MoEMLP, int | None, str], torch.Tensor] | None = None
        #: a packed layer's expert tensors where fine-tuning changed them (reference_impl.lora).
        self.expert_state: tuple[str, ...] | None = None

        E, dim, hidden, dtype = config.num_experts, config.dim, config.hidden, config.dtype
        self.router = Router(dim, E, dtype, expert_bias=config.expert_bias)
        shared_hidden = hidden if config.shared_hidden is None else config.shared_hidden
        self.shared = (ExpertMLP(dim, shared_hidden, config.activation, dtype)
                       if config.shared_expert else None)
        if config.kind == "unpacked":
            self.experts = nn.ModuleList(ExpertMLP(dim, hidden, config.activation, dtype)
                                         for _ in range(E))
        else:
            for weight, shape in self._packed_shapes().items():
                self.register_parameter(weight, nn.Parameter(torch.empty(shape, dtype=dtype)))
        self.reset_parameters(seed)

    def _packed_shapes(self) -> dict[str, tuple[int, int, int]]:
        c = self.config
        shapes = {"up_w": (c.num_experts, c.hidden, c.dim),
                  "down_w": (c.num_experts, c.dim, c.hidden)}
        if c.kind == "fused":
            return {FUSED_WEIGHT: (c.num_experts, 2 * c.hidden, c.dim), "down_w": shapes["down_w"]}
        if c.activation == "swiglu":
            shapes = {"gate_w": (c.num_experts, c.hidden, c.dim), **shapes}
        return shapes

    def base_weights(self) -> list[str]:
        """The packed base weights' names (``gate_up_w``, ``down_w`` fused; none unpacked), held as
        Parameters or, quantized, as the blocks and scales standing for them."""
        return [] if self.kind == "unpacked" else list(self._packed_shapes())

    def packed_weights(self) -> list[str]:
        """Names of the packed tensors of expert state held (leading expert axis): the base
        weights, or with fine-tuning state the tensors held for them (blocks, scales) and the
        adapters (reference_impl.lora); :meth:`expert_parameters` gives the Parameters."""
        return list(self.expert_state) if self.expert_state is not None else self.base_weights()

    def expert_parameters(self) -> list[nn.Parameter]:
        """Every expert Parameter of this layer: each expert's linears (and adapters), or the
        packed Parameters (a quantized base's blocks and scales are buffers)."""
        if self.kind == "unpacked":
            return list(self.experts.parameters())
        return [p for w in self.packed_weights() if (p := self._parameters.get(w)) is not None]

    def expert_weight(self, expert: int, linear: str) -> torch.Tensor:
        """Local expert ``expert``'s ``linear`` ("up", "gate", "down") weight in any form: for the
        fused form a view of its half of ``gate_up_w`` (:func:`fused_half`).

        Under expert tensor parallelism it is this rank's shard of the hidden axis (a plain tensor).
        """
        if self.kind == "unpacked":
            return _local(getattr(self.experts[expert], linear).weight)
        return self._packed_rows(linear)[expert]

    def _packed_rows(self, linear: str) -> torch.Tensor:
        """This rank's rows of the packed ``linear`` weight, ``[n, ...]``; a fused layer's gate or
        up half."""
        if self.kind == "fused" and linear in ("gate", "up"):
            half = ("gate", "up").index(linear)
            return fused_half(_local(getattr(self, FUSED_WEIGHT)), self.fused_order, half)
        return _local(getattr(self, f"{linear}_w"))

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Give every weight its deterministic value (global expert ids, so any EP split agrees)."""
        c = self.config
        fill(self.router.weight, c.init_std, seed, self.name, "router.weight")
        self.router.reset_expert_bias(c.init_std, seed, self.name, "router.expert_bias")
        if self.shared is not None:
            for pname, p in self.shared.named_parameters():
                fill(p, c.init_std, seed, self.name, "shared", pname)
        linears = ("gate", "up", "down") if c.activation == "swiglu" else ("up", "down")
        if self.kind != "unpacked":  # a fused layer's halves take the packed gate's and up's values
            for linear in linears:
                fill_rows(self._packed_rows(linear), c.init_std, self.local_expert_start, seed,
                          self.name, "expert", linear)
            return
        for i in range(self.num_local_experts):
            g = self.local_expert_start + i
            for linear in linears:
                w = self.expert_weight(i, linear)
                fill(w, c.init_std, seed, self.name, "expert", g, linear)

    def _expert(self, i: int | None, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``i`` on ``x``.  A fused layer multiplies by each half of its row (views) as
        the packed form multiplies by ``gate_w`` and ``up_w``, so the two forms agree bit for bit:
        one product with all ``2h`` rows would be one GEMM, as frameworks run it, but a GEMM of
        another width may sum in another order (torch 2.13's CPU kernels do, in the last bits), and
        the reference is the truth the others are held to.  ``i=None``: the shared expert."""
        hook = self.weight_hook
        if hook is None and (i is None or self.kind == "unpacked"):
            return cast(nn.Module, self.shared if i is None else self.experts[i])(x)

        def w(linear: str) -> torch.Tensor:
            return hook(self, i, linear) if hook else self.expert_weight(cast(int, i), linear)
        gate = F.linear(x, w("gate")) if self.activation == "swiglu" else None
        return F.linear(_act(F.linear(x, w("up")), gate), w("down"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        top_w, top_i = self.router.route(tokens, self.top_k)
        groups = [mesh.get_group() for mesh, size in ((self.etp_mesh, self.etp_world_size),
                                                      (self.ep_mesh, self.ep_world_size))
                  if size > 1]
        if not groups:
            routed_in, routed_w, out = tokens, top_w, torch.zeros_like(tokens)
        else:
            # One tensor through one collective per group, so every rank's backward runs the same
            # all-reduces in the same order; ``out`` starts as zeros tied to it, so a rank with no
            # experts (or no tokens for them) still joins those all-reduces.
            routed = torch.cat([tokens, top_w], dim=-1)
            for group in groups:
                routed = CopyToGroup.apply(routed, group)
            routed_in, routed_w = routed[:, : tokens.shape[-1]], routed[:, tokens.shape[-1]:]
            out = routed_in * 0
        start = self.local_expert_start
        # ascending: the experts run in id order, those no token chose not at all
        chosen = top_i.unique()
        for g in chosen[(chosen >= start) & (chosen < start + self.num_local_experts)].tolist():
            token, slot = (top_i == g).nonzero(as_tuple=True)
            y = self._expert(g - start, routed_in[token]) * routed_w[token, slot, None]
            out = out.index_add(0, token, y)
        for group in groups:
            out = ReduceOverGroup.apply(out, group)
        if self.shared is not None:
            out = out + self._expert(None, tokens)
        return out.reshape(x.shape)


class MoEBlock(nn.Module):
    """A pre-norm residual block around one MoE layer (``layers.{i}.norm``, ``layers.{i}.moe``)."""

    def __init__(self, config: MoEConfig, name: str, seed: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(config.dim, dtype=config.dtype)
        self.moe = MoEMLP(config, name=f"{name}.moe", seed=seed)
        fill(self.norm.weight, config.init_std, seed, name, "norm", mean=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class Layers(nn.ModuleDict):
    """A model's blocks under their global index (``layers.4``), as torchtitan keeps them: a
    pipeline stage drops the blocks it does not hold
    (:func:`~reference_impl.parallelize.apply_pipeline`) and the rest keep their names, so the
    stage's state dict names every layer globally.  A ``ModuleList`` would renumber them 0..k-1 --
    the stage-local naming that files stage 1's first layer where layer 0 belongs.  Indexing by int
    and iterating the blocks in layer order work as on a ``ModuleList``."""

    def __getitem__(self, index: int | str) -> nn.Module:
        return super().__getitem__(str(index))

    def __setitem__(self, index: int | str, module: nn.Module) -> None:
        super().__setitem__(str(index), module)

    def __delitem__(self, index: int | str) -> None:
        super().__delitem__(str(index))

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter([self._modules[k] for k in sorted(self._modules, key=int)])

    def indices(self) -> list[int]:
        """The global indices of the blocks held, ascending."""
        return sorted(int(k) for k in self._modules)


class MTPLayer(MoEBlock):
    """One multi-token-prediction depth (``mtp.{i}``), DeepSeek-V3's MTP module made small, with
    torchtitan's names (``torchtitan/models/deepseek_v3/mtp.py``): ``eh_proj(cat(enorm(inputs),
    hnorm(hidden)))`` ``[dim, 2 * dim]``, then a MoE block (``norm``, ``moe``: the attention this
    model has nowhere is left out), then ``mtp_norm``.

    ``hidden`` is the main stack's last hidden state (before its final norm) for depth 0 and the
    previous depth's output after it; ``inputs`` are this depth's inputs, the model's inputs shifted
    by ``i + 1`` tokens (:func:`mtp_inputs`, the stand-in for the embeddings of the tokens ``i + 1``
    ahead).  Its MoE layer is global layer ``num_layers + i`` (``MoEMLP.layer``), its experts split
    like any layer's.
    """

    def __init__(self, config: MoEConfig, index: int, layer: int, seed: int) -> None:
        name = f"mtp.{index}"
        super().__init__(config, name, seed)
        self.moe.layer = layer
        dim, dtype = config.dim, config.dtype
        self.enorm = nn.RMSNorm(dim, dtype=dtype)
        self.hnorm = nn.RMSNorm(dim, dtype=dtype)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False, dtype=dtype)
        self.mtp_norm = nn.RMSNorm(dim, dtype=dtype)
        for part in ("enorm", "hnorm", "mtp_norm"):
            fill(getattr(self, part).weight, config.init_std, seed, name, part, mean=1.0)
        fill(self.eh_proj.weight, config.init_std, seed, name, "eh_proj")

    def forward(  # type: ignore[override]
            self, hidden: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        h = self.eh_proj(torch.cat([self.enorm(inputs), self.hnorm(hidden)], dim=-1))
        return self.mtp_norm(super().forward(h))


def mtp_inputs(inputs: torch.Tensor, depth: int) -> torch.Tensor:
    """``inputs`` ``[..., tokens, dim]`` shifted ``depth`` tokens ahead, the last ``depth``
    tokens zeros (as torchtitan's ``roll_mtp_sequence`` fills the tail): the inputs of MTP depth
    ``depth - 1``."""
    tokens = inputs.shape[-2]
    kept = inputs.narrow(-2, min(depth, tokens), tokens - min(depth, tokens))
    tail = inputs.new_zeros((*inputs.shape[:-2], tokens - kept.shape[-2], inputs.shape[-1]))
    return torch.cat([kept, tail], dim=-2)


class MoEModel(nn.Module):
    """``num_layers`` MoE blocks and a final norm, then ``config.mtp_layers`` MTP layers (``mtp``,
    or ``None``)."""

    def __init__(self, config: MoEConfig, num_layers: int, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.num_layers = num_layers
        self.layers = Layers({str(i): MoEBlock(config, f"layers.{i}", seed)
                              for i in range(num_layers)})
        for i, block in enumerate(self.layers):
            cast(MoEBlock, block).moe.layer = i
        self.norm: nn.Module | None = nn.RMSNorm(config.dim, dtype=config.dtype)
        #: which pipeline stage of how many this model is (0 of 1: the whole model; see
        #: apply_pipeline).
        self.stage, self.num_stages = 0, 1
        fill(self.norm.weight, config.init_std, seed, "norm", mean=1.0)
        #: the MTP layers under their depth (``mtp.0``), held by the last pipeline stage only; None
        #: without any.
        self.mtp: Layers | None = None
        if config.mtp_layers:
            self.mtp = Layers({str(i): MTPLayer(config, i, num_layers + i, seed)
                               for i in range(config.mtp_layers)})

    @overload
    def forward(self, x: torch.Tensor, inputs: torch.Tensor | None = None, *,
                with_mtp: Literal[False] = False) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, inputs: torch.Tensor | None = None, *,
                with_mtp: Literal[True]) -> list[torch.Tensor]: ...

    def forward(self, x: torch.Tensor, inputs: torch.Tensor | None = None, *,
                with_mtp: bool = False) -> torch.Tensor | list[torch.Tensor]:
        """The held blocks in layer order, then the final norm where this model (or stage) holds it.

        ``with_mtp=True`` returns ``[output, mtp_0, mtp_1, ...]``: the output, then each MTP depth's
        output where this model (the last stage) holds the MTP layers -- ``[output]`` elsewhere.
        The MTP layers read the main stack's last hidden state and the model's ``inputs``: ``x``
        itself on a whole model or the first stage, which the caller passes on the last stage of a
        pipeline (it receives activations, not the inputs).
        """
        first = x
        for layer in self.layers:
            x = layer(x)
        out = x if self.norm is None else self.norm(x)
        if not with_mtp:
            return out
        outputs = [out]
        if self.mtp is not None:
            if inputs is None and self.stage != 0:
                raise ValueError(f"pipeline stage {self.stage} holds the MTP layers, which read "
                                 f"the model's inputs; pass them as forward(x, inputs, "
                                 f"with_mtp=True)")
            inputs = first if inputs is None else inputs
            hidden = x
            for depth, layer in enumerate(self.mtp, 1):
                hidden = layer(hidden, mtp_inputs(inputs, depth))
                outputs.append(hidden)
        return outputs


def build_model(config: MoEConfig, num_layers: int = 2, seed: int = 0) -> MoEModel:
    """A whole (ep=1) model; its weights depend only on ``(config, num_layers, seed)``.

    Build it under ``torch.device("meta")`` for a layout-only model with no data.
    """
    return MoEModel(config, num_layers, seed)


#: module-name parts that wrappers insert (activation checkpointing, torch.compile, FSDP1) and
#: get_model_state_dict leaves out of parameter names; DDP's ``module`` is left out too (see
#: named_modules).
WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every module of ``model`` once, named as its state-dict entries are (wrapper names left out).

    Pre-order, each module where it is first met, with an explicit stack: a nested generator per
    module cost a resumption per level for every module yielded, and the canonical views walk a
    model often."""
    seen: set[int] = set()
    stack: list[tuple[tuple[str, ...], nn.Module]] = [((), model)]
    while stack:
        parts, found = stack.pop()
        if id(found) in seen:
            continue
        seen.add(id(found))
        yield ".".join(parts), found
        is_ddp = isinstance(found, nn.parallel.DistributedDataParallel)
        children = [(parts if name in WRAPPER_PARTS or (is_ddp and name == "module")
                     else (*parts, name), child)
                    for name, child in found.named_children()]
        stack.extend(reversed(children))


def named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``model.named_parameters()`` under the names get_model_state_dict gives (wrapper names left
    out)."""
    seen: set[int] = set()
    for prefix, module in named_modules(model):
        for name, p in module._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield f"{prefix}.{name}" if prefix else name, p


def moe_layers(model: nn.Module) -> Iterator[tuple[str, MoEMLP]]:
    """Each :class:`MoEMLP` in ``model`` with the name its state-dict entries start with.

    The name is ``""`` when ``model`` is itself the MoEMLP, else e.g. ``"layers.0.moe"`` (entries
    are ``"layers.0.moe.router.weight"``).  Activation-checkpoint, torch.compile and DDP wrapper
    names are left out, as get_model_state_dict leaves them out.
    """
    return ((name, m) for name, m in named_modules(model) if isinstance(m, MoEMLP))


def moe_modules(model: nn.Module) -> Iterator[MoEMLP]:
    """Each :class:`MoEMLP` in ``model`` (``model.modules()`` order, wrappers included)."""
    return (m for m in model.modules() if isinstance(m, MoEMLP))

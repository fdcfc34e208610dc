"""A small, real MoE model whose checkpoints this project tests: its layers, its weights, its names.

:class:`MoEMLP` routes each token to ``top_k`` of ``num_experts`` experts (plus an optional shared
expert every token uses).  Its experts come in the two forms frameworks use:

- **unpacked**: ``experts`` is a ``ModuleList`` of small MLPs, ``experts.{i}.{up,gate,down}.weight``;
- **packed**: one Parameter per weight with a leading expert axis, ``up_w``/``gate_w`` ``[E, hidden,
  dim]`` and ``down_w`` ``[E, dim, hidden]``, so ``up_w[g]`` is unpacked ``experts[g].up.weight``.

Weights are a pure function of ``(seed, layer name, expert, weight name)``, so a model built for any
expert-parallel degree holds the same global expert ``g``: that is what lets a test compare a load
at ``ep=4`` with a save at ``ep=2`` bit for bit, with no communication.

How the model is split over ranks (expert and expert tensor parallelism, FSDP) is
:mod:`reference_impl.parallelize`, as a training framework keeps its model apart from its
parallelization; the forward only needs the groups that split sets on each layer, and crosses them
with :mod:`reference_impl.collectives`.  :func:`named_modules`, :func:`named_parameters` and
:func:`moe_layers` name modules and parameters as their state-dict entries are named.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from reference_impl.collectives import CopyToGroup, ReduceOverGroup
from reference_impl.memo import Memo

__all__ = [
    "PACKED_WEIGHTS",
    "WRAPPER_PARTS",
    "ExpertMLP",
    "MoEBlock",
    "MoEConfig",
    "MoEMLP",
    "MoEModel",
    "build_model",
    "moe_layers",
    "moe_modules",
    "named_modules",
    "named_parameters",
    "stable_seed",
]

#: the packed expert weights, in the order :class:`MoEMLP` registers them (gate only for SwiGLU).
PACKED_WEIGHTS = ("gate_w", "up_w", "down_w")


@dataclass(frozen=True)
class MoEConfig:
    """Shape and flavour of every MoE layer of a model."""

    num_experts: int = 6
    dim: int = 32
    hidden: int = 64
    kind: Literal["packed", "unpacked"] = "unpacked"
    activation: Literal["swiglu", "gelu"] = "swiglu"
    top_k: int = 2
    shared_expert: bool = True
    dtype: torch.dtype = torch.float32
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.kind not in ("packed", "unpacked"):
            raise ValueError(f"kind must be 'packed' or 'unpacked', got {self.kind!r}")
        if self.activation not in ("swiglu", "gelu"):
            raise ValueError(f"activation must be 'swiglu' or 'gelu', got {self.activation!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, {self.num_experts}], got {self.top_k}")


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` that is the same in every process (unlike ``hash()``)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _normal(shape: tuple[int, ...], std: float, dtype: torch.dtype, *key: object) -> torch.Tensor:
    generator = torch.Generator().manual_seed(stable_seed(*key))
    return (torch.randn(shape, generator=generator) * std).to(dtype)


#: ``_fill``'s draws, per (shape, std, key): a session builds the same model (seed, layer, expert) for
#: many cells and both kinds, and at 64-256 experts drawing each expert's weights again was most of a
#: build.  Entries are never handed out (``_fill`` copies from them), so no caller can change one.
#: 64 MiB of float32 per process, then it starts again.
_DRAWN = Memo("weight draws", 16 << 20, size=lambda t: t.numel())


def _drawn(shape: tuple[int, ...], std: float, key: tuple[object, ...], draw: Any) -> torch.Tensor:
    """The kept draw of ``(shape, std, key)``, made by ``draw()`` the first time (never handed out)."""
    found = _DRAWN.get((shape, std, key))
    return _DRAWN.put((shape, std, key), draw()) if found is None else found


def _fill(param: torch.Tensor, std: float, *key: object, mean: float = 0.0) -> None:
    """Write ``mean + N(0, std)`` drawn from ``key`` into ``param``; a meta tensor has no data to fill."""
    if param.is_meta:
        return
    shape = tuple(param.shape)
    found = _drawn(shape, std, key, lambda: _normal(shape, std, torch.float32, *key))
    with torch.no_grad():
        param.copy_(mean + found)


def _fill_rows(packed: torch.Tensor, std: float, first: int, *key: object) -> None:
    """Write row ``i`` of ``packed`` as :func:`_fill` writes expert ``first + i``'s weight (``key`` with the expert id
    before its last part), through one kept block: at 256 experts a row at a time was most of a packed build."""
    if packed.is_meta or not packed.shape[0]:
        return
    shape, row = tuple(packed.shape), tuple(packed.shape[1:])

    def stack() -> torch.Tensor:  # each row drawn in place as _normal draws it, or copied where _fill kept it
        block = torch.empty(shape, dtype=torch.float32)
        generator = torch.Generator()  # manual_seed resets all of its state: one generator serves every row
        kept: dict[int, torch.Tensor] = {}
        for i in range(shape[0]):
            ids = (*key[:-1], first + i, key[-1])
            found = _DRAWN.get((row, std, ids))
            if found is not None:
                kept[i] = found
            else:
                block[i].normal_(generator=generator.manual_seed(stable_seed(*ids)))
        block.mul_(std)  # as _normal scales its draw
        for i, found in kept.items():
            block[i] = found
        return block

    found = _drawn(shape, std, ("rows", first, *key), stack)
    with torch.no_grad():
        packed.copy_(found)


def _act(up: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """SwiGLU when the expert has a gate, GELU otherwise."""
    return F.gelu(up) if gate is None else F.silu(gate) * up


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (differentiable: its gradient comes back as a DTensor), else ``t``."""
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
    ``(seed, name)`` gives the same global experts at every EP degree and in both forms.

    After :func:`~reference_impl.parallelize.apply_expert_parallel` the module holds experts
    ``local_expert_start`` to ``local_expert_start + num_local_experts`` of ``num_experts``.  Its forward
    then computes those experts' share and sums it over the EP group, which is the layer's output (and the backward
    the ep=1 gradients) when every EP rank sees the same tokens.  Real EP frameworks all-to-all the
    tokens instead; this reference only needs a forward that is right, not fast.
    """

    def __init__(self, config: MoEConfig, name: str = "", seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.name = name
        #: the layer's global index in its model (a pipeline stage's first block may be layer 2).
        self.layer = 0
        self.kind = config.kind
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

        E, dim, hidden, dtype = config.num_experts, config.dim, config.hidden, config.dtype
        self.router = nn.Linear(dim, E, bias=False, dtype=dtype)
        self.shared = ExpertMLP(dim, hidden, config.activation, dtype) if config.shared_expert else None
        if config.kind == "unpacked":
            self.experts = nn.ModuleList(ExpertMLP(dim, hidden, config.activation, dtype) for _ in range(E))
        else:
            for weight, shape in self._packed_shapes().items():
                self.register_parameter(weight, nn.Parameter(torch.empty(shape, dtype=dtype)))
        self.reset_parameters(seed)

    def _packed_shapes(self) -> dict[str, tuple[int, int, int]]:
        c = self.config
        shapes = {"up_w": (c.num_experts, c.hidden, c.dim), "down_w": (c.num_experts, c.dim, c.hidden)}
        if c.activation == "swiglu":
            shapes = {"gate_w": (c.num_experts, c.hidden, c.dim), **shapes}
        return shapes

    def packed_weights(self) -> list[str]:
        """Names of the packed expert Parameters (empty for the unpacked form)."""
        return [w for w in PACKED_WEIGHTS if w in self._parameters] if self.kind == "packed" else []

    def expert_parameters(self) -> list[nn.Parameter]:
        """Every expert Parameter of this layer in either form: each expert's linears, or the packed weights."""
        if self.kind == "unpacked":
            return list(self.experts.parameters())
        return [getattr(self, w) for w in self.packed_weights()]

    def expert_weight(self, expert: int, linear: str) -> torch.Tensor:
        """Local expert ``expert``'s ``linear`` ("up", "gate", "down") weight in either form.

        Under expert tensor parallelism it is this rank's shard of the hidden axis (a plain tensor).
        """
        if self.kind == "unpacked":
            return _local(getattr(self.experts[expert], linear).weight)
        return _local(getattr(self, f"{linear}_w"))[expert]

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Give every weight its deterministic value (global expert ids, so any EP split agrees)."""
        c = self.config
        _fill(self.router.weight, c.init_std, seed, self.name, "router.weight")
        if self.shared is not None:
            for pname, p in self.shared.named_parameters():
                _fill(p, c.init_std, seed, self.name, "shared", pname)
        linears = ("gate", "up", "down") if c.activation == "swiglu" else ("up", "down")
        if self.kind == "packed":
            for linear in linears:
                _fill_rows(_local(getattr(self, f"{linear}_w")), c.init_std, self.local_expert_start, seed, self.name,
                           "expert", linear)
            return
        for i in range(self.num_local_experts):
            g = self.local_expert_start + i
            for linear in linears:
                w = self.expert_weight(i, linear)
                _fill(w, c.init_std, seed, self.name, "expert", g, linear)

    def _expert(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "unpacked":
            return self.experts[i](x)
        gate = F.linear(x, self.expert_weight(i, "gate")) if self.activation == "swiglu" else None
        return F.linear(_act(F.linear(x, self.expert_weight(i, "up")), gate), self.expert_weight(i, "down"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.router(tokens).float().softmax(dim=-1)
        top_w, top_i = probs.topk(self.top_k, dim=-1)
        top_w = (top_w / top_w.sum(dim=-1, keepdim=True)).to(tokens.dtype)
        groups = [mesh.get_group() for mesh, size in ((self.etp_mesh, self.etp_world_size),
                                                      (self.ep_mesh, self.ep_world_size)) if size > 1]
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
        chosen = top_i.unique()  # ascending: the experts run in id order, those no token chose not at all
        for g in chosen[(chosen >= start) & (chosen < start + self.num_local_experts)].tolist():
            token, slot = (top_i == g).nonzero(as_tuple=True)
            y = self._expert(g - start, routed_in[token]) * routed_w[token, slot, None]
            out = out.index_add(0, token, y)
        for group in groups:
            out = ReduceOverGroup.apply(out, group)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.reshape(x.shape)


class MoEBlock(nn.Module):
    """A pre-norm residual block around one MoE layer (``layers.{i}.norm``, ``layers.{i}.moe``)."""

    def __init__(self, config: MoEConfig, name: str, seed: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(config.dim, dtype=config.dtype)
        self.moe = MoEMLP(config, name=f"{name}.moe", seed=seed)
        _fill(self.norm.weight, config.init_std, seed, name, "norm", mean=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class Layers(nn.ModuleDict):
    """A model's blocks under their global index (``layers.4``), as torchtitan keeps them: a pipeline stage drops the
    blocks it does not hold (:func:`~reference_impl.parallelize.apply_pipeline`) and the rest keep their names, so the
    stage's state dict names every layer globally.  A ``ModuleList`` would renumber them 0..k-1 -- the stage-local
    naming that files stage 1's first layer where layer 0 belongs.  Indexing by int and iterating the blocks in layer
    order work as on a ``ModuleList``."""

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


class MoEModel(nn.Module):
    """``num_layers`` MoE blocks and a final norm: enough model for more than one MoE layer."""

    def __init__(self, config: MoEConfig, num_layers: int, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.num_layers = num_layers
        self.layers = Layers({str(i): MoEBlock(config, f"layers.{i}", seed) for i in range(num_layers)})
        for i, block in enumerate(self.layers):
            cast(MoEBlock, block).moe.layer = i
        self.norm: nn.Module | None = nn.RMSNorm(config.dim, dtype=config.dtype)
        #: which pipeline stage of how many this model is (0 of 1: the whole model; see apply_pipeline).
        self.stage, self.num_stages = 0, 1
        _fill(self.norm.weight, config.init_std, seed, "norm", mean=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The held blocks in layer order, then the final norm where this model (or stage) holds it."""
        for layer in self.layers:
            x = layer(x)
        return x if self.norm is None else self.norm(x)


def build_model(config: MoEConfig, num_layers: int = 2, seed: int = 0) -> MoEModel:
    """A whole (ep=1) model; its weights depend only on ``(config, num_layers, seed)``.

    Build it under ``torch.device("meta")`` for a layout-only model with no data.
    """
    return MoEModel(config, num_layers, seed)


#: module-name parts that wrappers insert (activation checkpointing, torch.compile, FSDP1) and
#: get_model_state_dict leaves out of parameter names; DDP's ``module`` is left out too (see named_modules).
WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every module of ``model`` once, named as its state-dict entries are (wrapper names left out).

    Pre-order, each module where it is first met, with an explicit stack: a nested generator per module cost a
    resumption per level for every module yielded, and the canonical views walk a model often."""
    seen: set[int] = set()
    stack: list[tuple[tuple[str, ...], nn.Module]] = [((), model)]
    while stack:
        parts, found = stack.pop()
        if id(found) in seen:
            continue
        seen.add(id(found))
        yield ".".join(parts), found
        is_ddp = isinstance(found, nn.parallel.DistributedDataParallel)
        children = [(parts if name in WRAPPER_PARTS or (is_ddp and name == "module") else (*parts, name), child)
                    for name, child in found.named_children()]
        stack.extend(reversed(children))


def named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``model.named_parameters()`` under the names get_model_state_dict gives (wrapper names left out)."""
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

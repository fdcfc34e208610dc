"""A small, real MoE feed-forward and the expert-parallel split whose checkpoints this project tests.

:class:`MoEMLP` routes each token to ``top_k`` of ``num_experts`` experts (plus an optional shared
expert every token uses).  Its experts come in the two forms frameworks use:

- **unpacked**: ``experts`` is a ``ModuleList`` of small MLPs, ``experts.{i}.{up,gate,down}.weight``;
- **packed**: one Parameter per weight with a leading expert axis, ``up_w``/``gate_w`` ``[E, hidden,
  dim]`` and ``down_w`` ``[E, dim, hidden]``, so ``up_w[g]`` is unpacked ``experts[g].up.weight``.

Weights are a pure function of ``(seed, layer name, expert, weight name)``, so a model built for any
expert-parallel degree holds the same global expert ``g``: that is what lets a test compare a load
at ``ep=4`` with a save at ``ep=2`` bit for bit, with no communication.

:func:`apply_expert_parallel` then keeps only this rank's experts, exactly as frameworks do, and
that is the bug this project is about: afterwards a rank names and shapes its experts as if they
were the layer's only ones (``experts.0`` is global expert ``start``; a packed weight has
``num_local_experts`` rows), so a DCP checkpoint of the raw state dict keeps one rank's experts in
place of all of them.  :mod:`reference_impl.expert_layout` is the fix.  Which experts a rank keeps
comes from :func:`reference_impl.layout.expert_range`, the one layout rule.

:func:`apply_expert_parallel` also applies expert tensor parallelism (``etp``): each expert's
weights sharded over the ``etp`` mesh dim on the hidden axis, the forward still the ep=1 one.
:func:`apply_fsdp` composes FSDP2 (or HSDP) on top, sharding each rank's experts over ``dp_shard``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from reference_impl.layout import expert_range

__all__ = [
    "HIDDEN_AXIS",
    "PACKED_WEIGHTS",
    "WRAPPER_PARTS",
    "ExpertMLP",
    "MoEBlock",
    "MoEConfig",
    "MoEMLP",
    "MoEModel",
    "apply_expert_parallel",
    "apply_fsdp",
    "build_model",
    "moe_layers",
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


def _fill(param: torch.Tensor, std: float, *key: object, mean: float = 0.0) -> None:
    """Write ``mean + N(0, std)`` drawn from ``key`` into ``param``; a meta tensor has no data to fill."""
    if not param.is_meta:
        with torch.no_grad():
            param.copy_(mean + _normal(tuple(param.shape), std, torch.float32, *key))


def _act(up: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """SwiGLU when the expert has a gate, GELU otherwise."""
    return F.gelu(up) if gate is None else F.silu(gate) * up


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


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (differentiable: its gradient comes back as a DTensor), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class _CopyToEP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (EP, or ETP).

    The tokens and routing weights every EP rank shares feed only the rank's own experts (and
    every ETP rank's only its part of their hidden axis), so each rank's gradient for them is a
    part of the whole; the sum gives every rank the whole, and with it the router and everything
    upstream get the gradient an ep=1 model gets (Megatron's "copy to the model-parallel region").
    """

    @staticmethod
    def forward(ctx: Any, shared: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return shared.view_as(shared)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class _ReduceOverEP(torch.autograd.Function):
    """Sum the group's partial outputs; the gradient, the same on every rank, passes through.

    Every EP rank sees the same tokens and holds part of the experts (every ETP rank part of each
    expert's hidden axis, so its down projection gives a partial sum), so the layer's output is
    the sum of the ranks' parts (Megatron's "reduce from the model-parallel region").
    """

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class MoEMLP(nn.Module):
    """Router over all experts, optional shared expert, and this rank's routed experts.

    ``name`` is the layer's name in its model; with ``seed`` it fixes every weight, so the same
    ``(seed, name)`` gives the same global experts at every EP degree and in both forms.

    After :func:`apply_expert_parallel` the module holds experts ``local_expert_start`` to
    ``local_expert_start + num_local_experts`` of ``num_experts``.  Its forward then computes those
    experts' share and sums it over the EP group, which is the layer's output (and the backward
    the ep=1 gradients) when every EP rank sees the same tokens.  Real EP frameworks all-to-all the
    tokens instead; this reference only needs a forward that is right, not fast.
    """

    def __init__(self, config: MoEConfig, name: str = "", seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.name = name
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
                routed = _CopyToEP.apply(routed, group)
            routed_in, routed_w = routed[:, : tokens.shape[-1]], routed[:, tokens.shape[-1]:]
            out = routed_in * 0
        for i in range(self.num_local_experts):
            token, slot = (top_i == self.local_expert_start + i).nonzero(as_tuple=True)
            if token.numel():
                y = self._expert(i, routed_in[token]) * routed_w[token, slot, None]
                out = out.index_add(0, token, y)
        for group in groups:
            out = _ReduceOverEP.apply(out, group)
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


class MoEModel(nn.Module):
    """``num_layers`` MoE blocks and a final norm: enough model for more than one MoE layer."""

    def __init__(self, config: MoEConfig, num_layers: int, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(MoEBlock(config, f"layers.{i}", seed) for i in range(num_layers))
        self.norm = nn.RMSNorm(config.dim, dtype=config.dtype)
        _fill(self.norm.weight, config.init_std, seed, "norm", mean=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def build_model(config: MoEConfig, num_layers: int = 2, seed: int = 0) -> MoEModel:
    """A whole (ep=1) model; its weights depend only on ``(config, num_layers, seed)``.

    Build it under ``torch.device("meta")`` for a layout-only model with no data.
    """
    return MoEModel(config, num_layers, seed)


#: module-name parts that wrappers insert (activation checkpointing, torch.compile, FSDP1) and
#: get_model_state_dict leaves out of parameter names; DDP's ``module`` is left out too (see _walk).
WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def _walk(module: nn.Module, parts: tuple[str, ...], seen: set[int]) -> Iterator[tuple[str, nn.Module]]:
    if id(module) in seen:
        return
    seen.add(id(module))
    yield ".".join(parts), module
    is_ddp = isinstance(module, nn.parallel.DistributedDataParallel)
    for child_name, child in module.named_children():
        skip = child_name in WRAPPER_PARTS or (is_ddp and child_name == "module")
        yield from _walk(child, parts if skip else (*parts, child_name), seen)


def named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every module of ``model`` once, named as its state-dict entries are (wrapper names left out)."""
    yield from _walk(model, (), set())


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


def _moe_modules(model: nn.Module) -> Iterator[MoEMLP]:
    return (m for m in model.modules() if isinstance(m, MoEMLP))


#: the tensor axis that expert tensor parallelism splits, per expert weight: the hidden axis
#: (``up``/``gate`` column-parallel, ``down`` row-parallel); packed weights add the expert axis.
HIDDEN_AXIS = {"gate": 0, "up": 0, "down": 1}


def apply_expert_parallel(model: nn.Module, device_mesh: Any) -> nn.Module:
    """Keep only this EP rank's experts in every :class:`MoEMLP` of ``model``, in place.

    Which experts: :func:`reference_impl.layout.expert_range` over ``device_mesh["ep"]`` (ranks
    past the last expert hold none).  The EP rank is the rank's coordinate on the ``ep`` dim,
    never its global rank, so EP groups of strided and of consecutive ranks both work.  Unpacked
    layers keep a ``ModuleList`` of their experts renumbered from 0; packed layers keep their rows
    as new Parameters (copies, so the full weights can be freed).

    With an ``etp`` dim of size > 1 (expert tensor parallelism) every expert weight also becomes a
    DTensor Parameter sharded over ``device_mesh["etp"]`` on its hidden axis (:data:`HIDDEN_AXIS`;
    ``up``/``gate`` column-parallel, ``down`` row-parallel), as DTensor's ``Shard`` splits it; the
    forward sums the partial outputs over etp.  Without ``ep``/``etp`` dims, or with both of size
    1, nothing changes.
    """
    names = getattr(device_mesh, "mesh_dim_names", None) or ()
    ep_mesh = device_mesh["ep"] if "ep" in names else None
    etp_mesh = device_mesh["etp"] if "etp" in names else None
    ep = ep_mesh.size() if ep_mesh is not None else 1
    etp = etp_mesh.size() if etp_mesh is not None else 1
    if ep == 1 and etp == 1:
        return model
    for moe in _moe_modules(model):
        if moe.ep_world_size != 1 or moe.etp_world_size != 1:
            raise ValueError(f"MoE layer {moe.name!r} is already split over {moe.ep_world_size} EP and "
                             f"{moe.etp_world_size} ETP ranks")
        if ep > 1:
            assert ep_mesh is not None
            ep_rank = ep_mesh.get_local_rank()
            start, end = expert_range(moe.num_experts, ep, ep_rank)
            if moe.kind == "unpacked":
                moe.experts = nn.ModuleList(list(moe.experts)[start:end])
            else:
                for weight in moe.packed_weights():
                    full = getattr(moe, weight)
                    setattr(moe, weight, nn.Parameter(full.detach()[start:end].clone(),
                                                      requires_grad=full.requires_grad))
            moe.ep_world_size, moe.ep_rank, moe.ep_mesh = ep, ep_rank, ep_mesh
            moe.local_expert_start, moe.num_local_experts = start, end - start
        if etp > 1:
            _split_hidden(moe, etp_mesh)
    return model


def _split_hidden(moe: MoEMLP, etp_mesh: Any) -> None:
    """Shard every expert weight of ``moe`` over ``etp_mesh`` on its hidden axis (no communication)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    def shard(full: torch.Tensor, axis: int) -> nn.Parameter:
        # Every rank holds the same full weights, so each takes its own shard (src_data_rank=None).
        local = distribute_tensor(full.detach(), etp_mesh, [Shard(axis)], src_data_rank=None)
        return nn.Parameter(local, requires_grad=full.requires_grad)

    if moe.kind == "unpacked":
        for expert in moe.experts:
            for linear, axis in HIDDEN_AXIS.items():
                module = getattr(expert, linear, None)
                if module is not None:
                    module.weight = shard(module.weight, axis)
    else:
        for weight in moe.packed_weights():
            setattr(moe, weight, shard(getattr(moe, weight), HIDDEN_AXIS[weight[:-2]] + 1))
    moe.etp_world_size, moe.etp_mesh = etp_mesh.size(), etp_mesh


def apply_fsdp(model: nn.Module, device_mesh: Any) -> nn.Module:
    """FSDP2 over ``device_mesh["dp_shard"]`` (HSDP with ``dp_replicate`` > 1): each :class:`MoEMLP`, then the model.

    Apply it after :func:`apply_expert_parallel`: each rank's experts are then sharded over
    dp_shard (FSDP2 pads uneven dim-0 shards, ranks may hold zero rows), and expert weights that
    expert tensor parallelism made DTensors over ``etp`` become 2-D (FSDP x ETP) DTensors.
    Parameters outside the experts are sharded over dp_shard and replicated over ep and etp, which
    a checkpoint stores once.  With a ``dp_replicate`` dim of size > 1 the mesh is
    ``("dp_replicate", "dp_shard")``, which FSDP2 applies as HSDP: replicate x shard.
    """
    from torch.distributed.fsdp import fully_shard

    names = getattr(device_mesh, "mesh_dim_names", None) or ()
    if "dp_shard" not in names:
        raise ValueError(f"apply_fsdp needs a mesh with a 'dp_shard' dimension, got {device_mesh}")
    hsdp = "dp_replicate" in names and device_mesh["dp_replicate"].size() > 1
    dp_mesh = device_mesh[("dp_replicate", "dp_shard")] if hsdp else device_mesh["dp_shard"]
    for moe in list(_moe_modules(model)):
        if moe is not model:
            fully_shard(moe, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model

"""The built-in ``deepspeed`` adapter: DeepSpeed 0.19.8's native MoE and its engine checkpoint.

It drives DeepSpeed's own code: blocks of a ``LayerNorm`` and a ``deepspeed.moe.layer.MoE``
(unpacked experts; the shared expert is its residual MoE), ``deepspeed.initialize`` (ZeRO-0, fp32,
``torch_adam`` AdamW over ``configure_moe_param_groups``), ``engine.save_checkpoint`` /
``load_checkpoint``, and the engine's forward (gate, ``_AllToAll`` dispatch, experts) under
:data:`FORWARD_SEED`.  Experts are filled by DeepSpeed's global id (``expp_rank *
num_local_experts + local_id``); ``read_checkpoint`` is ``_deepspeed_checkpoint.read_native``.  The
ground truth is the same model at ``ep_size=1`` without an engine, stepped by ``torch.optim.AdamW``
over the same groups.

Settings and workarounds, none of which changes what is checked:

* ``gradient_clipping: 0``: DeepSpeed clips to a global norm of 1.0 by default, a norm summed over
  every rank's experts whose rounding depends on the EP degree -- it would test the clip, not the
  checkpoint.
* ``DS_ACCELERATOR=cpu`` is set (unless set already) on import, by ``_deepspeed_common``, before the
  rank fork server imports ``deepspeed`` (``preload``): DeepSpeed picks its accelerator at import,
  and the CPU accelerator speaks gloo, the world's backend.  CPU/gloo only: on NCCL the CUDA
  accelerator would step with other kernels than the CPU ground truth.
* Persistent world: DeepSpeed keeps expert groups in module globals for the process's life and
  names and finds the optimizer file by *the largest EP group ever created*
  (``groups._get_max_expert_size_name``), so before each engine only that cell's ``ep_size_<ep>``
  groups stay visible, as a fresh job sees them (``_deepspeed_common.use_expert_groups``).
* The CPU accelerator JIT-compiles a shared-memory comm op at the first ``deepspeed.initialize``
  (minutes); ``ci/install_deepspeed.sh`` compiles it at install.

What the matrix finds: docs/frameworks/deepspeed.md.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from functools import cache
from typing import Any

from conformance.adapter import (
    ADAM_MOMENTS,
    Capabilities,
    FrameworkRefusal,
    Spec,
    forward_with_layers,
)
from conformance.adapters._deepspeed_checkpoint import NATIVE_EP_DEPENDENT, read_native
from conformance.adapters._deepspeed_common import deepspeed as _deepspeed
from conformance.adapters._deepspeed_common import installed_version, use_expert_groups
from conformance.synthetic import synthetic_grad, synthetic_weight

WEIGHT_DECAY = 0.01
#: torch's RNG seed for every forward check: DeepSpeed's top-2 gate samples the second expert with
#: Gumbel noise from the global RNG (``top2_2nd_expert_sampling``, on by default), which each rank
#: draws for its whole batch, so the same seed gives every rank at every EP degree the truth's
#: noise.
FORWARD_SEED = 0


@cache
def _classes() -> tuple[type, type]:
    """The expert template and the model: plain torch modules around DeepSpeed's ``MoE``."""
    import torch
    import torch.nn.functional as F
    from deepspeed.moe.layer import MoE
    from torch import nn

    class ExpertMLP(nn.Module):
        def __init__(self, dim: int, hidden: int, activation: str) -> None:
            super().__init__()
            self.activation = activation
            if activation == "swiglu":
                self.gate = nn.Linear(dim, hidden, bias=False)
            self.up = nn.Linear(dim, hidden, bias=False)
            self.down = nn.Linear(hidden, dim, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            up = self.up(x)
            act = F.silu(self.gate(x)) * up if self.activation == "swiglu" else F.gelu(up)
            return self.down(act)

    class Block(nn.Module):
        def __init__(self, spec: Spec, ep: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(spec.dim)
            self.moe = MoE(hidden_size=spec.dim,
                           expert=ExpertMLP(spec.dim, spec.hidden, spec.activation),
                           num_experts=spec.num_experts, ep_size=ep,
                           k=min(spec.top_k, spec.num_experts), use_residual=spec.shared_expert)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.moe(self.norm(x))[0]

    class DeepSpeedMoEModel(nn.Module):
        def __init__(self, spec: Spec, ep: int) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block(spec, ep) for _ in range(spec.num_layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    return ExpertMLP, DeepSpeedMoEModel


def _moe_layers(model: Any) -> list[Any]:
    module = getattr(model, "module", model)  # a DeepSpeedEngine, or the plain model (ground truth)
    return [block.moe for block in module.layers]


def _expert_offset(moe: Any) -> int:
    """The global id of ``moe``'s local expert 0, by DeepSpeed's rule (as in its save and load)."""
    if moe.ep_size == 1:
        return 0
    from deepspeed.utils import groups

    return groups._get_expert_parallel_rank(moe.expert_group_name) * moe.num_local_experts


def _local_experts(model: Any) -> Iterator[tuple[int, int, Any]]:
    """``(layer, global expert id, expert module)`` for this rank's experts."""
    for layer, moe in enumerate(_moe_layers(model)):
        offset = _expert_offset(moe)
        for i, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            yield layer, offset + i, expert


def _short(name: str) -> str:
    """An expert parameter's canonical name: its linear ("gate", "up", "down")."""
    return name.removesuffix(".weight")


def _dense_params(model: Any) -> Iterator[tuple[int | None, str, Any]]:
    """``(layer, name within the layer, parameter)`` for every non-expert parameter."""
    module = getattr(model, "module", model)
    experts = {id(p) for _, _, expert in _local_experts(model) for p in expert.parameters()}
    for fqn, p in module.named_parameters():
        if id(p) in experts:
            continue
        parts = fqn.split(".")
        if parts[0] == "layers":
            yield int(parts[1]), ".".join(parts[2:]), p
        else:
            yield None, fqn, p


def _fill(model: Any, seed: int) -> None:
    """Every parameter from synthetic_weight, experts keyed by their global id."""
    import torch

    with torch.no_grad():
        for layer, g, expert in _local_experts(model):
            for name, p in expert.named_parameters():
                p.copy_(synthetic_weight(seed, layer, g, _short(name), p.shape, dtype=p.dtype))
        for dense_layer, name, p in _dense_params(model):
            p.copy_(synthetic_weight(seed, dense_layer, None, name, p.shape, dtype=p.dtype))


def _set_grads(model: Any, seed: int, step: int) -> None:
    for layer, g, expert in _local_experts(model):
        for name, p in expert.named_parameters():
            p.grad = synthetic_grad(seed, step, layer, g, _short(name), p.shape,
                                    dtype=p.dtype).to(p.device)
    for dense_layer, name, p in _dense_params(model):
        p.grad = synthetic_grad(seed, step, dense_layer, None, name, p.shape,
                                dtype=p.dtype).to(p.device)


class DeepSpeedAdapter:
    name = "deepspeed"
    capabilities = Capabilities(kinds=("unpacked",), optimizer=True, fsdp=False, uneven=False,
                                max_ep=64, format="deepspeed", ep_orders=("consecutive",))
    #: imported once by the rank fork server (after this module, which sets DS_ACCELERATOR).
    preload = ("deepspeed", "deepspeed.moe.layer")
    #: see :data:`conformance.adapters._deepspeed_checkpoint.NATIVE_EP_DEPENDENT`.
    ep_dependent_keys = NATIVE_EP_DEPENDENT

    @property
    def version(self) -> str:
        """The installed DeepSpeed's version (read without importing it); pinned to 0.19.8 in CI."""
        return installed_version()

    # -- building ----------------------------------------------------------------------------------
    def build(self, spec: Spec, mesh: Any, seed: int) -> tuple[Any, Any]:
        import torch

        if spec.kind != "unpacked" or spec.fsdp or spec.dtype != "float32":
            raise ValueError("this adapter drives DeepSpeed's native MoE (unpacked experts), fp32, "
                             f"ZeRO-0; got kind={spec.kind!r}, fsdp={spec.fsdp}, "
                             f"dtype={spec.dtype!r}")
        deepspeed = _deepspeed()
        _, model_class = _classes()
        ep = 1 if mesh is None else mesh["ep"].size()
        model = model_class(spec, ep)
        steps = spec.optimizer_steps
        if mesh is None:  # the ground truth: ep=1, no engine, no communication
            from deepspeed.moe.utils import configure_moe_param_groups

            _fill(model, seed)
            if steps <= 0:
                return model, None
            optimizer = torch.optim.AdamW(configure_moe_param_groups(list(model.parameters())),
                                          lr=spec.lr, weight_decay=WEIGHT_DECAY)
            for step in range(steps):
                _set_grads(model, seed, step)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            return model, optimizer

        use_expert_groups(ep)
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 0},
            # DeepSpeed clips to a global norm of 1.0 by default; the norm sums over every rank's
            # experts, so its rounding depends on the EP degree.  Off: the values then depend on the
            # seed alone, and the checkpoint path is what the cells compare.
            "gradient_clipping": 0.0,
            "steps_per_print": 1 << 30,
        }
        if steps > 0:
            config["optimizer"] = {"type": "AdamW",
                                   "params": {"lr": spec.lr, "weight_decay": WEIGHT_DECAY,
                                              "torch_adam": True}}
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=list(model.parameters()) if steps > 0 else None,
            config=config)
        _fill(engine, seed)
        for step in range(steps):
            _set_grads(engine, seed, step)
            engine.step()
        return engine, optimizer

    # -- checkpoint path ---------------------------------------------------------------------------
    def save(self, model: Any, optimizer: Any, path: str) -> None:
        model.save_checkpoint(path)

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        try:
            loaded, _ = model.load_checkpoint(path, load_optimizer_states=optimizer is not None,
                                              load_lr_scheduler_states=False)
        # DeepSpeed's own error, prefixed with the EP degrees it happened between
        except Exception as exc:
            message = " ".join(str(exc).split()).replace(os.fspath(path), "<checkpoint>")
            raise RuntimeError(f"load_checkpoint ({_ep_story(model, path)}) raised "
                               f"{type(exc).__name__}: {message}") from exc
        if loaded is None:
            raise FrameworkRefusal("DeepSpeed engine.load_checkpoint found no checkpoint in "
                                   f"{path}")

    def forward(self, model: Any, batch: Any) -> Any:
        """The engine's (or the truth's plain model's) forward on ``batch``: DeepSpeed's gate, its
        token dispatch (``_AllToAll`` over the EP group at ep > 1) and its experts, under
        :data:`FORWARD_SEED`.

        In the named form, each ``MoE``'s own output too: each adds ~1e-6 to a residual stream of ~3
        (LayerNorm weights of scale 0.02), below the stream's rounding, so only its own output shows
        a wrong dispatch."""
        import torch

        layers = {f"layers.{i}.moe": moe for i, moe in enumerate(_moe_layers(model))}
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(FORWARD_SEED)
            return forward_with_layers(lambda: model(batch), layers)

    def read_checkpoint(self, path: str) -> dict[str, Any]:
        """The saved files in global form:
        :func:`conformance.adapters._deepspeed_checkpoint.read_native`."""
        return read_native(path)

    # -- canonical views ---------------------------------------------------------------------------
    def expert_tensors(self, model: Any, optimizer: Any) -> Iterator[tuple[int, int, str, Any]]:
        state = optimizer.state if optimizer is not None else {}
        for layer, g, expert in _local_experts(model):
            for name, p in expert.named_parameters():
                short = _short(name)
                yield layer, g, short, p
                for moment in ADAM_MOMENTS:
                    if moment in state.get(p, {}):
                        yield layer, g, f"{short}.{moment}", state[p][moment]

    def other_tensors(self, model: Any,
                      optimizer: Any) -> Iterator[tuple[int | None, None, str, Any]]:
        state = optimizer.state if optimizer is not None else {}
        for layer, name, p in _dense_params(model):
            yield layer, None, name, p
            for moment in ADAM_MOMENTS:
                if moment in state.get(p, {}):
                    yield layer, None, f"{name}.{moment}", state[p][moment]


def _ep_story(engine: Any, path: str) -> str:
    """"saved at ep=N, loading at ep=M as EP rank r": N counts the per-EP-rank optimizer files."""
    from deepspeed.utils import groups

    saved = len(glob.glob(os.path.join(path, "*", "expp_rank_*_optim_states.pt")))
    try:
        ep = _moe_layers(engine)[0].ep_size
        rank = groups._get_expert_parallel_rank(groups._get_max_expert_size_name())
    except Exception:  # the story must never hide DeepSpeed's own error
        return f"saved at ep={saved or '?'}"
    return f"saved at ep={saved or '?'}, loading at ep={ep} as EP rank {rank}"

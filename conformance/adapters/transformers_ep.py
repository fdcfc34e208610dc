"""The built-in ``transformers`` adapter: Hugging Face transformers 5.24.0's native expert parallelism end to end.

What it drives (transformers' own code; nothing of the EP split or of the checkpoint is re-implemented here):

* **Model.**  A tiny ``Qwen3MoeForCausalLM`` built from a ``Qwen3MoeConfig`` object (no hub download):
  ``spec.num_layers`` decoder layers, every one sparse (attention, ``Qwen3MoeSparseMoeBlock``: the router
  ``mlp.gate`` and ``Qwen3MoeExperts`` with packed ``gate_up_proj [E, 2*inter, dim]`` and
  ``down_proj [E, dim, inter]``), embeddings and an untied head.  Qwen3-MoE has no shared expert, so
  ``spec.shared_expert`` is not built.  It is made by ``from_pretrained(None, config=..., state_dict={},
  distributed_config=...)``, the one entry that takes ``distributed_config`` (``from_config`` does not), and
  its weights are then overwritten with :func:`conformance.synthetic_weight` (expert rows by global id, the
  rest by parameter name), each rank writing the region of every DTensor it holds.  Layer kind: packed only;
  SwiGLU (``silu``) only.
* **Expert parallelism and FSDP2.**  ``transformers.distributed.DistributedConfig(dp_replicate_size=R,
  fsdp_size=ep * dp_shard, ep_size=ep, ep_implementation="all_to_all")``: transformers builds its own meshes
  (``initialize_distributed_mesh``: dense ``(pp, dp_replicate, fsdp, tp)``, experts ``(pp, dp_replicate,
  efsdp, ep)`` with ``ep`` innermost, so an EP group is ``ep`` *consecutive* ranks -- the order declared in
  ``capabilities.ep_orders``), applies the model's ``base_model_ep_plan`` (``grouped_gemm``: ``Shard(0)`` of
  each expert weight over ``ep``; ``ep_dispatch_experts``: the all-to-all token exchange) and then FSDP2 over
  every rank (experts over ``efsdp = dp_shard``, the rest over ``fsdp``; HSDP with ``dp_replicate``).
  transformers composes EP only this way: its meshes must cover the world (``pp * dp_replicate * fsdp * tp``
  ranks) and ``save_pretrained(..., distributed_checkpoint=True)`` refuses a model that is neither FSDP- nor
  TP-sharded, so with tp=1 every distributed build is FSDP2 -- EP-only cells are ``n/a``
  (``capabilities.ep_only=False``).  ``grouped_gemm`` refuses ``E % ep != 0`` ("Cannot evenly shard 6
  experts across 4 expert-parallel ranks."): ``uneven=True`` (run it), so those cells are ``error`` cells whose
  first line is transformers' own refusal.
* **Optimizer.**  ``torch.optim.AdamW`` over ``model.parameters()`` (what the Trainer builds), stepped with
  :func:`conformance.synthetic_grad` gradients set on ``.grad`` region by region (no forward/backward).
* **Checkpoint.**  ``model.save_pretrained(path, distributed_checkpoint=True)`` (DCP through torch's
  ``HuggingFaceStorageWriter``: one ``shard-0000r-model-...safetensors`` per rank) and
  ``transformers.distributed.save_optimizer_distributed(model, optimizer, path/optim)`` (DCP, FQN-keyed,
  flattened); loading with ``transformers.distributed._load_model_checkpoint_distributed`` -- what
  ``from_pretrained(path, distributed_config=...)`` runs on a sharded checkpoint, here into the built model,
  since the contract loads in place -- and ``load_optimizer_distributed``.  The checkpoint check reads the
  files through ``read_checkpoint`` (torch's ``HuggingFaceStorageReader`` / ``FileSystemReader``, no process
  group).  transformers has no legacy save and no guard against a lossy checkpoint: legacy cells are ``n/a``.
* **Forward.**  The model's own forward (``model(inputs_embeds=batch).logits``: attention, router, all-to-all
  dispatch, experts, head) on the suite's batch; runs on CPU/gloo.  It is the root module's forward because
  FSDP2 refuses a forward of the inner ``model.model``, which is not a module it wraps (several roots).

What the matrix finds (asserted cell by cell in ``tests/test_adapter_transformers.py``; the write-up is
``docs/frameworks/transformers.md``): every cell of the ``1,2,4`` tier and of the test's subset passes bit for
bit with every check, forward included -- packed, model and model+optimizer, FSDP2 and HSDP, between ep 1, 2
and 4; E % ep != 0 is transformers' own loud refusal (``error`` cells).

Workarounds (none changes what is checked):

* The truth checkpoint is an ep=1 save without FSDP; transformers' distributed save needs FSDP2 (see above),
  so every build with a mesh composes FSDP2 -- at ep=1 it is ``DistributedConfig(fsdp_size=world)``, which
  stores the same global tensors.
* transformers' per-build load report and progress bar are silenced (``logging.set_verbosity_error``).
* transformers forms its own meshes in every build (``init_device_mesh``), and they are the ones checked: the
  suite's meshes are not substituted.  Within one rank process a second build of the same shape reuses the
  mesh the first one formed (:func:`_reused_meshes`), as one training script forms it once: the same world,
  shape and names give the same groups, and without it every build added process groups (each with its gloo
  threads) until a full tier ran ~250 threads per rank.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

from conformance.adapter import (
    ADAM_MOMENTS,
    Capabilities,
    Spec,
    installed_version,
    local_region,
    run_steps,
    torch_optimizer_scalars,
)
from conformance.synthetic import synthetic_grad, synthetic_weight

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
#: the expert parameters of layer N, as transformers names them
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
OPTIM_DIR = "optim"
VOCAB = 32


class TransformersAdapter:
    """transformers 5.24.0: ``DistributedConfig`` EP + FSDP2, ``save_pretrained(distributed_checkpoint=True)``."""

    name = "transformers"
    version = installed_version("transformers") or "5.24.0"
    capabilities = Capabilities(kinds=("packed",), optimizer=True, fsdp=True, uneven=True, max_ep=64,
                                format="hf-safetensors-dcp", ep_orders=("consecutive",), hsdp=True,
                                ep_only=False)
    preload = ("transformers.models.qwen3_moe.modeling_qwen3_moe", "transformers.distributed.checkpoint",
               "transformers.distributed.expert_parallel")

    # -- building ----------------------------------------------------------------------------------
    def build(self, spec: Spec, mesh: Any, seed: int) -> tuple[Any, Any]:
        import torch
        from transformers import Qwen3MoeForCausalLM
        from transformers.utils import logging

        if spec.kind != "packed":
            raise ValueError(f"transformers' Qwen3MoeExperts is packed; cannot build kind {spec.kind!r}")
        if spec.activation != "swiglu":
            raise ValueError(f"this adapter builds Qwen3-MoE's SwiGLU experts; cannot build {spec.activation!r}")
        logging.set_verbosity_error()
        logging.disable_progress_bar()
        kwargs: dict[str, Any] = {"config": _config(spec), "state_dict": {}, "dtype": getattr(torch, spec.dtype)}
        if mesh is not None:
            kwargs["distributed_config"] = _distributed_config(spec)
        with _reused_meshes():
            model = Qwen3MoeForCausalLM.from_pretrained(None, **kwargs)
        _fill(model, lambda layer, expert, name, shape: synthetic_weight(seed, layer, expert, name, shape))
        if spec.optimizer_steps <= 0:
            return model, None
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
        run_steps(lambda index: self.step(model, optimizer, seed, index), 0, spec.optimizer_steps)
        return model, optimizer

    def step(self, model: Any, optimizer: Any, seed: int, step: int) -> None:
        _fill(model, lambda layer, expert, name, shape: synthetic_grad(seed, step, layer, expert, name, shape),
              grad=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def scalars(self, model: Any, optimizer: Any) -> dict[str, Any]:
        return torch_optimizer_scalars(optimizer)

    def forward(self, model: Any, batch: Any) -> Any:
        import torch

        with torch.no_grad():
            return model(inputs_embeds=batch.unsqueeze(0)).logits[0]

    # -- checkpoint path ---------------------------------------------------------------------------
    def save(self, model: Any, optimizer: Any, path: str) -> None:
        from transformers.distributed import save_optimizer_distributed

        model.save_pretrained(path, distributed_checkpoint=True)
        if optimizer is not None:
            save_optimizer_distributed(model, optimizer, os.path.join(path, OPTIM_DIR))

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        from transformers.distributed import _load_model_checkpoint_distributed, load_optimizer_distributed

        _load_model_checkpoint_distributed(model, path)
        if optimizer is not None:
            load_optimizer_distributed(model, optimizer, os.path.join(path, OPTIM_DIR))

    def read_checkpoint(self, path: str) -> dict[str, Any]:
        """The model's safetensors shards and the optimizer's DCP files, in global form (no process group)."""
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

        found = _read_all(HuggingFaceStorageReader(path))
        optim = os.path.join(path, OPTIM_DIR)
        if os.path.isdir(optim):
            found |= _read_all(FileSystemReader(optim))
        return found

    # -- canonical views ---------------------------------------------------------------------------
    def expert_tensors(self, model: Any, optimizer: Any) -> Iterator[tuple[int, int, str, Any]]:
        state = optimizer.state if optimizer is not None else {}
        for name, p in model.named_parameters():
            match = _EXPERT.match(name)
            if not match:
                continue
            layer, weight_name = int(match.group(1)), match.group(2)
            tensors = {weight_name: p} | {f"{weight_name}.{m}": state[p][m] for m in ADAM_MOMENTS
                                          if m in state.get(p, {})}
            for label, tensor in tensors.items():
                local, region = local_region(tensor)
                first = region[0].start if region is not None else 0
                for i in range(local.shape[0]):
                    yield layer, first + i, label, local[i]

    def other_tensors(self, model: Any, optimizer: Any) -> Iterator[tuple[int | None, None, str, Any]]:
        state = optimizer.state if optimizer is not None else {}
        for name, p in model.named_parameters():
            if _EXPERT.match(name):
                continue
            layer = _layer_of(name)
            yield layer, None, name, p
            for moment in ADAM_MOMENTS:
                if moment in state.get(p, {}):
                    yield layer, None, f"{name}.{moment}", state[p][moment]


# -- the model -------------------------------------------------------------------------------------
#: the meshes transformers formed in this rank process, by ``init_device_mesh``'s arguments.
_MESHES: dict[str, Any] = {}


@contextlib.contextmanager
def _reused_meshes() -> Iterator[None]:
    """``torch.distributed.init_device_mesh`` (which transformers calls) answered once per distinct arguments in
    this process; re-flattening a reused mesh under the same name is a no-op in torch."""
    import torch.distributed as dist

    original = dist.init_device_mesh

    def init_device_mesh(*args: Any, **kwargs: Any) -> Any:
        key = repr((args, sorted(kwargs.items())))
        if key not in _MESHES:
            _MESHES[key] = original(*args, **kwargs)
        return _MESHES[key]

    dist.init_device_mesh = init_device_mesh
    try:
        yield
    finally:
        dist.init_device_mesh = original


def _config(spec: Spec) -> Any:
    """A tiny Qwen3-MoE at the suite's sizes: every layer sparse, no router aux loss, untied head."""
    from transformers import Qwen3MoeConfig

    heads = 2
    return Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=spec.dim, intermediate_size=spec.hidden, moe_intermediate_size=spec.hidden,
        num_hidden_layers=spec.num_layers, num_attention_heads=heads, num_key_value_heads=1,
        head_dim=spec.dim // heads, num_experts=spec.num_experts,
        num_experts_per_tok=min(spec.top_k, spec.num_experts), decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=False, output_router_logits=False, router_aux_loss_coef=0.0, tie_word_embeddings=False,
        max_position_embeddings=64, hidden_act="silu", attention_dropout=0.0)


def _distributed_config(spec: Spec) -> Any:
    """transformers' parallelism for ``spec.layout``: FSDP2 over every rank, EP groups of consecutive ranks."""
    from transformers.distributed import DistributedConfig

    layout = spec.layout
    if layout is None or layout.etp != 1:
        raise ValueError(f"transformers has no expert tensor parallelism; cannot build layout {layout}")
    return DistributedConfig(dp_replicate_size=layout.dp_replicate, fsdp_size=layout.ep * layout.dp_shard,
                             ep_size=layout.ep, ep_implementation="all_to_all")


def _layer_of(name: str) -> int | None:
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def _fill(model: Any, make: Any, *, grad: bool = False) -> None:
    """Each parameter's (or its gradient's) region from the global tensor ``make`` gives for it.

    Expert weights are built row by row from their global expert id, the rest from their name, so the
    values are the same at every layout.
    """
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            match = _EXPERT.match(name)
            shape = tuple(p.shape)
            if match:
                layer, weight_name = int(match.group(1)), match.group(2)
                full = torch.stack([make(layer, g, weight_name, shape[1:]) for g in range(shape[0])])
            else:
                full = make(_layer_of(name), None, name, shape)
            local, region = local_region(p)
            values = (full if region is None else full[region]).to(device=local.device, dtype=p.dtype)
            if not grad:
                local.copy_(values)
            elif isinstance(p, DTensor):
                p.grad = DTensor.from_local(values.contiguous(), p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
            else:
                p.grad = values.clone()


def _read_all(reader: Any) -> dict[str, Any]:
    """Every entry a DCP storage reader holds, flattened to its metadata key, read on this process alone."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return _flatten(state)


def _flatten(state: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(state, dict):
        return {prefix: state}
    found: dict[str, Any] = {}
    for key, value in state.items():
        found |= _flatten(value, f"{prefix}.{key}" if prefix else str(key))
    return found

"""The built-in ``transformers`` adapter: Hugging Face transformers 5.24.0's native expert
parallelism end to end.

It drives transformers' own code (nothing of the EP split or of the checkpoint is re-implemented): a
tiny ``Qwen3MoeForCausalLM`` from a ``Qwen3MoeConfig`` object (no hub download; packed SwiGLU
experts, no shared expert) made by ``from_pretrained(None, config=..., state_dict={},
distributed_config=...)`` -- the one entry that takes ``distributed_config`` -- with
``DistributedConfig(dp_replicate_size=R, fsdp_size=ep * dp_shard, ep_size=ep,
ep_implementation="all_to_all")`` (its own meshes, EP groups of consecutive ranks, its
``base_model_ep_plan``, then FSDP2/HSDP), then filled with synthetic weights by global expert id;
``torch.optim.AdamW`` (what the Trainer builds); ``save_pretrained(path,
distributed_checkpoint=True)`` and ``save_optimizer_distributed``;
``_load_model_checkpoint_distributed`` (what ``from_pretrained(path, distributed_config=...)`` runs
on a sharded checkpoint, here into the built model, since the contract loads in place) and
``load_optimizer_distributed``; and ``model(inputs_embeds=batch).logits`` as the forward.  Its
Hugging Face export is ``save_pretrained(path)`` (gathered) and its import ``from_pretrained(path,
distributed_config=...)`` at the cell's layout, copied into the cell's model (``hf_export``,
``hf_import``).

Workarounds (none changes what is checked):

* The truth checkpoint is an ep=1 save without FSDP; transformers' distributed save needs an FSDP-
  or TP-sharded model, so every build with a mesh composes FSDP2 -- at ep=1
  ``DistributedConfig(fsdp_size=world)``, which stores the same global tensors.
* transformers' per-build load report and progress bar are silenced
  (``logging.set_verbosity_error``).
* The forward is the root module's: FSDP2 refuses a forward of the inner ``model.model``, which is
  not a module it wraps (several roots).
* transformers forms its own meshes in every build (``init_device_mesh``), and they are the ones
  checked: the suite's meshes are not substituted.  Within one rank process a second build of the
  same shape reuses the mesh the first one formed (:func:`_reused_meshes`), as one training script
  forms it once: the same world, shape and names give the same groups, and without it every build
  added process groups (each with its gloo threads) until a full tier ran ~250 threads per rank.

What the matrix finds: docs/frameworks/transformers.md.
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
    HFModel,
    Spec,
    forward_with_layers,
    installed_version,
    local_region,
    run_steps,
    torch_optimizer_scalars,
)
from conformance.adapters.torch_native import persistent_buffers
from conformance.synthetic import synthetic_grad, synthetic_weight

#: each expert weight's canonical views: the fused ``gate_up_proj`` row ``[2I, H]`` is
#: ``[gate; up]`` (the forward's ``chunk(2)``), given as its two halves under the names of the
#: linears they are, as the reference's fused layers and the other adapters name them.
EXPERT_VIEWS = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
#: the expert parameters of layer N, as transformers names them
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
OPTIM_DIR = "optim"
#: the attribute a built model keeps its spec under (import_hf builds its load at its layout).
_SPEC = "_moe_ep_spec"
VOCAB = 32


class TransformersAdapter:
    """transformers 5.24.0: ``DistributedConfig`` EP + FSDP2,
    ``save_pretrained(distributed_checkpoint=True)``."""

    name = "transformers"
    version = installed_version("transformers") or "5.24.0"
    capabilities = Capabilities(kinds=("packed",), optimizer=True, fsdp=True, uneven=True,
                                max_ep=64, format="hf-safetensors-dcp", ep_orders=("consecutive",),
                                hsdp=True, ep_only=False)
    preload = ("transformers.models.qwen3_moe.modeling_qwen3_moe",
               "transformers.distributed.checkpoint", "transformers.distributed.expert_parallel")

    #: the transformers class built, and the last part of the names of the buffers that are state
    #: the way weights are (an expert bias): ``build`` gives them synthetic values
    #: (:func:`synthetic_weight` by their layer and name, times :attr:`buffer_scale`).
    model_class = "Qwen3MoeForCausalLM"
    synthetic_buffers: tuple[str, ...] = ()
    buffer_scale = 0.02

    def config(self, spec: Spec) -> Any:
        """The model's config at the suite's sizes (:func:`_config`)."""
        return _config(spec)

    # -- building ----------------------------------------------------------------------------------
    def build(self, spec: Spec, mesh: Any, seed: int) -> tuple[Any, Any]:
        import torch
        import transformers
        from transformers.utils import logging

        if spec.kind != "packed":
            raise ValueError(f"transformers' {self.model_class} experts are packed; cannot build "
                             f"kind {spec.kind!r}")
        if spec.activation != "swiglu":
            raise ValueError(f"{self.model_class}'s experts are SwiGLU; cannot build "
                             f"{spec.activation!r}")
        logging.set_verbosity_error()
        logging.disable_progress_bar()
        kwargs: dict[str, Any] = {"config": self.config(spec), "state_dict": {},
                                  "dtype": getattr(torch, spec.dtype)}
        if mesh is not None:
            kwargs["distributed_config"] = _distributed_config(spec)
        with _reused_meshes():
            model = getattr(transformers, self.model_class).from_pretrained(None, **kwargs)
        object.__setattr__(model, _SPEC, spec)  # what import_hf builds its load at
        _fill(model,
              lambda layer, expert, name, shape: synthetic_weight(seed, layer, expert, name, shape))
        _fill_buffers(model, self.synthetic_buffers,
                      lambda layer, name, shape: synthetic_weight(seed, layer, None, name, shape,
                                                                  scale=self.buffer_scale))
        if spec.optimizer_steps <= 0:
            return model, None
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
        run_steps(lambda index: self.step(model, optimizer, seed, index), 0, spec.optimizer_steps)
        return model, optimizer

    def step(self, model: Any, optimizer: Any, seed: int, step: int) -> None:
        _fill(model, lambda layer, expert, name, shape: synthetic_grad(seed, step, layer, expert,
                                                                       name, shape),
              grad=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def scalars(self, model: Any, optimizer: Any) -> dict[str, Any]:
        return torch_optimizer_scalars(optimizer)

    def forward(self, model: Any, batch: Any) -> Any:
        """The root module's forward (logits) and each MoE block's own output
        (``model.layers.N.mlp``, :func:`forward_with_layers`): a block's output (~1e-6) is below the
        rounding of the residual stream it joins, so another expert choice shows in it alone."""
        import torch

        layers = {f"model.layers.{i}.mlp": layer.mlp for i, layer in enumerate(model.model.layers)}
        with torch.no_grad():
            return forward_with_layers(lambda: model(inputs_embeds=batch.unsqueeze(0)).logits[0],
                                       layers)

    # -- Hugging Face export: the model is the transformers class itself ---------------------------
    def hf_model(self, spec: Spec) -> HFModel:
        return HFModel(self.model_class, self.config(spec).to_dict())

    def export_hf(self, model: Any, path: str) -> None:
        """``save_pretrained(path)``: the whole model, gathered over FSDP and EP, written by rank
        0."""
        import torch.distributed as dist

        model.save_pretrained(path)
        if dist.is_initialized():
            dist.barrier()

    def import_hf(self, model: Any, path: str) -> None:
        """``from_pretrained(path, distributed_config=...)`` at the cell's layout (the framework's
        load of a Hugging Face checkpoint makes a new model), its state then copied into
        ``model``: every parameter and persistent buffer, shard by shard."""
        import torch
        import transformers

        spec: Spec = getattr(model, _SPEC)
        kwargs: dict[str, Any] = {"config": self.config(spec), "dtype": getattr(torch, spec.dtype)}
        if spec.layout is not None:
            kwargs["distributed_config"] = _distributed_config(spec)
        with _reused_meshes():
            loaded = getattr(transformers, self.model_class).from_pretrained(path, **kwargs)
        found = loaded.state_dict()
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                tensor.copy_(found[name])

    def hf_forward(self, hf_model: Any, batch: Any) -> Any:
        """The same forward on the model loaded from the export (one process, no mesh)."""
        return self.forward(hf_model, batch)

    # -- checkpoint path ---------------------------------------------------------------------------
    def save(self, model: Any, optimizer: Any, path: str) -> None:
        from transformers.distributed import save_optimizer_distributed

        model.save_pretrained(path, distributed_checkpoint=True)
        if optimizer is not None:
            save_optimizer_distributed(model, optimizer, os.path.join(path, OPTIM_DIR))

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        # _load_model_checkpoint_distributed is transformers 5.24's (the adapter's target); the
        # venv's 5.18 lacks it
        from transformers.distributed import (  # type: ignore[attr-defined]
            _load_model_checkpoint_distributed,
            load_optimizer_distributed,
        )

        _load_model_checkpoint_distributed(model, path)
        if optimizer is not None:
            load_optimizer_distributed(model, optimizer, os.path.join(path, OPTIM_DIR))

    def read_checkpoint(self, path: str) -> dict[str, Any]:
        """The model's safetensors shards and the optimizer's DCP files, in global form (no process
        group)."""
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

        found = _read_all(HuggingFaceStorageReader(path))
        optim = os.path.join(path, OPTIM_DIR)
        if os.path.isdir(optim):
            found |= _read_all(FileSystemReader(optim))
        return found

    # -- canonical views ---------------------------------------------------------------------------
    def expert_tensors(self, model: Any, optimizer: Any) -> Iterator[tuple[int, int, str, Any]]:
        """Each expert's row of ``gate_up_proj`` as its ``gate`` and ``up`` halves, of ``down_proj``
        as ``down`` (:data:`EXPERT_VIEWS`), and the same cuts of their Adam moments."""
        state = optimizer.state if optimizer is not None else {}
        for name, p in model.named_parameters():
            match = _EXPERT.match(name)
            if not match:
                continue
            layer, weight_name = int(match.group(1)), match.group(2)
            tensors = {"": p} | {f".{m}": state[p][m] for m in ADAM_MOMENTS
                                 if m in state.get(p, {})}
            for suffix, tensor in tensors.items():
                local, region = local_region(tensor)
                first = region[0].start if region is not None else 0
                for i in range(local.shape[0]):
                    for label, view in _views(weight_name, local[i]):
                        yield layer, first + i, f"{label}{suffix}", view

    def other_tensors(self, model: Any,
                      optimizer: Any) -> Iterator[tuple[int | None, None, str, Any]]:
        """Every other parameter and its moments by name, and every persistent floating-point buffer
        (an expert bias: whole on every rank, as FSDP2 leaves buffers)."""
        state = optimizer.state if optimizer is not None else {}
        for name, p in model.named_parameters():
            if _EXPERT.match(name):
                continue
            layer = _layer_of(name)
            yield layer, None, name, p
            for moment in ADAM_MOMENTS:
                if moment in state.get(p, {}):
                    yield layer, None, f"{name}.{moment}", state[p][moment]
        for name, buffer in persistent_buffers(model):
            if buffer.is_floating_point():
                yield _layer_of(name), None, name, buffer


# -- the model -------------------------------------------------------------------------------------
#: the meshes transformers formed in this rank process, by ``init_device_mesh``'s arguments.
_MESHES: dict[str, Any] = {}


@contextlib.contextmanager
def _reused_meshes() -> Iterator[None]:
    """``torch.distributed.init_device_mesh`` (which transformers calls) answered once per distinct
    arguments in this process; re-flattening a reused mesh under the same name is a no-op in
    torch."""
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
    """A tiny Qwen3-MoE at the suite's sizes: every layer sparse, no router aux loss, untied
    head."""
    from transformers import Qwen3MoeConfig

    heads = 2
    # head_dim is a Qwen3MoeConfig field in transformers 5.24 (the adapter's target), not in the
    # venv's 5.18
    return Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=VOCAB, hidden_size=spec.dim, intermediate_size=spec.hidden,
        moe_intermediate_size=spec.hidden, num_hidden_layers=spec.num_layers,
        num_attention_heads=heads, num_key_value_heads=1, head_dim=spec.dim // heads,
        num_experts=spec.num_experts, num_experts_per_tok=min(spec.top_k, spec.num_experts),
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False, output_router_logits=False,
        router_aux_loss_coef=0.0, tie_word_embeddings=False, max_position_embeddings=64,
        hidden_act="silu", attention_dropout=0.0)


def _distributed_config(spec: Spec) -> Any:
    """transformers' parallelism for ``spec.layout``: FSDP2 over every rank, EP groups of
    consecutive ranks."""
    from transformers.distributed import DistributedConfig

    layout = spec.layout
    if layout is None or layout.etp != 1:
        raise ValueError("transformers has no expert tensor parallelism; cannot build layout "
                         f"{layout}")
    # dp_replicate_size, ep_size and ep_implementation are DistributedConfig fields in transformers
    # 5.24 (the adapter's target), not in the venv's 5.18
    return DistributedConfig(  # type: ignore[call-arg]
        dp_replicate_size=layout.dp_replicate, fsdp_size=layout.ep * layout.dp_shard,
        ep_size=layout.ep, ep_implementation="all_to_all")


def _layer_of(name: str) -> int | None:
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def _views(weight_name: str, row: Any) -> list[tuple[str, Any]]:
    """One expert's row of ``weight_name`` as its canonical views (:data:`EXPERT_VIEWS`): equal
    slices of the first axis, in order."""
    labels = EXPERT_VIEWS[weight_name]
    return list(zip(labels, row.chunk(len(labels)), strict=True))


def _fill(model: Any, make: Any, *, grad: bool = False) -> None:
    """Each parameter's (or its gradient's) region from the global tensor ``make`` gives for it.

    Expert weights are built row by row from their global expert id (``gate_up_proj``'s row from
    its ``gate`` and ``up`` halves), the rest from their name, so the values are the same at every
    layout.
    """
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            match = _EXPERT.match(name)
            shape = tuple(p.shape)
            if match:
                layer, labels = int(match.group(1)), EXPERT_VIEWS[match.group(2)]
                part = (shape[1] // len(labels), *shape[2:])
                full = torch.stack([torch.cat([make(layer, g, label, part) for label in labels])
                                    for g in range(shape[0])])
            else:
                full = make(_layer_of(name), None, name, shape)
            local, region = local_region(p)
            values = (full if region is None
                      else full[region]).to(device=local.device, dtype=p.dtype)
            if not grad:
                local.copy_(values)
            elif isinstance(p, DTensor):
                p.grad = DTensor.from_local(values.contiguous(), p.device_mesh, p.placements,
                                            run_check=False, shape=p.shape, stride=p.stride())
            else:
                p.grad = values.clone()


def _fill_buffers(model: Any, names: tuple[str, ...], make: Any) -> None:
    """Each persistent buffer whose name ends in one of ``names`` := ``make(layer, name, shape)``,
    whole on every rank (in its own dtype: an expert bias stays fp32 under bf16)."""
    import torch

    with torch.no_grad():
        for name, buffer in persistent_buffers(model):
            if name.rsplit(".", 1)[-1] in names:
                value = make(_layer_of(name), name, tuple(buffer.shape))
                buffer.copy_(value.to(buffer.device, buffer.dtype))


def _read_all(reader: Any) -> dict[str, Any]:
    """Every entry a DCP storage reader holds, flattened to its metadata key, read on this process
    alone."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return _flatten(state)


def _flatten(state: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(state, dict):
        return {prefix: state}
    found: dict[str, Any] = {}
    for key, value in state.items():
        found |= _flatten(value, f"{prefix}.{key}" if prefix else str(key))
    return found

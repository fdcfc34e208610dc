"""The reference's Hugging Face export and import: its model as ``Ernie4_5_MoeForCausalLM``.

A trained MoE reaches its users as a Hugging Face checkpoint, so the reference writes one, the
truth an export at any layout is held to.  The family is the one whose MoE layer computes what
:class:`~reference_impl.model.MoEMLP` computes: Ernie 4.5's MoE routes on ``softmax`` scores in
fp32, adds ``moe_statics.e_score_correction_bias`` to choose the top-k only (the unbiased scores of
the chosen experts, renormalised, weight them: :mod:`reference_impl.router`'s rule), and adds an
ungated shared expert.  Qwen3-MoE has no shared expert and no bias; DeepSeek-V3 scores with a
sigmoid: neither computes the reference's forward.

The reference has no attention, no token embedding and no output head, and the family has all
three.  The export holds them as a transformers model of the same forward needs them: every
``o_proj`` zero, so each block's attention adds exactly nothing to the residual stream and the
block is the reference's ``x + moe(norm(x))`` (``post_attention_layernorm`` is the reference's
``norm``); the embedding, the head and the other attention weights are synthetic values the same
at every layout.  The model's output is the base model's ``last_hidden_state`` on
``inputs_embeds``.

Two expert forms, by the model's kind, as the hub holds them:

- **per expert** (packed and unpacked layers): ``model.layers.N.mlp.experts.G.{gate,up,down}_proj.
  weight``, what ``save_pretrained`` writes and every converter reads;
- **fused** (fused layers): transformers 5's own ``mlp.experts.gate_up_proj`` ``[E, 2h, dim]``
  (gate rows, then up rows: its forward's ``chunk(2)``, whatever the model's ``fused_order``) and
  ``mlp.experts.down_proj`` ``[E, dim, h]``, which transformers 5 loads as it stands.

The export goes through the reference's own checkpoint (:func:`reference_impl.checkpoint.save`,
per expert: every expert under its global id at any layout), read whole on rank 0 and renamed; the
import is the same path backwards (every rank reads and renames the files, then loads its own
regions of them at its layout, as :func:`~reference_impl.checkpoint.load` loads a checkpoint).
That is how the offline converters of the frameworks work, and it keeps one rule of where each
expert lives.  A key this module does not know is an error, never dropped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from reference_impl.model import MoEConfig
from reference_impl.weights import normal

__all__ = ["HF_CLASS", "export_hf", "from_hf", "hf_config", "import_hf", "read_safetensors",
           "to_hf", "write_safetensors", "write_safetensors_file"]

#: the transformers class the reference's export is for.
HF_CLASS = "Ernie4_5_MoeForCausalLM"
#: the synthetic parts' sizes: a vocabulary, and the attention's heads (head_dim = dim // HEADS).
VOCAB, HEADS = 32, 2
#: the file the export writes (one shard: the models are small) and its index.
FILE, INDEX = "model.safetensors", "model.safetensors.index.json"
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.float64: "F64", torch.int64: "I64", torch.int32: "I32"}
_LINEARS = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_EXPERT = re.compile(r"^layers\.(\d+)\.moe\.experts\.(\d+)\.(gate|up|down)\.weight$")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_HF_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
#: the reference's names within a layer and the family's (``None``: a per-expert or fused weight).
_IN_LAYER = {"norm.weight": "post_attention_layernorm.weight",
             "moe.router.weight": "mlp.gate.weight",
             "moe.router.expert_bias": "mlp.moe_statics.e_score_correction_bias",
             **{f"moe.shared.{k}.weight": f"mlp.shared_experts.{v}.weight"
                for k, v in _LINEARS.items()}}


def hf_config(config: MoEConfig, num_layers: int) -> dict[str, Any]:
    """The ``Ernie4_5_MoeConfig`` fields of the family model that computes the reference's forward;
    ValueError for a model it cannot (GELU experts, MTP layers, a shared expert of another
    width)."""
    if config.activation != "swiglu":
        raise ValueError(f"{HF_CLASS} has SwiGLU experts; this model's are {config.activation}")
    if config.mtp_layers:
        raise ValueError(f"{HF_CLASS} in transformers has no multi-token-prediction layers; this "
                         f"model has {config.mtp_layers}")
    shared = config.hidden if config.shared_hidden is None else config.shared_hidden
    if config.shared_expert and shared % config.hidden:
        raise ValueError(f"{HF_CLASS}'s shared expert is a multiple of the expert width "
                         f"{config.hidden}; this model's is {shared}")
    if config.dim % HEADS:
        raise ValueError(f"the export's attention splits dim {config.dim} into {HEADS} heads")
    return {"model_type": "ernie4_5_moe", "architectures": [HF_CLASS], "vocab_size": VOCAB,
            "hidden_size": config.dim, "intermediate_size": config.hidden,
            "moe_intermediate_size": config.hidden, "num_hidden_layers": num_layers,
            "num_attention_heads": HEADS, "num_key_value_heads": 1,
            "head_dim": config.dim // HEADS, "moe_num_experts": config.num_experts,
            "moe_k": config.top_k,
            "moe_num_shared_experts": shared // config.hidden if config.shared_expert else 0,
            "moe_layer_start_index": 0, "moe_layer_end_index": num_layers - 1,
            "moe_layer_interval": 1, "hidden_act": "silu", "use_bias": False,
            # torch's RMSNorm without an eps uses its dtype's: the family's must be the same
            "rms_norm_eps": torch.finfo(config.dtype).eps, "tie_word_embeddings": False,
            "max_position_embeddings": 64, "torch_dtype": str(config.dtype).split(".")[-1]}


def _synthetic(shape: tuple[int, ...], dtype: torch.dtype, name: str) -> torch.Tensor:
    return normal(shape, 0.02, dtype, "hf export", name)


def to_hf(native: Mapping[str, torch.Tensor], config: MoEConfig,
          num_layers: int) -> dict[str, torch.Tensor]:
    """The family's keys from the reference's whole per-expert state (``layers.N.moe.experts.G.up
    .weight``, no ``model.`` prefix), with the parts the reference does not have (the module
    docstring); the fused form for fused models.  ValueError names a key it does not know."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    dim, dtype = config.dim, config.dtype
    for key, tensor in native.items():
        if m := _EXPERT.match(key):
            layer, g, linear = int(m[1]), int(m[2]), m[3]
            experts.setdefault((layer, linear), {})[g] = tensor
        elif key == "norm.weight":
            out["model.norm.weight"] = tensor
        elif (m := _LAYER.match(key)) and m[2] in _IN_LAYER:
            hf_key = f"model.layers.{m[1]}.{_IN_LAYER[m[2]]}"
            out[hf_key] = tensor.reshape(1, -1) if m[2].endswith("expert_bias") else tensor
        else:
            raise ValueError(f"the {HF_CLASS} export has no place for the reference's {key!r}")
    for (layer, linear), rows in experts.items():
        if sorted(rows) != list(range(config.num_experts)):
            raise ValueError(f"layer {layer}'s {linear} weight: the state holds experts "
                             f"{sorted(rows)}, expected 0..{config.num_experts - 1}")
        if config.kind != "fused":
            for g, tensor in rows.items():
                out[f"model.layers.{layer}.mlp.experts.{g}.{_LINEARS[linear]}.weight"] = tensor
    if config.kind == "fused":
        for layer in sorted({layer for layer, _ in experts}):
            gate, up, down = (experts[(layer, linear)] for linear in ("gate", "up", "down"))
            ids = range(config.num_experts)
            out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([gate[g], up[g]]) for g in ids])
            out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([down[g] for g in ids])
    head = dim // HEADS
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        out.setdefault(prefix + "mlp.moe_statics.e_score_correction_bias",
                       torch.zeros(1, config.num_experts))
        out[prefix + "input_layernorm.weight"] = torch.ones(dim, dtype=dtype)
        for proj, rows_ in (("q_proj", dim), ("k_proj", head), ("v_proj", head)):
            out[prefix + f"self_attn.{proj}.weight"] = _synthetic((rows_, dim), dtype,
                                                                  prefix + proj)
        out[prefix + "self_attn.o_proj.weight"] = torch.zeros(dim, dim, dtype=dtype)
    out["model.embed_tokens.weight"] = _synthetic((VOCAB, dim), dtype, "embed_tokens")
    out["lm_head.weight"] = _synthetic((VOCAB, dim), dtype, "lm_head")
    return dict(sorted(out.items()))


def from_hf(hf: Mapping[str, torch.Tensor], config: MoEConfig) -> dict[str, torch.Tensor]:
    """The reference's per-expert state from an export of either form (:func:`to_hf`'s inverse):
    the synthetic parts are left out; ValueError names a key it does not know."""
    reverse = {v: k for k, v in _IN_LAYER.items()}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in hf.items():
        if m := _HF_EXPERT.match(key):
            out[f"layers.{m[1]}.moe.experts.{m[2]}.{m[3]}.weight"] = tensor
        elif m := _HF_FUSED.match(key):
            names = ("gate", "up") if m[2] == "gate_up_proj" else ("down",)
            for g, row in enumerate(tensor):
                for name, part in zip(names, row.chunk(len(names)), strict=True):
                    out[f"layers.{m[1]}.moe.experts.{g}.{name}.weight"] = part
        elif key == "model.norm.weight":
            out["norm.weight"] = tensor
        elif (m := re.match(r"^model\.layers\.(\d+)\.(.+)$", key)) and m[2] in reverse:
            name = reverse[m[2]]
            if name.endswith("expert_bias"):
                tensor = tensor.reshape(-1)
            elif name.startswith("moe.shared.") and not config.shared_expert:
                raise ValueError(f"{key!r}: the export has a shared expert; this model has none")
            out[f"layers.{m[1]}.{name}"] = tensor
        elif not re.search(r"(input_layernorm|self_attn\.\w+|embed_tokens)\.weight$|^lm_head\.",
                           key):
            raise ValueError(f"the reference has no place for the {HF_CLASS} key {key!r}")
    return out


# -- safetensors ---------------------------------------------------------------------------------
def write_safetensors(tensors: Mapping[str, torch.Tensor], directory: str | os.PathLike[str],
                      config: Mapping[str, Any]) -> None:
    """``model.safetensors`` (:func:`write_safetensors_file`), its index and ``config.json`` in
    ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    total = write_safetensors_file(tensors, directory / FILE)
    index = {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(tensors, FILE)}
    (directory / INDEX).write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(dict(config), indent=2))


def write_safetensors_file(tensors: Mapping[str, torch.Tensor],
                           path: str | os.PathLike[str]) -> int:
    """One safetensors file (the format's header: 8-byte length, JSON, 8-byte aligned) at
    ``path``; the bytes of tensor data it holds."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for key, tensor in tensors.items():
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[key] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for data in blobs:
            f.write(data)
    return offset


def read_safetensors(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face checkpoint directory (the files its index names, else every
    ``*.safetensors``)."""
    directory = Path(directory)
    index = directory / INDEX
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.exists() else sorted(p.name for p in directory.glob("*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{directory} holds no *.safetensors file")
    reverse = {v: k for k, v in _DTYPES.items()}
    out: dict[str, torch.Tensor] = {}
    for name in files:
        raw = (directory / name).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        for key, info in header.items():
            if key == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            data = bytearray(raw[8 + n + begin:8 + n + end])
            out[key] = torch.frombuffer(data, dtype=torch.uint8).view(
                reverse[info["dtype"]]).reshape(info["shape"]) if data else torch.empty(
                info["shape"], dtype=reverse[info["dtype"]])
    return out


# -- export and import -----------------------------------------------------------------------------
def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _every_rank_knows(failed: Exception | None, what: str) -> None:
    """Raise on every rank when rank 0's part of ``what`` failed (its own exception there, a
    RuntimeError naming it elsewhere): no rank is left waiting for one that stopped."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if failed is not None:
            raise failed
        return
    said: list[Any] = [None if failed is None else f"{type(failed).__name__}: {failed}"]
    dist.broadcast_object_list(said, src=0)
    if failed is not None:
        raise failed
    if said[0] is not None:
        raise RuntimeError(f"{what} failed on rank 0: {said[0]}")


def _whole(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole, read by this process alone."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in metadata.items()
             if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


def export_hf(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write ``model`` (at any layout; a collective on every rank) as a :data:`HF_CLASS` checkpoint
    in ``path``: ``model.safetensors``, its index and ``config.json``.  A fine-tuned model is
    written merged (:mod:`reference_impl.merged_export`): the release its users load."""
    from reference_impl.checkpoint import save, state_dict
    from reference_impl.lora import has_tuning_state
    from reference_impl.merged_export import merged_state
    from reference_impl.moe import moe_layers

    config: MoEConfig = getattr(model, "config")  # noqa: B009 (an MoEModel's; nn.Module types it)
    num_layers: int = getattr(model, "num_layers")  # noqa: B009
    hf = hf_config(config, num_layers)  # refuses on every rank alike, before any collective
    path = os.fspath(path)
    native = os.path.join(path, "_native")
    if any(has_tuning_state(moe) for _, moe in moe_layers(model)):
        dcp.save(merged_state(model, state_dict(model, None)["model"]), checkpoint_id=native)
    else:
        save(model, None, native, per_expert=True)
    _barrier()
    failed: Exception | None = None
    if _rank() == 0:
        try:
            state = {k.removeprefix("model."): v for k, v in _whole(native).items()}
            shutil.rmtree(native)
            write_safetensors(to_hf(state, config, num_layers), path, hf)
        except (ValueError, OSError, RuntimeError) as exc:
            failed = exc
    _every_rank_knows(failed, f"the export to {path}")


def import_hf(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Load a :data:`HF_CLASS` checkpoint of either form into ``model`` at its layout (a collective
    on every rank); every tensor of the model is overwritten, none left at its value."""
    from reference_impl.checkpoint import load_whole

    state = from_hf(read_safetensors(path), getattr(model, "config"))  # noqa: B009
    load_whole(model, state, os.fspath(path))

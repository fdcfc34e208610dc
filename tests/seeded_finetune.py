"""Seeded bugs of fine-tuning state (issue 60): the reference adapter with one bug planted each, as
the fine-tuning cells' negative controls (``tests/test_detection_finetune.py`` asserts which cells
fail and how they read).

The bugs are the classes reported against LoRA-over-quantized-experts trainers in 2025-26:

- :class:`ScalesLeftInPlace` -- the EP split moves each expert's quantized blocks to its rank but
  leaves the scales where they were (sglang #33541: MXFP4 block scales wrong on per-expert
  checkpoints; Megatron-Bridge #5745);
- :class:`SharedAdaptersLeftAtInit` -- a load at ep > 1 restores the routed experts' adapters and
  leaves the shared expert's at their initial values (Megatron-Bridge #5379);
- :class:`ScalesCutAtTheWrongBlock` -- under expert TP, a block-FP8 shard's ``scale_inv`` read one
  block off (vLLM #52997);
- :class:`MergeOverLocalExpertsOnly` -- the merge adds the delta on the first EP rank's experts
  only, the others exported as their base (a merge over the local experts: ms-swift #9030);
- :class:`MergedExportWritesTheBase` -- the merged export writes each expert's base, the LoRA delta
  dropped (unsloth-zoo #647, #812);
- :class:`SingletonExpertDimSqueezed` -- the load ``squeeze()``-s each packed quantized layer's
  scales, and a rank holding one expert loses the expert axis (Megatron-Bridge #5731, #5745).

The first three have no Hugging Face members: their bugs are in the build and the DCP path, which
the HF checks would only read again, as has the last; the two before it are bugs of the merged
export itself.
"""

from __future__ import annotations

from typing import Any

from conformance.adapter import Spec
from conformance.adapters import reference


class _Base(reference.ReferenceAdapter):
    """The reference adapter without its HF members."""

    hf_model = export_hf = import_hf = hf_forward = None


def _local(tensor: Any) -> tuple[Any, Any]:
    """This rank's data of ``tensor`` and its region of the tensor (``None``: all of it)."""
    from reference_impl.regions import local_region

    return local_region(tensor)


class ScalesLeftInPlace(_Base):
    """A quantized layer's EP split keeps each expert's blocks but not its scales: a rank holding
    experts ``a..b`` holds the scales of experts ``0..b-a`` (the local ids read as global ones).
    At ep=1 nothing moves; a save at ep > 1 writes experts ``a..b``'s scales rows with the first
    experts' scales (``checkpoint``); a load then overwrites the build's scales with the
    checkpoint's, so only the saving side shows it."""

    name = "seeded-scales-left-in-place"

    def build(self, spec: Spec, mesh: Any, seed: int) -> tuple[Any, Any]:
        model, optimizer = super().build(spec, mesh, seed)
        fmt = spec.finetune.partition("+")[2]
        if fmt:
            self._first_experts_scales(model, spec, seed, fmt)
        return model, optimizer

    def _first_experts_scales(self, model: Any, spec: Spec, seed: int, fmt: str) -> None:
        import torch

        from conformance.adapters.finetune import apply_finetune
        from reference_impl.lora import _linears, quantized_names
        from reference_impl.moe import build_model, moe_layers

        whole = build_model(self.moe_config(spec), spec.num_layers, seed)
        apply_finetune(whole, spec, seed)
        wholes = dict(moe_layers(whole))
        with torch.no_grad():
            for name, moe in moe_layers(model):
                if moe.local_expert_start == 0:
                    continue
                source, n = wholes[name], moe.num_local_experts
                if moe.kind == "unpacked":
                    scales = quantized_names(fmt, "weight")[1]
                    pairs = [(getattr(getattr(e, lin), scales),
                              getattr(getattr(source.experts[i], lin), scales))
                             for i, e in enumerate(moe.experts) for lin in _linears(moe)]
                else:
                    pairs = [(getattr(moe, scales), getattr(source, scales)[:n])
                             for scales in (quantized_names(fmt, w)[1] for w in moe.base_weights())]
                for held, first in pairs:
                    local, region = _local(held)
                    wrong = first if region is None else first[region]
                    if wrong.shape == local.shape:  # (a fused layer's frame under etp: untouched)
                        local.copy_(wrong)


class SharedAdaptersLeftAtInit(_Base):
    """A load at ep > 1 maps the routed experts' adapters to this rank's experts and leaves the
    shared expert's adapters out (it is no expert of the EP split): they keep the load side's
    initial values, and the resumed run trains from them (``values``: silent)."""

    name = "seeded-shared-adapters-left-at-init"

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        import torch

        from reference_impl.moe import moe_layers

        layers = [moe for _, moe in moe_layers(model)]
        kept = [(p, p.detach().clone()) for moe in layers if moe.ep_world_size > 1
                and moe.shared is not None
                for n, p in moe.shared.named_parameters() if "lora_" in n]
        super().load(model, optimizer, path)
        with torch.no_grad():
            for p, initial in kept:
                _local(p)[0].copy_(_local(initial)[0])


class ScalesCutAtTheWrongBlock(_Base):
    """Under expert TP, the load reads each block-FP8 ``down`` weight's ``scale_inv`` shard one
    block off along the hidden axis (the shard's own blocks' scales taken from the next block, the
    last wrapping): the blocks come back right, their scales do not (``values``: silent)."""

    name = "seeded-scales-cut-at-the-wrong-block"

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        import torch

        from reference_impl.moe import moe_layers

        super().load(model, optimizer, path)
        with torch.no_grad():
            for _, moe in moe_layers(model):
                if moe.etp_world_size == 1:
                    continue
                # the hidden axis of down's block grid: its input's ([out/b, in/b] per expert)
                targets = ([(getattr(e.down, "weight_scale_inv", None), 1) for e in moe.experts]
                           if moe.kind == "unpacked"
                           else [(getattr(moe, "down_w_scale_inv", None), 2)])
                for tensor, axis in targets:
                    if tensor is not None:
                        local = _local(tensor)[0]
                        local.copy_(torch.roll(local, 1, dims=axis))


class MergeOverLocalExpertsOnly(reference.ReferenceAdapter):
    """The merge adds the LoRA delta on the experts of the first EP rank only -- the experts the
    merging loop met -- and every other expert goes into the merged export as its base.  At ep=1
    every rank holds every expert and the export is right; at ep > 1 the other EP ranks' experts
    differ from the ep=1 export's (``hf_export``: on disk), and the model loaded from it computes
    another forward."""

    name = "seeded-merge-over-local-experts-only"

    def export_hf(self, model: Any, path: str) -> None:
        import reference_impl.lora as lora

        real = lora._delta

        def first_ep_rank_only(moe: Any, i: Any, adapter: str, module: Any) -> Any:
            if i is None or moe.local_expert_start == 0:
                return real(moe, i, adapter, module)
            return 0.0

        lora._delta = first_ep_rank_only
        try:
            super().export_hf(model, path)
        finally:
            lora._delta = real


class MergedExportWritesTheBase(reference.ReferenceAdapter):
    """The merged export writes every expert's base weights (dequantized) without its LoRA delta, at
    every layout alike: the export equals the ep=1 export byte for byte, and only the model
    transformers loads from it shows the delta missing (``hf_export``: its forward)."""

    name = "seeded-merged-export-writes-the-base"

    def export_hf(self, model: Any, path: str) -> None:
        import reference_impl.lora as lora

        real = lora._delta
        lora._delta = lambda *args: 0.0  # base + 0.0: the delta dropped
        try:
            super().export_hf(model, path)
        finally:
            lora._delta = real


class SingletonExpertDimSqueezed(_Base):
    """The load gathers each packed quantized layer's scales for this rank's experts and
    ``squeeze()``-s them (Megatron-Bridge #5731, #5745: the singleton dims of ``*_scale_inv``
    dropped): where a rank holds one expert the expert axis goes with it, ``[1, R, C]`` becoming
    ``[R, C]``.  Only at ep=E (one expert a rank): the cells loading at ep=4 with E=4."""

    name = "seeded-singleton-expert-dim-squeezed"

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        from reference_impl.lora import quantized_names
        from reference_impl.moe import moe_layers

        super().load(model, optimizer, path)
        for _, moe in moe_layers(model):
            quant = getattr(moe, "quant", None)
            if quant is None or moe.kind == "unpacked" or moe.num_local_experts != 1:
                continue
            for weight in moe.base_weights():
                name = quantized_names(quant.fmt, weight)[1]
                if name in moe._buffers:
                    moe._buffers[name] = moe._buffers[name].squeeze()
                else:
                    getattr(moe, name).data = getattr(moe, name).data.squeeze()

"""Seeded Hugging Face export and import bugs: the reference adapter with one reported bug planted.

The negative controls of the ``hf_export`` and ``hf_import`` checks (``tests/test_hf.py`` asserts
which cells fail and how they read).  Each is planted where a converter would have it: in what the
export writes, or in what the import reads, around the reference's own converter
(:mod:`reference_impl.hf`), on rank 0, where the files are written and read.

- :class:`HFExpertsSwapped` -- the export files layer 0's experts 0 and 1 under each other's ids,
  complete and identical at every layout, and the import swaps them back: it round-trips its own
  mistake, and only the forward of the transformers model loaded from the export shows it (local
  expert ids into the fused HF tensor, slime PR #1799);
- :class:`HFExportRankZeroOnly` -- at ep > 1 the export holds only the experts of EP rank 0, not
  gathered from the other ranks (Megatron-Bridge #1716, #1871);
- :class:`HFDownTransposed` -- ``down_proj`` written ``[hidden, dim]``, read back transposed
  (GroupedMLP's layout, Megatron-LM #909; slime #1840 where the two dims are equal);
- :class:`HFImportBiasReset` -- the import resets the expert bias to zero (torchtitan #4475);
- :class:`HFImportDoesNothing` -- the import leaves every tensor at its initial value and reports
  success (Megatron-LM #5844);
- :class:`HFExportRefusesUneven` -- the export refuses an expert count the world does not divide,
  the ep=1 truth's included (an export that splits the experts over every rank to consolidate them);
- :class:`HFExportRankZeroOnlyImportRefuses` -- :class:`HFExportRankZeroOnly`, and an import that
  refuses at ep > 1: the export's defect leads, the import's refusal follows it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from conformance.adapters import reference
from reference_impl.hf import read_safetensors, write_safetensors


class ReferenceAdapter(reference.ReferenceAdapter):
    """The reference without fine-tuning cells: their HF checks do not run yet (a fine-tuned
    model's exports are not checked), so they would only be the same cells again."""

    capabilities = replace(reference.ReferenceAdapter.capabilities, finetune=())

Tensors = dict[str, Any]
_EXPERT = re.compile(r"^(model\.layers\.0\.mlp\.experts\.)([01])(\..+)$")
_FUSED = re.compile(r"^model\.layers\.0\.mlp\.experts\.(gate_up_proj|down_proj)$")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _rewrite(path: str, change: Callable[[Tensors], Tensors]) -> None:
    """The export in ``path`` rewritten by ``change`` on rank 0 (every rank waits)."""
    import torch.distributed as dist

    if _rank() == 0:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        write_safetensors(change(read_safetensors(path)), path, config)
    if dist.is_initialized():
        dist.barrier()


def _swap_experts_0_and_1(tensors: Tensors) -> Tensors:
    out = {}
    for key, tensor in tensors.items():
        if m := _EXPERT.match(key):
            key = f"{m[1]}{1 - int(m[2])}{m[3]}"
        elif _FUSED.match(key):
            tensor = tensor[[1, 0, *range(2, tensor.shape[0])]]
        out[key] = tensor
    return dict(sorted(out.items()))


class _Rewritten(ReferenceAdapter):
    """The reference whose export is rewritten by :meth:`on_export` and whose import reads a copy
    rewritten by :meth:`on_import`."""

    def on_export(self, model: Any, tensors: Tensors) -> Tensors:
        return tensors

    def on_import(self, tensors: Tensors) -> Tensors:
        return tensors

    def export_hf(self, model: Any, path: str) -> None:
        super().export_hf(model, path)
        _rewrite(path, lambda tensors: self.on_export(model, tensors))

    def import_hf(self, model: Any, path: str) -> None:
        import torch.distributed as dist

        copy: list[Any] = [None]
        if _rank() == 0:
            copy[0] = tempfile.mkdtemp(prefix=".seeded-", dir=os.path.dirname(path))
            shutil.copytree(path, copy[0], dirs_exist_ok=True)
        if dist.is_initialized():
            dist.broadcast_object_list(copy, src=0)
        try:
            _rewrite(copy[0], self.on_import)
            super().import_hf(model, copy[0])
        finally:
            if _rank() == 0:
                shutil.rmtree(copy[0], ignore_errors=True)


class HFExpertsSwapped(_Rewritten):
    """Layer 0's experts 0 and 1 under each other's ids in the export, swapped back by the
    import."""

    def on_export(self, model: Any, tensors: Tensors) -> Tensors:
        return _swap_experts_0_and_1(tensors)

    def on_import(self, tensors: Tensors) -> Tensors:
        return _swap_experts_0_and_1(tensors)


class HFExportRankZeroOnly(_Rewritten):
    """The export keeps only the experts rank 0 holds (its EP rank's range)."""

    def on_export(self, model: Any, tensors: Tensors) -> Tensors:
        from reference_impl.moe import moe_layers

        held = {moe.layer: range(moe.local_expert_start,
                                 moe.local_expert_start + moe.num_local_experts)
                for _, moe in moe_layers(model)}
        out = {}
        for key, tensor in tensors.items():
            m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.", key)
            fused = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.\w+_proj$", key)
            if m and int(m[2]) not in held.get(int(m[1]), ()):
                continue
            if fused:
                rows = held.get(int(fused[1]), range(0))
                tensor = tensor[rows.start:rows.stop]
            out[key] = tensor
        return out


class HFDownTransposed(_Rewritten):
    """Every ``down_proj`` written transposed, and transposed back on import."""

    @staticmethod
    def _transposed(tensors: Tensors) -> Tensors:
        return {k: (t.transpose(-1, -2).contiguous() if "experts" in k and "down_proj" in k else t)
                for k, t in tensors.items()}

    def on_export(self, model: Any, tensors: Tensors) -> Tensors:
        return self._transposed(tensors)

    def on_import(self, tensors: Tensors) -> Tensors:
        return self._transposed(tensors)


class HFImportBiasReset(ReferenceAdapter):
    """The import leaves every router's expert bias at zero."""

    def import_hf(self, model: Any, path: str) -> None:
        import torch

        from reference_impl.moe import moe_layers

        super().import_hf(model, path)
        with torch.no_grad():
            for _, moe in moe_layers(model):
                moe.router.expert_bias.zero_()


class HFImportDoesNothing(ReferenceAdapter):
    """The import reads the files and leaves the model as it was."""

    def import_hf(self, model: Any, path: str) -> None:
        read_safetensors(path)


class HFExportRefusesUneven(ReferenceAdapter):
    """An export that refuses E % world size != 0, by the framework's own tensor code: an optional
    member's failure, which must be named as ``export_hf``'s and leave the DCP checks standing."""

    def export_hf(self, model: Any, path: str) -> None:
        import torch
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        experts = getattr(model, "config").num_experts  # noqa: B009
        torch.zeros(experts).split([experts // world] * world)  # one chunk a rank, or it raises
        super().export_hf(model, path)


class HFExportRankZeroOnlyImportRefuses(HFExportRankZeroOnly):
    """:class:`HFExportRankZeroOnly` whose import refuses at ep > 1: it reads the export's experts
    into a tensor of the whole layer's, by the framework's own tensor code."""

    def import_hf(self, model: Any, path: str) -> None:
        import torch

        from reference_impl.moe import moe_layers

        moe = next(m for _, m in moe_layers(model))
        torch.zeros(getattr(model, "config").num_experts).split(  # noqa: B009
            [moe.num_local_experts])  # the whole layer's experts into this rank's, or it raises
        super().import_hf(model, path)


class HFExportNotApplicableOnRankZero(ReferenceAdapter):
    """An export that says it cannot run on rank 0 alone, after the collectives of a whole export:
    ``NotApplicable`` must be said by every rank alike, so this is the adapter's ``error``, named
    with the rank -- not a skip on rank 0 while the other ranks wait for it."""

    def export_hf(self, model: Any, path: str) -> None:
        from conformance.adapter import NotApplicable

        super().export_hf(model, path)
        if _rank() == 0:
            raise NotApplicable("rank 0 cannot write this export")

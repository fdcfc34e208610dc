"""The reference adapter's fine-tuning cells (:data:`~conformance.adapter.FINETUNES`): the build's
LoRA and quantized base, and the views of that state as the checks read it.

A fine-tuning cell builds the reference model, holds its routed experts quantized where the setup
says (``lora+mxfp4``, ``lora+fp8``), attaches LoRA adapters with B drawn from the seed (PEFT's zero
B would make every misfiled adapter read as right), and freezes the rest
(:mod:`reference_impl.lora`); the optimizer holds the adapters alone.

What the checks read of a fine-tuned layer is every tensor of each expert's state -- the base (or
its blocks and scales), the adapters and their moments -- one :class:`ExpertBlock` per packed
tensor (rows are experts, as the checkpoint holds them), or one entry per expert and tensor for
unpacked experts.  A fused layer under expert TP holds its gate/up axis in the fused frame (the
halves apart, each split over etp): those tensors are gathered over their mesh and read as the
ep=1 model holds them, ``2h`` rows in the layer's fused order, so the truth and every layout
compare alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from conformance.adapter import ADAM_MOMENTS, ExpertBlock, Spec, TensorEntry

__all__ = ["QUANT_BLOCK", "apply_finetune", "trainable", "tuned_expert_tensors"]

#: the quantization block of the matrix's small experts (dim 16, hidden 32): MXFP4's 32 and FP8's
#: 128 would each make one block of every weight; 8 makes several, and expert TP's halves of the
#: hidden axis whole blocks (reference_impl.quantized.block_span refuses a cut inside one).
QUANT_BLOCK = 8


def apply_finetune(model: Any, spec: Spec, seed: int) -> None:
    """``spec.finetune``'s state on the whole (ep=1) model, before any split: a quantized base
    where the setup names one, then LoRA adapters of ``spec.lora_rank`` on every expert, routed and
    shared, their A and B drawn from ``seed``; every other parameter frozen."""
    from reference_impl.lora import apply_lora, quantize_experts

    _, _, fmt = spec.finetune.partition("+")
    if fmt:
        quantize_experts(model, fmt, QUANT_BLOCK)
    apply_lora(model, spec.lora_rank, spec.lora_alpha, seed=seed, b_init="synthetic")


def trainable(model: Any) -> list[Any]:
    """The parameters an optimizer steps: all of them, or a fine-tuned model's adapters."""
    return [p for p in model.parameters() if p.requires_grad]


def tuned_expert_tensors(moe: Any, state: Any) -> Iterator[TensorEntry | ExpertBlock]:
    """Every tensor of expert state of a fine-tuned layer, with its Adam moments where it has
    them."""
    from reference_impl.lora import expert_state_plan

    if moe.kind == "unpacked":
        for i, expert in enumerate(moe.experts):
            g = moe.local_expert_start + i
            for name, tensor in _expert_tensors(expert):
                yield TensorEntry(moe.layer, g, name, tensor)
                for moment in ADAM_MOMENTS:
                    if moment in state.get(tensor, {}):
                        yield TensorEntry(moe.layer, g, f"{name}.{moment}", state[tensor][moment])
        return
    for name, _, framed, _ in expert_state_plan(moe):
        tensor = getattr(moe, name)
        held = [(name, tensor)] + [(f"{name}.{m}", state[tensor][m]) for m in ADAM_MOMENTS
                                   if m in state.get(tensor, {})]
        for label, t in held:
            yield ExpertBlock(moe.layer, moe.local_expert_start, label,
                              _unframed(t, name) if framed else t)


def _expert_tensors(expert: Any) -> Iterator[tuple[str, Any]]:
    """An unpacked expert's parameters and persistent buffers, each named as the packed views name
    theirs (``up``, ``up.weight_blocks``, ``up.lora_A.weight``)."""
    for name, tensor in (*expert.named_parameters(), *expert.named_buffers()):
        linear, _, rest = name.partition(".")
        yield (linear if rest == "weight" else name), tensor


def _unframed(t: Any, name: str) -> Any:
    """A fused tensor as the ep=1 model holds it: ``2h`` rows in the fused order on its gate/up axis
    (axis 2 for the fused adapter's B ``[E, r, 2h]``, else axis 1), from the fused frame expert TP
    holds it in -- the halves apart, ``[E, 2, h, ...]`` concatenated or ``[E, h, 2, ...]``
    interleaved, whose two axes read in order are the fused order's ``2h`` rows -- gathered over
    its mesh.  A tensor not in the frame (no expert TP) is returned as it is, and so is one of
    neither rank (a load that left it misshapen): the checks name its shape against the truth's."""
    from torch.distributed.tensor import DTensor

    unframed_dims = 4 if name.endswith("_blocks") else 3  # MXFP4 blocks: [E, 2h, in/b, b/2]
    if t.dim() != unframed_dims + 1:
        return t
    whole = t.full_tensor() if isinstance(t, DTensor) else t
    axis, shape = (2 if name.startswith("lora_") else 1), list(whole.shape)
    return whole.reshape(*shape[:axis], shape[axis] * shape[axis + 1], *shape[axis + 2:])

"""A kernel's rounding is not a wrong value: the one tolerance the checks allow between layouts.

Fused and foreach optimizers (torch's ``fused=True`` AdamW on CPU, the default of most GPU trainers)
round a shard of a tensor differently from the whole tensor: their vectorized body and their scalar
tail compute the same formula with and without a fused multiply-add.  Measured on this project's CPU
build (torch 2.13.0): a third of a tensor stepped on its own differs from the whole tensor's step by
up to 0.7 of ``eps x |value|`` after three steps and 3.2 after twenty (``exp_avg_sq``), never in
more than a few elements.  So what is saved at ep=N may differ from the ep=1 truth by that much, and
no layout is wrong.

The rule: ``max |got - want| <= ROUNDING_ULPS x eps(dtype) x max(max |got|, max |want|)`` over the
tensor compared (an expert's tensor, a shard, a packed row; ``eps``: the dtype's machine epsilon,
one unit in the last place at 1.0), the same non-finite values on both sides, and the same shape and
dtype; integers and booleans compare exactly.  The unit is the tensor's largest magnitude, not each
element's: an elementwise operation rounds to its operands' scale, and an Adam update that brings a
parameter near zero (``p - lr * update`` with the two close) leaves an error of the parameter's
scale on an element a hundred times smaller (measured: 112 ulps of that element, 0.02 of the
tensor's largest).  Another expert's, layer's, moment's or shard's values are named before this rule
is asked (the checks look for an exact match first), and a perturbation of one part in ten thousand
of a tensor is a hundred times outside it in float32.

What must be exact stays exact: a load is compared with what the checkpoint holds bit for bit
(:mod:`conformance.checks.saved`); only the save side's state against the ep=1 truth, the step after
a load against the truth's next step, and one checkpoint's values against the ep=1 checkpoint's use
this rule.
"""

from __future__ import annotations

from typing import Any

#: the tolerance in units of ``eps x`` the tensor's largest magnitude (the module docstring says
#: why, and the measure).
ROUNDING_ULPS = 8


def ulps(got: Any, want: Any) -> float:
    """``max |got - want|`` in units of ``eps x`` the larger tensor's largest magnitude (0.0 when
    equal; ``inf`` where shapes, dtypes or non-finite values disagree, or integers differ)."""
    import torch

    if got.shape != want.shape or got.dtype != want.dtype:
        return float("inf")
    if not got.numel() or torch.equal(got, want):
        return 0.0
    if not want.is_floating_point():
        return float("inf")
    a, b = got.double(), want.double()
    finite = a.isfinite() & b.isfinite()
    if not bool(((a == b) | (a.isnan() & b.isnan()) | finite).all()):
        return float("inf")
    a, b = a[finite], b[finite]
    info = torch.finfo(want.dtype)
    scale = max(float(a.abs().max()), float(b.abs().max())) * info.eps if a.numel() else 0.0
    return float((a - b).abs().max()) / max(scale, info.tiny)


def within_rounding(got: Any, want: Any) -> bool:
    """Whether ``got`` is ``want`` up to a kernel's rounding (:data:`ROUNDING_ULPS`); ``None`` on a
    side is not."""
    if got is None or want is None:
        return False
    return ulps(got, want) <= ROUNDING_ULPS


def describe(got: Any, want: Any) -> str:
    """``max abs diff 2.98e-08 (1.1 ulps)``: how far ``got`` is from ``want``, for a message."""
    diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    found = ulps(got, want)
    return f"max abs diff {diff:.3g}" + (f" ({found:.3g} ulps)" if found != float("inf") else "")


__all__ = ["ROUNDING_ULPS", "describe", "ulps", "within_rounding"]

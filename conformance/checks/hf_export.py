"""The ``hf_export`` check: the framework's own Hugging Face export, at every layout, is the
release a user loads.

In the cell that writes a save, from the save side's model at its layout: the export holds every
expert once under its global id (:func:`~conformance.inspection.inspect_index`, every file its index
names holding the keys it lists); it holds the same keys and bytes as the ep=1 export (a difference
named by layer, expert and key); transformers' own loader reports no missing, unexpected or
mismatched key for the declared class; and **the transformers model loaded from it computes the
framework's own forward** on the suite's batch, within the forward check's tolerance.  Only the
last catches an export that swaps, transposes or reorders experts the same way at every layout and
reads them back through the framework's own import.  Where it runs and the ep=1 export it compares
with: :mod:`conformance.checks.hf`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from conformance.adapter import HFModel
from conformance.checks.context import CheckContext, TimedAdapter
from conformance.checks.forward import forward_problems
from conformance.checks.hf import (
    EXPORT,
    called,
    load_hf_model,
    truth_raised,
    why_no_truth,
)
from conformance.checks.truth import Truth, batch_for, forward_outputs, ground_truth
from conformance.checks.verdict import RankVerdict
from conformance.matrix import Cell
from conformance.saves import export_dir, export_root
from conformance.world_state import world_state

__all__ = ["check_export", "export_problems", "run"]


def run(ctx: CheckContext) -> None:
    """The save side's export, beside the save the cell just wrote."""
    adapter, plan, spec, rank = ctx.adapter, ctx.plan, ctx.save_spec, ctx.rank
    assert plan.truth_path is not None, "asked only where the truth checkpoint is written"
    check_export(adapter, ctx.cell, spec, ctx.model, plan.path, plan.truth_path,
                 lambda: ground_truth(adapter, spec, rank), rank, ctx.verdict)


def export_problems(adapter: TimedAdapter, spec: Any, got: str, want: str, truth: Truth,
                    where: str) -> list[str]:
    """Everything wrong with the export in ``got`` (made at ``where``) against the ep=1 export in
    ``want`` and the ground truth's forward: one line each, empty when nothing is."""
    from conformance.inspection import (
        CheckpointError,
        compare_indexes,
        inspect_index,
        read_checkpoint,
    )

    hf = adapter.hf_model(spec)
    try:
        index = read_checkpoint(got)
    except CheckpointError as exc:
        return [f"the export at {where} cannot be read: {exc}"]
    lines = [f"the export at {where}: {f}" for f in _misfiled(index, truth)]
    lines += [f"the export at {where}: {f}" for f in
              inspect_index(index, num_experts=spec.num_experts).findings]
    same = os.path.realpath(got) == os.path.realpath(want)
    if not same:
        found = compare_indexes(index, read_checkpoint(want), values=True,
                                names=(f"{where} export", "ep=1 export"))
        lines += [f"the export at {where} differs from the ep=1 export: {f}" for f in found]
        same = not found
    # What transformers makes of the export is a function of its bytes alone: an export that holds
    # the ep=1 export's keys and bytes loads as the ep=1 export does, so that is loaded once.
    if same:
        loaded = world_state().store(_LOADED).keep(
            os.path.realpath(want), lambda: _as_loaded(adapter, spec, hf, want, truth, _HERE))
    else:
        loaded = _as_loaded(adapter, spec, hf, got, truth, _HERE)
    return [*lines, *(line.replace(_HERE, where) for line in loaded)]


#: the store of what transformers made of each ep=1 export (:func:`_as_loaded`'s lines).
_LOADED = "hf_export.loaded"
#: where the lines of :func:`_as_loaded` name the export's layout, filled in per cell.
_HERE = "\x00layout\x00"


def _as_loaded(adapter: TimedAdapter, spec: Any, hf: HFModel, directory: str, truth: Truth,
               where: str) -> list[str]:
    """What is wrong with the export in ``directory`` as transformers loads it: the loader's
    refusal or report, and its forward against the ground truth's."""
    import torch

    dtype = getattr(torch, spec.dtype)
    try:
        model, info = load_hf_model(hf, directory, dtype)
    except Exception as exc:  # transformers' own loader refused the export: that is the finding
        return [f"transformers' {hf.cls}.from_pretrained refused the export at {where}: "
                f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"]
    lines = _load_report(info, hf, where)
    if truth.output is None:
        return lines
    with torch.no_grad():
        result = forward_outputs(adapter.hf_forward(model, batch_for(spec)), type(adapter).__name__)
    unknown = [name for name in result if name not in truth.output]
    if unknown:
        return [*lines, f"hf_forward gives outputs {unknown} that forward does not"]
    wanted = {name: truth.output[name] for name in result}
    return lines + [f"{hf.cls} loaded from the export at {where}: "
                    f"{line.replace('after the load ', '')}"
                    for line in forward_problems(result, wanted, hf.tolerance_scale)]


def _misfiled(index: Any, truth: Truth) -> list[Any]:
    """Export keys (or rows) that hold another expert's tensor of the model, by value: what names
    the layer, expert and key of a mistake the forward only shows as a wrong output (the
    checkpoint check's attribution, :func:`~conformance.inspection.attribute_experts`).  A form the
    values do not show (gate and up fused into one row) is attributed by the forward alone."""
    from conformance.inspection import DEFAULT_PATTERNS, attribute_experts
    from conformance.inspection.learn import learn_expert_keys, learned_patterns, owners_of

    owners, _ = owners_of(truth.tensors)
    patterns = (*learned_patterns(learn_expert_keys(index, owners), index.entries),
                *DEFAULT_PATTERNS)
    return list(attribute_experts(index, owners, patterns=patterns))


def _load_report(info: Mapping[str, Any], hf: HFModel, where: str) -> list[str]:
    """transformers' loading report, less the keys the family carries beyond the class."""
    extra = [re.compile(r) for r in hf.extra_keys]
    lines = []
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(str(k) for k in info.get(what) or ()
                      if not (what == "unexpected_keys" and any(r.search(str(k)) for r in extra)))
        if keys:
            shown = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
            lines.append(f"transformers' {hf.cls} reports {len(keys)} "
                         f"{what.replace('_', ' ')} loading the export at {where}: {shown}")
    lines += [f"transformers' loader: {m}" for m in info.get("error_msgs") or ()]
    return lines


def check_export(adapter: TimedAdapter, cell: Cell, spec: Any, model: Any, path: str,
                 truth_path: str, truth: Callable[[], Truth], rank: int,
                 verdict: RankVerdict) -> None:
    """Export the save side's ``model`` beside the save in ``path`` (every rank) and check it on
    rank 0 (:func:`export_problems`)."""
    target, want = export_dir(path), export_dir(truth_path)
    raised = truth_raised(want)
    if raised is not None:  # every cell's problem, on rank 0: the ep=1 export is the release
        if rank == 0:
            verdict.problem(EXPORT, raised[1], raised[0])
        return
    why = why_no_truth(want)
    if why:
        verdict.skipped[EXPORT] = why
        return
    not_here, found = called(adapter, "export_hf", lambda: adapter.export_hf(model, target),
                        f"at {cell.save.describe()}")
    if not_here is not None:
        verdict.skipped[EXPORT] = f"the framework cannot export in this cell: {not_here}"
        return
    if found is not None:
        if rank == 0:
            verdict.problem(EXPORT, found[1], found[0])
        return
    if rank == 0:
        for line in export_problems(adapter, spec, export_root(target), export_root(want),
                                    truth(), cell.save.describe()):
            verdict.problem(EXPORT, line)

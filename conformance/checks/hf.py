"""The ``hf_export`` and ``hf_import`` checks: the Hugging Face checkpoint a release ships.

A trained MoE reaches its users through the framework's own converter, and most MoE checkpoint bugs
reported in 2025-26 are on that path: experts left out after a rename, a save at EP=4 exported
without the other ranks' experts, local expert ids into a fused tensor, gate and up swapped, the
expert bias reset on import.  Both checks run in the model-only cells of an adapter with the
members (:class:`~conformance.adapter.OptionalMembers`: ``hf_model``, ``export_hf``,
``import_hf``, ``hf_forward``):

- ``hf_export``, in the cell that writes a save, from the save side's model at its layout: the
  export holds every expert once under its global id (:func:`~conformance.inspection.
  inspect_index`, every file its index names holding the keys it lists); it holds the same keys and
  bytes as the ep=1 export (a difference named by layer, expert and key); transformers' own loader
  reports no missing, unexpected or mismatched key for the declared class; and **the transformers
  model loaded from it computes the framework's own forward** on the suite's batch, within the
  forward check's tolerance.  Only the last catches an export that swaps, transposes or reorders
  experts the same way at every layout and reads them back through the framework's own import.
- ``hf_import``, in every model-only cell, on the load side: the ep=1 export loaded at the cell's
  load layout into a model built with another seed gives the ep=1 state, every expert and the bias
  included; a tensor left at its initial value is named so (``silent``).

transformers is imported only here (``pip install pytest-moe-ep[hf]``); without it both checks are
skipped, saying why.  Loading runs on rank 0 alone, with no mesh: what a user of the release does.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from conformance.adapter import HFModel, NotApplicable
from conformance.checks.forward import forward_problems
from conformance.checks.missing import check_replicas
from conformance.checks.truth import Truth, batch_for, forward_outputs
from conformance.checks.values import canonical, compare
from conformance.checks.verdict import RankVerdict
from conformance.matrix import Cell
from conformance.saves import export_dir, export_root

__all__ = ["EXPORT", "IMPORT", "applies", "check_export", "check_import", "export_problems",
           "export_truth", "load_hf_model"]

EXPORT, IMPORT = "hf_export", "hf_import"
_MEMBERS = ("hf_model", "export_hf", "import_hf", "hf_forward")


def _transformers_missing() -> str:
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        return (f"transformers is not installed ({exc}); pip install 'pytest-moe-ep[hf]' to check "
                "the Hugging Face export")
    return ""


def applies(adapter: Any, cell: Cell) -> str | None:
    """``None`` when the checks run in ``cell``; else why not: ``""`` where they are not asked
    (legacy and model+optimizer cells; an adapter with none of the members), a reason to list
    where they would run but cannot."""
    if cell.legacy or cell.state != "model":
        return ""
    has = [m for m in _MEMBERS if adapter.members.has(m)]
    if not has:
        return ""
    if len(has) < len(_MEMBERS):
        return f"the adapter has {', '.join(has)} but not {', '.join(set(_MEMBERS) - set(has))}"
    return _transformers_missing() or None


def export_truth(adapter: Any, model: Any, truth_path: str) -> None:
    """The ep=1 export, by the truth checkpoint's build (every rank); an export the framework
    cannot make leaves no directory, and the cells say why (:func:`_why_no_truth`)."""
    target = export_dir(truth_path)
    try:
        adapter.export_hf(model, target)
    except NotApplicable as exc:
        _note(target, f"the framework cannot export the ep=1 model: {exc}")


def _note(target: str, why: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(target, exist_ok=True)
        with open(os.path.join(target, "NOT_EXPORTED"), "w") as f:
            f.write(why)


def _why_no_truth(target: str) -> str:
    marker = os.path.join(target, "NOT_EXPORTED")
    if os.path.exists(marker):
        with open(marker) as f:
            return f.read()
    if not os.path.isdir(target):
        return "no ep=1 export was written in this session (its cell stopped before it)"
    return ""


def load_hf_model(hf: HFModel, directory: str, dtype: Any) -> tuple[Any, dict[str, Any]]:
    """``(model, loading info)``: ``hf.cls`` from ``directory`` by transformers' own loader, with
    ``hf.config``, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    fields = dict(hf.config)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    cls = getattr(transformers, hf.cls)
    # The generation config given: an export need not carry one (transformers 5.18 fails reading
    # an absent generation_config.json when no config.json is beside it either).  Mismatched
    # shapes reported, not raised: the loading info then names them.
    model, info = cls.from_pretrained(directory, config=config, local_files_only=True,
                                      output_loading_info=True, dtype=dtype,
                                      ignore_mismatched_sizes=True,
                                      generation_config=transformers.GenerationConfig())
    return model.eval(), info


def export_problems(adapter: Any, spec: Any, got: str, want: str, truth: Truth,
                    where: str) -> list[str]:
    """Everything wrong with the export in ``got`` (made at ``where``) against the ep=1 export in
    ``want`` and the ground truth's forward: one line each, empty when nothing is."""
    import torch

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
    if os.path.realpath(got) != os.path.realpath(want):
        found = compare_indexes(index, read_checkpoint(want), values=True,
                                names=(f"{where} export", "ep=1 export"))
        lines += [f"the export at {where} differs from the ep=1 export: {f}" for f in found]
    dtype = getattr(torch, spec.dtype)
    try:
        model, info = load_hf_model(hf, got, dtype)
    except Exception as exc:  # transformers' own loader refused the export: that is the finding
        return [*lines, f"transformers' {hf.cls}.from_pretrained refused the export at {where}: "
                f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"]
    lines += _load_report(info, hf, where)
    if truth.output is None:
        return lines
    with torch.no_grad():
        result = forward_outputs(adapter.hf_forward(model, batch_for(spec)), type(adapter).__name__)
    unknown = [name for name in result if name not in truth.output]
    if unknown:
        return [*lines, f"hf_forward gives outputs {unknown} that forward does not"]
    wanted = {name: truth.output[name] for name in result}
    lines += [f"{hf.cls} loaded from the export at {where}: {line.replace('after the load ', '')}"
              for line in forward_problems(result, wanted, hf.tolerance_scale)]
    return lines


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


def check_export(adapter: Any, cell: Cell, spec: Any, model: Any, path: str, truth_path: str,
                 truth: Callable[[], Truth], rank: int, verdict: RankVerdict) -> None:
    """Export the save side's ``model`` beside the save in ``path`` (every rank) and check it on
    rank 0 (:func:`export_problems`)."""
    target, want = export_dir(path), export_dir(truth_path)
    why = _why_no_truth(want)
    if why:
        verdict.skipped[EXPORT] = why
        return
    try:
        adapter.export_hf(model, target)
    except NotApplicable as exc:
        verdict.skipped[EXPORT] = f"the framework cannot export in this cell: {exc}"
        return
    if rank == 0:
        for line in export_problems(adapter, spec, export_root(target), export_root(want),
                                    truth(), cell.save.describe()):
            verdict.problem(EXPORT, line)
    verdict.done(EXPORT)


def check_import(adapter: Any, cell: Cell, build: Callable[[], Any], truth_path: str,
                 truth: Truth, rank: int, verdict: RankVerdict) -> None:
    """The ep=1 export loaded into ``build()`` (the load side's build, another seed) against the
    ground truth; every difference a ``hf_import`` mismatch, a tensor the import left alone named
    so."""
    source = export_dir(truth_path)
    why = _why_no_truth(source)
    if why:
        verdict.skipped[IMPORT] = why
        return
    b = build()
    before = canonical(adapter, b.model, None, rank)
    try:
        adapter.import_hf(b.model, source)
    except NotApplicable as exc:
        verdict.skipped[IMPORT] = f"the framework cannot import in this cell: {exc}"
        return
    got = canonical(adapter, b.model, None, rank, copy=False)
    found = RankVerdict(rank)
    compare(rank, got, truth.tensors, before, found)
    check_replicas(rank, got, truth.tensors, cell.load, cell.fsdp, found)
    for mismatch in found.mismatches:
        mismatch.check = IMPORT
        mismatch.problem = f"after the import of the ep=1 Hugging Face export: {mismatch.problem}"
        verdict.add(mismatch)
    for problem in found.problems:
        verdict.problem(IMPORT, f"after the ep=1 export's import: {problem.text}")
    verdict.done(IMPORT)

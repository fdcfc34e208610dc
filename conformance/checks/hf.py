"""What the ``hf_export`` and ``hf_import`` checks share: the Hugging Face checkpoint a release
ships, where the checks run, the ep=1 export both read, and transformers' own loader.

A trained MoE reaches its users through the framework's own converter, and most MoE checkpoint bugs
reported in 2025-26 are on that path: experts left out after a rename, a save at EP=4 exported
without the other ranks' experts, local expert ids into a fused tensor, gate and up swapped, the
expert bias reset on import.  Both checks run in the model-only cells of an adapter with the
members (:class:`~conformance.adapter.OptionalMembers`: ``hf_model``, ``export_hf``,
``import_hf``, ``hf_forward``), against the ep=1 export the truth checkpoint's build writes
(:func:`export_truth`): :mod:`.hf_export` checks the export at every layout, :mod:`.hf_import`
the import of the ep=1 export at every layout.

transformers is imported only here (``pip install pytest-moe-ep[hf]``); without it both checks are
skipped, saying why.  Loading runs on rank 0 alone, with no mesh: what a user of the release does.

The members are optional, and so is what they find: an ``export_hf`` or ``import_hf`` that raises
is a problem of its own check, named as that member's (:func:`member_raised`: ``refused`` where the
framework raised, ``error`` where the adapter did), and the cell's DCP checks run on.  An export
that raised at the ep=1 truth is every cell's ``hf_export`` problem (:func:`truth_raised`), and
leaves ``hf_import`` nothing to import.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from conformance.adapter import HF_MEMBERS, HFModel, NotApplicable
from conformance.checks.context import CheckContext, TimedAdapter
from conformance.matrix import Cell
from conformance.saves import export_dir

__all__ = ["EXPORT", "IMPORT", "applies", "asked", "called", "export_truth", "load_hf_model",
           "member_raised", "truth_raised", "why_no_truth"]

EXPORT, IMPORT = "hf_export", "hf_import"
_MEMBERS = HF_MEMBERS


def _transformers_missing() -> str:
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        return (f"transformers is not installed ({exc}); pip install 'pytest-moe-ep[hf]' to check "
                "the Hugging Face export")
    return ""


def applies(adapter: TimedAdapter, cell: Cell) -> str | None:
    """``None`` when the checks run in ``cell``; else why not: ``""`` where they are not asked
    (legacy and model+optimizer cells; an adapter with none of the members), a reason to list
    where they would run but cannot.  Decided once per cell (:attr:`CheckContext.hf`): it may
    import transformers."""
    if cell.legacy or cell.state != "model":
        return ""
    has = [m for m in _MEMBERS if adapter.members.has(m)]
    if not has:
        return ""
    if len(has) < len(_MEMBERS):
        return f"the adapter has {', '.join(has)} but not {', '.join(set(_MEMBERS) - set(has))}"
    return _transformers_missing() or None


def asked(ctx: CheckContext) -> str | None:
    """Whether a cell's rank runs the checks: :func:`applies` as the cell decided it, and not
    asked where no truth checkpoint is written (an adapter whose checkpoints cannot be read): the
    ep=1 export is written beside it."""
    if ctx.hf is None and not ctx.plan.truth_path:
        return ""
    return ctx.hf


#: the marker files beside an ep=1 export that was not made: why not (the checks skip), or how the
#: member raised (every cell's ``hf_export`` problem: its finding, then its text).
NOT_EXPORTED, EXPORT_RAISED = "NOT_EXPORTED", "EXPORT_RAISED"


def member_raised(adapter: TimedAdapter, member: str, exc: BaseException,
                  where: str) -> tuple[str, str]:
    """``(finding, text)`` of an optional member that raised ``exc`` ``where`` ("at ep=2"): the
    framework's code refused (``refused``), or the adapter's own code failed (``error``, said
    so)."""
    from conformance.checks.blame import located, raised_where
    from conformance.findings import ERROR, REFUSED

    raised_in, _ = raised_where(exc, adapter)
    if raised_in == "framework":
        return REFUSED, f"the framework's {member}() raised {where}: {located(exc, adapter)}"
    return ERROR, (f"the adapter's {member}() failed {where}: {located(exc, adapter)} (an error in "
                   f"the {raised_in}, not a finding about the framework)")


def called(adapter: TimedAdapter, member: str, call: Callable[[], Any],
           where: str) -> tuple[str | None, tuple[str, str] | None]:
    """Run ``call`` -- the optional ``member`` (``export_hf``, ``import_hf``) -- on this rank, and
    agree with every rank on how it went, so that the ranks go on alike and none waits in a
    collective the others left: ``(why not, None)`` where every rank raised NotApplicable;
    ``(None, (finding, text))`` where a rank's member raised (the first such rank's), or where only
    some ranks raised NotApplicable (the adapter broke its contract: an ``error``); ``(None,
    None)`` where it ran on every rank."""
    import torch.distributed as dist

    from conformance.checks.blame import load_errors
    from conformance.findings import ERROR

    mine: tuple[str | None, tuple[str, str] | None] = (None, None)
    try:
        call()
    except NotApplicable as exc:
        mine = (str(exc) or "NotApplicable", None)
    except load_errors() as exc:
        mine = (None, member_raised(adapter, member, exc, where))
    every = [mine]
    if dist.is_initialized():
        every = [mine] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    not_applicable = [rank for rank, (why, _) in enumerate(every) if why is not None]
    if not_applicable and len(not_applicable) < len(every):
        return None, (ERROR, f"the adapter's {member}() raised NotApplicable {where} on rank(s) "
                             f"{', '.join(map(str, not_applicable))} only "
                             f"({every[not_applicable[0]][0]}); it must be raised on every rank "
                             "alike, before any collective")
    if not_applicable:
        return every[0][0], None
    return None, next((raised for _, raised in every if raised), None)


def export_truth(adapter: TimedAdapter, model: Any, truth_path: str) -> None:
    """The ep=1 export, by the truth checkpoint's build (every rank); an export the framework
    cannot make leaves no directory, and the cells say why (:func:`why_no_truth`); one that raised
    leaves how (:func:`truth_raised`)."""
    target = export_dir(truth_path)
    why, found = called(adapter, "export_hf", lambda: adapter.export_hf(model, target),
                        "at the ep=1 truth")
    if why is not None:
        _note(target, NOT_EXPORTED, f"the framework cannot export the ep=1 model: {why}")
    elif found is not None:
        _note(target, EXPORT_RAISED, "\n".join(found))


def _note(target: str, marker: str, text: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(target, exist_ok=True)
        with open(os.path.join(target, marker), "w") as f:
            f.write(text)


def truth_raised(target: str) -> tuple[str, str] | None:
    """``(finding, text)`` when the ep=1 export in ``target`` raised (:func:`export_truth`)."""
    marker = os.path.join(target, EXPORT_RAISED)
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        finding, text = f.read().split("\n", 1)
    return finding, text


def why_no_truth(target: str) -> str:
    """Why there is no ep=1 export in ``target`` to compare with or import ("" when there is)."""
    marker = os.path.join(target, NOT_EXPORTED)
    if os.path.exists(marker):
        with open(marker) as f:
            return f.read()
    raised = truth_raised(target)
    if raised is not None:
        return f"the ep=1 export raised ({raised[1]})"
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

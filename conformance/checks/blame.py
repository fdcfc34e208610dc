"""Blame by evidence: when the framework's load raises, the first line names the side that is wrong.

The checkpoint check has already said whether the save is EP-invariant.  If it is not, the cell
leads with the checkpoint's first difference (the load's error is its consequence).  If it is, the
save is right and the load is wrong: the cell leads with the framework's error, read in expert terms
where it can be -- DCP's "Size mismatch ... for K" on a packed expert key becomes "the model offers
2 rows for the checkpoint's 4 experts: the load does not map the saved global rows to this rank's
experts 0..1".  The whole exception text follows on the next lines (the JSON record keeps it; ``-v``
shows it).

DCP's exceptions are third-party English; they are read only here, and an error that matches none of
the known forms is shown as it is.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conformance.layout import ParallelLayout

SIZE_MISMATCH = re.compile(r"Size mismatch between saved torch\.Size\(\[(?P<saved>[\d, ]*)\]\) and "
                           r"current: torch\.Size\(\[(?P<current>[\d, ]*)\]\) for (?P<key>\S+)")
MISSING_KEY = re.compile(r"Missing key in checkpoint state_dict: (?P<key>\S+?)\.?(?:\s|$)")


class LoadFailed(Exception):
    """The framework's load raised.  ``side`` is who the evidence blames ("checkpoint" or "load");
    the message's first line is the diagnosis, the following lines the framework's whole error."""

    def __init__(self, side: str, headline: str, full: str) -> None:
        self.side, self.headline, self.full = side, headline, full
        super().__init__(f"{headline}\n{full}")


def load_errors() -> tuple[type[BaseException], ...]:
    """What a failed load (or build, or save) raises: any Exception, and DCP's CheckpointException
    (a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def one_line(exc: BaseException, limit: int = 400) -> str:
    # a bare assert: the location that follows says it all
    text = " ".join(str(exc).split()) or "(no message)"
    return (f"{type(exc).__name__}: "
            f"{text if len(text) <= limit else text[:limit].rsplit(' ', 1)[0] + '...'}")


_CONFORMANCE = Path(__file__).resolve().parents[1]
_HARNESS_ROOTS = (str(_CONFORMANCE), str(_CONFORMANCE.parent / "pytest_moe_ep"))
_ADAPTERS = str(_CONFORMANCE / "adapters")


def original(exc: BaseException) -> BaseException:
    """The exception the adapter's call raised: ``exc`` itself, or what the harness wrapped
    (``raise ... from``)."""
    from conformance.adapter import AdapterError

    seen = exc
    for _ in range(8):
        cause = seen.__cause__
        if cause is None or isinstance(seen, AdapterError):
            break
        seen = cause
    return seen


def _raise_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """Where ``exc`` was raised: the innermost frame of the rank's own failure inside DCP's gathered
    ones, else of its traceback."""
    for _, failure in sorted((getattr(exc, "failures", None) or {}).items()):
        stack = failure[1] if isinstance(failure, tuple) and len(failure) > 1 else None
        if isinstance(stack, traceback.StackSummary) and stack:
            return stack[-1]
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    return frames[-1] if frames else None


def short_path(filename: str) -> str:
    """A source path as a reader finds it: from the package on (``megatron/core/x.py``), not the
    machine's."""
    for marker in ("site-packages", "dist-packages"):
        if f"{os.sep}{marker}{os.sep}" in filename:
            return filename.split(f"{os.sep}{marker}{os.sep}", 1)[1]
    parent = str(_CONFORMANCE.parent)
    if filename.startswith(parent + os.sep):
        return filename[len(parent) + 1:]
    for entry in sorted((p for p in sys.path if p), key=len, reverse=True):
        if filename.startswith(entry.rstrip(os.sep) + os.sep):
            return filename[len(entry.rstrip(os.sep)) + 1:]
    return filename


def _adapter_files(adapter: object) -> set[str]:
    """The source files of the adapter's class and its bases (a seeded adapter in a test file among
    them)."""
    wrapped = getattr(adapter, "__wrapped__", adapter)
    cls = wrapped if isinstance(wrapped, type) else type(wrapped)
    files = set()
    for base in cls.__mro__:
        module = sys.modules.get(base.__module__)
        path = getattr(module, "__file__", None)
        if path and base.__module__ != "builtins":
            files.add(str(Path(path).resolve()))
    return files


def raised_where(exc: BaseException, adapter: object) -> tuple[str, str]:
    """``(raised_in, raised_at)`` of the exception the adapter's call raised: ``raised_in`` is
    "adapter" (the adapter's own code: its class's files, or a built-in adapter's modules),
    "harness" (this package's checks) or "framework" (anything else: the framework, torch, DCP),
    told apart by the frame that raised it; ``raised_at`` is ``path:line in function`` ("" when no
    traceback survived)."""
    from conformance.adapter import AdapterError, FrameworkRefusal

    first = original(exc)
    if isinstance(first, AdapterError):
        return "adapter", ""
    frame = _raise_frame(first)
    if frame is None:
        return "framework", ""
    where = f"{short_path(frame.filename)}:{frame.lineno} in {frame.name}"
    # the adapter's word that the framework cannot: where it said so
    if isinstance(first, FrameworkRefusal):
        return "framework", where
    path = (str(Path(frame.filename).resolve()) if frame.filename
            and not frame.filename.startswith("<") else "")
    if path and (path in _adapter_files(adapter) or path.startswith(_ADAPTERS + os.sep)):
        return "adapter", where
    if path and path.startswith(_HARNESS_ROOTS):
        return "harness", where
    return "framework", where


def located(exc: BaseException, adapter: object, limit: int = 400) -> str:
    """:func:`one_line` of ``exc`` as the adapter's call raised it (an adapter's wrapper names the
    configuration), with where its original was raised: a bare ``assert`` has no message, and its
    file and line are the message."""
    _, where = raised_where(exc, adapter)
    return f"{one_line(exc, limit)} (raised at {where})" if where else one_line(exc, limit)


def _failures(exc: BaseException) -> list[tuple[int | None, BaseException]]:
    """``(rank, exception)`` of every error DCP gathered (its ``failures``), else the exception's
    own chain."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        out: list[tuple[int | None, BaseException]] = []
        for rank, wrapped in sorted(failures.items()):
            inner = getattr(wrapped, "exc", None) or (wrapped[0] if isinstance(wrapped, tuple)
                                                      else wrapped)
            if isinstance(inner, BaseException):
                out.append((int(rank), inner))
        if out:
            return out
    chain: list[tuple[int | None, BaseException]] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 8:
        chain.append((None, seen))
        seen = seen.__cause__ or seen.__context__
    return chain


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


def translate(exc: BaseException, layout: ParallelLayout, num_experts: int, patterns: Sequence[Any],
              rank: int) -> str:
    """The framework's load error in expert terms ("" when it is none of the forms known here):
    first the keys this rank's load asked for that the checkpoint lacks
    (:mod:`conformance.checks.load_plan`, whatever DCP raised) unless the error's own words name
    one, then DCP's own words read in expert terms, then any key asked for in another global
    shape."""
    from conformance.checks.load_plan import explain, named
    from conformance.inspection import DEFAULT_PATTERNS, classify_keys

    said = named(exc, "\n".join(str(error) for _, error in _failures(exc)))
    lacking = "" if said else explain(exc, patterns, shapes=False)
    if lacking:
        return lacking
    for failed_rank, error in _failures(exc):
        text = str(error)
        who = failed_rank if failed_rank is not None else rank
        m = SIZE_MISMATCH.search(text)
        if m:
            key, saved, current = m["key"], _ints(m["saved"]), _ints(m["current"])
            info = classify_keys([key], patterns or DEFAULT_PATTERNS)[key]
            where = f"rank {who}, " + (f"layer {info.layer}, " if info.layer is not None else "")
            if (info.role == "expert" and info.kind == "packed" and saved and current
                and saved[0] != current[0]):
                start, end = layout.experts_of(who, num_experts)
                mine = (f"experts {start}..{end - 1}" if end - start > 1 else f"expert {start}"
                        if end > start else "no experts")
                return (f"{where}{key!r}: the model offers {current[0]} rows for the checkpoint's "
                        f"{saved[0]} experts: the load does not map the saved global rows to this "
                        f"rank's {mine}")
            return (f"{where}{key!r}: the checkpoint holds global shape {list(saved)}, the model "
                    f"offers {list(current)}")
        m = MISSING_KEY.search(text)
        if m:
            key = m["key"]
            info = classify_keys([key], patterns or DEFAULT_PATTERNS)[key]
            what = (f" (layer {info.layer}"
                    + (f", expert {info.expert}" if info.expert is not None else "") + ")"
                    if info.layer is not None else "")
            return (f"rank {who}: the model asks for {key!r}{what}, which the checkpoint does not "
                    "hold")
    return "" if said else explain(exc, patterns)  # words naming a lacking key: shown as they are


def load_failed(
        exc: BaseException, *, findings: Sequence[str], checked: str, layout: ParallelLayout,
        num_experts: int, patterns: Sequence[Any], rank: int, adapter: object = None) -> LoadFailed:
    """The :class:`LoadFailed` for a load that raised: the checkpoint leads only when it really
    differs.

    ``findings``: the checkpoint check's (save and truth); ``checked``: "" when that check ran, else
    why not.
    """
    inner = _failures(exc)
    raised = translate(exc, layout, num_experts, patterns, rank) or (
        f"{one_line(inner[0][1])} (DCP, rank {inner[0][0]})" if inner and inner[0][0] is not None
        else one_line(exc))
    _, at = raised_where(exc, adapter)
    # last: a headline cut short keeps the blame, loses the place
    where = f"; raised at {at}" if at else ""
    full = f"the framework's error in full: {type(exc).__name__}: {exc}"
    if findings:
        more = f" (and {len(findings) - 1} more problems)" if len(findings) > 1 else ""
        return LoadFailed("checkpoint", "the checkpoint differs from an EP-invariant one: "
                          f"{findings[0]}{more}; the "
                          f"load then raised: {raised}{f' ({where[2:]})' if where else ''}", full)
    why = ("the checkpoint is EP-invariant, so the load is wrong"
           if not checked else f"the checkpoint itself was not checked: {checked}")
    return LoadFailed("load", f"the load at {layout.describe()} raised: {raised} ({why}{where})",
                      full)

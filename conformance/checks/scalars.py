"""The ``scalars`` check: the optimizer's scalars and the training state's come back.

The load side was built with the run's configuration but seed B and one more optimizer step than the
save, so a load that leaves the step count or a schedule's position (and so its lr) alone shows here
(a constant lr is configuration, the same on both sides: not restoring it is no bug).  Compared: the
adapter's ``scalars`` (step counts, each group's lr, betas, weight decay, eps) and the training
state's beyond the optimizer (an LR scheduler's ``state_dict``), read by :mod:`conformance.scalars`.
Without ``scalars`` and without training state the check is skipped with the reason.

A piece of training state the save was handed that no key of the checkpoint holds -- neither its
name nor any of its fields, in the ep=1 save or in this one -- was left out by the save: no load
can restore it, and the first line says so (:func:`left_out`) rather than blaming the load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from conformance.checks.context import CheckContext, TimedAdapter, required
from conformance.checks.truth import Truth
from conformance.checks.verdict import RankVerdict
from conformance.inspection.keys import field_of
from conformance.members import Built
from conformance.scalars import all_scalars

#: the fields a left-out piece of training state's line names.
SHOWN = 3


def what(name: str) -> str:
    """What a scalar is called in a line: the training state's fields (``state.<name>.<field>``,
    :func:`conformance.scalars.state_scalars`) are no optimizer's."""
    return "training state" if name.startswith("state.") else "optimizer scalar"


def state_name(name: str) -> str | None:
    """The piece of training state a scalar's name is a field of (``lr_scheduler`` of
    ``state.lr_scheduler._last_lr``), or ``None`` for the optimizer's own."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "state" else None


def left_out(names: Iterable[str], keys: Iterable[str]) -> dict[str, list[str]]:
    """``piece -> its fields`` for each piece of training state among the scalar ``names`` that no
    checkpoint key holds: neither the piece's name nor any field's name is a part of any of
    ``keys`` (a field under any other prefix is held: a save may nest or rename the piece)."""
    fields: dict[str, set[str]] = {}
    for name in names:
        piece = state_name(name)
        if piece is not None:
            fields.setdefault(piece, set()).update(name.split(".")[2:])
    parts = {part for key in keys for part in key.split(".")}
    return {piece: sorted(f for f in found if not f.isdigit())
            for piece, found in sorted(fields.items()) if not ({piece, *found} & parts)}


def scalar_lines(got: dict[str, Any], want: dict[str, Any], when: str) -> list[str]:
    """The lines of :func:`scalar_problems`."""
    return [line for _, line in scalar_problems(got, want, when)]


def scalar_problems(got: dict[str, Any], want: dict[str, Any],
                    when: str) -> list[tuple[str, str]]:
    """``(the truth's or got's name, the line)`` for each way ``got`` differs from ``want``.  A
    name on one side only whose field (:func:`field_of`) the other side holds under other names
    only is that field re-keyed (a dict of schedulers under
    EP for the truth's one scheduler): it agrees when both sides hold the same set of values for it,
    and is named as re-keyed otherwise. A name only ``got`` has, whose field the truth holds with
    the same value under another name, is structure that grew with EP (a scheduler for the experts
    beside the truth's for the rest), not state; a name only ``want`` has is missing unless re-keyed
    (a lost param group is never excused by another group's equal lr)."""
    only_got = [n for n in got if n not in want]
    only_want = [n for n in want if n not in got]
    moved = {field_of(n) for n in only_got} & {field_of(n) for n in only_want}
    lines: list[tuple[str, str]] = []
    for name in sorted(set(got) & set(want)):
        if got[name] != want[name]:
            lines.append((name, f"{what(name)} {name!r} = {got[name]!r} {when}, expected "
                                f"{want[name]!r}"))
    for name in sorted(n for n in only_want if field_of(n) not in moved):
        lines.append((name, f"{what(name)} {name!r} is missing {when} (expected {want[name]!r})"))
    # field -> the truth's values of it: an extra name with one of them is structure, not state
    held: dict[tuple[str, str], set[str]] = {}
    for name, value in want.items():
        held.setdefault(field_of(name), set()).add(repr(value))
    for name in sorted(n for n in only_got if field_of(n) not in moved):
        if repr(got[name]) not in held.get(field_of(name), set()):
            lines.append((name, f"{what(name)} {name!r} = {got[name]!r} {when} is not in the "
                                "ground truth"))
    for field in sorted(moved):
        mine = sorted(n for n in only_got if field_of(n) == field)
        theirs = sorted(n for n in only_want if field_of(n) == field)
        values, expected = (sorted({repr(got[n]) for n in mine}),
                            sorted({repr(want[n]) for n in theirs}))
        if values != expected:
            lines.append((theirs[0], f"{what(theirs[0])} {theirs[0]!r}"
                          f"{f' (and {len(theirs) - 1} more)' if len(theirs) > 1 else ''}"
                          f" is re-keyed {when} as "
                          f"{mine[0]!r}{f' and {len(mine) - 1} more' if len(mine) > 1 else ''}"
                          f": values {', '.join(values)}, expected {', '.join(expected)}"))
    return lines


def check_scalars(adapter: TimedAdapter, b: Built, optimizer: Any, truth: Truth, rank: int,
                  verdict: RankVerdict, paths: tuple[str | None, ...] = ()) -> None:
    """``paths``: the checkpoint loaded and the ep=1 save, read (metadata only) for training state
    neither holds where a field of it came back wrong."""
    if optimizer is None or truth.scalars is None:
        if optimizer is not None:
            verdict.skipped["scalars"] = ("the adapter has no scalars(model, optimizer) and build "
                                          "returned no state")
        return
    problems = scalar_problems(all_scalars(adapter, b, optimizer) or {}, truth.scalars,
                               "after the load")
    wrong = [name for name, _ in problems if state_name(name) is not None]
    for piece, fields in _unsaved(adapter, wrong, paths).items():
        mine = [line for name, line in problems if state_name(name) == piece]
        problems = [(name, line) for name, line in problems if state_name(name) != piece]
        shown = ", ".join(fields[:SHOWN]) + (", ..." if len(fields) > SHOWN else "")
        verdict.problem("scalars", f"rank {rank}: the save left the training state {piece!r} out: "
                        "no key of the checkpoint or of the ep=1 save holds it or any of its "
                        f"{len(fields)} fields ({shown}), so no load can restore it: {mine[0]}"
                        + (f" (and {len(mine) - 1} more of its fields)" if len(mine) > 1 else ""))
    for _, line in problems:
        verdict.problem("scalars", f"rank {rank}: {line}")


def _unsaved(adapter: TimedAdapter, names: list[str],
             paths: tuple[str | None, ...]) -> dict[str, list[str]]:
    """:func:`left_out` of ``names`` in the DCP checkpoints at ``paths`` (the one loaded, the ep=1
    save).  No claim without the evidence: where a checkpoint cannot be read here (another format,
    no truth save), or a save wrote files of its own beside DCP's (a scheduler ``torch.save``-d next
    to the checkpoint holds the state under no key)."""
    from conformance.inspection import CheckpointError, read_dcp

    given = [path for path in paths if path]
    if (not names or not given or len(given) < len(paths)
            or adapter.members.capabilities.format != "dcp"):
        return {}
    keys: list[str] = []
    for path in given:
        try:
            index = read_dcp(path)
        except CheckpointError:
            return {}
        if _beside(path):
            return {}
        keys += index.entries
    return left_out(names, keys)


#: how deep below a save's path its files are looked for (the checkpoint itself may be
#: ``<path>/step-<n>/``).
DEPTH = 3


def _beside(path: str) -> bool:
    """Whether a save's ``path`` holds any file that is not DCP's own (``.metadata``,
    ``*.distcp``) within :data:`DEPTH` levels."""
    import os

    root = os.path.abspath(path)
    for here, dirs, files in os.walk(root):
        if here[len(root):].count(os.sep) >= DEPTH:
            dirs[:] = []
        if any(name != ".metadata" and not name.endswith(".distcp") for name in files):
            return True
    return False


def run(ctx: CheckContext) -> None:
    check_scalars(ctx.adapter, required(ctx.built, "the load side's build"), ctx.optimizer,
                  required(ctx.truth, "the ground truth"), ctx.rank, ctx.verdict,
                  (ctx.plan.path, ctx.plan.truth_path))

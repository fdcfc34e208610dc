"""One save feeds every load: which cell writes a checkpoint, which cells reuse it, when it is
removed.

A checkpoint is a pure function of the adapter and its save side -- layer kind, state, FSDP, layout,
expert count, legacy or not, and the layer count (a cell with pipeline stages on either side builds
:data:`~conformance.matrix.PIPELINE_LAYERS`) -- so every cell with the same
:attr:`~conformance.matrix.Cell.save_key` can load the one checkpoint the first of them writes.  The
controller counts each checkpoint's readers once the collection is final (after ``-k``) and removes
it after its last reader.  The truth checkpoint (the ep=1 save of a spec, what the checkpoint check
compares with) is shared the same way, per :func:`truth_key`, for the whole session.

A cell whose run failed may not have finished its save, so what it wrote is removed at once (a
full disk gets its space back); a save's inspection findings travel with it to every later reader.
A save -- or a truth checkpoint -- that *itself* failed or hung (the ranks at fault were on its side
when they stopped: :func:`stopped_side`) is met once: it would fail the same way again, or hang a
deadline more, so every later cell that needs it stops at once with that cell's findings, naming
it (:meth:`Saves.failure`), and the world a hang killed is not started again for them.  A save the
cell stopped before, or elsewhere, is written again by the next reader; so is one that failed for
want of space or permission, named as such by :func:`disk_problem` (a full disk may have room by
then).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance.matrix import Cell
from conformance.members import Members, members_of


@dataclass(frozen=True)
class CellPlan:
    """What the controller decided for this cell's files (sent to the ranks with the cell)."""

    #: the checkpoint this cell loads, and whether this cell writes it (the first of its readers).
    path: str
    save: bool = True
    #: the ep=1 truth checkpoint of the save side's model (None: no checkpoint check), and whether
    #: to write it.
    truth_path: str | None = None
    save_truth: bool = False
    #: the checkpoint check's findings, from the cell that wrote a shared save (and the truth
    #: checkpoint's).
    findings: tuple[str, ...] = ()
    truth_findings: tuple[str, ...] = ()
    #: the ``hf_export`` check's problems, ``(finding, text)``, from the cell that wrote a shared
    #: save: the export beside it is every reader's, and a reader whose import then refuses leads
    #: with the export's defect, not with the refusal.
    export_problems: tuple[tuple[str, str], ...] = ()
    #: expert-key regexes the user gave (``--moe-ep-expert-key``), tried before what the truth
    #: teaches.
    expert_keys: tuple[str, ...] = ()
    #: the matrix session's id: a rank that sees a new one drops its world state
    #: (:meth:`conformance.world_state.WorldState.begin`).
    session: str = ""


def _key(cell: Cell, share: bool) -> tuple[Any, ...]:
    return cell.save_key if share else (cell,)


#: the errors a save gets from its filesystem rather than from the adapter: errno -> what it means.
DISK_ERRORS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
               errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
               errno.EROFS: "read-only file system"}
_ERRNO = re.compile(r"\[Errno (\d+)\][^\n']*(?:'([^'\n]+)')?")


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def disk_problem(error: Any, plan: CellPlan) -> str | None:
    """The first line of a cell whose save failed with ENOSPC, EDQUOT, EACCES, EPERM or EROFS, else
    ``None``.

    ``error`` is the engine's :class:`~pytest_moe_ep.world.engine.WorldError`; the line names the
    directory written, its free space now (before the partial save is removed) and the failing
    ranks.
    """
    found: dict[int, tuple[int, str]] = {}
    for rank, rank_error in sorted(getattr(error, "errors", {}).items()):
        for match in _ERRNO.finditer(f"{rank_error.message}\n{rank_error.traceback}"):
            code = int(match.group(1))
            if code in DISK_ERRORS:
                found.setdefault(rank, (code, match.group(2) or ""))
                break
    if not found:
        return None
    code, named = next(iter(found.values()))
    candidates = [d for d in (plan.path, plan.truth_path) if d]
    directory = next((d for d in candidates if named
                      and os.path.abspath(named).startswith(d.rstrip("/") + "/")),
                     candidates[0] if candidates else os.path.dirname(named))
    try:
        usage = shutil.disk_usage(directory)
        space = f"{_size(usage.free)} free of {_size(usage.total)}"
    except OSError as exc:
        space = f"free space unknown ({exc.strerror or exc})"
    ranks = ", ".join(map(str, found))
    return (f"save failed: {DISK_ERRORS[code]} ({errno.errorcode[code]}) writing {directory}: "
            f"{space}; failed on rank(s) {ranks}")


def export_dir(checkpoint: str) -> str:
    """Where the Hugging Face export of the save in ``checkpoint`` goes
    (:mod:`conformance.checks.hf`): beside it, so a framework's checkpoint root never holds it."""
    return checkpoint.rstrip("/") + "-hf"


def export_root(directory: str) -> str:
    """The directory of a Hugging Face export's index: ``directory``, or the one subdirectory a
    framework writes it to (torchtitan's last save: ``step-N/``) when ``directory`` holds no
    ``*.safetensors`` itself."""
    top = Path(directory)
    if any(top.glob("*.safetensors")) or any(top.glob("*.safetensors.index.json")):
        return directory
    found = sorted(p.parent for p in top.glob("*/*.safetensors.index.json"))
    return str(found[-1]) if found else directory


def _empty(path: str) -> None:
    """Remove what a failed save wrote (and its export), keeping the directory the next writer is
    given."""
    shutil.rmtree(export_dir(path), ignore_errors=True)
    with contextlib.suppress(OSError):
        for child in Path(path).iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    child.unlink()


def kept_name(node_name: str) -> str:
    """A cell's node id as one directory name: ``checkpoint::packed::model::ep-only::E5::ep2->ep4``
    is ``checkpoint.packed.model.ep-only.E5.ep2-to-ep4`` (any other character outside
    ``[A-Za-z0-9._+-]``: ``_``)."""
    return re.sub(r"[^A-Za-z0-9._+-]", "_", node_name.replace("::", ".").replace("->", "-to-"))


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link where the filesystem allows one (a save many cells read is kept once on disk),
    else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def kept_dirs(plan: CellPlan) -> dict[str, str | None]:
    """What ``--moe-ep-keep-checkpoints`` keeps of a cell, by the name it is kept under: the save
    the cell loaded (``save``), the ep=1 save it was compared with (``ep1``; the *ground truth* is
    the model that save was made from), and the Hugging Face export of each where the cell wrote or
    read one (``save-hf``, ``ep1-hf``)."""
    truth = plan.truth_path
    return {"save": plan.path, "save-hf": export_dir(plan.path), "ep1": truth,
            "ep1-hf": export_dir(truth) if truth else None}


def keep_checkpoints(where: Path, **checkpoints: str | None) -> None:
    """Keep each of ``checkpoints`` (name -> directory) under ``where/<name>``; one that could not
    be kept is a warning naming it, not the cell's failure."""
    import warnings

    for name, path in checkpoints.items():
        if not path or not os.path.isdir(path):
            continue
        try:
            shutil.copytree(path, where / name, copy_function=_link_or_copy, dirs_exist_ok=True)
        except (OSError, shutil.Error) as exc:
            warnings.warn(f"--moe-ep-keep-checkpoints: could not keep {path} in {where / name}: "
                          f"{exc}", stacklevel=2)


def truth_key(cell: Cell) -> tuple[Any, ...]:
    return (cell.save_kind, cell.state, cell.num_experts, cell.pipeline, cell.finetune)


def stopped_side(error: Any) -> str | None:
    """The side (``truth``, ``save``, ``load``: :mod:`conformance.checks.cell`) every rank at fault
    in ``error`` (the engine's :class:`~pytest_moe_ep.world.engine.WorldError`) said it was on
    when the call stopped; ``None`` when they said none or not the same one."""
    activity = getattr(error, "activity", {})
    ranks = list(getattr(error, "at_fault", [])) or sorted(activity)
    sides = {activity.get(r, {}).get("side") for r in ranks}
    return next(iter(sides)) if len(sides) == 1 else None


@dataclass
class _Entry:
    path: str | None = None
    written: bool = False
    readers_left: int = 0
    findings: tuple[str, ...] = ()
    export_problems: tuple[tuple[str, str], ...] = ()
    #: the checkpoint failed or hung while being written: the cell it failed in, and the engine's
    #: error.
    failed: tuple[str, Any] | None = None


@dataclass
class Saves:
    """The controller's record of shared checkpoints (see the module docstring)."""

    engine: Any
    adapter: Any
    #: ``False``: every cell writes its own checkpoint (the benchmark's baseline for what sharing
    #: saves).
    share: bool = True
    saves: dict[tuple[Any, ...], _Entry] = field(default_factory=dict)
    truths: dict[tuple[Any, ...], _Entry] = field(default_factory=dict)
    #: what :func:`~conformance.members.check_adapter` resolved of the adapter (resolved here when
    #: not given).
    members: Members | None = None
    #: whether cells get a truth checkpoint: the checkpoint check can read this adapter's
    #: checkpoints.
    truths_wanted: bool = field(init=False, default=True)
    #: this session's id, sent with every plan.
    session: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: ``--moe-ep-keep-checkpoints``: each cell's checkpoints (:func:`kept_dirs`) are kept
    #: under ``keep/<the cell's id>/`` for reading offline (:func:`kept_name`); ``None``: removed as
    #: they go.
    keep: Path | None = None

    def __post_init__(self) -> None:
        self.truths_wanted = not (self.members or members_of(self.adapter)).unreadable()

    def count_readers(self, cells: list[Cell]) -> None:
        readers = Counter(_key(c, self.share) for c in cells if not c.na)
        for key, n in readers.items():
            self.saves.setdefault(key, _Entry()).readers_left = n

    def plan(self, cell: Cell, expert_keys: tuple[str, ...] = ()) -> CellPlan:
        entry = self.saves.setdefault(_key(cell, self.share), _Entry(readers_left=1))
        if entry.path is None:
            entry.path = str(self.engine.shared_dir(cell.node_name))
        truth_path, save_truth = None, False
        if not cell.legacy and self.truths_wanted:
            truth = self.truths.setdefault(truth_key(cell), _Entry())
            if truth.path is None:
                truth.path = str(self.engine.shared_dir(f"truth-{cell.node_name}"))
            truth_path, save_truth = truth.path, not truth.written
        truth_findings = self.truths[truth_key(cell)].findings if truth_path else ()
        return CellPlan(entry.path, save=not entry.written, truth_path=truth_path,
                        save_truth=save_truth, findings=entry.findings,
                        truth_findings=truth_findings, export_problems=entry.export_problems,
                        expert_keys=expert_keys,
                        session=self.session)

    def failure(self, cell: Cell) -> tuple[str, str, Any] | None:
        """What of ``cell``'s checkpoints failed in an earlier cell (:func:`stopped_side`): the
        words for it, the cell it failed in and the engine's error; ``None`` when neither did."""
        entry = self.saves.get(_key(cell, self.share))
        if entry is not None and entry.failed is not None:
            return (f"its save at {cell.save.fragment}", *entry.failed)
        truth = self.truths.get(truth_key(cell))
        if not cell.legacy and self.truths_wanted and truth is not None and truth.failed:
            return ("the ep=1 truth checkpoint it is compared with", *truth.failed)
        return None

    def passed_over(self, cell: Cell) -> None:
        """``cell`` did not run (:meth:`failure`): one reader fewer."""
        key = _key(cell, self.share)
        entry = self.saves.get(key)
        if entry is None:
            return
        entry.readers_left -= 1
        if entry.readers_left <= 0:
            if entry.path is not None:
                self._remove(entry.path)
            del self.saves[key]

    def finished(self, cell: Cell, plan: CellPlan, verdict: Any, stopped: Any = None,
                 failed_in: str = "") -> None:
        """After the cell's world call: ``verdict`` is rank 0's, as far as the cell got when it
        stopped (``None`` when none came back).  A checkpoint the cell wrote whole, its findings
        read, serves its later readers as it is -- a load that stopped on it would stop on a
        rewrite too; one it left half-written is emptied for the next reader to write again,
        unless it failed itself (``stopped``, the engine's error, says the ranks at fault were
        writing it): then it is met once, as the cell ``failed_in``."""
        entry = self.saves[_key(cell, self.share)]
        side = stopped_side(stopped) if stopped is not None else None
        if side == "save" and plan.save:
            entry.failed = (failed_in, stopped)
        elif side == "truth" and plan.save_truth and plan.truth_path is not None:
            self.truths[truth_key(cell)].failed = (failed_in, stopped)
        if self.keep is not None and getattr(self.engine, "rank", 0) == 0:  # before _empty below
            keep_checkpoints(self.keep / kept_name(cell.node_name), **kept_dirs(plan))
        if plan.truth_path is not None and plan.save_truth and verdict is not None \
                and verdict.wrote_truth:
            truth = self.truths[truth_key(cell)]
            truth.written, truth.findings = True, verdict.truth_findings
        if plan.save and verdict is not None and verdict.wrote_save:
            from conformance.checks.hf import EXPORT

            entry.written, entry.findings = True, verdict.findings
            entry.export_problems = tuple((p.finding, p.text) for p in verdict.problems
                                          if p.check == EXPORT)
        if getattr(self.engine, "rank", 0) == 0:
            if plan.save and not entry.written and entry.path:
                _empty(entry.path)
            if plan.save_truth and plan.truth_path and not self.truths[truth_key(cell)].written:
                _empty(plan.truth_path)
        entry.readers_left -= 1
        if entry.readers_left <= 0 and entry.path is not None:
            self._remove(entry.path)
            del self.saves[_key(cell, self.share)]

    def _remove(self, path: str) -> None:
        # under torchrun the ranks share rank 0's directory; the Hugging Face export goes with it
        if getattr(self.engine, "rank", 0) == 0:
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(export_dir(path), ignore_errors=True)

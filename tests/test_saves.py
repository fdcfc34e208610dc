"""One save, many loads: which cell writes a checkpoint, who reuses it, when it goes (controller
bookkeeping).

Unit level: the engine is a stand-in that only makes directories; the real sharing runs in every
matrix test (``test_matrix.py`` asserts cells report ``shared_save``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from conformance.adapters.reference import ReferenceAdapter
from conformance.checks.verdict import Problem
from conformance.layout import ParallelLayout
from conformance.matrix import Cell
from conformance.saves import Saves


@dataclass
class DirEngine:
    root: Path
    rank: int = 0
    made: int = 0

    def shared_dir(self, nodeid: str) -> Path:
        self.made += 1
        path = self.root / f"d{self.made}"
        path.mkdir()
        return path


@dataclass
class Verdict:
    """Rank 0's :class:`~conformance.checks.verdict.RankVerdict` as far as ``finished`` reads it:
    by default a cell that wrote what its plan asked."""

    findings: tuple[str, ...] = ()
    truth_findings: tuple[str, ...] = ()
    wrote_save: bool = True
    wrote_truth: bool = True
    problems: tuple[Problem, ...] = ()


def cell(load_ep: int, save_ep: int = 2) -> Cell:
    return Cell("packed", "packed", "model+optim", False, ParallelLayout.for_world(4, save_ep),
                ParallelLayout.for_world(4, load_ep), 4)


def test_the_first_reader_saves_the_others_reuse_and_the_last_removes(tmp_path: Path) -> None:
    saves = Saves(DirEngine(tmp_path), ReferenceAdapter())
    readers = [cell(1), cell(2), cell(4)]
    saves.count_readers(readers)
    first = saves.plan(readers[0])
    assert first.save and first.save_truth and first.truth_path
    saves.finished(readers[0], first, Verdict(("layer 0: a finding",), ("a truth finding",)))
    second = saves.plan(readers[1])
    assert not second.save and not second.save_truth and second.path == first.path
    assert second.findings == ("layer 0: a "
                               "finding",) and second.truth_findings == ("a truth finding",)
    saves.finished(readers[1], second, Verdict())
    assert Path(first.path).exists()
    third = saves.plan(readers[2])
    saves.finished(readers[2], third, Verdict())
    assert not Path(first.path).exists(), "the checkpoint outlived its last reader"
    assert Path(first.truth_path).exists(), "the truth checkpoint is kept for the session"


def test_a_saves_export_problems_reach_its_readers(tmp_path: Path) -> None:
    """The export beside a shared save is every reader's: its ``hf_export`` problems travel with
    the save, as its checkpoint findings do; no other check's problem does."""
    saves = Saves(DirEngine(tmp_path), ReferenceAdapter())
    readers = [cell(1), cell(4)]
    saves.count_readers(readers)
    first = saves.plan(readers[0])
    saves.finished(readers[0], first, Verdict(problems=(
        Problem("hf_export", "the export at ep=2: experts 2..3 missing"),
        Problem("hf_import", "the framework's import_hf() raised", "refused"))))
    assert saves.plan(readers[1]).export_problems == (("", "the export at ep=2: experts 2..3 "
                                                       "missing"),)


def test_a_failed_save_is_written_again_by_the_next_reader(tmp_path: Path) -> None:
    saves = Saves(DirEngine(tmp_path), ReferenceAdapter())
    readers = [cell(1), cell(4)]
    saves.count_readers(readers)
    first = saves.plan(readers[0])
    saves.finished(readers[0], first, None)  # the world call failed: the save may be incomplete
    again = saves.plan(readers[1])
    assert again.save and again.save_truth and again.path == first.path


def test_without_sharing_every_cell_saves(tmp_path: Path) -> None:
    saves = Saves(DirEngine(tmp_path), ReferenceAdapter(), share=False)
    readers = [cell(1), cell(4)]
    saves.count_readers(readers)
    plans = []
    for c in readers:
        plans.append(saves.plan(c))
        saves.finished(c, plans[-1], Verdict())
    assert all(p.save for p in plans) and plans[0].path != plans[1].path
    assert not any(Path(p.path).exists() for p in plans)


def test_a_save_written_whole_by_a_cell_that_stopped_is_not_written_again(tmp_path: Path) -> None:
    """A refused load stops its cell after the save and the truth were written and read: the next
    reader loads them as they are (a rewrite would be refused the same way); what a stopped cell
    left half-written is written again."""
    saves = Saves(DirEngine(tmp_path), ReferenceAdapter())
    readers = [cell(1), cell(4), cell(2, save_ep=4), cell(1, save_ep=4)]
    saves.count_readers(readers)
    first = saves.plan(readers[0])
    saves.finished(readers[0], first, Verdict(("layer 0: a finding",), ("a truth finding",)))
    second = saves.plan(readers[1])
    assert not second.save and second.findings == ("layer 0: a finding",)
    assert Path(second.path).exists()
    # the truth written, the save not: only the save is written again
    other = saves.plan(readers[2])
    assert other.save and not other.save_truth
    saves.finished(readers[2], other, Verdict(wrote_save=False))
    again = saves.plan(readers[3])
    assert again.save and again.path == other.path and not again.save_truth

"""A framework's expectations file: run the matrix in CI while it is still red, and fail only on
change.

Every real framework has red cells on the day it adopts the matrix.  An expectations file (TOML)
says, per cell id or ``fnmatch`` pattern, the finding a cell is expected to come back with
(:mod:`conformance.findings`, or ``pass``) and why::

    # pytest-moe-ep expectations (docs/matrix.md#expectations), for adapter acme

    [[cell]]
    id = "moe-ep-matrix::checkpoint::packed::model+optim::ep-only::E6::*->ep4"
    finding = "refused"
    reason = "acme cannot split E=6 experts over 4 ranks: https://github.com/acme/acme/issues/12"

A cell whose outcome matches its expectation is reported as xfailed with the reason and does not
fail the session; a cell worse or better than expected fails, naming what was expected and what came
back ("now passes: update the expectations").  A cell the file does not name is expected to pass.
An exact id wins over patterns; among patterns the last one in the file that matches wins (as in
``.gitignore``), so a later, narrower line overrides a broad one.
``--moe-ep-tolerate=refused,error`` accepts those findings everywhere without listing cells (they
are still reported).

``--moe-ep-update-expectations`` rewrites the file from the run's outcomes (:func:`updated_text`):
entries that did not change keep their text, reasons and comments; a changed or new entry gets a
reason placeholder that says who wrote it; an entry the run shows is no longer needed is removed;
patterns are never rewritten (a cell that disagrees with one gets an exact entry).  Only the cells
the run ran are touched (a ``-k`` slice updates its slice), and only a run that finished writes,
atomically (:func:`conformance.report.write_atomic`).

An entry may pin the adapter it is about (``adapter = "acme"`` in the entry, or once at the top for
all): held against another adapter, such a file is refused.  Without a pin the file can be held
against any adapter -- the fixed framework, a fork -- and says which of its cells now pass.

Bad input is an :class:`ExpectationsError` (the session turns it into a one-line usage error, exit
4): a file that does not parse, an unknown key or finding, an id or pattern that names no cell of
any tier, an entry naming another adapter.  This module imports neither torch nor pytest.
"""

from __future__ import annotations

import fnmatch
import json
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from conformance.findings import FINDINGS, PASS, severity

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - pytest brings tomli on 3.10
    import tomli as tomllib

PREFIX = "moe-ep-matrix::"
OUTCOMES = (PASS, *FINDINGS)
ENTRY_KEYS = ("id", "finding", "reason", "adapter")
TOP_KEYS = ("adapter", "cell")
#: a cell's expectation in its record: met, met because tolerated, unmet, or (update run) rewritten.
MET, TOLERATED, UNMET, UPDATED = "met", "tolerated", "unmet", "updated"
_HEADER = re.compile(r"^\s*\[\[\s*cell\s*\]\]\s*(#.*)?$")


class ExpectationsError(ValueError):
    """The file cannot be used; ``path`` and ``problem`` say why (``str()`` is the one line to
    show)."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path, self.problem = str(path), problem
        super().__init__(f"{path}: {problem}")


def normalize_id(cell_id: str) -> str:
    """A cell id as the node id reads (``moe-ep-matrix::`` may be left off in the file)."""
    return cell_id if cell_id.startswith((PREFIX, "*")) else PREFIX + cell_id


def normalize_adapter(name: str) -> str:
    """Adapter names compare as everywhere (:func:`conformance.adapters.name_key`): ``-`` and ``_``
    alike."""
    from conformance.adapters import name_key

    return name_key(name)


def is_pattern(cell_id: str) -> bool:
    return any(ch in cell_id for ch in "*?[")


@dataclass(frozen=True)
class Entry:
    """One ``[[cell]]`` of the file: an exact id or a pattern, its expected outcome and why."""

    id: str
    finding: str
    reason: str
    #: its position among the file's entries (later patterns win).
    index: int
    #: the adapter the entry pins (``None``: any).
    adapter: str | None = None

    @property
    def pattern(self) -> bool:
        return is_pattern(self.id)

    def matches(self, cell_id: str) -> bool:
        return fnmatch.fnmatchcase(cell_id, self.id) if self.pattern else cell_id == self.id


@dataclass(frozen=True)
class Expected:
    """What the file expects of one cell; ``entry`` is ``None`` for a cell the file does not
    name."""

    outcome: str
    reason: str = ""
    entry: Entry | None = None

    @property
    def by(self) -> str | None:
        return self.entry.id if self.entry is not None else None


@dataclass
class Expectations:
    """A parsed expectations file (or none: every cell expected to pass) and its text, kept for
    updates."""

    path: Path
    entries: list[Entry] = field(default_factory=list)
    adapter: str | None = None
    text: str = ""
    exists: bool = False

    @property
    def exact(self) -> dict[str, Entry]:
        return {e.id: e for e in self.entries if not e.pattern}

    def expected(self, cell_id: str) -> Expected:
        exact = self.exact.get(cell_id)
        if exact is not None:
            return Expected(exact.finding, exact.reason, exact)
        return self.fallback(cell_id)

    def fallback(self, cell_id: str) -> Expected:
        """What the patterns (else the default, ``pass``) expect of ``cell_id``: the last matching
        pattern."""
        for entry in reversed(self.entries):
            if entry.pattern and entry.matches(cell_id):
                return Expected(entry.finding, entry.reason, entry)
        return Expected(PASS)


def _string(path: Path, where: str, value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise ExpectationsError(path, f"{where}: '{key}' must be a string, got "
                                f"{type(value).__name__} {value!r}")
    return value


def parse(path: str | Path, text: str) -> Expectations:
    """``text`` (the content of ``path``) as :class:`Expectations`; :class:`ExpectationsError` says
    what is wrong."""
    path = Path(path)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ExpectationsError(path, f"not valid TOML: {exc}") from None
    unknown = sorted(set(doc) - set(TOP_KEYS))
    if unknown:
        raise ExpectationsError(path, f"unknown key(s) {', '.join(map(repr, unknown))}; an "
                                "expectations file holds 'adapter' and [[cell]] entries")
    adapter = _string(path, "the file", doc["adapter"], "adapter") if "adapter" in doc else None
    cells = doc.get("cell", [])
    if not isinstance(cells, list) or not all(isinstance(c, dict) for c in cells):
        raise ExpectationsError(path, "'cell' must be an array of tables: [[cell]] entries with "
                                "id, finding, reason")
    entries: list[Entry] = []
    seen: dict[str, int] = {}
    for index, raw in enumerate(cells):
        where = f"[[cell]] entry {index + 1}"
        bad = sorted(set(raw) - set(ENTRY_KEYS))
        if bad:
            raise ExpectationsError(path, f"{where}: unknown key(s) {', '.join(map(repr, bad))}; "
                                    f"an entry holds {', '.join(ENTRY_KEYS)}")
        for key in ("id", "finding"):
            if key not in raw:
                raise ExpectationsError(path, f"{where}: no '{key}'")
        cell_id = normalize_id(_string(path, where, raw["id"], "id"))
        where = f"{where} ({raw['id']!r})"
        finding = _string(path, where, raw["finding"], "finding")
        if finding not in OUTCOMES:
            raise ExpectationsError(path, f"{where}: unknown finding {finding!r}; expected one of "
                                          f"{', '.join(OUTCOMES)}")
        pinned = _string(path, where, raw["adapter"], "adapter") if "adapter" in raw else adapter
        if (pinned is not None and adapter is not None
            and normalize_adapter(pinned) != normalize_adapter(adapter)):
            raise ExpectationsError(path, f"{where}: names adapter {pinned!r}, the file is for "
                                    f"{adapter!r}")
        if not is_pattern(cell_id) and cell_id in seen:
            raise ExpectationsError(path, f"{where}: the same id as entry {seen[cell_id] + 1}; say "
                                    "each cell once")
        seen.setdefault(cell_id, index)
        entries.append(Entry(cell_id, finding,
                             _string(path, where, raw.get("reason", ""), "reason"), index, pinned))
    return Expectations(path, entries, adapter, text, exists=True)


def read(path: str | Path, *, adapter: str | None = None, universe: Iterable[str] | None = None,
         universe_note: str = "", missing_ok: bool = False) -> Expectations:
    """Read and check the file at ``path``: against the session's ``adapter`` name and, when given,
    the ids of every cell of every tier (``universe``; ``universe_note`` says for which world size
    and expert counts). ``missing_ok``: a file that does not exist yet is an empty one (what an
    update run starts from)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if missing_ok:
            return Expectations(path, adapter=adapter)
        raise ExpectationsError(path, "no such file (--moe-ep-update-expectations writes a first "
                                "one)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ExpectationsError(path, "cannot read it: "
                                f"{getattr(exc, 'strerror', None) or exc}") from None
    found = parse(path, text)
    if adapter is not None and found.adapter is not None and \
            normalize_adapter(found.adapter) != normalize_adapter(adapter):
        raise ExpectationsError(path, f"is for adapter {found.adapter!r}; this session checks "
                                f"{adapter!r}")
    for entry in found.entries:
        if adapter is not None and entry.adapter is not None and \
                normalize_adapter(entry.adapter) != normalize_adapter(adapter):
            raise ExpectationsError(path, f"[[cell]] entry {entry.index + 1} ({entry.id!r}) names "
                                    f"adapter {entry.adapter!r}; this session checks {adapter!r}")
    if universe is not None:
        ids = set(universe)
        for entry in found.entries:
            if not any(entry.matches(i) for i in ids):
                what = "pattern" if entry.pattern else "id"
                raise ExpectationsError(path, f"[[cell]] entry {entry.index + 1}: the {what} "
                                        f"{entry.id!r} names no cell of any tier{universe_note}")
    return found


@dataclass(frozen=True)
class Judgement:
    """A cell's outcome against its expectation: :data:`MET`, :data:`TOLERATED` or :data:`UNMET`,
    and why."""

    state: str
    expected: Expected
    got: str
    text: str

    @property
    def met(self) -> bool:
        return self.state != UNMET

    def record_fields(self) -> dict[str, Any]:
        """What the cell's record says of it (docs/matrix.md, the report's ``cells``)."""
        return {"expected": self.expected.outcome, "expected_reason": self.expected.reason,
                "expected_by": self.expected.by, "expectation": self.state}


def judge(expected: Expected, got: str, tolerate: Iterable[str] = ()) -> Judgement:
    """``got`` (``pass`` or a finding) against ``expected``; a tolerated finding is met wherever the
    file expects a pass or another tolerated finding."""
    tolerated = set(tolerate)
    want = expected.outcome
    why = f" ({expected.reason})" if expected.reason else ""
    if got == want:
        return Judgement(MET, expected, got, f"{got} as expected{why}")
    if got in tolerated and (want == PASS or want in tolerated):
        return Judgement(TOLERATED, expected, got, f"{got}, tolerated by --moe-ep-tolerate")
    source = f" by {expected.by!r}" if expected.by else " (not in the expectations file)"
    if got == PASS:
        text = f"now passes (expected {want}{source}{why}): update the expectations"
    elif severity(got) > severity(want):
        text = f"worse than expected: expected {want}{source}{why}, got {got}"
    else:
        text = (f"better than expected: expected {want}{source}{why}, got {got}: update the "
                "expectations")
    return Judgement(UNMET, expected, got, text)


# -- writing ---------------------------------------------------------------------------------------
def _toml_string(value: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(value, ensure_ascii=False)


def _entry_lines(cell_id: str, finding: str, reason: str, adapter: str | None = None) -> list[str]:
    pin = [f"adapter = {_toml_string(adapter)}"] if adapter else []
    return ["[[cell]]", f"id = {_toml_string(cell_id)}", f"finding = {_toml_string(finding)}",
            f"reason = {_toml_string(reason)}", *pin]


def placeholder(got: str, written_by: str, was: str | None = None) -> str:
    """The reason a written entry gets until a person replaces it: who wrote it and what it
    found."""
    changed = f", was {was}" if was else ""
    return f"TODO: {got}{changed} (written by {written_by}); replace with a bug link or a sentence"


def written_by(adapter: str, version: str) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    return f"pytest --moe-ep-update-expectations on {stamp}, {adapter} {version}".rstrip()


@dataclass(frozen=True)
class Update:
    """What :func:`updated_text` did: the new text and the ids it added, changed and removed."""

    text: str
    added: list[str]
    changed: list[str]
    removed: list[str]
    kept_comments: bool = True

    @property
    def changes(self) -> int:
        return len(self.added) + len(self.changed) + len(self.removed)

    def summary(self, path: Path | str) -> str:
        if not self.changes:
            return f"{path}: unchanged (every cell that ran is as the file expects)"
        note = ("" if self.kept_comments
                else " (its [[cell]] headers could not be told apart: comments not kept)")
        return (f"{path}: {len(self.added)} added, {len(self.changed)} changed, "
                f"{len(self.removed)} removed entries{note}")


def _blocks(text: str, count: int) -> tuple[list[str], list[list[str]]] | None:
    """The file's lines before its first entry, and each entry's lines (its leading comments with
    it); ``None`` when the ``[[cell]]`` headers do not match the ``count`` entries parsed (an
    inline-table form, say)."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if _HEADER.match(line)]
    if len(starts) != count:
        return None
    begins = []
    for start in starts:
        begin = start
        while begin > 0 and lines[begin - 1].lstrip().startswith("#"):
            begin -= 1
        begins.append(begin)
    head = lines[:begins[0]] if begins else lines
    blocks = [lines[b:(begins[i + 1] if i + 1 < len(begins) else len(lines))]
              for i, b in enumerate(begins)]
    return head, blocks


def _comments(block: list[str]) -> list[str]:
    out = []
    for line in block:
        if _HEADER.match(line):
            break
        out.append(line)
    return out


def updated_text(current: Expectations, outcomes: Mapping[str, str], *, adapter: str,
                 by: str) -> Update:
    """The file's new text once ``outcomes`` (cell id -> ``pass`` or finding, the cells the run ran)
    are in it."""
    exact = current.exact
    change: dict[str, str] = {}  # exact id -> its new finding
    remove: set[str] = set()
    added: dict[str, str] = {}
    for cell_id, got in sorted(outcomes.items()):
        entry = exact.get(cell_id)
        fallback = current.fallback(cell_id).outcome
        if entry is not None:
            if entry.finding == got:
                continue
            if got == fallback:
                remove.add(cell_id)
            else:
                change[cell_id] = got
        elif fallback != got:
            added[cell_id] = got
    split = _blocks(current.text, len(current.entries)) if current.exists else ([], [])
    kept_comments = split is not None
    if split is None:  # keep the meaning, not the layout
        pin = [f"adapter = {_toml_string(current.adapter)}"] if current.adapter else []
        head: list[str] = ["# pytest-moe-ep expectations (docs/matrix.md#expectations)", *pin, ""]
        blocks = [[*_entry_lines(e.id, e.finding, e.reason,
                                 e.adapter if e.adapter != current.adapter else None), ""]
                  for e in current.entries]
    else:
        head, blocks = split
    if not current.exists or not any(line.strip() for line in head):
        # The adapter is named in a comment, not pinned: the same file can be held against another
        # adapter (a fixed framework, a fork), and says which of its cells now pass.
        # ``adapter = "..."`` pins it.
        head = ["# pytest-moe-ep expectations: the outcome each red cell is expected to have, and "
                "why",
                "# (docs/matrix.md#expectations). A cell not named here is expected to pass.",
                f"# Written for adapter {adapter}.", ""]
    out = [*head]
    if out and out[-1].strip():
        out.append("")
    for entry, block in zip(current.entries, blocks, strict=True):
        if entry.id in remove:
            continue
        if entry.id in change:
            got = change[entry.id]
            pinned = entry.adapter if entry.adapter != current.adapter else None
            block = [*_comments(block),
                     *_entry_lines(entry.id, got, placeholder(got, by, was=entry.finding), pinned),
                     ""]
        out += block
        if out and out[-1].strip():
            out.append("")
    for cell_id, got in added.items():
        out += [*_entry_lines(cell_id, got, placeholder(got, by)), ""]
    while len(out) > 1 and not out[-1].strip() and not out[-2].strip():
        out.pop()
    text = "\n".join(out).rstrip("\n") + "\n"
    parse(current.path, text)  # what this writes must read back
    return Update(text, sorted(added), sorted(change), sorted(remove), kept_comments)


@dataclass
class Baseline:
    """A session's expectations: the file (empty without one), the tolerated findings, and whether
    this run rewrites the file."""

    file: Expectations
    tolerate: tuple[str, ...] = ()
    update: bool = False

    def judge(self, cell_id: str, got: str) -> Judgement:
        found = judge(self.file.expected(cell_id), got, self.tolerate)
        if self.update and not found.met:
            return Judgement(UPDATED, found.expected, got,
                             f"{got}: the expectation is updated ({found.text})")
        return found


#: what ``--moe-ep-tolerate`` accepts: loud findings only (silent loss and lossy files are listed
#: per cell).
TOLERABLE = ("refused", "error")


def parse_tolerate(given: str | None) -> tuple[str, ...]:
    """``--moe-ep-tolerate``'s value; :class:`ValueError` names what is wrong."""
    names = tuple(sorted({part.strip() for part in (given or "").split(",") if part.strip()}))
    bad = [n for n in names if n not in TOLERABLE]
    if bad:
        why = ("silent loss and lossy checkpoints are never tolerated wholesale: name those cells "
               "in an expectations file" if set(bad) <= set(FINDINGS)
               else f"the findings are {', '.join(FINDINGS)}")
        raise ValueError(f"--moe-ep-tolerate takes {' and '.join(TOLERABLE)}; got "
                         f"{', '.join(map(repr, bad))} ({why})")
    return names


__all__ = ["MET", "OUTCOMES", "TOLERABLE", "TOLERATED", "UNMET", "UPDATED", "Baseline", "Entry",
           "Expectations", "ExpectationsError", "Expected", "Judgement", "Update", "judge",
           "normalize_adapter", "normalize_id", "parse", "parse_tolerate", "placeholder", "read",
           "updated_text", "written_by"]

"""The report's files: their names, how each is written (atomically), and how a report is read back.

A report directory holds ``moe-ep-conformance.json``, ``.md`` and ``.html`` and one picture per
grid, ``moe-ep-conformance-grid-<kind>-<state>.svg`` (``-grid-legacy-<kind>``, ``-grid-functions``);
a diff writes ``moe-ep-conformance-diff.md`` and ``.svg``.  Every file is written to a temporary
file, fsync'ed and renamed, so a crash mid-write leaves the previous file, never a truncated one.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 6
READS = (1, 2, 3, 4, 5, SCHEMA_VERSION)
JSON_NAME = "moe-ep-conformance.json"
MD_NAME = "moe-ep-conformance.md"
HTML_NAME = "moe-ep-conformance.html"
GRID_PREFIX = "moe-ep-conformance-grid-"
DIFF_MD_NAME, DIFF_SVG_NAME = "moe-ep-conformance-diff.md", "moe-ep-conformance-diff.svg"
TMP_PREFIX = ".moe-ep-conformance-"


def grid_name(slug: str) -> str:
    """The picture file of the grid ``slug`` (:attr:`conformance.report.cells.Grid.slug`)."""
    return f"{GRID_PREFIX}{slug}.svg"


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds either its old content or all of ``text``: a temporary file, fsync'ed, then
    renamed."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{TMP_PREFIX}{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # what open() would have made, not mkstemp's 0600
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove_temporaries(out: Path) -> None:
    """What a writer killed mid-write left: only this package writes such names, one writer per
    directory."""
    for stale in out.glob(f"{TMP_PREFIX}*.tmp"):
        with contextlib.suppress(OSError):
            stale.unlink()


def write_files(out: Path, texts: dict[str, str]) -> dict[str, Path]:
    """Each ``name: text`` into ``out`` (created), atomically; then the grid pictures of an earlier
    report that this one does not have are removed (a crash before that leaves the earlier report
    whole)."""
    out.mkdir(parents=True, exist_ok=True)
    remove_temporaries(out)
    for name, text in texts.items():
        write_atomic(out / name, text)
    for stale in out.glob(f"{GRID_PREFIX}*.svg"):
        if stale.name not in texts:
            with contextlib.suppress(OSError):
                stale.unlink()
    return {name: out / name for name in texts}


class UsageProblem(Exception):
    """A report file that cannot be read: exit status 2 with one line, never a traceback."""


def read_report(path: Path) -> dict[str, Any]:
    """A report file, checked: :class:`UsageProblem` when it is missing or not a report this package
    reads."""
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise UsageProblem(f"{path}: cannot read it: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise UsageProblem(f"{path}: not a JSON report: {exc}") from exc
    if not isinstance(doc, dict) or "cells" not in doc:
        raise UsageProblem(f"{path}: not a moe-ep conformance report (no 'cells')")
    if doc.get("schema_version") not in READS:
        raise UsageProblem(f"{path}: schema_version {doc.get('schema_version')!r}, this tool reads "
                           f"{', '.join(map(str, READS))}")
    return doc


__all__ = ["DIFF_MD_NAME", "DIFF_SVG_NAME", "GRID_PREFIX", "HTML_NAME", "JSON_NAME", "MD_NAME",
           "READS", "SCHEMA_VERSION", "TMP_PREFIX", "UsageProblem", "grid_name", "read_report",
           "remove_temporaries",
           "write_atomic", "write_files"]

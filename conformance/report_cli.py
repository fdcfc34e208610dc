"""``python -m conformance.report``: the report's command line, apart from the report it imports.

- ``OLD.json NEW.json [--out DIR]``: the cells newly failing, newly passing and whose finding
  changed, printed and written into DIR (else beside NEW) with their picture (exit 0: none changed;
  1: some did; 2: bad input);
- ``summary REPORT.json``: the report's head for a CI step summary (``>> "$GITHUB_STEP_SUMMARY"``);
- ``index ROOT [--docs PAGE]``: ``ROOT/index.md`` and its picture over every report under ``ROOT``
  (and the page's status table, the picture beside it);
- ``--from-log LOG --out DIR [--expectations FILE [--update-expectations]]``: the report rebuilt
  from a ``pytest-reportlog`` log (:mod:`conformance.reportlog`), judged against an expectations
  file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from conformance.report import UsageProblem, compare_reports, read_report, step_summary, write_index
from conformance.report.diff import write_diff


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"python -m conformance.report{prog}",
                                   description=description)


def _index(argv: list[str]) -> int:
    parser = _parser(" index", "Write ROOT/index.md and its picture over the reports in ROOT's "
                     "subfolders.")
    parser.add_argument("root", type=Path)
    parser.add_argument("--docs", "--readme", dest="readme", type=Path,
                        help="also replace that page's framework-status block (docs/frameworks.md) "
                        "and write the picture beside it")
    found = parser.parse_args(argv)
    print(write_index(found.root, found.readme))
    return 0


def _summary(argv: list[str]) -> int:
    parser = _parser(" summary", "Print the report's head as Markdown (findings, the grids as text "
                     "squares, rerun commands) for $GITHUB_STEP_SUMMARY.")
    parser.add_argument("report", type=Path)
    print(step_summary(read_report(parser.parse_args(argv).report)))
    return 0


def _diff(argv: list[str]) -> int:
    parser = _parser("", "Print the cells newly failing, newly passing and whose finding changed "
                     "between two reports, and write them with their picture "
                     "(moe-ep-conformance-diff.md and .svg) into --out, else beside NEW. Also: "
                     "python -m conformance.report summary REPORT; ... index ROOT [--docs "
                     "docs/frameworks.md]; ... --from-log LOG --out DIR [--expectations FILE "
                     "[--update-expectations]]. Exit 0: no cell changed; 1: some did; 2: bad "
                     "input.")
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="where to write the diff (default: beside NEW)")
    args = parser.parse_args(argv)
    result = compare_reports(read_report(args.old), read_report(args.new))
    out = args.out or args.new.parent
    try:
        written = write_diff(out, result, str(args.old), str(args.new))
    except OSError as exc:
        raise UsageProblem(f"{out}: cannot write the diff there: {exc.strerror or exc}") from exc
    print("\n".join(result.lines()))
    print(f"wrote {', '.join(str(p) for p in written)}")
    return 1 if result.changed else 0


def main(argv: list[str] | None = None) -> int:
    """Exit 0 on success (no change, no unmet expectation), 1 when cells changed or were unexpected,
    2 on bad input (one line on stderr, never a traceback)."""
    if argv is None:
        argv = sys.argv[1:]
    try:
        if argv[:1] and argv[0].startswith("--from-log"):
            from conformance.reportlog import rebuild_main

            return rebuild_main(argv)
        if argv[:1] == ["index"]:
            return _index(argv[1:])
        if argv[:1] == ["summary"]:
            return _summary(argv[1:])
        return _diff(argv)
    except UsageProblem as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

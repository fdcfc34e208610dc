"""``python -m conformance.report``: the report's command line, apart from the report so neither imports the other.

- ``OLD.json NEW.json``: the cells whose status or finding changed (exit 0: none; 1: some; 2: bad input);
- ``index ROOT [--docs PAGE]``: ``ROOT/index.md`` over every report under ``ROOT`` (and the page's status table);
- ``--from-log LOG --out DIR [--expectations FILE [--update-expectations]]``: the report rebuilt from a
  ``pytest-reportlog`` log (:mod:`conformance.reportlog`), judged against an expectations file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from conformance.report import UsageProblem, compare_reports, read_report, write_index


def main(argv: list[str] | None = None) -> int:
    """Exit 0 on success (no change, no unmet expectation), 1 when cells changed or were unexpected, 2 on bad
    input (one line on stderr, never a traceback)."""
    if argv is None:
        argv = sys.argv[1:]
    try:
        if argv[:1] and argv[0].startswith("--from-log"):
            from conformance.reportlog import rebuild_main

            return rebuild_main(argv)
        if argv[:1] == ["index"]:
            parser = argparse.ArgumentParser(prog="python -m conformance.report index",
                                             description="Write ROOT/index.md over the reports in ROOT's subfolders.")
            parser.add_argument("root", type=Path)
            parser.add_argument("--docs", "--readme", dest="readme", type=Path,
                                help="also replace that page's framework-status block (docs/frameworks.md)")
            found = parser.parse_args(argv[1:])
            print(write_index(found.root, found.readme))
            return 0
        parser = argparse.ArgumentParser(prog="python -m conformance.report",
                                         description="Print the cells whose status or finding changed between two "
                                         "reports (or: python -m conformance.report index ROOT [--docs "
                                         "docs/frameworks.md]; or: python -m conformance.report --from-log LOG --out "
                                         "DIR [--expectations FILE [--update-expectations]]). "
                                         "Exit 0: none changed; 1: some changed; 2: bad input.")
        parser.add_argument("old", type=Path)
        parser.add_argument("new", type=Path)
        args = parser.parse_args(argv)
        result = compare_reports(read_report(args.old), read_report(args.new))
    except UsageProblem as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(result.lines()))
    return 1 if result.changed else 0


if __name__ == "__main__":
    sys.exit(main())

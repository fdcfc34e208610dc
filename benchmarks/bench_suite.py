"""Where the test suite's time goes: seconds per test module, from pytest's JUnit XML.

    python -m pytest tests -q -p no:cacheprovider --junitxml=after.xml
    python benchmarks/bench_suite.py after.xml                 # one run: modules, slowest first
    python benchmarks/bench_suite.py before.xml after.xml      # two runs side by side

The figures are each test's setup, call and teardown as pytest timed them (JUnit's ``time``), summed
per module; the total is the suite's wall time less pytest's own start-up and collection.  Compare
two runs made on the same machine, one after the other, with nothing else running: on a shared
2-core machine the ratio of two runs means more than either absolute time.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def module_seconds(junit: Path) -> tuple[dict[str, float], Counter[str]]:
    """Seconds and test counts per test module (``tests/test_x.py``) of one JUnit XML file."""
    seconds: dict[str, float] = {}
    tests: Counter[str] = Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        name = "/".join(module[:2]) + ".py" if len(module) >= 2 else case.get("classname", "?")
        seconds[name] = seconds.get(name, 0.0) + float(case.get("time") or 0.0)
        tests[name] += 1
    return seconds, tests


def table(runs: list[Path], top: int) -> str:
    """A Markdown table: the modules of the last run, slowest first, with every run's seconds."""
    found = [module_seconds(run) for run in runs]
    last_seconds, last_tests = found[-1]
    names = sorted(last_seconds, key=lambda n: -last_seconds[n])
    names += sorted({n for s, _ in found[:-1] for n in s} - set(names))
    head = "| module | tests | " + " | ".join(f"{run.name} (s)" for run in runs) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(runs)]
    shown, rest = names[:top], names[top:]
    for name in shown:
        cells = " | ".join(f"{s.get(name, 0.0):.1f}" for s, _ in found)
        lines.append(f"| {name} | {last_tests.get(name, 0)} | {cells} |")
    if rest:
        cells = " | ".join(f"{sum(s.get(n, 0.0) for n in rest):.1f}" for s, _ in found)
        lines.append(f"| {len(rest)} other modules | "
                     f"{sum(last_tests.get(n, 0) for n in rest)} | {cells} |")
    total = " | ".join(f"**{sum(s.values()):.0f}**" for s, _ in found)
    lines.append(f"| total | {sum(last_tests.values())} | {total} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", nargs="+", type=Path, help="JUnit XML files, oldest first")
    parser.add_argument("--top", type=int, default=25, help="modules listed by name (default 25)")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.junit if not p.is_file()]
    if missing:
        print(f"bench_suite: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    print(table(args.junit, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())

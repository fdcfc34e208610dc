#!/usr/bin/env bash
# The project's test command (README "Quick start"): lint, type-check, then the whole suite.
#
#   bash ci/test.sh          # what CI runs, within 12 minutes on 2 cores: the slow tests are skipped (the real
#                            # frameworks' whole as-found matrices, the reference's 8-rank default tier)
#   bash ci/test.sh --slow   # those too (about 15 more minutes on 2 cores; nightly in ci/github)
#
# One pytest-xdist worker per core (at most 4; MOE_EP_TEST_WORKERS overrides, 0 runs one process), a test file
# each at a time (--dist loadfile: a file's module fixtures and worlds are built once).  In one process a third
# of 2 cores' time goes unused -- a world starting, a subprocess importing, the grace after a rank failed --
# and a second worker fills it: docs/benchmarks.md has the figures.
set -euo pipefail
cd "$(dirname "$0")/.."
slow=()
if [ "${1:-}" = "--slow" ]; then slow=(--run-slow); fi
cores=$(nproc)
workers=${MOE_EP_TEST_WORKERS:-$(( cores < 2 ? 0 : (cores > 4 ? 4 : cores) ))}
ruff check .
mypy  # the files and settings are pyproject.toml's [tool.mypy]
python -m pytest tests -q -p no:cacheprovider --durations=20 -n "$workers" --dist loadfile "${slow[@]}"

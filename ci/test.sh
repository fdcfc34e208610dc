#!/usr/bin/env bash
# The project's test command (README "Quick start"): lint, type-check, then the whole suite.
#
#   bash ci/test.sh          # what CI runs, within 12 minutes on 2 cores: the slow tests are skipped (the real
#                            # frameworks' whole as-found matrices, the reference's 8-rank default tier)
#   bash ci/test.sh --slow   # those too (about 15 more minutes on 2 cores; nightly in ci/github)
set -euo pipefail
cd "$(dirname "$0")/.."
slow=()
if [ "${1:-}" = "--slow" ]; then slow=(--run-slow); fi
ruff check .
mypy  # the files and settings are pyproject.toml's [tool.mypy]
python -m pytest tests -q -p no:cacheprovider --durations=20 "${slow[@]}"

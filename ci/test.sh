#!/usr/bin/env bash
# The project's test command (README "Quick start"): lint, type-check, then the whole suite.
#
#   bash ci/test.sh          # what CI runs: the real frameworks' whole as-found matrices are skipped (slow)
#   bash ci/test.sh --slow   # those too (about 15 more minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
slow=()
if [ "${1:-}" = "--slow" ]; then slow=(--run-slow); fi
ruff check .
mypy  # the files and settings are pyproject.toml's [tool.mypy]
python -m pytest tests -q -p no:cacheprovider --durations=20 "${slow[@]}"

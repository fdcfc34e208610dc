#!/usr/bin/env bash
# The project's test command (README "Quick start"): lint, then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
python -m pytest tests -q -p no:cacheprovider --durations=20

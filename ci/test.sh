#!/usr/bin/env bash
# The project's test command (README "Quick start"): lint, type-check, then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
mypy  # the files and settings are pyproject.toml's [tool.mypy]
python -m pytest tests -q -p no:cacheprovider --durations=20

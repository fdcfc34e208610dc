#!/usr/bin/env bash
# Installs the oldest transformers the `[hf]` extra allows (its floor, read from pyproject.toml) into an
# overlay directory, with the dependencies that release asks for, so that CI runs the HF checks' tests on it:
#
#   bash ci/install_transformers_floor.sh [DIR]     # DIR defaults to .overlay-transformers-floor
#   PYTHONPATH=DIR python -m pytest tests/test_hf.py
#
# Why: a trainer that pins an older transformers than the venv's (NeMo Automodel's 5.18.0) must still be
# able to install pytest-moe-ep[hf]; the floor is a promise only while a test runs on it.  Why an overlay:
# the floor's huggingface-hub (< 2) and tokenizers (<= 0.23.0) differ from the venv's, which the frameworks
# installed there need.  transformers does not require torch, so nothing here replaces the pinned one.
set -euo pipefail

target=${1:-.overlay-transformers-floor}
floor=$(python - <<'PY'
import re
import tomllib

with open("pyproject.toml", "rb") as f:
    extra = tomllib.load(f)["project"]["optional-dependencies"]["hf"]
found = [re.fullmatch(r"transformers>=([0-9.]+)", r.replace(" ", "")) for r in extra]
print(next(m.group(1) for m in found if m))
PY
)
rm -rf "$target"
python -m pip install --target "$target" "transformers==$floor"
if [ -e "$target/torch" ]; then echo "transformers $floor pulled torch into $target" >&2; exit 1; fi
PYTHONPATH="$target" python - "$floor" <<'PY'
import sys

import transformers
from transformers import Ernie4_5_MoeForCausalLM  # noqa: F401  (the reference's export class)

assert transformers.__version__.startswith(sys.argv[1]), (transformers.__version__, sys.argv[1])
print("transformers", transformers.__version__, "(the [hf] floor, overlay)")
PY

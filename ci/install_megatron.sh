#!/usr/bin/env bash
# Installs Megatron-Core 0.16.0 for the `megatron` adapter into the current Python environment.
# CI runs it after installing torch==2.13.0 and the project; it never installs torch: megatron-core
# goes in --no-deps and its runtime needs are pinned here.  0.16.0 is the last release with a
# Python 3.11 wheel (0.17 and later ship cp312 wheels only).
set -euo pipefail

# What the adapter's path needs: megatron-core's declared requirements (numpy, packaging) and psutil,
# which its dist_checkpointing writer processes import without declaring it ("psutil is not
# installed").  The same pins as ci/install_deepspeed.sh, so the frameworks share one set.
python -m pip install \
    "numpy==2.4.6" \
    "packaging==26.4" \
    "psutil==7.2.2"

python -m pip install --no-deps "megatron-core==0.16.0"

python - <<'PY'
import torch
from megatron.core import package_info, parallel_state  # noqa: F401  (the adapter's entry points)
from megatron.core import dist_checkpointing  # noqa: F401

assert torch.__version__.startswith("2.13.0"), f"megatron-core's install replaced torch: {torch.__version__}"
print(f"megatron-core {package_info.__version__} (torch {torch.__version__})")
PY

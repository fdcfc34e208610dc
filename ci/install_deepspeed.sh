#!/usr/bin/env bash
# Installs DeepSpeed 0.19.8 for the `deepspeed` adapter into the current Python environment.
# CI runs it after installing torch==2.13.0 and the project; it never installs torch (DeepSpeed is
# built --no-deps --no-build-isolation against the torch already there, with no ops compiled ahead).
set -euo pipefail

# What `import deepspeed` and its engine need (deepspeed's own requirements, pinned).
python -m pip install \
    "einops==0.8.2" \
    "hjson==3.1.0" \
    "msgpack==1.2.4" \
    "ninja==1.13.2" \
    "numpy==2.4.6" \
    "psutil==7.2.2" \
    "py-cpuinfo==9.0.0" \
    "pydantic==2.14.4" \
    "pydantic-core==2.50.5" \
    "annotated-types==0.8.0" \
    "typing-inspection==0.4.5" \
    "tqdm==4.70.1"

# --no-cache-dir: a wheel pip cached from an earlier build ignores DS_BUILD_OPS.
DS_BUILD_OPS=0 python -m pip install --no-deps --no-build-isolation --no-cache-dir "deepspeed==0.19.8"

# DeepSpeed's CPU accelerator JIT-compiles its shared-memory communication op (C++, via ninja, into
# TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) the first time deepspeed.initialize runs.
# Compile it here, once: inside the matrix's first cell it would take minutes on 2 cores.  It needs
# a C++ compiler; without one DeepSpeed cannot initialise on CPU at all, so fail here, visibly.
# Into this environment's own directory (tests/conftest.py points the tests there): venvs of one
# torch sharing ~/.cache/torch_extensions rebuild each other's op, and a rank killed mid-build
# leaves a lock every later build waits on.
TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$(python -c 'import sys; print(sys.prefix)')/torch_extensions}
export TORCH_EXTENSIONS_DIR
DS_ACCELERATOR=cpu python - <<'EOF'
import deepspeed
from deepspeed.comm.torch import build_shm_op

print(f"deepspeed {deepspeed.__version__}: shared-memory comm op {'ready' if build_shm_op() else 'not needed'}")
EOF

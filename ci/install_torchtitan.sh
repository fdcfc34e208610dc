#!/usr/bin/env bash
# Installs torchtitan 0.3.0 and what its MoE, parallelize, optimizer and checkpoint modules import
# into the current Python environment, for the `torchtitan` / `torchtitan-local` adapters
# (conformance/adapters/torchtitan.py).  Run after torch==2.13.0 and the project are installed;
# never installs torch: torchtitan and torch_checkpointing (which require torch) go in with
# --no-deps, and torchtitan's data/logging extras (datasets, tokenizers, torchdata, tensorboard,
# wandb, pillow) are left out -- the adapters import none of them.
set -euo pipefail

python -m pip install --no-deps torchtitan==0.3.0 torch_checkpointing==0.1.1
# triton: torchtitan's token dispatcher imports it at import time (no GPU needed); it has no deps.
python -m pip install --no-deps triton==3.9.0
python -m pip install spmd_types==0.2.3 tyro==1.0.17 einops==0.8.2 safetensors==0.8.0 numpy
python - <<'PY'
import importlib.metadata as md

import torchtitan.components.checkpoint  # noqa: F401
import torchtitan.components.optimizer  # noqa: F401
import torchtitan.models.qwen3  # noqa: F401

print("torchtitan", md.version("torchtitan"), "with torch", md.version("torch"))
PY

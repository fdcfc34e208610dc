#!/usr/bin/env bash
# Installs NeMo Automodel 0.7.0 and what its MoE, parallelizer, checkpoint and Qwen3-MoE state-dict
# adapter modules import into the current Python environment, for the `nemo_automodel` adapter
# (conformance/adapters/nemo_automodel.py) and the `--moe-ep-functions=nemo_automodel` suite.  Run
# after torch==2.13.0 and the project are installed; never installs torch: nemo-automodel and
# transformers (which require torch, and nemo-automodel a CUDA stack: TE, DeepEP, torchao, ...) go in
# with --no-deps, then transformers 5.18.0's own requirements (the version nemo-automodel 0.7.0 pins),
# none of which pulls torch.
set -euo pipefail

python -m pip install --no-deps nemo-automodel==0.7.0 transformers==5.18.0
python -m pip install huggingface-hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 regex==2026.11.19 \
    typer==0.29.2 pyyaml==6.0.4 tqdm==4.70.1 numpy==2.4.6 packaging
python - <<'PY'
import importlib.metadata as md

import nemo_automodel.components.checkpoint.checkpointing  # noqa: F401
import nemo_automodel.components.models.qwen3_moe.state_dict_adapter  # noqa: F401
import nemo_automodel.components.moe.layers  # noqa: F401
import nemo_automodel.components.moe.parallelizer  # noqa: F401
import nemo_automodel.components.moe.state_dict_utils  # noqa: F401

print("nemo_automodel", md.version("nemo-automodel"), "transformers", md.version("transformers"),
      "with torch", md.version("torch"))
PY

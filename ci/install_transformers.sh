#!/usr/bin/env bash
# Installs Hugging Face transformers 5.24.0 and accelerate 1.15.0 for the `transformers` adapter
# (conformance/adapters/transformers_ep.py) into an overlay directory, not into the environment itself:
#
#   bash ci/install_transformers.sh [DIR]     # DIR defaults to .overlay-transformers
#   PYTHONPATH=DIR python -m pytest tests/test_adapter_transformers.py
#
# Why an overlay: NeMo Automodel 0.7.0 pins transformers==5.18.0 (ci/install_nemo_automodel.sh), which is
# what its users get, and 5.18.0 has no DistributedConfig(ep_size=...) expert parallelism; users of
# transformers' own EP get 5.24.0.  The overlay puts 5.24.0 first on PYTHONPATH for the transformers run
# only, over the same torch 2.13.0 and the same shared dependencies, so each framework is tested at the
# version its users get.  Never installs torch: both packages go in with --no-deps; their other
# requirements (huggingface-hub, tokenizers, safetensors, regex, typer, pyyaml, tqdm, numpy, packaging,
# psutil) are installed into the environment, pinned to the versions ci/install_nemo_automodel.sh
# installs, none of which pulls torch.
set -euo pipefail

target=${1:-.overlay-transformers}
rm -rf "$target"
python -m pip install --no-deps --target "$target" transformers==5.24.0 accelerate==1.15.0
python -m pip install huggingface-hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 regex==2026.11.19 \
    typer==0.29.2 pyyaml==6.0.4 tqdm==4.70.1 numpy==2.4.6 psutil==7.2.2 packaging
PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" python - <<'PY'
import dataclasses
import importlib.metadata as md

import transformers
from transformers.distributed import DistributedConfig, load_optimizer_distributed, save_optimizer_distributed  # noqa: F401
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401

assert transformers.__version__ == "5.24.0", transformers.__version__
assert "ep_size" in {f.name for f in dataclasses.fields(DistributedConfig)}
print("transformers", transformers.__version__, "accelerate", md.version("accelerate"), "with torch",
      md.version("torch"), "(overlay)")
PY

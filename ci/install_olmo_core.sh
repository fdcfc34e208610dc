#!/usr/bin/env bash
# Installs OLMo-core 3.0.0 and what its MoE, parallel, optimizer and checkpoint modules import into the current
# Python environment, for the `olmo_core` / `olmo_core-dropless` adapters (conformance/adapters/olmo_core.py).
# Run after torch==2.13.0 and the project are installed; never installs torch.  ai2-olmo-core (which requires
# torch) and cached-path go in with --no-deps: cached-path pins rich<14 and filelock<4, older than what this
# environment has, and its import needs only its cloud-scheme clients below (boto3, google-cloud-storage,
# requests), never called here.  bettermap and dataclass-extensions are imported by olmo_core.config/io.
set -euo pipefail

python -m pip install --no-deps ai2-olmo-core==3.0.0 cached-path==1.8.10 bettermap==1.3.1 \
    dataclass-extensions==0.5.0
python -m pip install boto3==1.44.8 google-cloud-storage==3.17.1 requests==2.34.2 dill==0.4.1
python - <<'PY'
import importlib.metadata as md

import olmo_core.distributed.checkpoint  # noqa: F401
import olmo_core.distributed.parallel  # noqa: F401
import olmo_core.nn.moe  # noqa: F401
import olmo_core.optim  # noqa: F401

assert md.version("torch").startswith("2.13.0"), f"an install replaced torch: {md.version('torch')}"
print("olmo_core", md.version("ai2-olmo-core"), "with torch", md.version("torch"))
PY

#!/usr/bin/env bash
# The conformance release artifact: the matrix for every built-in adapter whose framework is installed, one report
# directory each (OUT/<adapter>/moe-ep-conformance.{json,md}) plus OUT/index.md.
#
#   bash ci/conformance.sh [OUT] [--readme README.md]   # --readme also rewrites README's "Framework status" table
#
# Release reports run the full tier (every cell); MOE_EP_TIER=default runs the covering tier instead.
# A red matrix is the point of the exercise, not a script failure: this exits non-zero only when a run errors out
# (usage error, crash), never because cells fail.
set -uo pipefail
out=${1:-conformance-reports}
shift || true
mkdir -p "$out"
status=0
tier=${MOE_EP_TIER:-full}

run() {  # run NAME [pytest args...]
    local name=$1; shift
    echo "== $name"
    python -m pytest -p no:cacheprovider -q --moe-ep-report="$out/$name" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n 3 "$out/$name.log"
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 1 ]; then status=1; echo "   (pytest exited $rc: see $out/$name.log)"; fi
}

installed() { python -c "import $1" > /dev/null 2>&1; }

run reference --moe-ep-matrix="$tier" --moe-ep-adapter=reference
run legacy --moe-ep-matrix="$tier" --moe-ep-adapter=legacy
if installed nemo_automodel; then
    run nemo_automodel --moe-ep-matrix="$tier" --moe-ep-adapter=nemo_automodel
    run nemo_automodel-functions --moe-ep-functions=nemo_automodel
fi
if installed torchtitan; then
    run torchtitan --moe-ep-matrix="$tier" --moe-ep-adapter=torchtitan
    run torchtitan-local --moe-ep-matrix="$tier" --moe-ep-adapter=torchtitan-local
fi
if installed deepspeed; then
    run deepspeed --moe-ep-matrix="$tier" --moe-ep-adapter=deepspeed
    run deepspeed-autoep --moe-ep-matrix="$tier" --moe-ep-adapter=deepspeed-autoep
    run deepspeed-autoep-zero2 --moe-ep-matrix="$tier" --moe-ep-adapter=deepspeed-autoep-zero2
    run deepspeed-autoep-noconvert --moe-ep-matrix="$tier" --moe-ep-adapter=deepspeed-autoep-noconvert
fi
# transformers' native EP (DistributedConfig(ep_size=...), 5.24.0): from ci/install_transformers.sh's overlay when
# there is one (the environment's transformers is NeMo Automodel's 5.18.0), else the environment's if it has it.
hf_overlay=${MOE_EP_TRANSFORMERS_OVERLAY:-.overlay-transformers}
hf_ep() { PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}" python -c "import dataclasses, transformers.distributed as d
assert 'ep_size' in {f.name for f in dataclasses.fields(d.DistributedConfig)}" > /dev/null 2>&1; }
if [ -d "$hf_overlay" ] && hf_ep "$hf_overlay"; then
    PYTHONPATH="$hf_overlay${PYTHONPATH:+:$PYTHONPATH}" run transformers --moe-ep-matrix="$tier" --moe-ep-adapter=transformers
elif hf_ep ""; then
    run transformers --moe-ep-matrix="$tier" --moe-ep-adapter=transformers
fi
if installed megatron.core; then
    run megatron --moe-ep-matrix="$tier" --moe-ep-adapter=megatron
fi
if installed olmo_core; then
    run olmo_core --moe-ep-matrix="$tier" --moe-ep-adapter=olmo_core
    run olmo_core-dropless --moe-ep-matrix="$tier" --moe-ep-adapter=olmo_core-dropless
fi
python -m conformance.report index "$out" "$@" || status=1
exit $status

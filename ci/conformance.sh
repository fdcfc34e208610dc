#!/usr/bin/env bash
# The conformance release artifact: the matrix for every built-in adapter whose framework is installed, one report
# directory each (OUT/<adapter>/moe-ep-conformance.{json,md,html} and a picture per grid) plus OUT/index.md and
# its picture, OUT/frameworks-status.svg (frameworks by findings: a stacked bar each).
#
#   bash ci/conformance.sh [OUT] [--docs docs/frameworks.md]   # --docs also rewrites that page's status table
#                                                              # and the picture beside it
#
# Release reports run the full tier (every cell); MOE_EP_TIER=default runs the covering tier instead.
# Each adapter's run is held against its expectations file, ci/expectations/<adapter>.toml, when there is one, so
# the release report says which red cells were expected and why; MOE_EP_UPDATE_EXPECTATIONS=1 rewrites those files
# from the runs instead (the baseline the framework tests hold their slices against).
# A red matrix is the point of the exercise, not a script failure: this exits non-zero only when a run errors out
# (usage error, crash), never because cells fail.
set -uo pipefail
out=${1:-conformance-reports}
shift || true
mkdir -p "$out"
status=0
tier=${MOE_EP_TIER:-full}

expectations_dir=${MOE_EP_EXPECTATIONS_DIR:-ci/expectations}

run() {  # run NAME [pytest args...]
    local name=$1; shift
    local baseline="$expectations_dir/$name.toml" held=()
    if [ "${MOE_EP_UPDATE_EXPECTATIONS:-}" = 1 ]; then
        held=(--moe-ep-expectations="$baseline" --moe-ep-update-expectations)
    elif [ -f "$baseline" ]; then
        held=(--moe-ep-expectations="$baseline")
    fi
    echo "== $name"
    python -m pytest -p no:cacheprovider -q --moe-ep-report="$out/$name" "${held[@]}" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n 3 "$out/$name.log"
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 1 ]; then status=1; echo "   (pytest exited $rc: see $out/$name.log)"; fi
}

# Every built-in whose framework is installed, from the one registry (conformance/adapters/__init__.py).
# transformers' native EP (5.24.0) comes from ci/install_transformers.sh's overlay when there is one (the
# environment's transformers is NeMo Automodel's 5.18.0).
hf_overlay=${MOE_EP_TRANSFORMERS_OVERLAY:-.overlay-transformers}
if [ -d "$hf_overlay" ]; then export PYTHONPATH="$PWD/$hf_overlay${PYTHONPATH:+:$PYTHONPATH}"; fi
while read -r name kind; do
    if [ "$kind" = checkpoint ]; then
        run "$name" --moe-ep-matrix="$tier" --moe-ep-adapter="$name"
    else
        run "$name-functions" --moe-ep-functions="$name"
    fi
done < <(python -m conformance.adapters)
python -m conformance.report index "$out" "$@" || status=1
exit $status

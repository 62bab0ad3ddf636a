#!/usr/bin/env bash
# megarl's GPU path on one GPU, with figures: rollout tokens/s, weight-sync seconds, step time, peak GPU memory,
# and which parts were skipped and why (see tools/gpu_check.py for the parts).
#
#   tools/gpu_check.sh [--cpu-smoke] [--parts tiny,0.5b,te,sglang,dynamic] [--out DIR] [--budget-seconds S]
#
# Needs torch (CUDA), megatron-core and the small packages megatron-core imports at run time (einops; numpy,
# packaging). A bare GPU machine without network: put the wheels in $WHEELS (default shared/wheels, e.g.
# megatron_core-0.16.1-cp312-*.whl, einops, numpy, packaging); those whose package does not import are installed
# without index or dependencies into a temporary directory first. Transformer Engine, SGLang and Megatron's dynamic
# inference engine (needs flash-attn) are used when they can run, and reported as skipped (with the reason) when not.
# Finishes in under 8 minutes: parts that would not fit the budget are skipped, and a hard timeout stops the rest.
# `--cpu-smoke` runs the same code on CPU with small shapes (about two minutes on 2 cores) to check the script.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-}
if [[ -z $PY ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=$(command -v python3); fi
fi
WHEELS=${WHEELS:-shared/wheels}
# Install each carried wheel whose package does not import yet (never shadow what the machine has).
missing=()
for whl in "$WHEELS"/*.whl; do
  [[ -e $whl ]] || continue
  name=$(basename "$whl"); name=${name%%-*}
  module=${name/megatron_core/megatron.core}
  "$PY" -c "import $module" >/dev/null 2>&1 || missing+=("$whl")
done
if (( ${#missing[@]} )); then
  DEPS=$(mktemp -d "${TMPDIR:-/tmp}/megarl_gpu_check_deps.XXXXXX")
  echo "== installing carried wheels into $DEPS: ${missing[*]##*/}"
  "$PY" -m pip install --quiet --no-index --no-deps --target "$DEPS" "${missing[@]}"
  export PYTHONPATH=$DEPS${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore} OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# megarl from this checkout, installed or not (a bare GPU machine has only the carried wheels)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec timeout --kill-after=15 "${GPU_CHECK_TIMEOUT:-465}" "$PY" tools/gpu_check.py "$@"

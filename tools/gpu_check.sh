#!/usr/bin/env bash
# megarl's GPU path, with figures: rollout tokens/s, weight-sync seconds, step time, peak GPU memory, and a verdict
# line per stage (`PASS stage NAME: ...`, `FAIL stage NAME: reason`, `SKIP stage NAME: reason`), collected at the end.
#
#   tools/gpu_check.sh [--cpu-smoke] [--parts tiny,0.5b,te,sglang,dynamic,sglang-lora] [--out DIR]
#
# `--parts sglang-lora` times --lora-weight-sync merged against adapter on SGLang (not a default part: give it
# GPU_CHECK_SINGLE_SECONDS=420 and GPU_CHECK_TP2_STAGES=none, two cold SGLang starts need that much).
#
# Two steps under one time budget, GPU_CHECK_TIMEOUT seconds in all (default 540: a lent device gives 15 minutes,
# its start included, and one cold SGLang start takes one to two of them; stages that would not fit are skipped
# with the reason):
#   1. tools/gpu_check.py, one process at TP 1 (GPU_CHECK_SINGLE_SECONDS, default 280, for its parts);
#   2. tools/gpu_check_tp2.py with what is left: TP 2 under torchrun with the built-in engine and with SGLang
#      colocated, and a disaggregated pair (an SGLang server and a trainer, weights over NCCL). These need two
#      GPUs (NCCL refuses two ranks on one GPU) and, for SGLang, `sglang` importable; otherwise they are skipped
#      with the reason. GPU_CHECK_TP2_STAGES picks a subset (comma-separated), or none.
#
# Needs torch (CUDA), megatron-core and the small packages megatron-core imports at run time (einops; numpy,
# packaging). A bare GPU machine without network: put the wheels in $WHEELS (default shared/wheels, e.g.
# megatron_core-0.16.1-cp312-*.whl, einops, numpy, packaging); those whose package does not import are installed
# without index or dependencies into a temporary directory first. Transformer Engine, SGLang and Megatron's dynamic
# inference engine (needs flash-attn) are used when they can run, and reported as skipped (with the reason) when not.
# `--cpu-smoke` runs the same code on CPU with small shapes (a few minutes on 2 cores) to check the script.
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

TOTAL=${GPU_CHECK_TIMEOUT:-540}
SINGLE=${GPU_CHECK_SINGLE_SECONDS:-280}
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/megarl_gpu_check_logs.XXXXXX")
start=$SECONDS
smoke=()
for arg in "$@"; do [[ $arg == --cpu-smoke ]] && smoke=(--cpu-smoke); done

# 1. One process, TP 1. Its own budget skips parts that would not fit; the hard timeout stops a hung one.
set +e
timeout --kill-after=15 $((SINGLE + 45)) "$PY" tools/gpu_check.py --budget-seconds "$SINGLE" "$@" 2>&1 \
  | tee "$LOGS/single.log"
rc=${PIPESTATUS[0]}
set -e
if (( rc == 124 || rc == 137 )); then
  echo "FAIL stage single-process: timed out after $((SINGLE + 45)) s (GPU_CHECK_SINGLE_SECONDS + 45)" \
    | tee -a "$LOGS/single.log"
elif (( rc == 2 )); then
  exit 2  # refused to start (no GPU, missing packages): it said why
fi

# 2. Across processes, with what is left of the budget (GPU_CHECK_TP2_STAGES=none: not at all).
left=$(( TOTAL - (SECONDS - start) - 15 ))
: > "$LOGS/tp2.log"
if [[ ${GPU_CHECK_TP2_STAGES:-} != none ]]; then
  set +e
  timeout --kill-after=15 $(( left > 1 ? left + 10 : 11 )) "$PY" tools/gpu_check_tp2.py --budget-seconds "$left" \
    --stages "${GPU_CHECK_TP2_STAGES:-tp2-builtin,tp2-sglang,disaggregated}" --python "$PY" \
    ${smoke[@]+"${smoke[@]}"} 2>&1 | tee "$LOGS/tp2.log"
  rc=${PIPESTATUS[0]}
  set -e
  if (( rc == 124 || rc == 137 )); then
    echo "FAIL stage tp2: timed out after the budget ($TOTAL s in all, GPU_CHECK_TIMEOUT)" | tee -a "$LOGS/tp2.log"
  fi
fi

echo
echo "== verdicts ($(( SECONDS - start )) s of $TOTAL)"
if ! grep -h -E '^(PASS|FAIL|SKIP) stage ' "$LOGS/single.log" "$LOGS/tp2.log"; then
  echo "FAIL stage all: no stage printed a verdict (logs: $LOGS)"
  exit 1
fi
if grep -q -h -E '^FAIL stage ' "$LOGS/single.log" "$LOGS/tp2.log"; then exit 1; fi

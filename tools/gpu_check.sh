#!/usr/bin/env bash
# `make gpu-check`: megarl's GPU path on one lent GPU, within 10 minutes, on a machine without network that has
# Python 3.12 and a CUDA torch and nothing else. Each part prints PASS / FAIL / SKIP with its reason and its time,
# has its own timeout (one hang cannot eat the budget), and the last line is one a reader can paste:
#   gpu-check: setup PASS 31s, a PASS 41s, starter PASS 52s, b PASS 38s, c PASS 77s, d SKIP 0s (sglang ...)
#
#   setup    a venv in .cache/gpu-check/venv with --system-site-packages (the machine's CUDA torch is kept), and
#            pip install --no-index --find-links .cache/gpu-wheels -r tools/gpu_wheels.txt (no network needed)
#   d        where SGLang is importable, and first (before anything else has touched the GPU): its colocated cycle,
#            release and resume memory, weight update over CUDA IPC, verified generate (tools/gpu_check.py --parts
#            sglang); skipped with the reason otherwise (a lent machine without network has no SGLang)
#   a        the actor on CUDA in bf16 against transformers: dense Qwen2 and Qwen3-MoE at EP 1, before and after an
#            update (tools/gpu_check_actor.py)
#   starter  the CPU demo's starter model, built there by tools/make_starter_model.py with STARTER_STEPS (600), or
#            .cache/starter when carried (the demo's own, 1,760 steps, ~8 MiB: `make .cache/starter/config.json`;
#            GPU_CHECK_CARRY=".cache/gpu-wheels .cache/starter" make gpu-check-dry sizes that carry)
#   b        train.py with the built-in engine on CUDA, 3 steps, --verify-weight-sync (tools/gpu_check_train.py sync)
#   c        30 GRPO steps of recipes/tiny_cpu.sh on the GPU, on 32 of its training problems, all of them every step,
#            the rate held (GPU_CHECK_LEARN_FLAGS); the engine's reward must rise, last 5 steps over the first 5
#            (tools/gpu_check_train.py learn)
#
#   tools/gpu_check.sh [--parts a,b,c,d] [--dry-run]
#   make gpu-wheels       # HERE, once, with the package index: fetches .cache/gpu-wheels (~49 MiB)
#   make gpu-check-dry    # what would be carried, with sizes; fails over 64 MiB or without the wheels
#
# On a machine without a CUDA GPU it prints the plan and skips every part with the reason (exit 0). Exit 1 when a
# part failed. GPU_CHECK_BUDGET (540 s) bounds the whole; a part that would not fit in what is left is skipped.
# Logs: .cache/gpu-check/logs/<part>.log, copied with each run's metrics to $OUT/gpu-check when $OUT is a folder
# (the device tool's). PYTHON picks the interpreter (default: the first of python3.12, python3,
# .venv/bin/python whose torch sees a GPU).
#
# The lead's `device` tool call (nothing to install first; the wheels are carried):
#   run(command="bash tools/gpu_check.sh", carry=[".cache/gpu-wheels"], timeout_s=600)
# (`make gpu-wheels` and `make gpu-check-dry` first, here: the tree and the wheels must fit in 64 MiB) and, to rerun
# some parts on the still-warm machine (the venv and the starter are kept in .cache/gpu-check there):
#   run(command="bash tools/gpu_check.sh --parts b,c", carry=[".cache/gpu-wheels"], timeout_s=400)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PARTS=a,b,c,d
DRY=0
while (( $# )); do
  case $1 in
    --dry-run) DRY=1 ;;
    --parts) PARTS=${2:?--parts needs a list, e.g. a,c}; shift ;;
    --parts=*) PARTS=${1#--parts=} ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (allowed: --parts a,b,c,d, --dry-run, --help)" >&2; exit 2 ;;
  esac
  shift
done
for p in ${PARTS//,/ }; do
  [[ $p =~ ^[abcd]$ ]] || { echo "gpu_check.sh: --parts $PARTS: unknown part $p (allowed: a, b, c, d)" >&2; exit 2; }
done
wants() { [[ ,$PARTS, == *,$1,* ]]; }

WHEELS=${GPU_CHECK_WHEELS:-.cache/gpu-wheels}
WORK=${GPU_CHECK_DIR:-.cache/gpu-check}
BUDGET=${GPU_CHECK_BUDGET:-540}
# 600 pre-training steps: a minute or so of the GPU machine's CPUs (the demo's 1,760 take three on 2 idle cores),
# and the starter part (c) was measured on (held-out greedy 29 %, sampled 17 %).
STARTER_STEPS=${STARTER_STEPS:-600}
LEARN_STEPS=${GPU_CHECK_LEARN_STEPS:-30}
# (c)'s flags over the recipe, besides its pool of 32 problems (tools/gpu_check_train.py says why): the recipe's
# peak rate held constant (its decay runs over 5,400 steps).
LEARN_FLAGS=${GPU_CHECK_LEARN_FLAGS:---lr-decay-style constant}
# Each part's own timeout, seconds (a part gets the smaller of this and what is left of the budget).
declare -A CAP=([setup]=150 [d]=240 [a]=150 [starter]=180 [b]=150 [c]=240)
declare -A TITLE=(
  [setup]="venv (--system-site-packages) + the carried wheels, no network"
  [d]="SGLang colocated cycle: release/resume memory, weight update, verified generate (where importable)"
  [a]="actor on CUDA, bf16, against transformers: Qwen2 and Qwen3-MoE at EP 1"
  [starter]="starter model for b and c (carried .cache/starter, or tools/make_starter_model.py --steps $STARTER_STEPS)"
  [b]="train.py, built-in engine on CUDA, 3 steps, --verify-weight-sync"
  [c]="train.py, $LEARN_STEPS GRPO steps of recipes/tiny_cpu.sh on 32 problems ($LEARN_FLAGS), reward rising")
ORDER=(setup d a starter b c)

echo "== gpu-check plan (budget $BUDGET s, GPU_CHECK_BUDGET; parts: $PARTS)"
for part in "${ORDER[@]}"; do printf '   %-8s %4ss  %s\n' "$part" "${CAP[$part]}" "${TITLE[$part]}"; done

if (( DRY )); then
  echo "== dry run: what the device tool carries (working tree + the ignored folders it is told to carry)"
  # GPU_CHECK_CARRY: the device call's carry list, if it carries more than the wheels (e.g. .cache/starter)
  exec "${PYTHON:-python3}" tools/gpu_carry.py size --carry ${GPU_CHECK_CARRY:-$WHEELS}
fi

declare -A WORD SECS WHY
LOGS=$WORK/logs
mkdir -p "$LOGS"
start=$SECONDS

verdict() {  # part word seconds reason
  WORD[$1]=$2 SECS[$1]=$3 WHY[$1]=$4
  echo "${2} ${1} (${3}s): ${4}"
}

summary() {
  local line="gpu-check:" part sep=""
  for part in setup a starter b c d; do
    [[ -n ${WORD[$part]:-} ]] || continue
    line+="$sep $part ${WORD[$part]} ${SECS[$part]}s"
    [[ ${WORD[$part]} == PASS ]] || line+=" (${WHY[$part]:0:90})"
    sep=","
  done
  echo
  echo "== summary ($(( SECONDS - start )) s of $BUDGET)"
  for part in setup d a starter b c; do
    [[ -n ${WORD[$part]:-} ]] && printf '   %-8s %s %ss: %s\n' "$part" "${WORD[$part]}" "${SECS[$part]}" "${WHY[$part]}"
  done
  echo "$line"
}

# run_part PART CMD...: the command under the part's timeout, its output to the log and the screen; the verdict is
# its last `PASS: ...` / `FAIL: ...` / `SKIP: ...` line (or `PASS stage NAME: ...` from tools/gpu_check.py).
run_part() {
  local part=$1; shift
  local left=$(( BUDGET - (SECONDS - start) )) limit=${CAP[$part]}
  (( left < limit )) && limit=$left
  echo
  echo "== $part: ${TITLE[$part]} (timeout ${limit}s)"
  if (( limit < 20 )); then
    verdict "$part" SKIP 0 "only ${left}s left of the ${BUDGET}s budget"
    return
  fi
  local t=$SECONDS rc line
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOGS/$part.log"
  rc=${PIPESTATUS[0]}
  line=$(grep -E '^(PASS|FAIL|SKIP)( stage [A-Za-z0-9._-]+)?: ' "$LOGS/$part.log" | tail -1)
  local word=${line%%[ :]*} why=${line#*: }
  if (( rc == 124 || rc == 137 )); then
    verdict "$part" FAIL $(( SECONDS - t )) "timed out after ${limit}s (log: $LOGS/$part.log)"
  elif [[ -z $line ]]; then
    verdict "$part" FAIL $(( SECONDS - t )) "exited $rc without a verdict (log: $LOGS/$part.log)"
  elif (( rc != 0 )) && [[ $word == PASS ]]; then
    verdict "$part" FAIL $(( SECONDS - t )) "exited $rc after: $why"
  else
    verdict "$part" "$word" $(( SECONDS - t )) "$why"
  fi
}

skip_all() {  # reason: every asked part skipped (and not asked ones too, so the summary is complete)
  local part
  for part in setup d a starter b c; do verdict "$part" SKIP 0 "$1"; done
}

# -- the interpreter with a CUDA torch ---------------------------------------------------------------------------
PY="" seen=""
for cand in ${PYTHON:-python3.12 python3 .venv/bin/python}; do
  command -v "$cand" >/dev/null 2>&1 || [[ -x $cand ]] || continue
  out=$(timeout 120 "$cand" -c 'import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.device_count())' 2>/dev/null) || continue
  read -r version cuda count <<<"$out"
  if [[ $cuda == True ]]; then PY=$cand; break; fi
  seen+="${seen:+; }$cand: torch $version sees no CUDA GPU"
done
if [[ -z $PY ]]; then
  echo
  echo "== no CUDA GPU here (${seen:-no Python here imports torch}): every part is skipped"
  skip_all "no CUDA GPU"
  summary
  exit 0
fi
"$PY" -c 'import sys, torch; print(f"== {sys.executable} {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")'

# -- setup: the venv and the carried wheels -----------------------------------------------------------------------
VENV=$WORK/venv
VPY=$VENV/bin/python
setup() {
  set -e
  [[ -d $WHEELS ]] && compgen -G "$WHEELS/*.whl" >/dev/null || {
    echo "FAIL: no wheels in $WHEELS: run \`make gpu-wheels\` where there is a package index, and carry $WHEELS"
    exit 1; }
  if [[ ! -x $VPY ]]; then
    if ! "$PY" -m venv --system-site-packages "$VENV"; then  # no ensurepip: a venv without pip, the host's pip
      rm -rf "$VENV"
      "$PY" -m venv --without-pip --system-site-packages "$VENV"
    fi
  fi
  if ! "$VPY" -c 'import torch' 2>/dev/null; then  # torch in a user site, which a venv does not see: point at it
    "$PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' \
      > "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_host_torch.pth"
  fi
  local pip=("$VPY" -m pip)
  "$VPY" -m pip --version >/dev/null 2>&1 || pip=("$PY" -m pip --python "$VPY")
  local out
  if ! out=$(PIP_CONSTRAINT="" PIP_CONFIG_FILE=/dev/null "${pip[@]}" install --quiet --disable-pip-version-check \
      --no-index --find-links "$WHEELS" -r tools/gpu_wheels.txt 2>&1); then
    echo "$out" | tail -20
    echo "FAIL: pip install --no-index from $WHEELS into Python $("$VPY" -c 'import sys; print(sys.version.split()[0])'):" \
      "$(echo "$out" | grep -E '^ERROR' | tail -1) (the wheels are for CPython 3.12)"
    exit 1
  fi
  "$VPY" -c 'import torch, megatron.core, transformers, einops; assert torch.cuda.is_available(); print(f"PASS: torch {torch.__version__} kept, megatron-core {megatron.core.__version__}, transformers {transformers.__version__}")'
}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export WHEELS VENV VPY PY
export -f setup
run_part setup bash -c setup
if [[ ${WORD[setup]} != PASS ]]; then
  for part in d a starter b c; do verdict "$part" SKIP 0 "setup failed"; done
  summary
  exit 1
fi

# -- the parts ----------------------------------------------------------------------------------------------------
if wants d; then
  if why=$(timeout 120 "$VPY" -c 'import sglang' 2>&1); then
    run_part d "$VPY" tools/gpu_check.py --parts sglang --budget-seconds $(( CAP[d] - 30 )) --out "$WORK/d"
  else
    verdict d SKIP 0 "sglang is not importable ($(echo "$why" | tail -1 | cut -c1-100))"
  fi
fi
if wants a; then run_part a "$VPY" tools/gpu_check_actor.py --device cuda; fi
STARTER=${GPU_CHECK_STARTER:-}
[[ -z $STARTER && -f .cache/starter/config.json ]] && STARTER=.cache/starter  # the demo's, carried
STARTER=${STARTER:-$WORK/starter}
if wants b || wants c; then
  if [[ -f $STARTER/config.json ]]; then
    verdict starter PASS 0 "carried or kept from an earlier run: $STARTER"
  else
    run_part starter env OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} bash -c \
      "'$VPY' tools/make_starter_model.py --out '$STARTER' --steps $STARTER_STEPS && echo 'PASS: $STARTER'"
  fi
fi
for part in b c; do
  wants $part || continue
  if [[ ${WORD[starter]} != PASS ]]; then verdict $part SKIP 0 "no starter model"; continue; fi
  mode=sync extra=()
  [[ $part == c ]] && mode=learn extra=(--steps "$LEARN_STEPS" -- $LEARN_FLAGS)
  run_part $part "$VPY" tools/gpu_check_train.py $mode --starter "$STARTER" --out "$WORK/runs" \
    --timeout $(( CAP[$part] - 15 )) "${extra[@]}"
done

summary | tee "$LOGS/summary.txt"
if [[ -n ${OUT:-} && -d $OUT ]]; then  # the device tool brings $OUT back: the logs and each run's metrics
  mkdir -p "$OUT/gpu-check"
  cp -r "$LOGS" "$OUT/gpu-check/" 2>/dev/null
  for f in "$WORK"/runs/*/{metrics.jsonl,eval.json} "$WORK"/d/results.json; do
    [[ -f $f ]] && cp "$f" "$OUT/gpu-check/$(basename "$(dirname "$f")")-$(basename "$f")"
  done
fi
for part in "${!WORD[@]}"; do [[ ${WORD[$part]} == FAIL ]] && exit 1; done
exit 0

# Shared by colocated.sbatch and disaggregated.sbatch; sourced, never run on its own.
#
# Dry run (MEGARL_DRY_RUN=1): every command that would run is printed, shell-quoted, instead; nothing is started,
# and no Slurm command is needed. Outside an allocation the hosts are MEGARL_HOSTS ("a b ...") or
# node001..nodeN with N = MEGARL_NODES (default 2).

megarl_init() {
  DRY_RUN=${MEGARL_DRY_RUN:-0}
  JOB_ID=${SLURM_JOB_ID:-dryrun}
  JOB_NAME=${SLURM_JOB_NAME:-megarl}
  RESTART=${SLURM_RESTART_COUNT:-0}
  GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
  MASTER_PORT=${MASTER_PORT:-29500}
  LOG_DIR=${LOG_DIR:-$MEGARL_ROOT/logs/$JOB_NAME}
  MAX_FAILURES=${MAX_FAILURES:-3}
  PYTHON=${MEGARL_PYTHON:-python3}
  mapfile -t HOSTS < <(megarl_hostnames)
  NODES=${#HOSTS[@]}
  if [[ -n ${MEGARL_SETUP:-} ]]; then  # site setup: module loads, a venv's activate script, NCCL variables
    # shellcheck disable=SC1090
    source "$MEGARL_SETUP"
  fi
  [[ $DRY_RUN == 1 ]] || mkdir -p "$LOG_DIR"
  echo "megarl: job $JOB_ID ($JOB_NAME) restart $RESTART on $NODES node(s) x $GPUS_PER_NODE GPU(s): ${HOSTS[*]}"
}

megarl_hostnames() {
  if [[ -n ${MEGARL_HOSTS:-} ]]; then
    tr ' ,' '\n\n' <<<"$MEGARL_HOSTS" | sed '/^$/d'
  elif [[ -n ${SLURM_JOB_NODELIST:-} ]] && command -v scontrol >/dev/null; then
    scontrol show hostnames "$SLURM_JOB_NODELIST"
  else
    seq -f 'node%03g' 1 "${MEGARL_NODES:-${SLURM_JOB_NUM_NODES:-2}}"
  fi
}

megarl_show() {  # one command on one line, each word shell-quoted where it needs to be
  local w out=()
  for w in "$@"; do
    if [[ $w =~ ^[][A-Za-z0-9_@%+=:,./-]+$ ]]; then
      out+=("$w")
    elif [[ $w != *"'"* ]]; then
      out+=("'$w'")
    else
      out+=("$(printf '%q' "$w")")
    fi
  done
  echo "${out[*]}"
}

# The recipe's parallel sizes against the world size, before any GPU work. Sets HF_CHECKPOINT, TP, PP, DP,
# SAVE_DIR (and CP). Needs a python3 with nothing but the standard library (megarl/config.py is pure Python);
# megarl comes from the checkout, installed there or not.
megarl_check() {
  local world=$1 out
  shift
  out=$(PYTHONPATH="$MEGARL_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" "$MEGARL_ROOT/launch/render.py" check \
          --world-size "$world" -- "$@") || {
    echo "megarl: the launch does not fit the recipe (above); nothing was started" >&2
    exit 2
  }
  eval "$out"
  local cp=""
  if (( ${CP:-1} > 1 )); then cp=" x CP=$CP"; fi
  echo "megarl: TP=$TP x PP=$PP$cp x DP=$DP = $world GPUs; checkpoints in ${SAVE_DIR:-<none>}"
}

# srun flags for one step: a name for its logs, tasks per node, the hosts; the container when CONTAINER_IMAGE is set.
megarl_srun_args() {
  local name=$1 per_node=$2
  shift 2
  local hosts=("$@")
  local IFS=,
  SRUN_ARGS=(srun --nodes="${#hosts[@]}" --ntasks-per-node="$per_node" --nodelist="${hosts[*]}" --kill-on-bad-exit=1
             --output="$LOG_DIR/$JOB_ID-r$RESTART-$name-%t.log")
  if [[ -n ${CONTAINER_IMAGE:-} ]]; then
    SRUN_ARGS+=(--container-image="$CONTAINER_IMAGE" --container-workdir="$MEGARL_ROOT"
                --container-mounts="$MEGARL_ROOT:$MEGARL_ROOT${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}")
  else
    SRUN_ARGS+=(--chdir="$MEGARL_ROOT")
  fi
}

megarl_train_args() {  # the recipe and its flags, then the launch's own overrides
  TRAIN_ARGS=("$@")
  [[ -z ${CKPT_DIR:-} ]] || TRAIN_ARGS+=(--save "$CKPT_DIR")
  [[ -z ${OUTPUT_DIR:-} ]] || TRAIN_ARGS+=(--output-dir "$OUTPUT_DIR")
}

# After a restart, workers sharing the agents' rendezvous store key it by their own agent's restart count, which
# differs between the node whose worker died and the others: they would read the dead worker's addresses. A fresh
# store each round avoids it (torch 2.13; tests/faults/test_elastic_two_agents.py).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

megarl_train_cmd() {  # torchrun with the rendezvous on the first host; every node runs the same command
  local nodes=$1 head=$2  # MAX_RESTARTS: torchrun restarts the workers of every node after one dies (elastic; they
  # resume from the newest whole checkpoint), this many times before the job fails and MAX_FAILURES requeues it
  TRAIN_CMD=(torchrun --nnodes "$nodes" --nproc-per-node "$GPUS_PER_NODE" --rdzv-backend c10d
             --rdzv-endpoint "$head:$MASTER_PORT" --rdzv-id "$JOB_ID" --max-restarts "${MAX_RESTARTS:-2}"
             launch/resume.py "${TRAIN_ARGS[@]}")
}

# Run a step in the background and wait for it, so that the USR1 trap (time limit near) runs while it works.
megarl_step() {
  if [[ $DRY_RUN == 1 ]]; then
    megarl_show "$@"
    return 0
  fi
  "$@" &
  STEP_PID=$!
  local rc=0
  wait "$STEP_PID" || rc=$?
  while kill -0 "$STEP_PID" 2>/dev/null; do  # a trapped signal interrupted the wait, not the step
    rc=0
    wait "$STEP_PID" || rc=$?
  done
  return "$rc"
}

# Wait until every server (host:port) answers /health_generate, for at most TIMEOUT seconds in all, while process
# PID (the servers' step) lives. Each request is bounded by what is left of the deadline (at most 10 s): a server
# that accepts the connection and never answers cannot hold the wait past it.
megarl_wait_healthy() {  # TIMEOUT PID SERVER...
  local timeout=$1 pid=$2 s left
  shift 2
  local deadline=$((SECONDS + timeout))
  for s in "$@"; do
    while true; do
      left=$((deadline - SECONDS))
      ((left > 0)) || { echo "megarl: $s not healthy after $timeout s" >&2; return 1; }
      curl -sf --max-time $((left < 10 ? left : 10)) "http://$s/health_generate" >/dev/null && break
      if ! kill -0 "$pid" 2>/dev/null; then
        echo "megarl: the SGLang servers exited; see ${LOG_DIR:-their log}" >&2
        return 1
      fi
      left=$((deadline - SECONDS))
      ((left <= 0)) || sleep $((left < 10 ? left : 10))
    done
  done
}

# Requeue: Slurm starts the same script again (SLURM_RESTART_COUNT + 1) and launch/resume.py loads the newest
# complete checkpoint. A time limit always requeues; a failure requeues at most MAX_FAILURES times; a bad
# config (exit 2) never does.
megarl_on_time_limit() {
  echo "megarl: time limit near: requeueing job $JOB_ID; it resumes from its newest complete checkpoint"
  [[ $DRY_RUN == 1 ]] || scontrol requeue "$JOB_ID"
}

megarl_on_exit() {
  local rc=$1 counter="$LOG_DIR/$JOB_ID.failures" failures=0
  if ((rc == 0)); then
    echo "megarl: finished"
    return 0
  fi
  if ((rc == 2)); then
    echo "megarl: stopped on a config error (exit 2); not requeueing" >&2
    return 2
  fi
  [[ -f $counter ]] && failures=$(<"$counter")
  if ((failures >= MAX_FAILURES)); then
    echo "megarl: exit $rc after $failures requeue(s) on failure (MAX_FAILURES=$MAX_FAILURES); giving up" >&2
    return "$rc"
  fi
  echo $((failures + 1)) >"$counter"
  echo "megarl: exit $rc: requeueing job $JOB_ID (failure $((failures + 1)) of $MAX_FAILURES)" >&2
  scontrol requeue "$JOB_ID"
}

# The CPU demo's task on a mixture of experts: GRPO on `a+b=` / `a-b=` arithmetic with the Qwen3-MoE starter
# (recipes/models/tiny_qwen3_moe.sh) on 2 processes with expert parallelism (EP 2: each process holds 2 of the 4
# experts of every layer and the tokens travel to their experts; attention and embeddings are data parallel).
# The rollout engine records every token's experts and the actor replays them (--routing-replay).
#
# Not yet measured: the held-out accuracy this recipe reaches from the MoE starter. The settings are the dense
# demo's (recipes/tiny_cpu.sh), which are measured there; on 2 shared cores the MoE starter's build took ~2.8 s
# a step, too slow to calibrate here.
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO_ROOT/recipes/tiny_cpu.sh"
source "$REPO_ROOT/recipes/models/tiny_qwen3_moe.sh"

DATA_ARGS=(
  --prompt-data "$STARTER_DIR/train.jsonl"
  --eval-data "$STARTER_DIR/heldout.jsonl"
  --rollout-batch-size 8
)
ALGORITHM_ARGS+=(--routing-replay)
LOGGING_ARGS=(
  --output-dir "$REPO_ROOT/runs/tiny_cpu_moe"
  --log-interval 10
  --eval-samples-per-prompt 4
)

# The CPU demo's task on DeepSeek-V3's architecture (`make demo-deepseek`): the mixture-of-experts demo's settings
# (recipes/tiny_cpu_moe.sh: 32 prompts x 8 a step, EP 2, rollout routing replay) with the DeepSeek-V3 starter
# (recipes/models/tiny_deepseek_v3.sh): multi-latent attention, a shared expert beside the routed ones and DeepSeek's
# grouped sigmoid router with its expert bias (kept as pretrained: Megatron's bias update rate is 0). A short run,
# 600 steps; its result: docs/results.md, "A model family in one place: DeepSeek-V3".
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO_ROOT/recipes/tiny_cpu_moe.sh"
source "$REPO_ROOT/recipes/models/tiny_deepseek_v3.sh"

DATA_ARGS=(
  --prompt-data "$STARTER_DIR/train.jsonl"
  --eval-data "$STARTER_DIR/heldout.jsonl"
  --rollout-batch-size 32                     # prompts per step (x 8 samples = 256 completions)
)
TRAINING_ARGS=(
  --num-steps 600
  --lr 7.5e-5
  --min-lr 1e-5
  --lr-decay-style linear
  --micro-batch-size 128                      # each process's 128 completions in one micro-batch
  --seed 1234
)
LOGGING_ARGS=(
  --output-dir "$REPO_ROOT/runs/tiny_cpu_deepseek_v3"
  --log-interval 10
  --eval-samples-per-prompt 4
)

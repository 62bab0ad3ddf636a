# The CPU demo's task on a mixture of experts (`make demo-moe`): GRPO on `a+b=` / `a-b=` arithmetic with the
# Qwen3-MoE starter (recipes/models/tiny_qwen3_moe.sh) on 2 processes with expert parallelism (EP 2: each process
# holds 2 of the 4 experts of every layer and the tokens travel to their experts; attention and embeddings are data
# parallel). The rollout engine records every token's experts and the actor replays them (--routing-replay).
#
# The starter is upcycled: a dense Qwen3 one expert wide (MLP 512) pre-trained for the dense demo's 1,760 steps, each
# MLP copied into the 4 experts (tools/make_starter_model.py says why), so it starts as the dense model does.
#
# Settings: the dense demo's (recipes/tiny_cpu.sh) but 4x the prompts per step at half the peak rate, over 2,600
# steps: at the dense demo's rate the MoE lost greedy accuracy early, and the larger batch learns far more per step.
# The runs behind these choices, the result and the routing metrics: docs/results.md, "The mixture-of-experts demo".
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO_ROOT/recipes/tiny_cpu.sh"
source "$REPO_ROOT/recipes/models/tiny_qwen3_moe.sh"

DATA_ARGS=(
  --prompt-data "$STARTER_DIR/train.jsonl"
  --eval-data "$STARTER_DIR/heldout.jsonl"
  --rollout-batch-size 32                     # prompts per step (x 8 samples = 256 completions)
)
ALGORITHM_ARGS+=(--routing-replay)
TRAINING_ARGS=(
  --num-steps 2600
  --lr 7.5e-5
  --min-lr 1e-5
  --lr-decay-style linear
  --micro-batch-size 128                      # each process's 128 completions in one micro-batch
  --seed 1234
)
LOGGING_ARGS=(
  --output-dir "$REPO_ROOT/runs/tiny_cpu_moe"
  --log-interval 10
  --eval-samples-per-prompt 4
)

# R1-style code RL on GPUs: a Qwen2.5-Coder-7B-class actor (TP=4), SGLang rollout colocated, rewards from the
# sandboxed `code` verifier running each row's tests.
#   torchrun --nproc-per-node 8 megarl/train.py recipes/r1_code.sh [--flag value ...]
#   sbatch --nodes 2 launch/slurm/colocated.sbatch recipes/r1_code.sh      # several nodes (docs/guide.md)
# Data: problems with tests, converted to megarl's jsonl (`answer` holds {"inputs", "outputs"} stdin/stdout
# cases, or {"test", "entry_point"} for function-style tests; `verifier` is "code"):
#   megarl-prepare-data code-contests <code_contests_train.parquet> $DATA_DIR/train.jsonl
#   megarl-prepare-data humaneval <HumanEval.jsonl> $DATA_DIR/humaneval.jsonl
# The response is the whole program, bare or in a ```python block; REWARD_ARGS choose how it is judged and the
# sandbox it runs in (docs/guide.md, "Sandbox choice").
# Needs CUDA GPUs, SGLang and Transformer Engine; on a CPU machine it stops at once with a message saying so.
# Size it before launching: megarl-plan recipes/r1_code.sh --gpus 8
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODEL_DIR=${MODEL_DIR:-/models/Qwen2.5-Coder-7B-Instruct}  # same shape as Qwen2.5-7B
source "$REPO_ROOT/recipes/models/${RECIPE_MODEL:-qwen2.5-7b}.sh"
DATA_DIR=${DATA_DIR:-/data/code-contests}

ROLLOUT_ARGS=(
  --rollout-backend sglang
  --n-samples-per-prompt 8
  --rollout-temperature 1.0
  --max-response-len 4096
)

DATA_ARGS=(
  --prompt-data "$DATA_DIR/train.jsonl"
  --eval-data "$DATA_DIR/humaneval.jsonl"
  --default-verifier code
  --max-prompt-len 2048         # longer problem statements are left out (counted in the log)
  --rollout-batch-size 64
)

REWARD_ARGS=(
  --code-reward all             # 1 only when every test passes; fraction: the share of tests passed
  --sandbox local               # docker: a pool of hardened containers (make sandbox-image; --sandbox-image)
  --sandbox-workers 1           # sandbox workers per verifying process
)

ALGORITHM_ARGS=(
  --advantage-estimator grpo
  --eps-clip 0.2
  --eps-clip-high 0.28          # DAPO clip-higher
  --kl-coef 0.0
  --loss-aggregation token-mean
)

TRAINING_ARGS=(
  --num-steps 300
  --lr 1e-6
  --lr-warmup-steps 10
  --weight-decay 0.1
  --clip-grad 1.0
  --micro-batch-size 2
  --updates-per-rollout 2
  --use-distributed-optimizer
  --seed 42
)

CHECKPOINT_ARGS=(
  --save "$REPO_ROOT/checkpoints/r1_code"
  --save-interval 10
)

LOGGING_ARGS=(
  --output-dir "$REPO_ROOT/runs/r1_code"
  --log-interval 1
)

# R1-style math RL on a GPU node: Qwen2.5-Math-1.5B-class actor, TP=2, SGLang rollout colocated on the same GPUs.
#   torchrun --nproc-per-node 8 megarl/train.py recipes/r1_math.sh [--flag value ...]
# Needs CUDA GPUs, SGLang and Transformer Engine; on a CPU machine it stops at once with a message saying so.
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO_ROOT/recipes/models/qwen2.5-1.5b.sh"
DATA_DIR=${DATA_DIR:-/data/dapo-math}

ROLLOUT_ARGS=(
  --rollout-backend sglang
  --n-samples-per-prompt 8
  --rollout-temperature 1.0
  --max-response-len 4096
)

DATA_ARGS=(
  --prompt-data "$DATA_DIR/train.jsonl"
  --eval-data "$DATA_DIR/aime24.jsonl"
  --default-verifier math
  --rollout-batch-size 128
)

ALGORITHM_ARGS=(
  --advantage-estimator grpo
  --eps-clip 0.2
  --eps-clip-high 0.28          # DAPO clip-higher
  --kl-coef 0.0
  --loss-aggregation token-mean
)

TRAINING_ARGS=(
  --num-steps 500
  --lr 1e-6
  --lr-warmup-steps 10
  --weight-decay 0.1
  --clip-grad 1.0
  --micro-batch-size 4
  --updates-per-rollout 4
  --seed 42
)

CHECKPOINT_ARGS=(
  --save "$REPO_ROOT/checkpoints/r1_math"
  --save-interval 20
)

LOGGING_ARGS=(
  --output-dir "$REPO_ROOT/runs/r1_math"
  --log-interval 1
)

# R1-style math RL on a GPU node: Qwen2.5-Math-1.5B-class actor, TP=2, SGLang rollout colocated on the same GPUs.
#   torchrun --nproc-per-node 8 megarl/train.py recipes/r1_math.sh [--flag value ...]
#   RECIPE_MODEL=qwen2.5-math-7b torchrun ...           # the 7B model (TP=4), any recipes/models/<m>.sh
#   sbatch --nodes 2 launch/slurm/colocated.sbatch recipes/r1_math.sh   # several nodes (docs/guide.md)
# Data: DAPO-Math-17k for training and AIME 2024 for evaluation, converted to megarl's jsonl with
#   megarl-prepare-data dapo-math <dapo-math-17k.parquet> $DATA_DIR/train.jsonl
#   megarl-prepare-data math <aime-2024.parquet> $DATA_DIR/aime24.jsonl
# Needs CUDA GPUs, SGLang and Transformer Engine; on a CPU machine it stops at once with a message saying so.
# Size it before launching: megarl-plan recipes/r1_math.sh --gpus 8
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO_ROOT/recipes/models/${RECIPE_MODEL:-qwen2.5-math-1.5b}.sh"
DATA_DIR=${DATA_DIR:-/data/dapo-math}

# Qwen2.5-Math has 4,096 positions: prompt + response must fit in them (train.py refuses more at start), so
# responses get 3,072 and prompts up to 1,024 tokens; longer prompts are left out and counted.
ROLLOUT_ARGS=(
  --rollout-backend sglang
  --n-samples-per-prompt 8
  --rollout-temperature 1.0
  --max-response-len 3072
)

DATA_ARGS=(
  --prompt-data "$DATA_DIR/train.jsonl"
  --eval-data "$DATA_DIR/aime24.jsonl"
  --default-verifier math
  --max-prompt-len 1024
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

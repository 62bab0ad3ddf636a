# On-policy distillation on a GPU node: recipes/r1_math.sh's Qwen2.5-Math-1.5B student samples, a Qwen2.5-Math-7B
# teacher (the same tokenizer) scores every sampled token, and the student learns from the per-token reverse KL
# -(log p_student - log p_teacher) added to GRPO's group-normalised verifiable reward (docs/guide.md, "On-policy
# distillation").
#   torchrun --nproc-per-node 8 megarl/train.py recipes/r1_math_distill.sh [--flag value ...]
#   ... --distill-only                  # distillation alone (rewards still scored and reported)
#   ... --teacher http://host:30000     # a teacher served elsewhere (SGLang's /generate with prompt log-probs)
# The teacher is a frozen Megatron model with the actor's TP/PP (here TP 2: 7.6B bf16 weights = 7.1 GiB a GPU).
# Size it before launching: megarl-plan recipes/r1_math_distill.sh --gpus 8 (TEACHER_SHAPE below counts the
# teacher before its checkpoint is downloaded).
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RECIPE_MODEL=${RECIPE_MODEL:-qwen2.5-math-1.5b}
source "$REPO_ROOT/recipes/r1_math.sh"
TEACHER_DIR=${TEACHER_DIR:-/models/Qwen2.5-Math-7B}
# Qwen2.5-Math-7B's config.json (as recipes/models/qwen2.5-math-7b.sh's MODEL_SHAPE)
declare -A TEACHER_SHAPE=(
  [model_type]=qwen2 [num_hidden_layers]=28 [hidden_size]=3584 [num_attention_heads]=28 [num_key_value_heads]=4
  [intermediate_size]=18944 [vocab_size]=152064 [max_position_embeddings]=4096 [rope_theta]=10000
  [tie_word_embeddings]=false
)

MODEL_ARGS+=(
  --teacher "$TEACHER_DIR"
)

ALGORITHM_ARGS+=(
  --distill-coef 1.0
)

CHECKPOINT_ARGS=(
  --save "$REPO_ROOT/checkpoints/r1_math_distill"
  --save-interval 20
)

LOGGING_ARGS=(
  --output-dir "$REPO_ROOT/runs/r1_math_distill"
  --log-interval 1
)

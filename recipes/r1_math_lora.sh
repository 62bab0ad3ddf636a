# R1-style math RL with LoRA on a 7B model: recipes/r1_math.sh on Qwen2.5-Math-7B with rank-64 adapters on every
# projection, the base frozen in bf16, the reference being the actor with its adapters off (no second model), and
# SGLang receiving the merged weights after each step.
#   torchrun --nproc-per-node 8 megarl/train.py recipes/r1_math_lora.sh [--flag value ...]
#   RECIPE_MODEL=qwen3-8b torchrun ...     # any dense recipes/models/<m>.sh
# Sized by the planner (`megarl-plan recipes/r1_math_lora.sh --gpus 8`, 8 x H100 80 GB): the 7.6B model trains at
# TP 2 (4 data-parallel groups) in 60.2 GiB a GPU at the peak, where full fine-tuning at TP 2 would need 115.3 GiB
# (its fp32 gradients 14.2 and Adam states 42.6 GiB a GPU; the adapters' 0.4 and 1.2) and so runs at TP 4.
# The learning rate is 10x full fine-tuning's (LoRA trains 2 % of the parameters from a zero B), the rule of thumb
# the CPU demo (make demo-lora) measured at 5x; not tuned at this scale.
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RECIPE_MODEL=${RECIPE_MODEL:-qwen2.5-math-7b}
source "$REPO_ROOT/recipes/r1_math.sh"

MODEL_ARGS+=(
  --tensor-model-parallel-size 2   # (after the model file's TP 4: the later flag wins)
  --lora-rank 64
  --lora-alpha 128
  --lora-target-modules q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
)

TRAINING_ARGS+=(
  --lr 1e-5
)

CHECKPOINT_ARGS=(
  --save "$REPO_ROOT/checkpoints/r1_math_lora"
  --save-interval 20
)

LOGGING_ARGS=(
  --output-dir "$REPO_ROOT/runs/r1_math_lora"
  --log-interval 1
)

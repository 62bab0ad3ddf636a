# The CPU demo (recipes/tiny_cpu.sh) with LoRA: adapters of rank 16 on every projection of the tiny starter, the
# base weights frozen; the built-in engine receives the merged weights W + (alpha / rank) B A after every step.
# A KL term would take its reference log-probs from the same model with its adapters off (no second model).
# LoRA trains far fewer parameters from a zero B, so it takes a higher peak rate than full fine-tuning (PEFT's and
# TRL's LoRA examples use ~10x); this rate is that rule of thumb, not yet tuned on this task.
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO_ROOT/recipes/tiny_cpu.sh"

MODEL_ARGS+=(
  --lora-rank 16
  --lora-alpha 32
  --lora-dropout 0
  --lora-target-modules q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
)

TRAINING_ARGS+=(
  --lr 1.5e-3
  --min-lr 1e-4
)

LOGGING_ARGS+=(
  --output-dir "$REPO_ROOT/runs/tiny_cpu_lora"
)

# The CPU demo (recipes/tiny_cpu.sh) with LoRA: adapters of rank 16 on every projection of the tiny starter, the
# base weights frozen; the built-in engine receives the merged weights W + (alpha / rank) B A after every step.
# A KL term would take its reference log-probs from the same model with its adapters off (no second model).
# LoRA trains far fewer parameters (180K, 9 % of the starter's 2.0M) from a zero B, so it takes a higher peak
# rate than full fine-tuning: 5x the demo's, decaying over the same 5,400 steps to 5x its floor. Over the first
# 250 steps of 600-step schedules (2026-12-04) training accuracy rose faster at 5x and 10x than in full
# fine-tuning, and 20x (3e-3) fell to 0 %; the lower one keeps a margin for the long schedule's longer time near
# the peak. `make demo-lora` runs it; docs/results.md, "LoRA on the CPU demo", has the measured figures.
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO_ROOT/recipes/tiny_cpu.sh"

MODEL_ARGS+=(
  --lora-rank 16
  --lora-alpha 32
  --lora-dropout 0
  --lora-target-modules q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
)

TRAINING_ARGS+=(
  --lr 7.5e-4
  --min-lr 5e-5
)

LOGGING_ARGS+=(
  --output-dir "$REPO_ROOT/runs/tiny_cpu_lora"
)

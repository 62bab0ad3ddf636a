# The reasoning-gym CPU demo (`make demo-rg`): GRPO on a task nobody here wrote, reasoning-gym's `chain_sum`
# (2-3 one-digit terms, "State the final answer to the following arithmetic problem: 7 - 2 + 9 ="), rewarded by
# the `reasoning_gym` verifier: the answer between the response's <answer> tags, scored by the task's own scorer.
#
# The starter (`tools/make_rg_starter_model.py`, into .cache/rg-starter) answers `<answer>A</answer>`, right in
# about half of its training rows and a near miss in the other half. Its rows were written by
# `megarl-prepare-data reasoning-gym` (the task's code, megarl's labels): train.jsonl is seed 1, heldout.jsonl
# seed 100,000 with every question of the train split left out.
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RG_STARTER_DIR=${RG_STARTER_DIR:-$REPO_ROOT/.cache/rg-starter}

MODEL_ARGS=(
  --hf-checkpoint "$RG_STARTER_DIR"
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 1
  --transformer-impl local
)

ROLLOUT_ARGS=(
  --rollout-backend builtin
  --n-samples-per-prompt 8
  --rollout-temperature 1.0
  --max-response-len 24          # "<answer>-18</answer>" is 20 tokens, then EOS
)

DATA_ARGS=(
  --prompt-data "$RG_STARTER_DIR/train.jsonl"
  --eval-data "$RG_STARTER_DIR/heldout.jsonl"      # questions never trained on, another seed
  --rollout-batch-size 8                            # prompts per step (x 8 samples = 64 completions)
)

ALGORITHM_ARGS=(
  --advantage-estimator grpo
  --eps-clip 0.2
  --kl-coef 0
  --loss-aggregation token-mean
)

# Bound by the step count only, so every machine trains the same model (docs/results.md, "The reasoning-gym demo";
# 300 steps gave 22.4 % -> 29.4 % held-out sampled, 800 give 34.1 %).
TRAINING_ARGS=(
  --num-steps 800
  --lr 1e-4
  --min-lr 1e-5
  --lr-decay-style linear
  --micro-batch-size 32
  --seed 1234
)

LOGGING_ARGS=(
  --output-dir "$REPO_ROOT/runs/tiny_cpu_rg"
  --log-interval 10
  --log-samples-interval 50
  --eval-max-prompts 200
  --eval-interval 200
  --eval-samples-per-prompt 4
)

# The math CPU demo (`make demo-math`): GRPO on the math-forms task (`megarl/tasks/math_forms.py`: fractions,
# percents, decimals, radicals, factoring, like terms), whose right answers come in many spellings (`7/12`,
# `14/24`, `\frac{7}{12}`, `3+3x` for `3x+3`...), rewarded by the `math` verifier, which judges values.
#
# The starter (`tools/make_math_starter_model.py`, into .cache/math-starter) writes a line of working and boxes
# an answer: a right one, spelled any of several ways, in about half of its training rows, a plausible mistake in
# the other half. `make demo-math` first runs the control: the same recipe and seed trained on train_exact.jsonl,
# the same rows for the `exact_string` verifier (1 only for the canonical spelling, character for character).
# Both runs are judged on heldout.jsonl by the `math` verifier, whose labels list the question's own expression as
# a not-answer: equal in value, it would otherwise reward copying the question.
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MATH_STARTER_DIR=${MATH_STARTER_DIR:-$REPO_ROOT/.cache/math-starter}

MODEL_ARGS=(
  --hf-checkpoint "$MATH_STARTER_DIR"
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 1
  --transformer-impl local
)

ROLLOUT_ARGS=(
  --rollout-backend builtin
  --n-samples-per-prompt 8
  --rollout-temperature 1.0
  --max-response-len 80          # the longest solution is 71 tokens (working, box), then EOS
)

DATA_ARGS=(
  --prompt-data "$MATH_STARTER_DIR/train.jsonl"     # the control passes train_exact.jsonl
  --eval-data "$MATH_STARTER_DIR/heldout.jsonl"     # 200 problems never trained on, judged by `math`
  --rollout-batch-size 8                             # prompts per step (x 8 samples = 64 completions)
)

ALGORITHM_ARGS=(
  --advantage-estimator grpo
  --eps-clip 0.2
  --kl-coef 0
  --loss-aggregation token-mean
)

# Bound by the step count only, so every machine trains the same model (docs/results.md, "The math demo").
TRAINING_ARGS=(
  --num-steps 500
  --lr 1e-4
  --min-lr 1e-5
  --lr-decay-style linear
  --micro-batch-size 32
  --seed 1234
)

# Rollout samples are logged generously (32 every 5 steps): the demo's summary reads them for the copy rate.
LOGGING_ARGS=(
  --output-dir "$REPO_ROOT/runs/tiny_cpu_math"
  --log-interval 5
  --log-samples-interval 5
  --log-samples-count 32
  --eval-samples-per-prompt 4
)

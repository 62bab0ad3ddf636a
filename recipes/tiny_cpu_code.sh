# The code CPU demo (`make demo-code`): GRPO teaches a tiny model to write one-line Python functions from specs in
# words (`megarl/tasks/code_functions.py`), rewarded by the `code` verifier running each row's four asserts in
# megarl's local sandbox, through the reward pool. 2 processes (data parallel) on 2 cores.
#
# The starter (`tools/make_code_starter_model.py`, into .cache/code-starter) saw a wrong program in half of its
# pre-training rows, so it knows the format and the fragments but often writes a program that fails the tests.
# The run ends with `held-out pass@1 (sampled): before X% -> after Y%` over 200 problems never trained on, and the
# greedy pass@1 in the table above it. Any flag can be overridden on the command line after the recipe.
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CODE_STARTER_DIR=${CODE_STARTER_DIR:-$REPO_ROOT/.cache/code-starter}

MODEL_ARGS=(
  --hf-checkpoint "$CODE_STARTER_DIR"
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 1
  --transformer-impl local
)

ROLLOUT_ARGS=(
  --rollout-backend builtin
  --n-samples-per-prompt 8
  --rollout-temperature 1.0
  --max-response-len 112         # the longest canonical program is 96 tokens (+ EOS); room to ramble, no more
)

DATA_ARGS=(
  --prompt-data "$CODE_STARTER_DIR/train.jsonl"
  --eval-data "$CODE_STARTER_DIR/heldout.jsonl"   # 200 problems never trained on
  --default-verifier code                          # the rows name it too
  --rollout-batch-size 8                           # prompts per step (x 8 samples = 64 programs)
)

# Each program runs in the local sandbox (namespaces, Landlock, seccomp); `--sandbox docker` runs it in a pool of
# containers instead (make sandbox-image). Four reward workers per rank, each with its own sandbox worker: a
# program's check is mostly waiting, not CPU (one pipeline, a free core: 12.6 ms a program, 4.4 ms of it CPU),
# so four pipelines score the rows as they finish, during the rest of the generation, and the step waits on
# 2-3 % of its time for rewards instead of 22-27 % with one (docs/results.md, "The code demo").
REWARD_ARGS=(
  --code-reward all              # 1 only when all four asserts pass
  --code-test-seconds 2          # a one-liner on a list of six ints takes microseconds; 2 s is a runaway
  --sandbox local
  --sandbox-workers 1
  --reward-workers 4
)

ALGORITHM_ARGS=(
  --advantage-estimator grpo
  --eps-clip 0.2
  --kl-coef 0
  --loss-aggregation token-mean
)

# Bound by the step count only, so every machine trains the same model. 700 steps: ~1 s a step on 2 quiet cores,
# ~12 minutes, inside the demo's 15; held-out sampled pass@1 11.2 % -> 47.9 %. At 3e-4 and above the policy
# collapsed within 10 steps (unbalanced parentheses, then near-empty programs); over 300 steps 1e-4 gained 24
# points. The measurements: docs/results.md, "The code demo".
TRAINING_ARGS=(
  --num-steps 700
  --lr 1e-4
  --min-lr 1e-5
  --lr-decay-style linear
  --micro-batch-size 32
  --seed 1234
)

LOGGING_ARGS=(
  --output-dir "$REPO_ROOT/runs/tiny_cpu_code"
  --log-interval 10
  --eval-samples-per-prompt 4
  --eval-metric-name pass@1      # a sample is a program; correct means it passed its tests
)

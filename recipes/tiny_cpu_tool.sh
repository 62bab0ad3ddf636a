# The tool-use CPU demo (`make demo-tool`): GRPO teaches the tiny starter to call the python tool for products it
# cannot compute in its head (`a*b=`, a three-digit by a two-digit number; `megarl/tasks/multiplication.py`).
#
# The starter (`tools/make_tool_starter_model.py`, into .cache/tool-starter) saw tool-use demonstrations in a small
# share of its pre-training rows and answered in its head in the rest, so it calls the tool for about that share
# of prompts. Each trajectory: the model's turn, ended at the closing fence of a python block (a stop string); the
# block runs in megarl's local sandbox; its output comes back in an ```output block (mask 0); the model's final
# turn is judged by the `arithmetic` verifier (exactly the product). `make demo-tool` also runs the control:
# the same recipe and seed with --tool-calls-fail (every call answered by an error), to show what the tool is worth.
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TOOL_STARTER_DIR=${TOOL_STARTER_DIR:-$REPO_ROOT/.cache/tool-starter}

MODEL_ARGS=(
  --hf-checkpoint "$TOOL_STARTER_DIR"
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 1
  --transformer-impl local
)

ROLLOUT_ARGS=(
  --rollout-backend builtin
  --rollout-function tool_use
  --n-samples-per-prompt 8
  --rollout-temperature 1.0
  --max-response-len 64          # the whole trajectory: call, tool output and answer (~45 tokens)
)

TOOL_ARGS=(
  --tool-parser python           # a ```python block is a call; its output comes back in an ```output block
  --tools python
  --max-turns 2                  # a call, then the answer
  --max-tool-calls 1
  --max-tool-output-tokens 16
  --tool-timeout 5
  --tool-memory-mb 128
  --tool-workers 1               # per rank: two sandbox workers on the two cores
)

DATA_ARGS=(
  --prompt-data "$TOOL_STARTER_DIR/train.jsonl"
  --eval-data "$TOOL_STARTER_DIR/heldout.jsonl"   # 200 products never trained on
  --rollout-batch-size 8                           # prompts per step (x 8 samples = 64 trajectories)
)

ALGORITHM_ARGS=(
  --advantage-estimator grpo
  --eps-clip 0.2
  --kl-coef 0
  --loss-aggregation token-mean
)

TRAINING_ARGS=(
  --num-steps 100
  --lr 1e-4
  --min-lr 1e-5
  --lr-decay-style linear
  --micro-batch-size 32
  --seed 1234
)

LOGGING_ARGS=(
  --output-dir "$REPO_ROOT/runs/tiny_cpu_tool"
  --log-interval 10
  --eval-samples-per-prompt 4
)

# The four-model PPO on the CPU demo task: actor, critic, reference and a learned reward model (hf_rm), on the same
# 2 processes. The reward model stands in for the arithmetic verifier: tools/train_reward_model.py trains it from
# the verifier's labels (the right answer against answers off by 1-3, a digit too many, none). `make demo-rm`
# builds it and runs this recipe; by hand, build it first:
#
#   OMP_NUM_THREADS=1 .venv/bin/python tools/train_reward_model.py --init .cache/starter \
#       --arithmetic .cache/starter --calibrate --out .cache/reward_model
#
# Every row is scored 'hf_rm + 0*arithmetic': the reward is the reward model's score alone, while the verifier
# still decides each sample's outcome, so accuracy, held-out evaluation and rm_agreement (the share of samples on
# which the model's verdict, score > 0, matches the verifier's) are the verifier's judgement, logged every step.
# Each trainer process starts one megarl-serve-rm holding the reward model (loaded once, scored in batches).
#
# Measured on `make demo`'s starter, 2 shared cores (1,000 steps, 6.7 min of training): the reward model (400
# steps, --calibrate) reached 59.1% pairwise / 61.6% sign accuracy on the held-out problems' pairs, but only 43.5%
# pairwise on held-out right-vs-off-by-1..3 pairs (megarl-verify): it learned the format, not the sums. PPO then
# optimised it, not the arithmetic: held-out sampled 23.6% -> 1.9%, greedy 64.0% -> 2.0%, rm_agreement 0.26 in
# the first 10 steps -> 0.03 in the last 20 while the reward model's mean score rose (0.25 -> 0.33): reward
# hacking of a weak reward model, which rm_agreement shows step by step. The recipe runs the four models; a
# reward model good enough to teach this task is not built yet.
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO_ROOT/recipes/tiny_cpu_ppo.sh"
REWARD_MODEL_DIR=${REWARD_MODEL_DIR:-$REPO_ROOT/.cache/reward_model}

DATA_ARGS+=(
  --verifier-key reward_spec            # a field the demo rows lack: every row takes --default-verifier
  --default-verifier "hf_rm + 0*arithmetic"
)

REWARD_ARGS=(
  --reward-model "$REWARD_MODEL_DIR"
  --reward-model-batch-size 64          # one request per step's 64 completions
)

LOGGING_ARGS=(
  --output-dir "$REPO_ROOT/runs/tiny_cpu_ppo_rm"
  --log-interval 10
  --eval-samples-per-prompt 4
)

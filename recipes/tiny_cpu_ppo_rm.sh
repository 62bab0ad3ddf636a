# The four-model PPO on the CPU demo task: actor, critic, reference and a learned reward model (hf_rm), on the same
# 2 processes. The reward model stands in for the arithmetic verifier: tools/train_reward_model.py trains it from
# the verifier's labels (the right answer against answers off by 1-3, a digit too many, none, and against the
# starter's own samples the verifier calls wrong). `make demo-rm` builds it and runs this recipe; by hand, build it first:
#
#   OMP_NUM_THREADS=1 .venv/bin/python tools/train_reward_model.py --init .cache/starter \
#       --arithmetic .cache/starter --policy-samples 8 --calibrate --steps 1000 --out .cache/reward_model
#
# Every row is scored 'hf_rm + 0*arithmetic': the reward is the reward model's score alone, while the verifier
# still decides each sample's outcome, so accuracy, held-out evaluation and rm_agreement (the share of samples on
# which the model's verdict, score > 0, matches the verifier's) are the verifier's judgement, logged every step.
# Each trainer process starts one megarl-serve-rm holding the reward model (loaded once, scored in batches).
#
# Measured on `make demo`'s starter, 2 cores shared with other jobs (so times are high). Judged on the held-out
# problems against the verifier: the starter's own samples (16 per problem), each wrong one against the answer
# ("policy pairs"), and right vs off-by-1..3 pairs:
#   reward model                                    policy pairs  off-by-1..3  best of 16 by score (random: 22.7%)
#   400 steps, verifier-made pairs only             44.0%         45.4%        11.0%
#   1,000 steps, + --policy-samples 8 (the build)   58.9%         61.1%        24.5%
#   as the build, 800 steps, lr 5e-4, batch 32, two
#   copies of the starter's layers stacked on top   50.7%         50.0%        14.5%   (tried, not kept)
# (a 1,200-step build at lr 1e-3 was stopped at step 800, its loss behind the lr 3e-4 one's: 1.240 vs 1.131.)
# The build takes ~10 min of 1 core; its score is read at the last answer token, whose layers see only the lower
# layers' output at the other positions, so it must learn the sums afresh rather than read the starter's.
# PPO from here, this recipe unchanged (1,000 steps, 0.75 s/step, 12.6 min of training):
#   old reward model: held-out sampled 23.6% -> 1.9%, greedy 64.0% -> 2.0%, rm_agreement 0.26 -> 0.03;
#   the build above: sampled 23.6% -> 16.2%, greedy 64.0% -> 20.0%, rm_agreement 0.46 in the first 10 steps ->
#   0.35 in the last 20 while the model's mean score rose (-0.12 -> 0.22).
# Still reward hacking, slower: a reward model that picks the right answer from 16 samples no more often than
# chance cannot teach the sums. The aim (+20 points sampled in 15 min) is not met.
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

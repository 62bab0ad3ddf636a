# The four-model PPO on the CPU demo task: actor, critic, reference and a learned reward model (hf_rm), on the same
# 2 processes. The reward model stands in for the arithmetic verifier. `make demo-rm` builds it and runs this recipe;
# by hand, build it first (both by step counts, one thread; ~7 and ~4 minutes):
#
#   OMP_NUM_THREADS=1 .venv/bin/python tools/make_starter_model.py --out .cache/reward_trunk --steps 1760 --noise-p 0
#   OMP_NUM_THREADS=1 .venv/bin/megarl-train-reward-model --init .cache/reward_trunk --policy .cache/starter \
#       --arithmetic .cache/starter --policy-samples 8 --far-negatives --calibrate --lr 3e-4 --steps 800 \
#       --out .cache/reward_model
#
# The reward model's trunk is a language model of the task pre-trained like the starter but on clean answers (a
# reward model usually starts from a stronger model than the policy); the tool then trains it, as a sequence
# classifier, on the verifier's verdicts: the right answer against the starter's own wrong samples (8 a problem),
# answers off by 1-3, a digit too many, none, and the far misses a policy drifts to (a digit dropped, reversed,
# random numbers, stray characters). Every row is scored 'hf_rm + 0*arithmetic': the reward is the reward
# model's score alone (normalised by the mean and std stored at training), while the verifier still decides each
# sample's outcome, so accuracy, the held-out evaluation and rm_agreement (the share of samples on which the
# model's verdict, a normalised score > 0, matches the verifier's) are the verifier's judgement, logged every step.
# Each trainer process starts one megarl-serve-rm holding the reward model (loaded once, scored in batches).
#
# Measured (the reward model against the verifier, PPO with it, and the earlier reward models on the starter's own
# trunk, which PPO gamed): docs/results.md, "The four-model PPO with a reward model".
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO_ROOT/recipes/tiny_cpu_ppo.sh"
REWARD_MODEL_DIR=${REWARD_MODEL_DIR:-$REPO_ROOT/.cache/reward_model}

DATA_ARGS+=(
  --verifier-key reward_spec            # a field the demo rows lack: every row takes --default-verifier
  --default-verifier "hf_rm + 0*arithmetic"
  --rollout-batch-size 32               # 32 prompts x 8 samples a step: steadier than 8 at this PPO's rates
)

REWARD_ARGS=(
  --reward-model "$REWARD_MODEL_DIR"
  --reward-model-normalize              # (score - mean) / std as stored: raw scores span ~+-10, the critic's 0-start
  --reward-model-batch-size 128         # one request per process per step (128 completions)
)

TRAINING_ARGS+=(                        # over tiny_cpu_ppo.sh's: the last of a flag wins
  --num-steps 1200
  --lr 1.5e-4
  --min-lr 1e-5
  --micro-batch-size 128                # a process's 128 completions in one micro-batch
)

LOGGING_ARGS=(
  --output-dir "$REPO_ROOT/runs/tiny_cpu_ppo_rm"
  --log-interval 10
  --eval-samples-per-prompt 4
  --eval-interval 300
)

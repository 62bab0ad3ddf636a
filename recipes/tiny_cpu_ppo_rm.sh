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
#
# Later measurements (2 cores shared with 4-7 other training processes and paused at times, so wall times are
# high; every run is bound by its step count):
# - Where a step goes (this recipe, 1,000 steps, the medians of metrics.jsonl): 0.38 s a step, of which the reward
#   server scoring the 64 completions 0.03 s, the critic 0.16 s, the actor update 0.11 s, log-probs 0.03 s,
#   generation 0.01 s; a more loaded run: 0.69 s, reward 0.05 s, critic 0.31 s, update 0.19 s. The 0.75 s a step
#   above was the load, not the reward model (0.24 s a step for tiny_cpu_ppo.sh was measured on a quieter machine).
# - The ceiling, tiny_cpu_ppo.sh with the exact verifier reward: lr 1.5e-4 -> 1e-5 over 2,400 steps gave held-out
#   sampled 23.6 %, greedy 27.5 % at step 600; lr 1e-4 -> 1e-5 over 2,000 steps with --critic-lr 1e-3 gave 27.0 % /
#   32.5 % at step 500 (both stopped there); the critic's explained variance stayed -0.02..0.00 even at
#   --critic-lr 1e-3 (it learns the mean reward only), so the advantages are reward minus a batch-wide baseline and
#   the hard prompts' samples are all pushed down: greedy falls fast at GRPO's learning rates. The best measured
#   with the exact reward stays 31.8 % (+8) at 5e-5, 1,000 steps: +20 in 15 minutes is out of this PPO's reach
#   even with a perfect reward model.
# - Reward models, judged on fresh samples (16 a problem) of 600 training problems (the prompts PPO trains on) and
#   of the 200 held-out ones: policy pairs / best of 16 by score (a random sample: 25.0 % / 22.9 %):
#     the 400-step model (verifier-made pairs only)                     train 51.0/16.0  held-out 44.2/10.5
#     2 layers, all trained, lr 1e-3, 50 warm-up steps, beta2 0.98, 500 train 52.2/16.0  held-out 51.3/14.5
#     (its loss stalls at ~1.25 from step 300; lr 1e-4 and 3e-5 were on the same course at step 200: 1.27, 1.32)
#     --add-layers 1 --freeze-init, lr 2e-3, 300 steps                  train 56.4/20.3  held-out 54.4/14.5
#     --add-layers 2 --freeze-init, lr 1e-3, 30 warm-up, beta2 0.98, 600 train 62.0/27.2  held-out 60.0/23.0
#   (same data as the build: the verifier's pairs plus 8 starter samples a training problem). With two new layers
#   over the frozen starter the loss falls below the 2-layer model's floor (1.08 at step 600, still falling): the
#   new layers can read what the starter's layers predict at the answer's earlier tokens, where a 2-layer model
#   read at the last token has to learn the sums itself. Still far from the >90 % on training problems the
#   policy would need. The tool's own build with these options (--policy-samples 8 --calibrate --add-layers 2
#   --freeze-init --lr 1e-3 --warmup-steps 30 --adam-beta2 0.98 --steps 600 --eval-train-problems 600) reports
#   training pairs 76.7 %, held-out pairs 69.5 % (verifier-made and sampled together), fresh samples of training
#   problems 65.8 %. PPO from it, this recipe unchanged (REWARD_MODEL_DIR=that model, 1,000 steps, 0.45 s a step
#   median, reward server 0.06 s of it): held-out sampled 23.6 % -> 15.2 % at step 500 -> 12.5 %, greedy
#   64.0 % -> 17.5 % -> 11.5 %, rm_agreement 0.38 in the first 10 steps -> 0.28 in the last 20 (the model's
#   mean score -0.10 -> 0.14): exploited faster than the 1,000-step build, so `make demo-rm` keeps that one.
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

# The CPU demo's task on a mixture of experts (`make demo-moe`): GRPO on `a+b=` / `a-b=` arithmetic with the
# Qwen3-MoE starter (recipes/models/tiny_qwen3_moe.sh) on 2 processes with expert parallelism (EP 2: each process
# holds 2 of the 4 experts of every layer and the tokens travel to their experts; attention and embeddings are data
# parallel). The rollout engine records every token's experts and the actor replays them (--routing-replay).
#
# The starter is upcycled: a dense Qwen3 one expert wide (MLP 512) pre-trained for the dense demo's 1,760 steps, each
# MLP copied into the 4 experts (tools/make_starter_model.py says why). It starts as the dense model does: held-out
# sampled 22.5 %, greedy 61.0 % (the Qwen2 starter: 23.6 % / 64.0 %); built in 10.5 min (0.36 s a step, one thread).
#
# Settings: the dense demo's (recipes/tiny_cpu.sh) but 4x the prompts per step at half the peak rate, over 2,600
# steps. 32 prompts a step cost 2.2x the time of 8 (0.46 vs 0.21 s a step on quiet cores) and learn far more per
# step. All measured on the same starter, 2026-12-02, on 2 cores shared with other jobs (the results are bound by
# the step count; the times are not):
#   settings                                        held-out sampled / greedy           training accuracy
#   dense demo's: 8 prompts, lr 1.5e-4 -> 1e-5,
#     5,400 steps                                   26.9 / 31.0 at 1,800, 33.8 / 37.0   0.24 at 1,000, 0.39 at 3,600
#                                                   at 3,600 (stopped there)
#   the same over 3,000 steps                       36.1 / 48.5 at 3,000                0.41 at 2,800
#   16 prompts, lr 1.5e-4, 3,400 steps              (stopped at 1,150)                  0.33 at 1,000
#   16 prompts, lr 7.5e-5, 3,400 steps              35.1 / 47.5 at 1,700 (stopped)      0.35 at 1,000, 0.41 at 1,800
#   32 prompts, lr 7.5e-5, 2,600 steps (this)       44.2 / 62.0 at 1,300, 55.8 / 74.5   0.43 at 1,000, 0.58 at 2,400
# At the dense demo's rate the MoE lost greedy accuracy early (61 % -> 31 %) and learned more slowly than the dense
# model did at the same step; the lower rate and larger batch keep greedy accuracy and learn faster per step.
# Time: a step here is 0.46-0.49 s on 2 quiet cores (the update 0.35-0.45 s: 128 completions a process through
# attention, the expert all-to-alls and 2 of 4 experts, forward and backward), so 15 minutes hold ~1,800 steps.
# Measured with nothing else running, 2026-12-02, `--num-steps 1800` (the schedule over 1,800 steps):
#   held-out sampled 22.5 % -> 42.1 % (+19.6), greedy 61.0 % -> 61.0 %, in 14.9 min of training (0.487 s a step
#   median), peak memory 831 MiB per process. That is 78 % of the +25 points aimed at for 15 minutes; the recipe
#   keeps 2,600 steps (+33.3 above; ~20-21 min on quiet cores at that step time, 34.4 min on the shared ones).
#   A shorter response cap (--max-response-len 4, every answer fits) saved under 5 % a step: not kept.
# Routing over the 2,600 steps (metrics.jsonl): router_entropy 1.36 -> 0.96 (ln 4 = 1.39: the random router starts
# near uniform and specialises as the copies part), router_load_imbalance 1.59 -> 1.51, routing_topk_disagree_frac 0
# (the fp32 engine and actor choose the same experts), largest engine-actor log-prob gap 1.2e-4.
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO_ROOT/recipes/tiny_cpu.sh"
source "$REPO_ROOT/recipes/models/tiny_qwen3_moe.sh"

DATA_ARGS=(
  --prompt-data "$STARTER_DIR/train.jsonl"
  --eval-data "$STARTER_DIR/heldout.jsonl"
  --rollout-batch-size 32                     # prompts per step (x 8 samples = 256 completions)
)
ALGORITHM_ARGS+=(--routing-replay)
TRAINING_ARGS=(
  --num-steps 2600
  --lr 7.5e-5
  --min-lr 1e-5
  --lr-decay-style linear
  --micro-batch-size 128                      # each process's 128 completions in one micro-batch
  --seed 1234
)
LOGGING_ARGS=(
  --output-dir "$REPO_ROOT/runs/tiny_cpu_moe"
  --log-interval 10
  --eval-samples-per-prompt 4
)

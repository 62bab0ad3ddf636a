# PPO with a critic on the CPU demo task: the tiny_cpu recipe with GAE advantages from a Megatron value model
# (the actor's trunk plus a scalar head, its own optimizer, trained colocated on the same 2 processes).
# The four models: actor, critic, reference (--kl-coef > 0) and reward (the arithmetic verifier).
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO_ROOT/recipes/tiny_cpu.sh"

ALGORITHM_ARGS=(
  --advantage-estimator gae
  --gae-gamma 1.0
  --gae-lambda 1.0            # one score at the end of a ~3-token answer: A_t = R - V(s_t)
  --gae-whiten                # advantages whitened over the global batch's response tokens
  --value-clip 0.2
  --eps-clip 0.2
  --kl-coef 0.001
  --kl-estimator k3
  --loss-aggregation token-mean
)

# A step also runs the critic (values, then its update), ~2-3x a GRPO step, so fewer steps fit in the budget.
# Measured (2 shared cores, `make demo`'s starter): 1,094 steps in 9.5 min, train reward 0.26 -> 0.36 (200-step
# means), held-out sampled 23.6% -> 30.9%, greedy 64.0% -> 50.0%. The critic learns the mean reward but little
# more here (explained variance ~0), so this is close to REINFORCE with a batch baseline: the tokens of every
# wrong answer are pushed down, right first digits included, and greedy accuracy falls. The same recipe with
# --advantage-estimator reinforce_pp (batch-whitened rewards, no critic) did the same: 888 steps in 3 min, sampled
# 30.4%, greedy 47.0%. At --lr 1e-4 PPO's greedy fell further (40.5%, sampled 31.1%), hence a lower actor
# learning rate than tiny_cpu.sh's; GRPO's per-prompt baseline is what keeps greedy accuracy there.
TRAINING_ARGS=(
  --num-steps 2400
  --max-train-minutes 9.5
  --lr 5e-5
  --min-lr 5e-6
  --lr-decay-style linear
  --critic-lr 1e-4
  --micro-batch-size 32
  --seed 1234
)

LOGGING_ARGS=(
  --output-dir "$REPO_ROOT/runs/tiny_cpu_ppo"
  --log-interval 10
  --eval-samples-per-prompt 4
)

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

# A step also runs the critic (values, then its update): about twice a GRPO step. Bound by the step count only.
# Held-out greedy accuracy falls: the critic learns the mean reward but little more on this task, so the
# advantages are close to REINFORCE with a batch baseline; a higher rate lost more, hence 5e-5.
# Measured: docs/results.md, "PPO with a critic".
TRAINING_ARGS=(
  --num-steps 1000
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

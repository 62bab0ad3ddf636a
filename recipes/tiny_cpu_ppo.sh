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

# The critic trains twice as many models' worth of compute per step, so fewer steps fit in the budget.
TRAINING_ARGS=(
  --num-steps 2400
  --max-train-minutes 9.5
  --lr 1e-4
  --min-lr 1e-5
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

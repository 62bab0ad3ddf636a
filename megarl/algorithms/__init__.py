"""Algorithm slots of GRPO-style training as pure tensor functions: advantage estimators, policy losses,
KL estimators and loss aggregation. No megatron, no process groups; the trainer calls only the registries."""

from megarl.algorithms.advantages import (
    compute_dr_grpo_advantages,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_rloo_advantages,
    get_advantage_fn,
    register_advantage,
)
from megarl.algorithms.gae import compute_gae_advantages  # registers "gae" (PPO with a critic)
from megarl.algorithms.losses import (
    AGGREGATION_MODES,
    aggregate,
    get_kl_fn,
    get_policy_loss_fn,
    grpo_token_loss,
    kl_k1,
    kl_k2,
    kl_k3,
    policy_loss_clip,
    policy_loss_dual_clip,
    policy_loss_gspo,
    register_kl,
    register_policy_loss,
    truncated_is_weights,
)

__all__ = [
    "AGGREGATION_MODES",
    "aggregate",
    "compute_dr_grpo_advantages",
    "compute_gae_advantages",
    "compute_grpo_advantages",
    "compute_reinforce_pp_advantages",
    "compute_reinforce_pp_baseline_advantages",
    "compute_rloo_advantages",
    "get_advantage_fn",
    "get_kl_fn",
    "get_policy_loss_fn",
    "grpo_token_loss",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "policy_loss_clip",
    "policy_loss_dual_clip",
    "policy_loss_gspo",
    "register_advantage",
    "register_kl",
    "register_policy_loss",
    "truncated_is_weights",
]

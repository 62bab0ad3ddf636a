"""Algorithm slots of GRPO-style training as pure tensor functions: advantage estimators, policy losses,
KL estimators, rollout corrections and loss aggregation. No megatron, no process groups; the trainer calls only the
registries.

The names below are loaded on first use (PEP 562), so that `megarl.algorithms.slots`, the registries and the
built-ins' options, imports without torch (the command line is parsed on hosts that have none).
"""

import importlib

_FROM = {
    "megarl.algorithms.advantages": ("ADVANTAGES", "AdvantageEstimator", "AdvantageFn", "Needs",
                                     "compute_dr_grpo_advantages", "compute_grpo_advantages",
                                     "compute_reinforce_pp_advantages", "compute_reinforce_pp_baseline_advantages",
                                     "compute_rloo_advantages", "register_advantage"),
    "megarl.algorithms.corrections": ("OFF_POLICY_CORRECTIONS", "geometric_rejection_weights", "icepop_weights",
                                      "masked_is_weights", "register_correction", "sequence_truncated_is_weights",
                                      "truncated_is_weights"),
    "megarl.algorithms.gae": ("compute_gae_advantages",),
    "megarl.algorithms.losses": ("AGGREGATION_MODES", "KL_ESTIMATORS", "POLICY_LOSSES", "aggregate",
                                 "grpo_token_loss", "kl_k1", "kl_k2", "kl_k3", "policy_loss_cispo", "policy_loss_clip",
                                 "policy_loss_dual_clip", "policy_loss_gspo", "register_kl", "register_policy_loss"),
}
_MODULE_OF = {name: module for module, names in _FROM.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'megarl.algorithms' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))

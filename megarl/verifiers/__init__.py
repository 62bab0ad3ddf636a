"""Reward verifiers. Import neither torch nor megatron here: reward workers and `megarl-verify` stay light."""

from megarl.verifiers.base import OUTCOMES, VerifyResult, Verifier, get_verifier, register_verifier, verifier_names


def reward_names() -> list[str]:
    """Everything a row's `verifier` field may name alone: the rule verifiers and the reward models (a reward spec
    may compose them, `megarl.verifiers.compose`)."""
    from megarl.verifiers.reward_models import reward_model_names

    return sorted(verifier_names() + reward_model_names())


__all__ = ["OUTCOMES", "VerifyResult", "Verifier", "get_verifier", "register_verifier", "reward_names",
           "verifier_names"]

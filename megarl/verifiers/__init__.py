"""Reward verifiers. Import neither torch nor megatron here: reward workers and `megarl-verify` stay light."""

from megarl.verifiers.base import OUTCOMES, VerifyResult, Verifier, get_verifier, register_verifier, verifier_names

__all__ = ["OUTCOMES", "VerifyResult", "Verifier", "get_verifier", "register_verifier", "verifier_names"]

"""Reward verifiers. Import neither torch nor megatron here: reward workers and `megarl-verify` stay light."""

from megarl.verifiers.base import VerifyResult, Verifier, get_verifier, register_verifier, verifier_names

__all__ = ["VerifyResult", "Verifier", "get_verifier", "register_verifier", "verifier_names"]

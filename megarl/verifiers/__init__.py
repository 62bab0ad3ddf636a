"""Rule verifiers: a response and its ground truth in, a `VerifyResult` out, one sample at a time, in reward worker
processes (`megarl.reward.pool`) or the trainer. Built in: `arithmetic`, `code` (programs run in the sandbox),
`math` (sympy, in `math/`), `exact_string` (the last `\\boxed{}` character for character: the math demo's
control), `env_reward` (an OpenEnv environment's reward, `tool_use` with `--openenv`), `reasoning_gym`
(reasoning-gym's tasks, each by its own scorer; the `rg` extra). Import neither torch nor megatron here: reward
workers and `megarl-verify` stay light.
"""

from megarl.verifiers.base import (OUTCOMES, VERIFIERS, Verifier, VerifierCapabilities, VerifyResult,
                                   register_verifier)

__all__ = ["OUTCOMES", "VERIFIERS", "VerifyResult", "Verifier", "VerifierCapabilities", "register_verifier"]

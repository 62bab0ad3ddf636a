"""A user's plugin module, outside the megarl package (tests/e2e/test_plugins.py): a verifier, an advantage
estimator, an off-policy correction and a rollout backend, each with an option of its own, and a rollout function,
registered by name, usable from a recipe with `--plugins tests/e2e/example_plugin.py` (each option is then a flag,
`--first-chars`, `--advantage-scale`, `--ratio-cap`, `--engine-tag`, with no edit to megarl).

Each records the process it ran in, and the option it got, as an empty file `<what>.<pid>` under
$EXAMPLE_PLUGIN_TRACE (when set), so the test can tell the trainer's processes from the reward workers' and see
that the recipe's value reached the component.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from megarl.algorithms import compute_grpo_advantages, register_advantage, register_correction, truncated_is_weights
from megarl.registry import option
from megarl.rollout import ROLLOUTS, register_rollout
from megarl.rollout.backends import BACKENDS, register_backend
from megarl.verifiers import VerifyResult, register_verifier


def _trace(what: str) -> None:
    where = os.environ.get("EXAMPLE_PLUGIN_TRACE")
    if where:
        open(os.path.join(where, f"{what}.{os.getpid()}"), "a").close()


@dataclass
class StartsWithOptions:
    first_chars: str = option("0123456789", "starts_with_digit: the characters a response may start with")


@register_verifier("starts_with_digit", options=StartsWithOptions)
class StartsWithDigit:
    """Reward 1 when the response starts with one of `first_chars` (a digit by default), whatever the row's ground
    truth."""

    name = "starts_with_digit"

    def __init__(self, first_chars: str = "0123456789"):
        self.first_chars = first_chars

    def verify(self, response: str, ground_truth) -> VerifyResult:
        _trace(f"verifier-{self.first_chars}")
        ok = response[:1] != "" and response[:1] in self.first_chars
        return VerifyResult(float(ok), "correct" if ok else "incorrect", extracted=response[:1])


@register_rollout("tagged_single_turn")
def tagged_single_turn(engine, prompts, params, reward, tokenizer):
    """The default rollout function, each sample tagged with the number of turns it took (one) and whether its
    response ends with the stop token."""
    _trace("rollout")
    samples = ROLLOUTS.get("single_turn")(engine, prompts, params, reward, tokenizer)
    return [replace(s, metadata={**s.metadata, "turns": 1.0, "stopped": float(s.status.value == "completed")})
            for s in samples]


@dataclass
class ScaledOptions:
    advantage_scale: float = option(1.0, "scaled_grpo: GRPO's advantages times this")


@register_advantage("scaled_grpo", options=ScaledOptions)
def scaled_grpo(rewards, eps=1e-6, advantage_scale=1.0, **inputs):
    """GRPO's advantages, scaled: the estimator is called with its option, `advantage_scale`."""
    _trace(f"advantage-{advantage_scale:g}")
    return advantage_scale * compute_grpo_advantages(rewards, eps)


@dataclass
class CappedRatioOptions:
    ratio_cap: float = option(3.0, "capped_ratio: the importance weight's cap")

    def kwargs(self, cfg) -> dict:
        return {"cap": self.ratio_cap}  # the correction's keyword argument, under a flag of the plugin's naming


@register_correction("capped_ratio", options=CappedRatioOptions)
def capped_ratio(old_logp, rollout_logp, mask, cap):
    """Token-level truncated importance sampling under a name of the plugin's (its metrics `capped_ratio_*`)."""
    _trace(f"correction-{cap:g}")
    return truncated_is_weights(old_logp, rollout_logp, mask, cap, name="capped_ratio")


@dataclass
class TracedOptions:
    engine_tag: str = option("plain", "traced_builtin: a tag the backend records when it builds its engine")


@register_backend("traced_builtin", options=TracedOptions)
def traced_builtin(cfg, actor=None):
    """The built-in engine, built by a backend of the plugin's, which records the tag it was given."""
    _trace(f"backend-{BACKENDS.settings(cfg, 'traced_builtin').engine_tag}")
    return BACKENDS.get("builtin").build(cfg, actor)

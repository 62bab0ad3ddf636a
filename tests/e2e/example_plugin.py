"""A user's plugin module, outside the megarl package (tests/e2e/test_plugins.py): a verifier with an option of
its own and a rollout function, registered by name, usable from a recipe with `--plugins tests/e2e/example_plugin.py`
(the option is then a flag, `--first-chars`, with no edit to megarl).

Each records the process it ran in as an empty file `<what>.<pid>` under $EXAMPLE_PLUGIN_TRACE (when set), so
the test can tell the trainer's processes from the reward workers'.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from megarl.registry import option
from megarl.rollout import ROLLOUTS, register_rollout
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

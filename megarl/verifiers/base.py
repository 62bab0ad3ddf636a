"""The verifier boundary: a response and its ground truth in, a structured result out.

A verifier is chosen per sample by the `verifier` field of the data row, through the registry below, never by
dataset name. A verifier is a rule run on one sample at a time, in a reward worker process or the trainer; batch
sources that score in the trainer (reward models) are `megarl.reward.models`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol, get_args, runtime_checkable

from megarl.registry import Registry, refuse_bare_capabilities

Outcome = Literal["correct", "incorrect", "no_answer", "parse_error", "timeout"]
OUTCOMES: tuple[str, ...] = get_args(Outcome)


@dataclass
class VerifyResult:
    score: float  # the reward
    outcome: Outcome
    extracted: str | None = None  # the answer found in the response, as written
    normalized: str | None = None  # what was compared
    seconds: float = 0.0
    model_score: float | None = None  # a reward model's raw score, when one scored this row (`compose`)
    agrees: bool | None = None  # that model's verdict matches the row's rule verifier's (when both scored it)
    # What a sandboxed check cost (the `code` verifier): test cases run and the sandbox's CPU seconds for this
    # program; None where nothing ran in a sandbox. The reward stage adds them up into tests/s and CPU per program.
    tests_run: int | None = None
    sandbox_cpu_seconds: float | None = None
    # Times the check was run again because the sandbox failed under it (its worker, harness or container died or
    # was killed from outside; `megarl.sandbox.harness_protocol.RERUNS`): the row's `reward_sandbox_reruns`.
    sandbox_reruns: int = 0
    # What the response tried against its verifier, by category (`megarl.verifiers.signals.CATEGORIES`): a short
    # piece of evidence each. Signals change no reward: the verdict above is the same with or without them.
    signals: dict[str, str] = field(default_factory=dict)
    signals_seconds: float = 0.0  # the time computing them took (in `seconds` too); 0 with signals off


@runtime_checkable
class Verifier(Protocol):
    name: str

    def verify(self, response: str, ground_truth: Any) -> VerifyResult: ...


class VerifierCapabilities:
    """A verifier's optional abilities, declared: derive from this class (besides implementing `Verifier`) and set
    or override what applies; a verifier that does not derive from it has the defaults (`megarl.reward.pool`,
    `megarl.reward.functions.InProcessReward` read these, never probe for them).

    - `budget_s`: seconds one check may take, when the verifier enforces a budget of its own; a reward pool's
      worker is held to the smaller of it and the pool's timeout (None: the pool's timeout alone);
    - `verify_unguarded`: the same judgement without the verifier's own budget, for a caller that enforces one
      (a reward pool's worker, which is killed when it overruns);
    - `close`: release what the verifier holds (a helper process).
    """

    budget_s: float | None = None

    def verify_unguarded(self, response: str, ground_truth: Any) -> VerifyResult:
        return self.verify(response, ground_truth)  # type: ignore[attr-defined]

    def close(self) -> None:
        """Nothing to release."""


VERIFIERS: Registry[Callable[..., Verifier]] = Registry(
    "verifier", builtins=("megarl.verifiers.arithmetic", "megarl.verifiers.code", "megarl.verifiers.env_reward",
                          "megarl.verifiers.exact_string", "megarl.verifiers.math", "megarl.verifiers.reasoning_gym"))

# Class decorator: `@register_verifier("arithmetic")`, or `@register_verifier("code", options=CodeOptions)` for a
# verifier with flags of its own (`megarl.registry`). The class is built with the run's options for it as keyword
# arguments (none for most verifiers), in the trainer, in every reward worker and in `megarl-verify`, so every
# argument needs a default.


def register_verifier(name: str, *, options: type | None = None) -> Callable[[Any], Any]:
    """`VERIFIERS.register`, refusing a verifier class that sets a capability without deriving from
    `VerifierCapabilities` (it would lose it in silence: `megarl.registry.refuse_bare_capabilities`)."""

    def decorate(cls: Any) -> Any:
        refuse_bare_capabilities(cls, VerifierCapabilities, f"verifier {name!r}:")
        return VERIFIERS.register(name, options=options)(cls)

    return decorate

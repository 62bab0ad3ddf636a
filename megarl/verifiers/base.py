"""The verifier boundary: a response and its ground truth in, a structured result out.

A verifier is chosen per sample by the `verifier` field of the data row, through the registry below, never by
dataset name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol, get_args, runtime_checkable

from megarl.registry import Registry

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


@runtime_checkable
class Verifier(Protocol):
    name: str

    def verify(self, response: str, ground_truth: Any) -> VerifyResult: ...


_VERIFIERS: Registry[Callable[..., Verifier]] = Registry("verifier")


def register_verifier(name: str):
    """Class decorator: `@register_verifier("arithmetic")`. The class is built with the run's options for that
    verifier as keyword arguments (`megarl.config.verifier_options`; none for most verifiers), so every argument
    needs a default."""
    return _VERIFIERS.register(name)


def verifier_names() -> list[str]:
    _import_builtin()
    return _VERIFIERS.names()


def verifier_class(name: str) -> Callable[..., Verifier]:
    """What is registered as `name` (a class, usually); an unknown name raises ValueError listing the valid ones."""
    _import_builtin()
    return _VERIFIERS.get(name)


def get_verifier(name: str, **options) -> Verifier:
    """A new instance of the verifier registered as `name`, built with `options`; an unknown name raises
    ValueError listing the valid ones."""
    return verifier_class(name)(**options)


def _import_builtin():
    # Importing the modules registers them; done lazily so that base stays import-cycle free.
    from megarl.verifiers import arithmetic  # noqa: F401
    from megarl.verifiers import code  # noqa: F401
    from megarl.verifiers import math  # noqa: F401

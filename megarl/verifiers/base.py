"""The verifier boundary: a response and its ground truth in, a structured result out.

A verifier is chosen per sample by the `verifier` field of the data row, through the registry below, never by
dataset name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol, runtime_checkable

from megarl.registry import Registry

Outcome = Literal["correct", "incorrect", "no_answer", "parse_error", "timeout"]


@dataclass
class VerifyResult:
    score: float  # the reward
    outcome: Outcome
    extracted: str | None = None  # the answer found in the response, as written
    normalized: str | None = None  # what was compared
    seconds: float = 0.0


@runtime_checkable
class Verifier(Protocol):
    name: str

    def verify(self, response: str, ground_truth: Any) -> VerifyResult: ...


_VERIFIERS: Registry[Callable[[], Verifier]] = Registry("verifier")


def register_verifier(name: str):
    """Class decorator: `@register_verifier("arithmetic")`; the class is built with no arguments."""
    return _VERIFIERS.register(name)


def verifier_names() -> list[str]:
    _import_builtin()
    return _VERIFIERS.names()


def get_verifier(name: str) -> Verifier:
    """A new instance of the verifier registered as `name`; an unknown name raises ValueError listing them."""
    _import_builtin()
    return _VERIFIERS.get(name)()


def _import_builtin():
    # Importing the modules registers them; done lazily so that base stays import-cycle free.
    from megarl.verifiers import arithmetic  # noqa: F401
    from megarl.verifiers import code  # noqa: F401
    from megarl.verifiers import math  # noqa: F401

"""The verifier boundary: a response and its ground truth in, a structured result out.

A verifier is chosen per sample by the `verifier` field of the data row, through the registry below, never by
dataset name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol, runtime_checkable

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


_REGISTRY: dict[str, Callable[[], Verifier]] = {}


def register_verifier(name: str):
    """Class decorator: `@register_verifier("arithmetic")`; the class is built with no arguments."""

    def wrap(factory):
        if name in _REGISTRY:
            raise ValueError(f"verifier {name!r} is registered twice")
        _REGISTRY[name] = factory
        return factory

    return wrap


def verifier_names() -> list[str]:
    _import_builtin()
    return sorted(_REGISTRY)


def get_verifier(name: str) -> Verifier:
    _import_builtin()
    if name not in _REGISTRY:
        raise KeyError(f"unknown verifier {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]()


def _import_builtin():
    # Importing the modules registers them; done lazily so that base stays import-cycle free.
    from megarl.verifiers import arithmetic  # noqa: F401

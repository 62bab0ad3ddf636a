"""Reward specs: what a row's `verifier` field (and `--default-verifier`) may say, and how parts combine.

    "math"                       one verifier (or one reward model: "hf_rm")
    "0.7*math + 0.3*hf_rm"       a weighted sum of sources (a weight defaults to 1)
    "hf_rm + 0*arithmetic"       the reward model's score as the reward, the rule's outcome for accuracy and the
                                 agreement metric
    "math > hf_rm"               the rule first, the model for ties: s_math + w * sigmoid(s_hf_rm), w = 0.5 unless
    "math > 0.1*hf_rm"           given; with a 0/1 rule and w < 1 a correct answer always outranks a wrong one,
                                 and among equally right answers the model's favourite scores highest

How a composed row's result reads:
- reward: the formula above, from the parts' scores;
- outcome: the first rule verifier's outcome (so `accuracy`, dynamic sampling and evaluation stay the rule's),
  or the first part's when every part is a model; any part that timed out or failed to parse makes the whole row
  that outcome with reward 0 (a half-scored row would be a silent error in the reward);
- `model_score`: the first reward model's raw score, `agrees`: whether that model's verdict (score above its
  threshold) matches the first rule's (`correct` or not), for the health metrics.

Pure Python; names are checked against both registries (verifiers and reward models).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Sequence

from megarl.reward.models import REWARD_MODELS
from megarl.verifiers.base import VERIFIERS, VerifyResult
from megarl.verifiers import signals as hack_signals
from megarl.verifiers.signals import merge

GATE_WEIGHT = 0.5
SYNTAX = "a name, 'w1*a + w2*b' (a weighted sum) or 'rule > [w*]model' (the rule first, the model for ties)"
_TERM = re.compile(r"^\s*(?:([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*\*\s*)?([A-Za-z_][\w.\-]*)\s*$")


@dataclass(frozen=True)
class Part:
    name: str
    weight: float


@dataclass(frozen=True)
class Spec:
    kind: Literal["one", "sum", "gate"]
    parts: tuple[Part, ...]


def _term(text: str, spec: str) -> Part:
    m = _TERM.match(text)
    if m is None:
        raise ValueError(f"reward spec {spec!r}: cannot read {text.strip()!r}; a spec is {SYNTAX}")
    return Part(m.group(2), float(m.group(1)) if m.group(1) else 1.0)


@lru_cache(maxsize=256)
def parse(spec: str) -> Spec:
    """The spec's structure; ValueError naming the spec and the syntax when it has none."""
    if spec.count(">") > 1:
        raise ValueError(f"reward spec {spec!r}: one '>' at most; a spec is {SYNTAX}")
    if ">" in spec:
        rule_text, model_text = spec.split(">")
        rule, model = _term(rule_text, spec), _term(model_text, spec)
        if "*" in rule_text:
            raise ValueError(f"reward spec {spec!r}: the gate's rule takes no weight; a spec is {SYNTAX}")
        return Spec("gate", (rule, Part(model.name, model.weight if "*" in model_text else GATE_WEIGHT)))
    parts = tuple(_term(t, spec) for t in spec.split("+"))
    if len(parts) == 1 and "*" not in spec:
        return Spec("one", parts)
    return Spec("sum", parts)


def reward_names() -> list[str]:
    """Everything a row's `verifier` field may name alone: the rule verifiers and the reward models."""
    return sorted(VERIFIERS.names() + REWARD_MODELS.names())


def spec_error(spec: str) -> str | None:
    """Why `spec` is not a valid reward spec (bad syntax, a name in neither registry), or None."""
    try:
        parsed = parse(spec)
    except ValueError as e:
        return str(e)
    known = reward_names()
    unknown = [p.name for p in parsed.parts if p.name not in known]
    if unknown:
        return f"unknown verifier {unknown[0]!r}; registered: {', '.join(known)}"
    return None


def is_plain_rule(spec: str) -> bool:
    """A spec that is one registered rule verifier: scored exactly as before reward models existed."""
    return spec in VERIFIERS


def combine(spec: Spec, results: Sequence[VerifyResult], models: set[str]) -> VerifyResult:
    """One row's result from its parts' results (in `spec.parts` order); `models` names the reward models."""
    parts = spec.parts
    seconds = sum(r.seconds for r in results)
    rules = [r for p, r in zip(parts, results) if p.name not in models]
    scored = [r for p, r in zip(parts, results) if p.name in models]
    model_score = scored[0].score if scored else None
    agrees = (rules[0].outcome == "correct") == (scored[0].outcome == "correct") if rules and scored else None
    signals = merge(*(r.signals for r in results))
    signals_s = sum(r.signals_seconds for r in results)
    if rules and scored and scored[0].outcome == "correct" and rules[0].outcome == "incorrect" and \
            hack_signals.enabled():
        signals.setdefault("rm_disagrees", f"reward model scores {scored[0].score:.3g} (above its threshold) where "
                                           "the rule verifier says incorrect")
    for p, r in zip(parts, results):
        if r.outcome in ("timeout", "parse_error"):
            return VerifyResult(0.0, r.outcome, normalized=f"{p.name}: {r.normalized}", seconds=seconds,
                                model_score=None if p.name in models else model_score, signals=signals,
                                signals_seconds=signals_s)
    first = rules[0] if rules else results[0]
    if spec.kind == "gate":
        score = results[0].score + parts[1].weight * _sigmoid(results[1].score)
    else:
        score = sum(p.weight * r.score for p, r in zip(parts, results))
    return VerifyResult(score, first.outcome, extracted=first.extracted, normalized=first.normalized,
                        seconds=seconds, model_score=model_score, agrees=agrees, signals=signals,
                        signals_seconds=signals_s)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))

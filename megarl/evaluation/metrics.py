"""pass@k, maj@k and their bootstrap confidence intervals, from each prompt's verdicts; numpy, no torch.

- pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): with n samples of a prompt
  of which c are correct, the chance that k drawn without replacement hold at least one correct,
  1 - C(n - c, k) / C(n, k): unbiased for any k <= n, and c / n at k = 1 (the trainer's sampled accuracy).
- maj@k: a vote among the prompt's first k samples over the answers the verifier extracted (`Sample.extracted`,
  whitespace stripped; a sample without one abstains); the answer with the most votes wins, a tie going to the one
  that appeared first, and the prompt counts as solved when the winning answer's first sample was judged correct.
  No answer at all: not solved. Answers are compared as written (`7/12` and `14/24` are two answers).
- A figure over a set of prompts is the mean of its per-prompt values; its confidence interval is a percentile
  bootstrap over prompts: `resamples` draws of as many prompts with replacement (numpy's PCG64 seeded with
  `seed`), the mean of each, and their `(1 - confidence) / 2` and `(1 + confidence) / 2` quantiles (numpy's
  linear interpolation). Every figure of one set of prompts uses the same draws.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class PromptResult:
    """One prompt's samples as the verifier judged them, in the order they were drawn."""

    subset: str  # what the figures are grouped by (`subset`)
    correct: tuple[bool, ...]
    answers: tuple[str | None, ...] = ()  # the extracted answers, for maj@k; () when none were recorded
    tool_used: tuple[float, ...] = field(default=(), compare=False)  # per sample, from a tool-calling rollout

    @property
    def n(self) -> int:
        return len(self.correct)

    @property
    def c(self) -> int:
        return sum(self.correct)


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of the n samples, c of them correct, hold a correct one."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if k < 1 or k > n:
        raise ValueError(f"pass@{k} needs 1 <= k <= the samples per prompt ({n})")
    if n - c < k:  # every draw of k holds a correct one
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """1.0 when the majority answer among the first k samples is a correct one, else 0.0 (see the module
    docstring for abstentions and ties)."""
    if k < 1 or k > len(correct):
        raise ValueError(f"maj@{k} needs 1 <= k <= the samples per prompt ({len(correct)})")
    if len(answers) != len(correct):
        raise ValueError(f"maj@{k}: {len(answers)} answers for {len(correct)} verdicts")
    first: dict[str, bool] = {}  # each answer's first sample's verdict, in order of appearance
    for answer, ok in zip(answers[:k], correct[:k]):
        if answer is not None and answer.strip():
            first.setdefault(answer.strip(), bool(ok))
    if not first:
        return 0.0
    votes = Counter(a.strip() for a in answers[:k] if a is not None and a.strip())
    top = max(votes.values())
    winner = next(a for a in first if votes[a] == top)  # dicts keep insertion order: the first of the tied
    return 1.0 if first[winner] else 0.0


def subset(row_source: str, verifier: str) -> str:
    """What a row's figures are grouped under: its `source` field without a trailing `:<row number>` (as
    `megarl-prepare-data` writes them, "humaneval:12" -> "humaneval"), or its verifier when it has none."""
    name = re.sub(r":\d+$", "", row_source.strip())
    return name or verifier


def check_ks(ks: Sequence[int], n: int, what: str = "k") -> None:
    """Every k within 1..n, before any sample is drawn; ValueError naming the offending k."""
    for k in ks:
        if k < 1:
            raise ValueError(f"{what} {k}: k must be >= 1")
        if k > n:
            raise ValueError(f"{what} {k} is more than the {n} samples per prompt: pass@k and maj@k need k <= n "
                             f"(raise the samples per prompt to at least {k}, or drop k={k})")


def per_prompt(results: Sequence[PromptResult], metric: str) -> np.ndarray:
    """Each prompt's value of `metric` ("pass@K" or "maj@K")."""
    kind, _, k = metric.partition("@")
    if kind == "pass":
        return np.array([pass_at_k(r.n, r.c, int(k)) for r in results], dtype=np.float64)
    if kind == "maj":
        return np.array([maj_at_k(r.answers or (None,) * r.n, r.correct, int(k)) for r in results], dtype=np.float64)
    raise ValueError(f"unknown metric {metric!r}: pass@K or maj@K")


def bootstrap_ci(values: np.ndarray, *, resamples: int, seed: int, confidence: float) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of `values` (see the module docstring)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if len(values) == 0 or resamples < 1:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = np.empty(resamples, dtype=np.float64)
    chunk = max(1, 2_000_000 // len(values))  # draws held at once
    for start in range(0, resamples, chunk):
        size = min(chunk, resamples - start)
        means[start : start + size] = values[rng.integers(0, len(values), size=(size, len(values)))].mean(axis=1)
    lo, hi = np.percentile(means, [50 * (1 - confidence), 50 * (1 + confidence)])
    return float(lo), float(hi)


def summarize(results: Sequence[PromptResult], metrics: Sequence[str], *, resamples: int = 1000, seed: int = 0,
              confidence: float = 0.95) -> dict:
    """`{"prompts", "samples", metric: {"value", "ci": [lo, hi]}, ...}` over `results`; a bootstrap of `resamples`
    draws (0: no interval, `ci` None)."""
    out: dict = {"prompts": len(results), "samples": sum(r.n for r in results)}
    for metric in metrics:
        values = per_prompt(results, metric)
        value = math.fsum(values) / len(values) if len(values) else float("nan")  # exactly rounded: any order
        ci = list(bootstrap_ci(values, resamples=resamples, seed=seed, confidence=confidence)) if resamples else None
        out[metric] = {"value": value, "ci": ci}
    return out


def by_subset(results: Sequence[PromptResult], metrics: Sequence[str], **bootstrap) -> dict:
    """`{"overall": summarize(all), "by_source": {subset: summarize(its prompts)}}`, subsets in order of first
    appearance."""
    groups: dict[str, list[PromptResult]] = {}
    for r in results:
        groups.setdefault(r.subset, []).append(r)
    return {"overall": summarize(results, metrics, **bootstrap),
            "by_source": {name: summarize(rs, metrics, **bootstrap) for name, rs in groups.items()}}

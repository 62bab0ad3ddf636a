"""The benchmarks' reward: the share of digit characters in a response, as a megarl verifier (`bench_digits`)
and as a TRL reward function. A plain function on both sides, so a benchmark's reward phase measures the
frameworks' plumbing, not a verifier; train.py loads it with `--plugins tools/bench/digits_reward.py`."""

from __future__ import annotations

from megarl.verifiers import VerifyResult, register_verifier


def digit_share(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(len(text), 1)


@register_verifier("bench_digits")
class DigitShare:
    """megarl's side of the benchmark reward."""

    name = "bench_digits"

    def verify(self, response: str, ground_truth) -> VerifyResult:
        score = digit_share(response)
        return VerifyResult(score, "correct" if score >= 0.5 else "incorrect")


def digit_share_reward(completions, **kwargs) -> list[float]:
    """TRL's side of the benchmark reward."""
    return [digit_share(c) for c in completions]

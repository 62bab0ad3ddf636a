"""Verifier for the synthetic arithmetic task (`megarl.tasks.arithmetic`): the response must be the bare answer.

Rules, strict on purpose so that reward also teaches the clean format the task expects:
- The response ends at the first `<|endoftext|>` (callers usually strip it already; a leftover one, or anything
  an engine emitted after it, is ignored). Surrounding whitespace is ignored.
- The answer is the leading integer (optional `-`) of what remains, reported in `extracted`.
  No leading integer (empty, `"abc"`, `"x=19"`) -> `no_answer`, score 0.
- The whole remaining text must equal `str(ground_truth)` exactly -> `correct`, score 1; anything else ->
  `incorrect`, score 0. So `"19 junk"`, `"19abc"` and `"019"` earn nothing even where the leading integer is
  right: `extracted` still says `"19"`, which lets logs tell a format slip from a wrong sum.

`normalized` is the text actually compared (the stripped response). Imports neither torch nor megatron.
"""

from __future__ import annotations

import re
import time
from typing import Any

from megarl.verifiers.base import VerifyResult, register_verifier

EOS_TEXT = "<|endoftext|>"
_LEADING_INT = re.compile(r"-?\d+")


@register_verifier("arithmetic")
class ArithmeticVerifier:
    name = "arithmetic"

    def verify(self, response: str, ground_truth: Any) -> VerifyResult:
        start = time.perf_counter()
        result = _judge(response, str(ground_truth).strip())
        result.seconds = time.perf_counter() - start
        return result


def _judge(response: str, expected: str) -> VerifyResult:
    text = response.split(EOS_TEXT, 1)[0].strip()
    match = _LEADING_INT.match(text)
    if match is None:
        return VerifyResult(score=0.0, outcome="no_answer", extracted=None, normalized=text)
    if text == expected:
        return VerifyResult(score=1.0, outcome="correct", extracted=match.group(), normalized=text)
    return VerifyResult(score=0.0, outcome="incorrect", extracted=match.group(), normalized=text)

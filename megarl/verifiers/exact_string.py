"""The exact-string verifier: the control of the math demo, the reward a symbolic checker is measured against.

Correct (score 1) only when the text of the response's last `\\boxed{...}` (balanced braces; outer whitespace
stripped) is the ground truth character for character: `\\boxed{7/12}` for "7/12", but neither `\\boxed{14/24}`
nor `\\boxed{\\frac{7}{12}}`. No box, or one never closed -> `no_answer`; a label object without an answer (or a
None label) -> `parse_error`; anything else -> `incorrect`.

The ground truth is the answer string, or a `math` label `{"answer", "not_answers"}` (`megarl.verifiers.math`),
whose answer is taken: the same data rows serve both verifiers, and a not-answer can never equal the answer
character for character. Pure string work: no sympy, no torch.
"""

from __future__ import annotations

import re
import time
from typing import Any

from megarl.verifiers.base import VerifyResult, register_verifier

_BOXED = re.compile(r"\\boxed\{")


def last_boxed(response: str) -> str | None:
    """The text inside the last `\\boxed{...}`, braces balanced; None when there is none or it is not closed."""
    starts = [m.end() for m in _BOXED.finditer(response)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(response)):
        depth += {"{": 1, "}": -1}.get(response[i], 0)
        if depth == 0:
            return response[start:i]
    return None


@register_verifier("exact_string")
class ExactStringVerifier:
    name = "exact_string"

    def verify(self, response: str, ground_truth: Any) -> VerifyResult:
        start = time.perf_counter()
        answer = ground_truth.get("answer") if isinstance(ground_truth, dict) else ground_truth
        boxed = last_boxed(str(response))
        if answer is None:  # a label object without its answer: the row cannot be judged
            result = VerifyResult(0.0, "parse_error", normalized="the label has no 'answer'")
        elif boxed is None:
            result = VerifyResult(0.0, "no_answer")
        else:
            same = boxed.strip() == str(answer)
            result = VerifyResult(float(same), "correct" if same else "incorrect", extracted=boxed,
                                  normalized=boxed.strip())
        result.seconds = time.perf_counter() - start
        return result

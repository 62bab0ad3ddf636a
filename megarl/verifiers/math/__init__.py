"""Verifier for math answers: extract the final answer, normalise LaTeX and text, decide equivalence with sympy.

    MathVerifier().verify(r"... so the area is $\\boxed{\\frac{9}{4}\\pi}$.", r"\\frac94\\pi")  # correct

The ground truth is the answer (a string; a list or tuple is a list answer), or a dict that adds what does not
count:

    {"answer": "7/6", "not_answers": ["1/2+2/3"]}

`not_answers` are spellings equal to the answer in value that do not answer the question: the question's own
expression ("Compute: 1/2+2/3" is not answered by `\\boxed{1/2+2/3}`), the working's unfinished steps, the decimal
a "write as a fraction" question starts from. Equivalence judges values, so without them a policy is rewarded for
copying the question. A response whose answer uses the same numbers and letters as a not-answer, in any order
and arrangement (`2/3+1/2`, `\\frac{1}{2}+\\frac{2}{3}`), is `incorrect`: its numeric literals (by value: `.5` and
`0.50` are one number) and variable letters, as a multiset with signs and operators left out, are compared with
each not-answer's (`normalize.literals`). So a not-answer also rules out every right answer with exactly its
numbers and letters (for "Simplify: 3+x", `x+3`): list only spellings no right answer shares them with.

Outcomes: `correct` (score 1), `incorrect`, `no_answer` (nothing extractable), `parse_error` (an answer was found
but neither it nor a plain string comparison could be judged), `timeout` (the check ran out of its wall-clock
budget: huge exponent towers, deep nesting, giant sums...). Only `correct` scores.

Steps, cheapest first (see `extract`, `normalize`, `parse`, `equiv` in this package for the rules):
1. extraction (`strategy`: "lenient" by default, "strict" = the last `\\boxed{}` only);
2. normalisation of both sides; identical strings are correct without any parsing;
3. parsing into a small tree (numbers, expressions, relations, assignments, tuples and intervals, sets and
   lists, matrices, text); equivalence structure first, values second; sympy only for the values.

The whole check runs in a helper process under a wall-clock budget (`megarl.verifiers.budget.Guard`), so it
behaves the same from the main thread, a worker thread or a subprocess, and it can always be stopped. Inside a
reward-pool worker, which is itself killed when it overruns, `verify_unguarded` skips the extra hop.
This module imports neither sympy, torch nor megatron: the helper does the heavy lifting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from megarl.registry import option
from megarl.verifiers.base import VerifierCapabilities, VerifyResult, register_verifier

DEFAULT_BUDGET_S = 5.0
_JUDGE = "megarl.verifiers.math:judge"


@dataclass
class MathOptions:
    math_strategy: Literal["lenient", "strict"] = option("lenient", "math verifier: answer extraction (strict: the "
                                                         "last \\boxed{} only)")
    math_signals: bool = option(True, "math verifier: report reward-hacking signals (a copy of the question, "
                                      "hedged boxed answers, no working); no reward changes")

    def kwargs(self, cfg) -> dict[str, Any]:
        return dict(strategy=self.math_strategy, signals=self.math_signals)


@register_verifier("math", options=MathOptions)
class MathVerifier(VerifierCapabilities):
    name = "math"
    budget_s = DEFAULT_BUDGET_S  # seconds a check may take; a reward pool's worker is held to it too

    def __init__(self, strategy: str = "lenient", budget_s: float = DEFAULT_BUDGET_S, signals: bool = True):
        if strategy not in ("lenient", "strict"):
            raise ValueError(f"math verifier strategy must be 'lenient' or 'strict', got {strategy!r}")
        from megarl.verifiers.budget import Guard

        self.strategy, self.budget_s, self.signals = strategy, budget_s, signals
        self._guard = Guard(preload=("megarl.verifiers.math.equiv",))

    def verify(self, response: str, ground_truth: Any) -> VerifyResult:
        from megarl.verifiers.budget import BudgetExceeded

        start = time.perf_counter()
        try:
            fields = self._guard.call(_JUDGE, (response, ground_truth, self.strategy), self.budget_s)
            result = VerifyResult(*fields)
        except BudgetExceeded:
            result = VerifyResult(0.0, "timeout")
        except Exception as e:  # noqa: BLE001 - the helper died or sympy raised something unforeseen
            result = VerifyResult(0.0, "parse_error", normalized=f"verifier failed: {type(e).__name__}: {e}")
        self._signals(result, response, ground_truth)
        result.seconds = time.perf_counter() - start
        return result

    def verify_unguarded(self, response: str, ground_truth: Any) -> VerifyResult:
        """The same judgement in this process, with no budget: only for callers that enforce one themselves."""
        start = time.perf_counter()
        result = VerifyResult(*judge(response, ground_truth, self.strategy))
        self._signals(result, response, ground_truth)
        result.seconds = time.perf_counter() - start
        return result

    def _signals(self, result: VerifyResult, response: str, ground_truth: Any) -> None:
        from megarl.verifiers import signals

        if self.signals and signals.enabled():
            start = time.perf_counter()
            result.signals = signals.math_signals(response, ground_truth, result.extracted, result.outcome)
            result.signals_seconds = time.perf_counter() - start

    def close(self) -> None:
        self._guard.close()


def judge(response: str, ground_truth: Any, strategy: str = "lenient") -> tuple:
    """(score, outcome, extracted, normalized) for one response; runs wherever it is called (no budget here)."""
    from megarl.verifiers.math.equiv import equivalent
    from megarl.verifiers.math.extract import final_answer
    from megarl.verifiers.math.normalize import literals, normalize
    from megarl.verifiers.math.parse import Seq, parse_answer

    ground_truth, not_answers = _split_label(ground_truth)
    extracted = final_answer(str(response), strategy)
    if extracted is None:
        return 0.0, "no_answer", None, None
    pred = normalize(extracted)
    if not pred:
        return 0.0, "no_answer", extracted, pred
    if not_answers and literals(pred) in {literals(normalize(str(n))) for n in not_answers}:
        return 0.0, "incorrect", extracted, pred  # a copy of the question, or an unfinished step (see the docstring)
    if isinstance(ground_truth, (list, tuple)):  # several accepted answers in the data row: a list answer
        ground_truth = ", ".join(map(str, ground_truth))
    gold = normalize(str(ground_truth))
    if pred.replace(" ", "") == gold.replace(" ", ""):
        return 1.0, "correct", extracted, pred
    # Past this point any exception means "could not be judged": our parser's ParseError, sympy's many error types
    # (PolynomialError, NotImplementedError, ...), RecursionError on deep nesting. None of them may escape.
    try:
        gold_tree = parse_answer(gold)
    except Exception:  # noqa: BLE001 - see above: an unparsable gold answer, however it fails
        gold_tree = None
    try:
        pred_tree = parse_answer(pred, list_hint=isinstance(gold_tree, Seq) and gold_tree.kind == "list")
    except Exception:  # noqa: BLE001 - see above: an unparsable answer is a parse_error
        return 0.0, "parse_error", extracted, pred
    try:
        same = gold_tree is not None and equivalent(gold_tree, pred_tree)
    except Exception:  # noqa: BLE001 - see above: a comparison that fails is a parse_error
        return 0.0, "parse_error", extracted, pred
    return (1.0, "correct", extracted, pred) if same else (0.0, "incorrect", extracted, pred)


def _split_label(ground_truth: Any) -> tuple[Any, list]:
    """(the answer, its not-answers) of a label: a dict `{"answer", "not_answers"}`, or a plain answer."""
    if not isinstance(ground_truth, dict):
        return ground_truth, []
    unknown = set(ground_truth) - {"answer", "not_answers", "needs_working"}
    if "answer" not in ground_truth or unknown:
        raise ValueError(f"a math label given as an object needs the key 'answer' and may have 'not_answers' and "
                         f"'needs_working' (a hacking signal's, `megarl.verifiers.signals`); got "
                         f"the keys {sorted(ground_truth)}")
    not_answers = ground_truth.get("not_answers") or []
    if not isinstance(not_answers, (list, tuple)):
        raise ValueError(f"a math label's 'not_answers' must be a list of spellings, got {type(not_answers).__name__}")
    return ground_truth["answer"], list(not_answers)

"""The math verifier: extraction, each answer family (with look-alikes that must NOT match), the time budget, and
the same verdicts from the main thread, a thread and a subprocess.

Expectations are written out by hand here; the labelled cases of `tools/bench/verifier_math.py` are deliberately
not used.
Most cases call `judge` (the verdict without the helper process) to stay fast; the budget tests use the verifier.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import REPO, env
from megarl.verifiers import VERIFIERS
from megarl.verifiers.math import MathVerifier, judge

OUTCOMES = {"correct", "incorrect", "no_answer", "parse_error", "timeout"}


def verdict(response: str, gold: str) -> bool:
    return judge(response, gold)[1] == "correct"


def boxed(answer: str) -> str:
    return f"Some working first. So the final result is $\\boxed{{{answer}}}$."


# -- answer families: (response answer, gold, expected) -----------------------------------------------------------

NUMBERS = [
    ("42", "42", True), ("42.0", "42", True), ("-7", "-7", True), ("7", "-7", False),
    ("1,234,567", "1234567", True), ("12{,}345", "12345", True), ("1\\,000", "1000", True),
    (".5", "0.5", True), ("0.50", "\\frac{1}{2}", True), ("2.5e3", "2500", True),
    ("1.5\\times 10^{-3}", "0.0015", True),
    ("2.5e3", "250", False), ("007", "7", True), ("17", "71", False),
]
FRACTIONS = [
    ("\\frac{3}{4}", "0.75", True), ("\\dfrac34", "3/4", True), ("\\tfrac{6}{8}", "\\frac34", True),
    ("2\\frac{1}{2}", "\\frac{5}{2}", True),  # a mixed number
    ("-2\\frac{1}{2}", "-2.5", True), ("1/2", "2", False), ("\\frac{1}{2}", "\\frac{2}{1}", False),
    ("0.333", "\\frac{1}{3}", False), ("0.3333333333333333", "\\frac{1}{3}", True),
]
CONSTANTS_AND_RADICALS = [
    ("3.14", "\\pi", False), ("3.14159", "\\pi", False), ("\\pi", "\\pi", True), ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("3\\sqrt{2}", "\\sqrt{8}", False), ("\\sqrt{2}/2", "\\frac{1}{\\sqrt{2}}", True), ("e^{i\\pi}", "-1", True),
    ("\\ln 8", "3\\ln 2", True), ("\\ln 9", "3\\ln 2", False), ("\\log_2 8", "3", True), ("2^{10}", "1024", True),
    ("2^{10}", "1025", False), ("2^{3^{4^{5}}}+1", "2^{3^{4^{5}}}", False), ("10^{100}+1", "10^{100}", False),
]
EXPRESSIONS = [
    ("(x+1)^2", "x^2+2x+1", True), ("(x+1)^2", "x^2+1", False), ("\\sin^2 x+\\cos^2 x", "1", True),
    ("2\\sin x\\cos x", "\\sin(2x)", True), ("2\\sin x\\cos x", "\\sin(3x)", False),
    ("\\frac{x}{2}+\\frac{1}{2}", "\\frac{x+1}{2}", True), ("x+x", "3x", False), ("3+4i", "4i+3", True),
    ("3+4i", "3+5i", False), ("\\frac{n(n+1)}{2}", "\\frac{n^2+n}{2}", True),
]
RELATIONS = [
    ("y=2x+1", "2x-y+1=0", True), ("y=2x+1", "y=2x-1", False), ("x>3", "3<x", True), ("x\\ge 3", "x>3", False),
    ("-x>-1", "x<1", True), ("x>-1", "x<1", False), ("x=5", "5", True), ("5", "x=5", True), ("x+y=5", "5", False),
    ("k = 2 + 2 = 4", "4", True), ("x \\neq 2", "x != 2", True), ("-2 \\le x \\le 7", "[-2, 7]", True),
    ("-2 < x \\le 7", "[-2, 7]", False),
]
INTERVALS = [
    ("[1, 2)", "[1,2)", True), ("(1, 2)", "[1, 2]", False), ("[1,2)", "(1,2]", False),
    ("(-\\infty, 3]", "x \\le 3", True), ("(-\\infty, 3)", "x \\le 3", False),
    ("[0,1] \\cup [2,3]", "[2,3] \\cup [0,1]", True), ("[0,1] \\cup [2,3]", "[0,1] \\cup (2,3]", False),
    ("x \\in (0, \\infty)", "(0,\\infty)", True),
]
SETS_AND_TUPLES = [
    ("(1,2)", "[1,2]", False), ("(1,2)", "(2,1)", False), ("(1, \\frac{9}{2})", "(1, 4.5)", True),
    ("\\{1, 2, 3\\}", "\\{3, 2, 1\\}", True), ("\\{1, 2\\}", "(1, 2)", False), ("\\{1,2\\}", "\\{1,2,3\\}", False),
    ("2, 1", "1, 2", True), ("1, 2", "(1, 2)", True), ("2, 1", "(1, 2)", False), ("1, 2, 3", "1, 2", False),
    ("(1,2), (3,4)", "(3,4), (1,2)", True), ("(1,2), (3,4)", "(3,4), (2,1)", False),
    ("p = 5, q = 2", "5, 2", True),
]
PLUS_MINUS = [
    ("1 \\pm \\sqrt{2}", "1+\\sqrt{2}, 1-\\sqrt{2}", True), ("\\pm 3", "3", False), ("-3, 3", "\\pm 3", True),
    ("1 \\pm \\sqrt{2}", "1 \\pm \\sqrt{3}", False),
]
MATRICES = [
    ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{bmatrix}1&2\\\\3&4\\end{bmatrix}", True),
    ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{pmatrix}1&2\\\\3&5\\end{pmatrix}", False),
    ("\\begin{pmatrix} 1 & 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", False),
    ("\\begin{pmatrix} \\frac{1}{2} \\\\ 0.25 \\end{pmatrix}", "\\begin{pmatrix}0.5\\\\\\frac14\\end{pmatrix}", True),
    ("\\begin{pmatrix} 1 & 0 \\\\ 0 & 1 \\end{pmatrix} + \\begin{pmatrix} 1 & 0 \\\\ 0 & 1 \\end{pmatrix}",
     "\\begin{pmatrix}2&0\\\\0&2\\end{pmatrix}", True),
    ("\\begin{pmatrix}1\\end{pmatrix}, \\begin{pmatrix}2\\end{pmatrix}",
     "\\begin{pmatrix}2\\end{pmatrix}, \\begin{pmatrix}1\\end{pmatrix}", True),
    ("\\begin{pmatrix}1\\end{pmatrix}, \\begin{pmatrix}1\\end{pmatrix}",
     "\\begin{pmatrix}2\\end{pmatrix}, \\begin{pmatrix}1\\end{pmatrix}", False),
]
TEXT_AND_CHOICES = [
    ("\\text{Evelyn}", "\\text{Evelyn}", True), ("Evelyn", "\\text{Evelyn}", True), ("\\text{(B)}", "B", True),
    ("(B)", "\\text{B}", True), ("C", "B", False), ("\\text{odd}", "\\text{even}", False),
]
UNITS_PERCENT_MONEY = [
    ("25\\%", "25", True), ("25 percent", "25\\%", True), ("26\\%", "25\\%", False), ("5\\text{ cm}", "5", True),
    ("5 \\mbox{ cm}^2", "5", True), ("6\\text{ cm}", "5", False), ("\\$12.50", "12.5", True), ("90^\\circ", "90", True),
    ("91^{\\circ}", "90", False),
]

FAMILIES = {
    "numbers": NUMBERS, "fractions": FRACTIONS, "constants_radicals": CONSTANTS_AND_RADICALS,
    "expressions": EXPRESSIONS, "relations": RELATIONS, "intervals": INTERVALS, "sets_tuples": SETS_AND_TUPLES,
    "plus_minus": PLUS_MINUS, "matrices": MATRICES, "text_choices": TEXT_AND_CHOICES,
    "units_percent_money": UNITS_PERCENT_MONEY,
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_answer_family(family):
    wrong = [(answer, gold, expected) for answer, gold, expected in FAMILIES[family]
             if verdict(boxed(answer), gold) != expected]
    assert not wrong, f"{family}: verdicts differ from expected for {wrong}"


def test_every_family_has_look_alikes_that_must_not_match():
    for family, cases in FAMILIES.items():
        assert any(not expected for *_, expected in cases), family


# -- extraction ---------------------------------------------------------------------------------------------------

EXTRACTION = [
    ("We get $\\boxed{\\frac{1}{\\sqrt{2}}}$ in the end.", "\\frac{1}{\\sqrt{2}}"),
    ("so the value is \\boxed 5 and we stop", "5"),
    ("\\fbox{12}", "12"),
    ("At first I wrote $\\boxed{1}$ but that was wrong, as the second case shows when checked carefully. "
     "Finally $\\boxed{2}$.", "2"),
    ("The roots are $\\boxed{-2}$ and $\\boxed{1}$.", "-2, 1"),
    ("So x = 5.\nThe answer is 7.", "7"),
    ("Working...\n**Answer:** $\\frac{3}{4}$", "\\frac{3}{4}"),
    ("Final Answer: The final answer is $12$. I hope it is correct.", "12"),
    ("Adding the parts gives the total of $x = 3$", "x = 3"),
    ("12", "12"),
    ("<think>maybe \\boxed{3}</think>\nThe answer is $\\boxed{4}$.", "4"),
    ("The answer is \\boxed{6}.<|im_end|><|im_start|>user\nWhat is \\boxed{9}?", "6"),
]


@pytest.mark.parametrize("response, extracted", EXTRACTION)
def test_extraction(response, extracted):
    score, outcome, got, _ = judge(response, extracted)
    assert got == extracted and outcome == "correct"


def test_no_answer_and_strict_strategy():
    assert judge("I do not know how to solve this.", "3")[1] == "no_answer"
    assert judge("", "3")[1] == "no_answer"
    assert judge("The answer is 3.", "3", "strict")[1] == "no_answer"  # strict: boxed only
    assert judge("The answer is $\\boxed{3}$.", "3", "strict")[1] == "correct"
    assert judge("$\\boxed{2}$ then $\\boxed{3}$", "3", "strict")[2] == "3"
    with pytest.raises(ValueError, match="strategy"):
        MathVerifier(strategy="loose")


def test_digits_inside_words_are_not_answers():
    assert not verdict("AZYUK2A", "2")


# -- labels with not-answers: equal in value, but no answer (a copy of the question) ------------------------------


def test_not_answers_are_incorrect_in_any_arrangement_and_right_answers_still_count():
    label = {"answer": "7/6", "not_answers": ["1/2+2/3"]}
    for copy in ("1/2+2/3", "2/3+1/2", "\\frac{1}{2}+\\frac{2}{3}", "\\dfrac12 + \\dfrac23"):
        assert judge(boxed(copy), "7/6")[1] == "correct"  # equal in value: without the label's list it scores
        assert judge(boxed(copy), label)[:2] == (0.0, "incorrect"), copy
    for right in ("7/6", "14/12", "\\frac{7}{6}", "1+1/6"):
        assert judge(boxed(right), label)[:2] == (1.0, "correct"), right
    assert judge(boxed("5/6"), label)[1] == "incorrect"  # still wrong for being wrong
    # decimals are compared by value (0.375 = .3750); letters count (x^2+x-6 is not (x-2)(x+3))
    assert judge(boxed(".3750"), {"answer": "3/8", "not_answers": ["0.375"]})[1] == "incorrect"
    fac = {"answer": "(x-2)(x+3)", "not_answers": ["x^2+x-6"]}
    assert judge(boxed("-6+x+x^2"), fac)[1] == "incorrect"
    assert judge(boxed("(x+3)(x-2)"), fac)[1] == "correct"
    assert judge(boxed("(x+3)(x-2)"), {"answer": "(x-2)(x+3)"})[1] == "correct"  # not_answers is optional


def test_a_label_object_needs_an_answer_and_a_list():
    with pytest.raises(ValueError, match="'answer'"):
        judge(boxed("1"), {"value": "1"})
    with pytest.raises(ValueError, match="list"):
        judge(boxed("1"), {"answer": "1", "not_answers": "1+0"})


# -- the verifier object: registry, budget, threads and processes -------------------------------------------------


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(budget_s=1.5)
    yield v
    v.close()


def test_registered_and_structured(verifier):
    assert "math" in VERIFIERS.names() and VERIFIERS.build("math").name == "math"
    verifier.verify("$\\boxed{1}$", "1")  # the first call also waits for the helper to start
    r = verifier.verify("Thus $\\boxed{\\dfrac{1}{2}}$.", "0.5")
    assert (r.score, r.outcome, r.extracted, r.normalized) == (1.0, "correct", "\\dfrac{1}{2}", "\\frac{1}{2}")
    assert 0 < r.seconds < 1.5
    assert isinstance(verifier.verify("$\\boxed{3}$", "4").score, float)


@pytest.mark.parametrize("answer", ["10^{10^{10^{10}}}", "9^{9^{9^{9}}}"])
def test_pathological_input_is_a_timeout_within_budget(verifier, answer):
    verifier.verify("$\\boxed{1}$", "1")  # a ready helper, so the clock measures the check only
    start = time.perf_counter()
    r = verifier.verify(f"$\\boxed{{{answer}}}$", "1")
    elapsed = time.perf_counter() - start
    assert r.outcome == "timeout" and r.score == 0.0
    assert elapsed < 1.5 + 1.0
    assert verifier.verify("$\\boxed{7}$", "7").outcome == "correct"  # a fresh helper took over


def test_deep_nesting_ends_cleanly(verifier):
    r = verifier.verify("$\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}$", "1")
    assert r.outcome in ("parse_error", "timeout", "correct") and r.seconds < 1.5 + 1.0


CONSISTENCY = [
    ("$\\boxed{\\frac{1}{2}}$", "0.5"), ("$\\boxed{(1,2)}$", "[1,2]"), ("The answer is $x \\ge 5$.", "5 \\le x"),
    ("$\\boxed{10^{10^{10^{10}}}}$", "1"), ("nothing here", "3"), ("$\\boxed{\\{1,2\\}}$", "\\{2,1\\}"),
]
EXPECTED_OUTCOMES = ["correct", "incorrect", "correct", "timeout", "no_answer", "correct"]

_SUBPROCESS = """
import json, sys
from megarl.verifiers.math import MathVerifier
cases = json.loads(sys.stdin.read())
v = MathVerifier(budget_s=1.5)
print(json.dumps([v.verify(r, g).outcome for r, g in cases]))
"""


@pytest.mark.slow
def test_same_answers_from_main_thread_thread_and_subprocess(verifier):
    main = [verifier.verify(r, g).outcome for r, g in CONSISTENCY]
    in_thread: list = []
    other = MathVerifier(budget_s=1.5)  # a thread of its own and its own helper
    t = threading.Thread(target=lambda: in_thread.extend(other.verify(r, g).outcome for r, g in CONSISTENCY))
    t.start()
    t.join(timeout=120)
    other.close()
    proc = subprocess.run([sys.executable, "-c", _SUBPROCESS], input=json.dumps(CONSISTENCY), capture_output=True,
                          text=True, env=env(), cwd=REPO, timeout=180)
    assert proc.returncode == 0, proc.stderr
    in_subprocess = json.loads(proc.stdout.strip().splitlines()[-1])
    assert main == EXPECTED_OUTCOMES
    assert in_thread == EXPECTED_OUTCOMES
    assert in_subprocess == EXPECTED_OUTCOMES


# -- property: arbitrary input never raises and always returns within the budget -----------------------------------

LATEX_PIECES = list("0123456789+-*/^_{}()[]\\|=<>,.;:$ !%xyzabnpeiq") + [
    "\\frac", "\\sqrt", "\\boxed{", "\\pi", "\\infty", "\\pm", "\\cup", "\\{", "\\}", "\\left(", "\\right)",
    "\\text{", "\\begin{pmatrix}", "\\end{pmatrix}", "&", "\\\\", "The answer is ", "\\sum_{k=1}^{"]
LATEXISH = st.lists(st.sampled_from(LATEX_PIECES), max_size=40).map("".join)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(response=st.one_of(st.text(max_size=200), LATEXISH), gold=st.one_of(st.text(max_size=30), LATEXISH))
def test_arbitrary_input_never_raises_and_respects_the_budget(verifier, response, gold):
    start = time.perf_counter()
    r = verifier.verify(response, gold)
    elapsed = time.perf_counter() - start
    assert r.outcome in OUTCOMES and r.score in (0.0, 1.0)
    assert not (r.normalized or "").startswith("verifier failed"), r.normalized  # no unforeseen exception inside
    # the budget, plus a replacement helper's start-up when the previous call timed out
    assert elapsed < verifier.budget_s + 5.0

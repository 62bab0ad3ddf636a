"""The math-forms task: counts and split, answers checked without the verifier, the verifier against the control."""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict
from fractions import Fraction
from math import isqrt

import pytest

from megarl.tasks.math_forms import (
    CHARS,
    NUM_HELDOUT,
    all_problems,
    exact_string_reward,
    forms,
    label,
    not_answers,
    read_jsonl,
    rows,
    solution,
    split_problems,
    write_jsonl,
    wrong_forms,
)
from megarl.verifiers import VERIFIERS

PROMPT_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n+-=*/^().,:\\{}_")


@pytest.fixture(scope="module")
def problems():
    return all_problems()


def _family(problem) -> str:
    return problem.id.split("-", 1)[0]


def _boxed(response: str) -> str:
    return response.rsplit("\\boxed{", 1)[1][:-1]


# --- counts, split, rows ------------------------------------------------------------------------------------------


def test_thousands_of_distinct_problems_in_every_family(problems):
    assert len(problems) >= 2000
    assert len({p.id for p in problems}) == len({p.prompt for p in problems}) == len(problems)
    by_family = defaultdict(int)
    for p in problems:
        by_family[_family(p)] += 1
    assert set(by_family) == {"add", "mul", "pct", "dec", "root", "fac", "lin"}
    assert all(p.verifier == "math" for p in problems)
    assert all_problems() == problems  # a fixed enumeration


def test_split_is_seeded_order_independent_and_disjoint(problems):
    train, heldout = split_problems(problems, num_heldout=200, seed=0)
    assert len(heldout) == NUM_HELDOUT == 200 and len(train) == len(problems) - 200
    assert not {p.id for p in train} & {p.id for p in heldout}
    shuffled = problems[:]
    random.Random(7).shuffle(shuffled)
    assert {p.id for p in split_problems(shuffled, num_heldout=200, seed=0)[1]} == {p.id for p in heldout}
    assert split_problems(seed=0) == (train, heldout)
    assert {p.id for p in split_problems(problems, num_heldout=200, seed=1)[1]} != {p.id for p in heldout}


def test_jsonl_rows_round_trip_and_keep_their_forms(problems, tmp_path):
    path = tmp_path / "math.jsonl"
    assert write_jsonl(path, problems[:50]) == 50
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert set(rows[0]) == {"id", "prompt", "answer", "verifier"} and rows[0]["verifier"] == "math"
    back = read_jsonl(path)
    assert back == problems[:50] and forms(back[0]) == forms(problems[0])


def test_prompts_use_plain_ascii_and_responses_the_tokenizer_chars(problems):
    assert all(set(p.prompt) <= PROMPT_CHARS for p in problems)
    for p in problems[::7]:
        for response in [solution(p), *forms(p), *wrong_forms(p)]:
            assert set(response) <= set(CHARS), (p.id, response)


def test_every_problem_has_other_spellings_and_mistakes(problems):
    n_forms = [len(forms(p)) for p in problems]
    assert sum(n_forms) / len(problems) >= 2 and min(n_forms) >= 1
    assert all(wrong_forms(p) for p in problems)
    for p in problems[::11]:
        spellings = [_boxed(r) for r in forms(p)]
        assert p.answer not in spellings and len(set(spellings)) == len(spellings)


# --- canonical answers, checked in plain python -------------------------------------------------------------------


def _python_expr(text: str) -> str:
    """`(x-2)(x+3)`, `3(x+1)`, `x^2+x-6` as python: `^` is `**`, juxtaposition is `*`."""
    return re.sub(r"(?<=[\d)a-z])(?=[a-z(])", "*", text.replace("^", "**"))


def _numeric_value(problem) -> Fraction:
    if m := re.fullmatch(r"Compute: (\d+)/(\d+)([+*])(\d+)/(\d+)\n", problem.prompt):
        x, y = Fraction(int(m[1]), int(m[2])), Fraction(int(m[4]), int(m[5]))
        return x + y if m[3] == "+" else x * y
    if m := re.fullmatch(r"Write (\d+) percent as a fraction\n", problem.prompt):
        return Fraction(int(m[1]), 100)
    m = re.fullmatch(r"Write (\d+\.\d+) as a fraction\n", problem.prompt)
    return Fraction(m[1])


def _check_root(problem):
    m = re.fullmatch(r"Compute: \\sqrt\{(\d+)\}\+\\sqrt\{(\d+)\}\n", problem.prompt)
    k, r = map(int, re.fullmatch(r"(\d+)\\sqrt\{(\d+)\}", problem.answer).groups())
    assert all(r % (s * s) for s in range(2, isqrt(r) + 1)), "the radicand is square-free"
    coefficients = []
    for n in map(int, m.groups()):
        assert n % r == 0 and isqrt(n // r) ** 2 == n // r
        coefficients.append(isqrt(n // r))
    assert sum(coefficients) == k


def _at(text: str, var: str, point: int) -> int:
    return eval(_python_expr(text), {"__builtins__": {}}, {var: point})  # our own generated polynomials


def _check_expression(problem):
    expr = problem.prompt.split(": ", 1)[1].strip()
    (var,) = set(re.findall(r"[a-z]", expr))
    for point in (-7, -2, 0, 1, 3, 10):
        assert _at(problem.answer, var, point) == _at(expr, var, point), (problem.id, point)
    if _family(problem) == "fac":
        assert re.fullmatch(rf"\({var}[+-]\d\)(\({var}[+-]\d\)|\^2)", problem.answer), problem.answer


def test_canonical_answers_are_the_values_of_the_problems(problems):
    for p in problems:
        family = _family(p)
        if family in ("add", "mul", "pct", "dec"):
            assert p.answer == str(_numeric_value(p)), p.id  # the value, in lowest terms
        elif family == "root":
            _check_root(p)
        else:
            _check_expression(p)


# --- the math verifier against the exact-string control ------------------------------------------------------------


def test_exact_string_reward_reads_the_last_box():
    assert exact_string_reward("1/2 = 2/4\n\\boxed{1/2}", "1/2") == 1.0
    assert exact_string_reward("\\boxed{3} then \\boxed{ \\frac{1}{2} }", "\\frac{1}{2}") == 1.0
    assert exact_string_reward("\\boxed{1/2} then \\boxed{2/4}", "1/2") == 0.0
    assert exact_string_reward("1/2", "1/2") == 0.0
    assert exact_string_reward("\\boxed{1/2", "1/2") == 0.0


@pytest.fixture(scope="module")
def math_verifier():
    v = VERIFIERS.build("math")
    yield v
    v.close()


def _sample(problems, per_family: int, seed: int = 0):
    by_family = defaultdict(list)
    for p in sorted(problems, key=lambda p: p.id):
        by_family[_family(p)].append(p)
    rng = random.Random(seed)
    return [p for family in sorted(by_family) for p in rng.sample(by_family[family], per_family)]


def _copies(problem) -> list[str]:
    """Responses that box a not-answer, as written and with the operands of a sum or product swapped."""
    out = []
    for text in not_answers(problem):
        out.append(text)
        if m := re.fullmatch(r"([^+*]+)([+*])([^+*]+)", text):
            out.append(m[3] + m[2] + m[1])
    return [f"working\n\\boxed{{{c}}}" for c in out]


def _judge(verifier, sample):
    """(disagreements with the task's labels, responses judged, share of right forms the control scores 0).
    The label is the row's: the answer and the not-answers, which the verifier must score incorrect."""
    disagreements, judged, control_zero, n_forms = [], 0, 0, 0
    for p in sample:
        for response, right in [(solution(p), True)] + [(r, True) for r in forms(p)] + [
                (r, False) for r in wrong_forms(p) + _copies(p)]:
            outcome = verifier.verify(response, label(p)).outcome
            judged += 1
            if (outcome == "correct") != right:
                disagreements.append((p.id, _boxed(response), p.answer, outcome))
        for response in forms(p):
            n_forms += 1
            control_zero += exact_string_reward(response, p.answer) == 0.0
        assert exact_string_reward(solution(p), p.answer) == 1.0
        assert all(exact_string_reward(r, p.answer) == 0.0 for r in wrong_forms(p))
    return disagreements, judged, control_zero / n_forms


def test_verifier_agrees_on_a_seeded_sample(problems, math_verifier):
    # 63 problems, 480 responses: about a second once the verifier's helper process has started
    disagreements, judged, control_zero_share = _judge(math_verifier, _sample(problems, 9))
    assert not disagreements, f"{len(disagreements)}/{judged} responses judged otherwise: {disagreements[:10]}"
    assert control_zero_share >= 0.5


@pytest.mark.slow
def test_verifier_agrees_on_every_problem(problems, math_verifier):
    # 5,198 problems, 38,789 responses: about 30 s on one core
    disagreements, judged, control_zero_share = _judge(math_verifier, problems)
    assert not disagreements, f"{len(disagreements)}/{judged} responses judged otherwise: {disagreements[:10]}"
    assert control_zero_share >= 0.5


def test_copies_of_the_question_are_equal_in_value_and_listed_as_not_answers(problems, math_verifier):
    """The hole the labels close: a boxed copy of the question scores with a plain answer label."""
    sample = [p for p in _sample(problems, 3) if not_answers(p)]
    assert {_family(p) for p in sample} == {"add", "mul", "dec", "root", "fac", "lin"}  # pct: `35\\%` is 35
    for p in sample:
        question = p.prompt.split(": ", 1)[1].strip() if ": " in p.prompt else p.prompt.split()[1]
        assert question in not_answers(p)
        copy = f"working\n\\boxed{{{question}}}"
        assert math_verifier.verify(copy, p.answer).outcome == "correct", p.id
        assert math_verifier.verify(copy, label(p)).outcome == "incorrect", p.id


def test_rows_carry_the_label_for_either_verifier(problems, tmp_path):
    (row,) = rows([problems[0]], verifier="exact_string")
    assert row == {"id": problems[0].id, "prompt": problems[0].prompt, "verifier": "exact_string",
                   "answer": {"answer": problems[0].answer, "not_answers": not_answers(problems[0])}}
    assert json.loads(json.dumps(row)) == row


def test_exact_string_verifier_is_the_control_reward():
    v = VERIFIERS.build("exact_string")
    gold = {"answer": "7/12", "not_answers": ["1/3+1/4"]}
    cases = [("4/12+3/12 = 7/12\n\\boxed{7/12}", "correct"), ("\\boxed{ 7/12 }", "correct"),
             ("\\boxed{14/24}", "incorrect"), ("\\boxed{\\frac{7}{12}}", "incorrect"),
             ("\\boxed{7/12} then \\boxed{1/3+1/4}", "incorrect"), ("7/12", "no_answer"), ("\\boxed{7/12", "no_answer")]
    for response, outcome in cases:
        for truth in (gold, "7/12"):
            r = v.verify(response, truth)
            assert (r.outcome, r.score) == (outcome, float(outcome == "correct")), (response, truth)
            assert r.score == exact_string_reward(response, "7/12")
    assert v.verify("\\boxed{7/12}", {"not_answers": []}).outcome == "parse_error"  # a label with no answer

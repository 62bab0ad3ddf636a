"""The task of the math demo: problems whose right answer has many spellings, so only a symbolic check rewards it.

Seven families, 5,198 distinct problems, each with one canonical answer (the data row's ground truth):

    family  prompt                          canonical     other right spellings (`forms`)
    add     Compute: 1/3+1/4                7/12          14/24  \\frac{7}{12}  \\dfrac{7}{12}
    mul     Compute: 2/5*3/4                3/10          6/20  \\frac{3}{10}  0.3
    pct     Write 35 percent as a fraction  7/20          35/100  \\frac{7}{20}  0.35
    dec     Write 0.375 as a fraction       3/8           375/1000  \\frac{3}{8}
    root    Compute: \\sqrt{8}+\\sqrt{2}      3\\sqrt{2}     \\sqrt{18}  3\\sqrt2  3*\\sqrt{2}
    fac     Factor: x^2+x-6                 (x-2)(x+3)    (x+3)(x-2)  (-2+x)(x+3)  (x-2)*(x+3)
    lin     Simplify: 2x+3+x                3x+3          3+3x  3*x+3  3(x+1)  (2+1)x+3

A response is one line of working, then the answer boxed on its own line (`solution`, `forms`, `wrong_forms`):

    Compute: 1/3+1/4\\n  +  1/3+1/4 = 4/12+3/12 = 7/12\\n\\boxed{7/12}

The `math` verifier scores every spelling in `forms` correct and every one in `wrong_forms` (an off-by-one
numerator, the sum of numerators over the sum of denominators, sqrt(a)+sqrt(b) = sqrt(a+b), a sign error)
incorrect; `exact_string_reward`, the control, scores 1 only for the canonical string, so it rewards none of the
forms. Plain-text `sqrt(8)` is not offered as a spelling: the verifier does not read it as a root.

A copy of the question is no answer, though equal in value: the verifier judges values, so to it `\\boxed{1/3+1/4}`
equals 7/12 and `\\boxed{x^2+x-6}` equals (x-2)(x+3), and RL would learn to copy. `not_answers` lists, per
problem, the question's expression and the working's unfinished steps (`4/12+3/12`, `2\\sqrt{2}+\\sqrt{2}`, the
decimal a `dec` question starts from); `label` puts them in the data row (`{"answer", "not_answers"}`), and the
`math` verifier then scores a response written with the same numbers and letters as one of them incorrect
(`megarl.verifiers.math`). No right spelling in `forms` shares its numbers and letters with a not-answer (tested).

Pure Python (no torch, no sympy), like `megarl.tasks.arithmetic`, whose `Problem` rows and jsonl helpers this
module reuses (and the `exact_string` verifier's box reader); `CHARS` extends that task's tokenizer by the
characters of LaTeX answers.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

from megarl.tasks import arithmetic
from megarl.tasks.arithmetic import TOKENIZER_CHARS, Problem, read_jsonl, write_jsonl
from megarl.verifiers.exact_string import last_boxed

__all__ = ["CHARS", "NUM_HELDOUT", "VERIFIER", "Problem", "all_problems", "exact_string_reward", "forms", "label",
           "not_answers", "read_jsonl", "rows", "solution", "split_problems", "wrong_forms", "write_jsonl"]

NUM_HELDOUT = 200
VERIFIER = "math"
CHARS = TOKENIZER_CHARS + "\\{}^_"

_VARS_FAC = ("x", "y", "t")
_VARS_LIN = ("x", "y")
_SQUAREFREE = (2, 3, 5, 6, 7, 10)
_DEC_DENOMINATORS = (2, 4, 5, 8, 10, 20, 25, 40, 50)  # at most three decimal places


class _Case(NamedTuple):
    prompt: str
    working: str  # one line
    answer: str  # canonical
    right: list[str]  # other correct spellings of the answer
    wrong: list[str]  # plausible mistakes
    copies: list[str]  # equal in value but no answer: the question's expression, unfinished steps of the working


# -- spelling helpers -----------------------------------------------------------------------------------------------


def _unique(spellings, exclude: str) -> list[str]:
    """Keep the first of each spelling, drop the canonical one."""
    out: list[str] = []
    for s in spellings:
        if s != exclude and s not in out:
            out.append(s)
    return out


def _latex_frac(n: int, d: int, macro: str = "frac") -> str:
    sign = "-" if n < 0 else ""
    return f"{sign}\\{macro}{{{abs(n)}}}{{{d}}}"


def _decimal(v: Fraction) -> str | None:
    """`v` as a terminating decimal ("0.35", "2.0"), or None when it does not terminate within 6 places."""
    for k in range(7):
        scaled = v * 10**k
        if scaled.denominator == 1:
            n = abs(scaled.numerator)
            sign = "-" if v < 0 else ""
            if k == 0:
                return f"{sign}{n}.0"
            return f"{sign}{n // 10**k}.{n % 10**k:0{k}d}"
    return None


def _fraction_forms(value: Fraction, unreduced: list[tuple[int, int]]) -> list[str]:
    """Right spellings of a number: LaTeX fractions, the unreduced fractions of the working, a decimal."""
    n, d = value.numerator, value.denominator
    forms = [_latex_frac(n, d), _latex_frac(n, d, "dfrac")] if d > 1 else []
    for un, ud in unreduced:
        if (un, ud) != (n, d):
            forms += [f"{un}/{ud}", _latex_frac(un, ud)]
    forms.append(_decimal(value))
    return _unique((f for f in forms if f is not None), exclude=str(value))


def _wrong_numbers(value: Fraction, candidates: list[str]) -> list[str]:
    return _unique((c for c in candidates if Fraction(c) != value), exclude=str(value))


def _term(k: int, v: str, first: bool) -> str:
    """`k*v` as written in a sum: "3x", "-x", "+x", "+3x"; an empty string for k == 0."""
    if k == 0:
        return ""
    body = v if abs(k) == 1 else f"{abs(k)}{v}"
    sign = "-" if k < 0 else ("" if first else "+")
    return sign + body


def _linear(k: int, b: int, v: str) -> str:
    """k*v + b with the variable first: "3x+3", "-x-4", "5" when k == 0."""
    return (_term(k, v, True) + (f"{b:+d}" if b else "")) if k else str(b)


def _factor(v: str, p: int) -> str:
    return f"({v}{p:+d})" if p else v


def _factored(v: str, p: int, q: int) -> str:
    p, q = sorted((p, q))
    return f"{_factor(v, p)}^2" if p == q else _factor(v, p) + _factor(v, q)


def _radical(k: int, r: int, braces: bool = True) -> str:
    root = f"\\sqrt{{{r}}}" if braces else f"\\sqrt{r}"
    return root if k == 1 else f"{k}{root}"


# -- the families -----------------------------------------------------------------------------------------------------


def _add(a: int, b: int, c: int, d: int) -> _Case:
    value, lcd = Fraction(a, b) + Fraction(c, d), math.lcm(b, d)
    na, nc = a * lcd // b, c * lcd // d
    working = f"{a}/{b}+{c}/{d} = {na}/{lcd}+{nc}/{lcd} = {na + nc}/{lcd}"
    right = _fraction_forms(value, [(na + nc, lcd), (a * d + c * b, b * d)])
    wrong = _wrong_numbers(value, [f"{na + nc + 1}/{lcd}", f"{a + c}/{b + d}", str(-value)])
    copies = [f"{a}/{b}+{c}/{d}", f"{na}/{lcd}+{nc}/{lcd}"]
    return _Case(f"Compute: {a}/{b}+{c}/{d}", working, str(value), right, wrong, copies)


def _mul(a: int, b: int, c: int, d: int) -> _Case:
    value = Fraction(a * c, b * d)
    working = f"{a}/{b}*{c}/{d} = {a}*{c}/({b}*{d}) = {a * c}/{b * d}"
    right = _fraction_forms(value, [(a * c, b * d)])
    wrong = _wrong_numbers(value, [f"{a * c + 1}/{b * d}", str(Fraction(a * d, b * c)), str(-value)])
    copies = [f"{a}/{b}*{c}/{d}", f"{a}*{c}/({b}*{d})"]
    return _Case(f"Compute: {a}/{b}*{c}/{d}", working, str(value), right, wrong, copies)


def _pct(p: int) -> _Case:
    value = Fraction(p, 100)
    right = _fraction_forms(value, [(p, 100)])
    wrong = _wrong_numbers(value, [f"{p + 1}/100", f"{p}/10", str(p)])
    # `35\\%` is 35 to the verifier, not 0.35: no copy of this question is equal to its answer
    return _Case(f"Write {p} percent as a fraction", f"{p} percent = {p}/100", str(value), right, wrong, [])


def _dec(n: int, d: int) -> _Case:
    value = Fraction(n, d)
    text = _decimal(value)
    places = len(text.split(".")[1])
    scaled = int(text.replace(".", ""))
    # the decimal itself is a right value but not what the question asks for, so it is no form
    right = [f for f in _fraction_forms(value, [(scaled, 10**places)]) if f != text]
    wrong = _wrong_numbers(value, [f"{n + 1}/{d}", f"{scaled}/{10 ** (places + 1)}", f"{d}/{n}"])
    return _Case(f"Write {text} as a fraction", f"{text} = {scaled}/{10**places}", str(value), right, wrong, [text])


def _root(a: int, c: int, r: int) -> _Case:
    """sqrt(a^2 r) + sqrt(c^2 r) = (a+c) sqrt(r), r square-free."""
    k = a + c
    working = f"\\sqrt{{{a * a * r}}}+\\sqrt{{{c * c * r}}} = {_radical(a, r)}+{_radical(c, r)}"
    right = [f"\\sqrt{{{k * k * r}}}", f"{k}*\\sqrt{{{r}}}", f"\\sqrt{{{r}}}\\cdot {k}"]
    if r < 10:
        right.append(_radical(k, r, braces=False))
    right += [_radical(k // s, s * s * r) for s in range(2, k) if k % s == 0][:1]  # half-way: 3\sqrt{8}
    # sqrt(x)+sqrt(y) = sqrt(x+y), an off-by-one coefficient, a wrong radicand; compared by their squares
    wrong = [(1, (a * a + c * c) * r), (k + 1, r), (k, r + 1)]
    wrong_spelled = [_radical(m, s) for m, s in wrong if m * m * s != k * k * r]
    expression = f"\\sqrt{{{a * a * r}}}+\\sqrt{{{c * c * r}}}"
    copies = _unique([expression, f"{_radical(a, r)}+{_radical(c, r)}"], exclude="")
    if a == c == 1 and r == 2:
        copies = []  # \sqrt{2}+\sqrt{2} has the numbers of 2\sqrt{2}: the verifier could not tell them apart
    return _Case(f"Compute: {expression}", working, _radical(k, r), _unique(right, _radical(k, r)), wrong_spelled,
                 copies)


def _fac(v: str, p: int, q: int) -> _Case:
    """v^2 + (p+q) v + pq = (v+p)(v+q), p <= q, neither zero."""
    poly = f"{v}^2" + _term(p + q, v, False) + f"{p * q:+d}"
    times = f"{p}*{q}" if q > 0 else f"{p}*({q})"
    working = f"{times} = {p * q} and {p}{q:+d} = {p + q}"
    answer = _factored(v, p, q)
    fp, fq = _factor(v, p), _factor(v, q)
    right = [fq + fp, f"({p}+{v}){fq}", f"{fp}*{fq}"]
    if p == q:
        right.append(f"({p}+{v})^2")
    mistakes = [(-p, -q), (p + 1, q), (p, -q)]
    wrong = [_factored(v, *m) for m in mistakes if sorted(m) != [p, q]]
    return _Case(f"Factor: {poly}", working, answer, _unique(right, answer), _unique(wrong, answer), [poly])


def _lin(v: str, a: int, b: int, c: int) -> _Case:
    """a v + b + c v = (a+c) v + b."""
    k = a + c
    expression = f"{_term(a, v, True)}{b:+d}{_term(c, v, False)}"
    working = f"{_term(a, v, True)}{_term(c, v, False)} = {_term(k, v, True)}"
    answer = _linear(k, b, v)
    right = [f"{b}{_term(k, v, False)}", f"({a}{c:+d}){v}{b:+d}"]
    if abs(k) != 1:
        right.append(f"{k}*{v}{b:+d}")
    g = math.gcd(k, b)
    if g > 1:
        right.append(f"{g}({_linear(k // g, b // g, v)})")
    mistakes = [(k + 1, b), (k, -b), (a * c, b)]
    wrong = [_linear(m, n, v) for m, n in mistakes if (m, n) != (k, b)]
    return _Case(f"Simplify: {expression}", working, answer, _unique(right, answer), _unique(wrong, answer),
                 [expression])


def _proper(max_den: int = 9):
    return [(n, d) for d in range(2, max_den + 1) for n in range(1, d)]


_FAMILIES = {
    "add": (_add, [(a, b, c, d) for a, b in _proper() for c, d in _proper()]),
    "mul": (_mul, [(a, b, c, d) for a, b in _proper() for c, d in _proper()]),
    "pct": (_pct, [(p,) for p in range(1, 101)]),
    "dec": (_dec, [(n, d) for d in _DEC_DENOMINATORS for n in range(1, d) if math.gcd(n, d) == 1]),
    "root": (_root, [(a, c, r) for r in _SQUAREFREE for a in range(1, 8) for c in range(1, 8)]),
    "fac": (_fac, [(v, p, q) for v in _VARS_FAC for p in range(-9, 10) for q in range(p, 10) if p and q]),
    "lin": (_lin, [(v, a, b, c) for v in _VARS_LIN for a in range(1, 6) for b in range(-9, 10)
                   for c in range(-5, 6) if b and c and a + c]),
}


# -- the task ---------------------------------------------------------------------------------------------------------


def _id(family: str, args: tuple) -> str:
    return f"{family}-" + "_".join(map(str, args))  # "add-1_3_1_4", "fac-x_-3_2": the family, then its operands


def _case(problem: Problem) -> _Case:
    family, _, rest = problem.id.partition("-")
    make, _ = _FAMILIES[family]
    return make(*(int(s) if s.lstrip("-").isdigit() else s for s in rest.split("_")))


def _respond(working: str, spelling: str) -> str:
    return f"{working}\n\\boxed{{{spelling}}}"


def all_problems() -> list[Problem]:
    """Every problem, family by family in a fixed order."""
    problems = []
    for family, (make, arg_list) in _FAMILIES.items():
        for args in arg_list:
            case = make(*args)
            problems.append(Problem(_id(family, args), case.prompt + "\n", case.answer, VERIFIER))
    return problems


def split_problems(
    problems: list[Problem] | None = None, num_heldout: int = NUM_HELDOUT, seed: int = 0
) -> tuple[list[Problem], list[Problem]]:
    """(train, heldout): as `megarl.tasks.arithmetic.split_problems`, a seeded choice by id, whatever the order."""
    return arithmetic.split_problems(all_problems() if problems is None else problems, num_heldout, seed)


def solution(problem: Problem) -> str:
    """The demonstration response: the working, then the canonical answer boxed."""
    case = _case(problem)
    return _respond(case.working, case.answer)


def forms(problem: Problem) -> list[str]:
    """Responses whose boxed answer is right but spelled otherwise than the canonical answer."""
    case = _case(problem)
    return [_respond(case.working, s) for s in case.right]


def wrong_forms(problem: Problem) -> list[str]:
    """Responses whose boxed answer is a plausible mistake."""
    case = _case(problem)
    return [_respond(case.working, s) for s in case.wrong]


def not_answers(problem: Problem) -> list[str]:
    """Spellings equal to the answer in value that do not answer the question (see the module docstring)."""
    return _case(problem).copies


def label(problem: Problem) -> dict:
    """The data row's ground truth for the `math` verifier: the canonical answer and the not-answers."""
    return {"answer": problem.answer, "not_answers": not_answers(problem)}


def rows(problems: list[Problem], verifier: str = VERIFIER) -> list[dict]:
    """Training rows `{"id", "prompt", "answer", "verifier"}` whose answer is `label`, for `verifier`."""
    return [{"id": p.id, "prompt": p.prompt, "answer": label(p), "verifier": verifier} for p in problems]


def exact_string_reward(response: str, answer: str) -> float:
    """The control's reward: 1.0 when the text in the last `\\boxed{}` (outer whitespace stripped) is `answer`
    (the `exact_string` verifier's rule)."""
    boxed = last_boxed(response)
    return 1.0 if boxed is not None and boxed.strip() == answer else 0.0

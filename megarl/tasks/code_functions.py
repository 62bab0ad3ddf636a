"""The generated task of the code demo: write a one-line Python function `f(x)` from a spec in words.

A problem composes 1-3 primitives over ints, strings and lists of ints (`x + 3`, `sorted`, `sum`, `.upper()`, ...),
chained so that each one's output type is the next one's input type. The prompt states the signature and the
chain in words; the model writes the whole function:

    # f(x: list) -> int: only the even elements, then sum, then times 3
    def f(x):
        return sum([v for v in x if v % 2 == 0]) * 3

The row's answer is what the `code` verifier takes in function style, `{"test": "assert f([1, 2]) == 6\\n...",
"entry_point": "f"}`: four asserts on inputs drawn with a seed from the problem's id. Their expected values come
from plain-Python reference implementations, never from running the generated source, so the tests check the
source fragments rather than repeat them. `solution` is the canonical source, for pre-training a starter;
`wrong_solution` gives a plausible wrong one (a neighbouring primitive, a constant one off).

Chains are enumerated shortest first and deduplicated by behaviour: a chain whose outputs on a fixed probe set
equal an earlier one's (`x + 1` then `x + 2` is `x + 3`) is dropped, and so are chains that are constant or the
identity on the probes, fail on one of them, or give outputs too large to read. What is left is 15,617
distinct problems; a seeded split sets 200 aside, never trained on.

Pure Python, like `megarl.tasks.arithmetic`, whose tokenizer characters it extends.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from megarl.tasks import arithmetic
from megarl.tasks.arithmetic import TOKENIZER_CHARS

NUM_HELDOUT = 200
NUM_TESTS = 4
MAX_STEPS = 3
VERIFIER = "code"
# The prompts keep to these characters (`#`: prompt + solution is a Python file); the solutions add `%` (mod,
# even/odd). CHARS is the tokenizer's alphabet.
PROMPT_CHARS = TOKENIZER_CHARS + "[]_'\"<>#"
CHARS = PROMPT_CHARS + "%"
# Outputs larger than this (ints) or longer (lists, strings) make a problem unreadable: such chains are dropped.
MAX_INT = 10_000
MAX_LEN = 20


@dataclass(frozen=True)
class Primitive:
    """One step of a chain. `source` is a format string over the inner expression: `{x}` where any expression
    fits (a call's argument), `{t}` where a compound one needs parentheses (`{t} * 3` of `x + 1` is `(x + 1) * 3`).
    `atomic` says whether this step's own expression can go in a `{t}` slot bare."""

    name: str  # unique among the primitives taking the same type; part of problem ids
    takes: str  # "int", "str" or "list" (of ints)
    gives: str
    phrase: str  # what the prompt says
    source: str
    fn: Callable[[Any], Any]  # the reference implementation
    atomic: bool = True


def _primitives() -> list[Primitive]:
    P = Primitive
    ps = []
    for k in (1, 2, 3, 5, 10):
        ps.append(P(f"add{k}", "int", "int", f"plus {k}", f"{{t}} + {k}", lambda x, k=k: x + k, False))
    for k in (1, 2, 3, 5):
        ps.append(P(f"sub{k}", "int", "int", f"minus {k}", f"{{t}} - {k}", lambda x, k=k: x - k, False))
    for k in (2, 3, 4, 5, 10):
        ps.append(P(f"mul{k}", "int", "int", f"times {k}", f"{{t}} * {k}", lambda x, k=k: x * k, False))
    for k in (2, 3, 10):
        ps.append(P(f"div{k}", "int", "int", f"divided by {k} rounded down", f"{{t}} // {k}",
                    lambda x, k=k: x // k, False))
    for k in (2, 3, 5, 10):
        ps.append(P(f"mod{k}", "int", "int", f"mod {k}", f"{{t}} % {k}", lambda x, k=k: x % k, False))
    ps += [
        P("abs", "int", "int", "absolute value", "abs({x})", abs),
        P("neg", "int", "int", "negated", "-{t}", lambda x: -x, False),
        P("square", "int", "int", "squared", "{t} ** 2", lambda x: x * x, False),
        P("relu", "int", "int", "at least 0", "max({x}, 0)", lambda x: max(x, 0)),
        P("str", "int", "str", "as a string", "str({x})", str),
        P("range", "int", "list", "the numbers from 0 up to it, exclusive", "list(range({x}))",
          lambda x: list(range(x))),
    ]
    for t, what in (("list", "element"), ("str", "character")):
        ps += [
            P("rev", t, t, "reversed", "{t}[::-1]", lambda x: x[::-1]),
            P("tail", t, t, f"without the first {what}", "{t}[1:]", lambda x: x[1:]),
            P("init", t, t, f"without the last {what}", "{t}[:-1]", lambda x: x[:-1]),
            P("take2", t, t, f"the first 2 {what}s", "{t}[:2]", lambda x: x[:2]),
            P("take3", t, t, f"the first 3 {what}s", "{t}[:3]", lambda x: x[:3]),
            P("twice", t, t, "repeated twice", "{t} * 2", lambda x: x * 2, False),
            P("len", t, "int", "length", "len({x})", len),
        ]
    for k in (1, 2, 3):
        ps.append(P(f"mapadd{k}", "list", "list", f"each element plus {k}", f"[v + {k} for v in {{x}}]",
                    lambda x, k=k: [v + k for v in x]))
    for k in (2, 3):
        ps.append(P(f"mapmul{k}", "list", "list", f"each element times {k}", f"[v * {k} for v in {{x}}]",
                    lambda x, k=k: [v * k for v in x]))
    ps += [
        P("sort", "list", "list", "sorted", "sorted({x})", sorted),
        P("sortdesc", "list", "list", "sorted in descending order", "sorted({x}, reverse=True)",
          lambda x: sorted(x, reverse=True)),
        P("unique", "list", "list", "its distinct elements, sorted", "sorted(set({x}))", lambda x: sorted(set(x))),
        P("mapneg", "list", "list", "each element negated", "[-v for v in {x}]", lambda x: [-v for v in x]),
        P("mapabs", "list", "list", "each element absolute", "[abs(v) for v in {x}]", lambda x: [abs(v) for v in x]),
        P("mapsquare", "list", "list", "each element squared", "[v * v for v in {x}]", lambda x: [v * v for v in x]),
        P("evens", "list", "list", "only the even elements", "[v for v in {x} if v % 2 == 0]",
          lambda x: [v for v in x if v % 2 == 0]),
        P("odds", "list", "list", "only the odd elements", "[v for v in {x} if v % 2 == 1]",
          lambda x: [v for v in x if v % 2 == 1]),
        P("positives", "list", "list", "only the positive elements", "[v for v in {x} if v > 0]",
          lambda x: [v for v in x if v > 0]),
        P("sum", "list", "int", "sum", "sum({x})", sum),
        P("max", "list", "int", "largest element", "max({x})", max),
        P("min", "list", "int", "smallest element", "min({x})", min),
        P("first", "list", "int", "first element", "{t}[0]", lambda x: x[0]),
        P("last", "list", "int", "last element", "{t}[-1]", lambda x: x[-1]),
        P("upper", "str", "str", "in upper case", "{t}.upper()", str.upper),
        P("lower", "str", "str", "in lower case", "{t}.lower()", str.lower),
        P("swapcase", "str", "str", "with the case of each letter swapped", "{t}.swapcase()", str.swapcase),
        P("capitalize", "str", "str", "capitalized", "{t}.capitalize()", str.capitalize),
        P("exclaim", "str", "str", "followed by !", "{t} + '!'", lambda x: x + "!", False),
        P("dropa", "str", "str", "with every a removed", "{t}.replace('a', '')", lambda x: x.replace("a", "")),
        P("atob", "str", "str", "with every a replaced by b", "{t}.replace('a', 'b')",
          lambda x: x.replace("a", "b")),
        P("sortchars", "str", "str", "with its characters sorted", "''.join(sorted({x}))",
          lambda x: "".join(sorted(x))),
        P("counta", "str", "int", "number of a characters", "{t}.count('a')", lambda x: x.count("a")),
        P("findb", "str", "int", "position of the first b, or -1", "{t}.find('b')", lambda x: x.find("b")),
        P("countupper", "str", "int", "number of upper case letters", "len([c for c in {x} if c.isupper()])",
          lambda x: len([c for c in x if c.isupper()])),
    ]
    return ps


PRIMITIVES: dict[tuple[str, str], Primitive] = {(p.takes, p.name): p for p in _primitives()}

# The fixed inputs two chains must differ on to count as two problems; the tests draw others (`_draw_input`).
PROBES: dict[str, list] = {
    "int": [-7, -2, 0, 1, 3, 4, 9, 12, 17],
    "list": [[3, 1, 2], [5, -2, 8, 8, 1], [-4, 7, 0, 6], [10, 3, -1, 2, 9, 4], [2, 2], [6, 11, 4], [-3, -8, 5]],
    "str": ["abc", "Banana", "xyzab", "aAbB", "hello", "BCa", "cabbage", "Dbe"],
}


@dataclass(frozen=True)
class Problem:
    id: str  # "fn-list-evens-sum-mul3": the input type and the chain, stable across runs
    prompt: str  # "# f(x: list) -> int: only the even elements, then sum, then times 3\n"
    answer: dict  # {"test": "assert f(...) == ...\n" * 4, "entry_point": "f"}, the code verifier's ground truth
    solution: str  # "def f(x):\n    return sum([v for v in x if v % 2 == 0]) * 3\n"
    verifier: str = VERIFIER

    @property
    def chain(self) -> list[Primitive]:
        takes, *names = self.id.split("-")[1:]
        return _chain(takes, names)


def _chain(takes: str, names: Iterable[str]) -> list[Primitive]:
    chain = []
    for name in names:
        chain.append(PRIMITIVES[takes, name])
        takes = chain[-1].gives
    return chain


def _run(chain: list[Primitive], x: Any) -> Any:
    for p in chain:
        x = p.fn(x)
    return x


def _readable(value: Any) -> bool:
    if isinstance(value, int):
        return abs(value) <= MAX_INT
    return len(value) <= MAX_LEN and all(abs(v) <= MAX_INT for v in value if isinstance(v, int))


def behaviour(chain: list[Primitive]) -> tuple | None:
    """The outputs on the probes, or None when the chain fails on one, is unreadable, constant or the identity."""
    probes = PROBES[chain[0].takes]
    try:
        outs = [_run(chain, x) for x in probes]
    except (ValueError, IndexError):  # max() of an empty list, [0] of one
        return None
    if not all(_readable(o) for o in outs) or len({repr(o) for o in outs}) == 1 or outs == probes:
        return None
    return tuple(repr(o) for o in outs)


def expression(chain: list[Primitive]) -> str:
    """The chain as one Python expression over `x`, parenthesised only where precedence needs it."""
    expr, atomic = "x", True
    for p in chain:
        expr, atomic = p.source.format(x=expr, t=expr if atomic else f"({expr})"), p.atomic
    return expr


def source(chain: list[Primitive]) -> str:
    return f"def f(x):\n    return {expression(chain)}\n"


def prompt(chain: list[Primitive]) -> str:
    spec = ", then ".join(p.phrase for p in chain)
    return f"# f(x: {chain[0].takes}) -> {chain[-1].gives}: {spec}\n"


def _draw_input(takes: str, rng: random.Random) -> Any:
    if takes == "int":
        return rng.randint(-10, 20)
    if takes == "list":
        return [rng.randint(-5, 12) for _ in range(rng.randint(2, 6))]
    return "".join(rng.choice("aabcdeABCxy") for _ in range(rng.randint(3, 8)))


def draw_tests(chain: list[Primitive], problem_id: str) -> list | None:
    """NUM_TESTS distinct inputs seeded by the id, on which the chain runs and gives at least two different
    outputs (so no constant program passes); None when 200 draws do not find them."""
    rng = random.Random(problem_id)
    inputs, outputs = [], set()
    for _ in range(200):
        x = _draw_input(chain[0].takes, rng)
        try:
            out = _run(chain, x)
        except (ValueError, IndexError):
            continue
        if x in inputs or not _readable(out) or (len(inputs) == NUM_TESTS - 1 and outputs == {repr(out)}):
            continue
        inputs.append(x)
        outputs.add(repr(out))
        if len(inputs) == NUM_TESTS:
            return inputs
    return None


def _problem(problem_id: str, chain: list[Primitive]) -> Problem | None:
    inputs = draw_tests(chain, problem_id)
    if inputs is None:
        return None
    test = "".join(f"assert f({x!r}) == {_run(chain, x)!r}\n" for x in inputs)
    return Problem(problem_id, prompt(chain), {"test": test, "entry_point": "f"}, source(chain))


def _chains(max_steps: int) -> Iterable[list[Primitive]]:
    """Every well-typed chain, shortest first, in the order of the primitive table."""
    layer = [[p] for p in PRIMITIVES.values()]
    for _ in range(max_steps):
        yield from layer
        layer = [c + [p] for c in layer for p in PRIMITIVES.values() if p.takes == c[-1].gives]


def all_problems(max_steps: int = MAX_STEPS) -> list[Problem]:
    """Every distinct problem, in a fixed order: the first chain of each behaviour on the probes is kept."""
    seen, problems = set(), []
    for chain in _chains(max_steps):
        key = behaviour(chain)
        if key is None or (chain[0].takes, key) in seen:
            continue
        problem = _problem("-".join(["fn", chain[0].takes] + [p.name for p in chain]), chain)
        if problem is not None:
            seen.add((chain[0].takes, key))
            problems.append(problem)
    return problems


def split_problems(
    problems: list[Problem] | None = None, num_heldout: int = NUM_HELDOUT, seed: int = 0
) -> tuple[list[Problem], list[Problem]]:
    """Return (train, heldout): a seeded, order-independent choice of `num_heldout` problems set aside (the same
    rule as the arithmetic task's: it depends only on the seed and the set of ids)."""
    return arithmetic.split_problems(all_problems() if problems is None else problems, num_heldout, seed)


def _family(p: Primitive) -> str | None:
    """"add" for add1, add2, ...: the primitives that differ only by a constant."""
    stem = p.name.rstrip("0123456789")
    return stem if stem != p.name else None


def wrong_solution(problem: Problem, rng: random.Random) -> str:
    """A plausible wrong program, chosen by `rng` among those that fail at least one of the problem's tests (by the
    reference implementation): half the time, where there is one, a step's constant changed (add3 -> add2), else
    a step swapped for another primitive of the same signature (sum -> max, upper -> lower)."""
    chain = problem.chain
    inputs = draw_tests(chain, problem.id)
    expected = [repr(_run(chain, x)) for x in inputs]

    def fails(candidate: list[Primitive]) -> bool:
        try:
            return [repr(_run(candidate, x)) for x in inputs] != expected
        except (ValueError, IndexError):
            return True  # a program that crashes on a test fails it too

    constant, swapped = [], []
    for i, p in enumerate(chain):
        for q in PRIMITIVES.values():
            if (q.takes, q.gives) != (p.takes, p.gives) or q is p:
                continue
            wrong = chain[:i] + [q] + chain[i + 1:]
            if fails(wrong):
                (constant if _family(p) and _family(q) == _family(p) else swapped).append(wrong)
    pool = constant if constant and (not swapped or rng.random() < 0.5) else swapped
    if not pool:  # a one-step chain with no other primitive of its signature (str, range): misread the input
        first = chain[0].takes
        pool = [[q] + chain for q in PRIMITIVES.values() if q.takes == q.gives == first and fails([q] + chain)]
    return source(rng.choice(pool))


write_jsonl = arithmetic.write_jsonl  # one row per problem, every field (solution included)


def read_jsonl(path: str | Path) -> list[Problem]:
    return arithmetic.read_jsonl(path, Problem)

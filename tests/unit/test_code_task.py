"""The generated code task: distinct problems, a seeded held-out split, canonical solutions that pass their own tests
(in plain Python, for every problem), wrong programs that fail them, and the real code verifier agreeing."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from megarl.tasks import code_functions as cf
from megarl.tasks.code_functions import CHARS, PROMPT_CHARS, all_problems, split_problems, wrong_solution


@pytest.fixture(scope="module")
def problems():
    return all_problems()


def _passes(program: str, test: str) -> bool:
    """The plain-Python check: the program, then the asserts, in a fresh namespace."""
    env: dict = {}
    try:
        exec(program, env)
        exec(test, env)
    except (AssertionError, ValueError, IndexError, TypeError):
        return False
    return True


def test_counts_and_distinct_behaviour(problems):
    assert len(problems) >= 2000
    assert len({p.id for p in problems}) == len(problems)
    assert len({p.prompt for p in problems}) == len(problems)
    # Distinct by behaviour on the probes, not only by spelling.
    assert len({(p.chain[0].takes, cf.behaviour(p.chain)) for p in problems}) == len(problems)
    assert {len(p.chain) for p in problems} == {1, 2, 3}
    assert {p.chain[0].takes for p in problems} == {"int", "list", "str"}
    # Shortest chains first, each behaviour kept at its first chain: the one-step problems are a fixed prefix.
    one_step = all_problems(max_steps=1)
    assert problems[:len(one_step)] == one_step


def test_split_is_seeded_order_independent_and_disjoint(problems):
    train, held = split_problems(problems)
    assert len(held) == 200 and len(train) == len(problems) - 200
    assert not {p.id for p in train} & {p.id for p in held}
    shuffled = problems[:]
    random.Random(1).shuffle(shuffled)
    assert {p.id for p in split_problems(shuffled)[1]} == {p.id for p in held}
    assert {p.id for p in split_problems(problems, seed=1)[1]} != {p.id for p in held}
    with pytest.raises(ValueError, match="exceeds"):
        split_problems(problems[:10], num_heldout=11)


def test_every_canonical_solution_passes_its_own_tests(problems):
    """The tests come from the reference implementations, the solution from the source fragments: this checks one
    against the other for every problem."""
    failing = [p.id for p in problems if not _passes(p.solution, p.answer["test"])]
    assert failing == []
    assert all(p.answer["entry_point"] == "f" and p.answer["test"].count("assert f(") == cf.NUM_TESTS
               for p in problems)
    # The tests tell a constant program apart: at least two different expected values each.
    assert all(len({line.rsplit(" == ", 1)[1] for line in p.answer["test"].splitlines()}) >= 2 for p in problems)


def test_prompts_and_solutions_keep_to_the_tokenizer_characters(problems):
    allowed = set(PROMPT_CHARS)
    assert set("+-=*/.,:;!?()[]_'\"<> \n") <= allowed
    bad = [p.id for p in problems if not set(p.prompt) <= allowed]
    assert bad == []
    assert all(set(p.solution) <= set(CHARS) for p in problems)
    assert all(p.prompt.startswith("# f(x: ") and p.prompt.endswith("\n") and p.prompt.count("\n") == 1
               for p in problems)
    assert all(p.solution.startswith("def f(x):\n    return ") for p in problems)


def test_wrong_solutions_fail_their_tests(problems):
    sample = random.Random(0).sample(problems, 300) + [p for p in problems if p.id in ("fn-int-str", "fn-int-range")]
    for p in sample:
        wrong = wrong_solution(p, random.Random(p.id))
        assert wrong != p.solution and set(wrong) <= set(CHARS)
        assert not _passes(wrong, p.answer["test"]), (p.id, wrong)
        assert wrong_solution(p, random.Random(p.id)) == wrong  # seeded


def test_rows_round_trip(problems, tmp_path):
    path = tmp_path / "code.jsonl"
    assert cf.write_jsonl(path, problems[:50]) == 50
    assert cf.read_jsonl(path) == problems[:50]


def test_the_code_verifier_agrees_with_plain_python(problems):
    from megarl.verifiers import VERIFIERS

    verifier = VERIFIERS.build("code", backend="local")
    rng = random.Random(0)
    sample = rng.sample(problems, 20)
    pairs = [(p.solution, p.answer) for p in sample] + [(wrong_solution(p, rng), p.answer) for p in sample]
    results = verifier.verify_many(pairs)
    assert [r.outcome for r in results] == ["correct"] * 20 + ["incorrect"] * 20, [r.normalized for r in results]
    assert [r.outcome == "correct" for r in results] == [_passes(program, gold["test"]) for program, gold in pairs]


@pytest.mark.slow  # importing transformers
def test_a_prompt_and_its_solution_tokenize_character_by_character(problems):
    from megarl.tasks.arithmetic import build_tokenizer

    tok = build_tokenizer(chars=CHARS)
    text = problems[-1].prompt + problems[-1].solution
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text


def test_the_task_does_not_import_torch():
    code = "import sys, megarl.tasks.code_functions; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_rows_round_trip_through_jsonl(tmp_path):
    from megarl.tasks.code_functions import read_jsonl, write_jsonl

    rows = all_problems()[:50]
    assert write_jsonl(tmp_path / "rows.jsonl", rows) == 50
    assert read_jsonl(tmp_path / "rows.jsonl") == rows

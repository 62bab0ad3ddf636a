"""The arithmetic task, its verifier and the starter tokenizer: pure and fast (no model, no training)."""

from __future__ import annotations

import json

import pytest

from megarl.tasks.arithmetic import (
    EOS_TOKEN,
    NUM_HELDOUT,
    PAD_TOKEN,
    all_problems,
    build_tokenizer,
    read_jsonl,
    split_problems,
    write_jsonl,
)
from megarl.verifiers import VERIFIERS
from megarl.verifiers.arithmetic import ArithmeticVerifier


# --- verifier -----------------------------------------------------------------------------------------------


@pytest.fixture
def verify():
    return ArithmeticVerifier().verify


def test_registered_under_its_name():
    v = VERIFIERS.build("arithmetic")
    assert isinstance(v, ArithmeticVerifier) and v.name == "arithmetic"


@pytest.mark.parametrize("response", ["19", " 19", "19\n", "\n 19 \t", "19<|endoftext|>", "19 <|endoftext|>\n"])
def test_correct_tolerates_whitespace_and_trailing_eos(verify, response):
    r = verify(response, "19")
    assert (r.score, r.outcome, r.extracted, r.normalized) == (1.0, "correct", "19", "19")
    assert r.seconds >= 0.0


def test_ground_truth_may_be_an_int(verify):
    assert verify("19", 19).outcome == "correct"
    assert verify("18", 19).outcome == "incorrect"


def test_wrong_answer(verify):
    r = verify("18", "19")
    assert (r.score, r.outcome, r.extracted) == (0.0, "incorrect", "18")


@pytest.mark.parametrize("response", ["", "   ", "abc", "x=19", "+19", "<|endoftext|>", "-"])
def test_no_leading_integer_is_no_answer(verify, response):
    r = verify(response, "19")
    assert (r.score, r.outcome, r.extracted) == (0.0, "no_answer", None)


@pytest.mark.parametrize(
    "response, leading",
    [("19 junk", "19"), ("19abc", "19"), ("19=19", "19"), ("019", "019"), ("19 20", "19"), ("1 9", "1")],
)
def test_unclean_format_earns_nothing_but_reports_the_leading_integer(verify, response, leading):
    r = verify(response, "19")
    assert (r.score, r.outcome, r.extracted, r.normalized) == (0.0, "incorrect", leading, response)


def test_negative_numbers(verify):
    assert verify("-3", "-3").outcome == "correct"
    r = verify("-3", "3")
    assert (r.outcome, r.extracted) == ("incorrect", "-3")
    assert verify("3", "-3").outcome == "incorrect"


def test_text_after_eos_is_ignored(verify):
    assert verify("19<|endoftext|><|pad|>junk", "19").outcome == "correct"


def test_verifier_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, megarl.verifiers.arithmetic, megarl.tasks.arithmetic; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# --- task and split -----------------------------------------------------------------------------------------


def test_problem_set():
    problems = all_problems()
    assert len(problems) == 3927 and len({p.id for p in problems}) == 3927
    for p in problems:
        a, op, b = p.id.split("-")[1], p.id.split("-")[0], p.id.split("-")[2]
        assert p.prompt == f"{a}{'+' if op == 'add' else '-'}{b}="
        assert int(p.answer) == (int(a) + int(b) if op == "add" else int(a) - int(b)) >= 0
        assert 0 <= int(a) <= 50 and 0 <= int(b) <= 50 and p.verifier == "arithmetic"
    assert {p.id for p in problems} >= {"add-12-7", "sub-50-50", "add-50-50", "sub-0-0"}
    assert "sub-3-4" not in {p.id for p in problems}


def test_split_sizes_disjoint_and_complete():
    train, heldout = split_problems()
    assert len(heldout) == NUM_HELDOUT == 200 and len(train) == 3927 - 200
    assert not {p.id for p in train} & {p.id for p in heldout}
    assert {p.id for p in train} | {p.id for p in heldout} == {p.id for p in all_problems()}


def test_split_is_deterministic_seeded_and_order_independent():
    _, a = split_problems(seed=0)
    _, b = split_problems(seed=0)
    _, c = split_problems(seed=1)
    _, d = split_problems(list(reversed(all_problems())), seed=0)
    ids = lambda ps: {p.id for p in ps}
    assert ids(a) == ids(b) == ids(d)
    assert ids(a) != ids(c)
    # Both operations are represented, not a contiguous slice of the fixed order.
    assert any(p.id.startswith("add") for p in a) and any(p.id.startswith("sub") for p in a)


def test_jsonl_rows(tmp_path):
    _, heldout = split_problems()
    path = tmp_path / "heldout.jsonl"
    assert write_jsonl(path, heldout) == 200
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert set(rows[0]) == {"id", "prompt", "answer", "verifier"}
    assert all(isinstance(r["answer"], str) and r["verifier"] == "arithmetic" for r in rows)
    assert read_jsonl(path) == heldout
    write_jsonl(path, [p for p in all_problems() if p.id == "add-12-7"])
    assert json.loads(path.read_text()) == {"id": "add-12-7", "prompt": "12+7=", "answer": "19",
                                            "verifier": "arithmetic"}


# --- tokenizer ----------------------------------------------------------------------------------------------

ROUND_TRIP_TEXTS = [
    "12+7=19",
    "50-50=0",
    "  leading and trailing  ",
    "two\nlines\n\nand a blank one",
    "Mixed CASE, punctuation: (a/b)*c; ok? yes!",
    "a+b= ",
]


@pytest.fixture(scope="module")
def saved_tokenizer_dir(tmp_path_factory):
    """A starter tokenizer saved next to a `model_type: qwen2` config: the case where transformers 5.x swaps in
    its own `Qwen2Tokenizer` and a plain character-level tokenizer would lose spaces and newlines."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("starter_tok")
    tok = build_tokenizer(d)
    transformers.Qwen2Config(vocab_size=80, num_hidden_layers=1).save_pretrained(str(d))
    return d, tok


def test_tokenizer_vocabulary(saved_tokenizer_dir):
    _, tok = saved_tokenizer_dir
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id == 0
    assert tok.pad_token == PAD_TOKEN and tok.pad_token_id == 1
    assert tok.bos_token is None
    assert len(tok) == 79  # 77 characters + 2 specials; the model pads to 80
    # One token per character: a digit string is as many tokens as digits.
    assert len(tok("12+7=19", add_special_tokens=False)["input_ids"]) == 7


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_auto_tokenizer_round_trips_exactly(saved_tokenizer_dir, text):
    from transformers import AutoTokenizer

    d, built = saved_tokenizer_dir
    loaded = AutoTokenizer.from_pretrained(str(d))
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert ids == built(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert loaded.decode(ids) == text


def test_auto_tokenizer_keeps_special_tokens(saved_tokenizer_dir):
    from transformers import AutoTokenizer

    d, _ = saved_tokenizer_dir
    loaded = AutoTokenizer.from_pretrained(str(d))
    assert (loaded.eos_token_id, loaded.pad_token_id, len(loaded)) == (0, 1, 79)
    ids = loaded("12+7=19" + EOS_TOKEN, add_special_tokens=False)["input_ids"]
    assert ids[-1] == 0 and len(ids) == 8  # no BOS added, EOS recognised as one token
    assert loaded.decode(ids, skip_special_tokens=True) == "12+7=19"

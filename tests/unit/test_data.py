"""Prompt datasets (`load_prompts`) and the seeded, resumable prompt order (`PromptSampler`).

Uses the real character-level tokenizer of the arithmetic task, built locally (no hub).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.config import ConfigError
from megarl.data import PromptSampler, load_prompts
from megarl.reward.compose import reward_names, spec_error
from megarl.verifiers import VERIFIERS

KEYS = dict(input_key="prompt", label_key="answer", verifier_key="verifier")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from megarl.tasks.arithmetic import build_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return transformers.AutoTokenizer.from_pretrained(out)


def write_lines(tmp_path: Path, lines: list[str], name: str = "data.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def row(prompt, answer, verifier="arithmetic", **extra) -> str:
    d = {"prompt": prompt, "answer": answer, **extra}
    if verifier is not None:
        d["verifier"] = verifier
    return json.dumps(d)


def load(path, tokenizer, **kw):
    """As the trainer loads them: each row's verifier field checked as a reward spec."""
    return load_prompts(path, tokenizer, **{**KEYS, "spec_error": spec_error, **kw})


# ------------------------------------------------------------------------------------------------ load_prompts


def test_valid_rows_load_with_prompt_ids(tmp_path, tokenizer):
    path = write_lines(tmp_path, [row("12+7=", "19"), "", "   ", row("50-8=", "42", id="sub-50-8"), row("0+0=", 0)])
    records = load(path, tokenizer)
    assert [r.index for r in records] == [0, 1, 2]  # blank lines are skipped and take no index
    assert [r.prompt for r in records] == ["12+7=", "50-8=", "0+0="]
    assert [r.label for r in records] == ["19", "42", 0]  # labels are passed through as written
    assert [r.verifier for r in records] == ["arithmetic"] * 3
    # The tokenizer is character level over "0123456789+-= ..." after <|endoftext|> (0) and <|pad|> (1):
    # '1' -> 3, '2' -> 4, '+' -> 12, '7' -> 9, '=' -> 14. No BOS is prepended.
    assert records[0].prompt_ids == [3, 4, 12, 9, 14]
    for r in records:
        assert tokenizer.decode(r.prompt_ids) == r.prompt


def test_custom_keys(tmp_path, tokenizer):
    path = write_lines(tmp_path, [json.dumps({"q": "3+4=", "gt": "7", "v": "arithmetic"})])
    (r,) = load(path, tokenizer, input_key="q", label_key="gt", verifier_key="v")
    assert (r.prompt, r.label, r.verifier) == ("3+4=", "7", "arithmetic")


def test_default_verifier_fills_rows_without_one(tmp_path, tokenizer):
    path = write_lines(tmp_path, [row("1+1=", "2", verifier=None), row("2+2=", "4", verifier="arithmetic")])
    records = load(path, tokenizer, default_verifier="arithmetic")
    assert [r.verifier for r in records] == ["arithmetic", "arithmetic"]


def test_row_verifier_wins_over_default(tmp_path, tokenizer):
    # A row naming an unknown verifier is still an error even when a valid default exists.
    path = write_lines(tmp_path, [row("1+1=", "2", verifier="nope")])
    with pytest.raises(ConfigError, match=r"unknown verifier 'nope'"):
        load(path, tokenizer, default_verifier="arithmetic")


@pytest.mark.parametrize(
    "bad_line, pattern",
    [
        ('{"prompt": "1+1=", "answer": ', r"not valid JSON"),
        ('["1+1=", "2"]', r"expected a JSON object, got list"),
        ('"1+1="', r"expected a JSON object, got str"),
        ('{"answer": "2", "verifier": "arithmetic"}', r"missing field 'prompt' \(fields: answer, verifier\)"),
        ('{"prompt": "1+1=", "verifier": "arithmetic"}', r"missing field 'answer'"),
        ('{}', r"missing field 'prompt' \(fields: none\)"),
        ('{"prompt": "", "answer": "0", "verifier": "arithmetic"}', r"field 'prompt' must be a non-empty string"),
        ('{"prompt": 5, "answer": "5", "verifier": "arithmetic"}', r"field 'prompt' must be a non-empty string"),
        ('{"prompt": "1+1=", "answer": "2"}', r"no 'verifier' field and no --default-verifier"),
    ],
)
def test_invalid_row_names_file_and_line(tmp_path, tokenizer, bad_line, pattern):
    # Two good rows and a blank line first: the reported line number counts the blank line too.
    path = write_lines(tmp_path, [row("1+1=", "2"), "", row("2+2=", "4"), bad_line, row("3+3=", "6")])
    with pytest.raises(ConfigError, match=pattern) as e:
        load(path, tokenizer)
    assert str(e.value).startswith(f"{path}:4: ")


def test_unknown_verifier_lists_registered_ones(tmp_path, tokenizer):
    path = write_lines(tmp_path, [row("1+1=", "2", verifier="sympy")])
    with pytest.raises(ConfigError) as e:
        load(path, tokenizer)
    msg = str(e.value)
    assert msg.startswith(f"{path}:1: unknown verifier 'sympy'; registered: ")
    assert "arithmetic" in VERIFIERS.names()
    assert msg.endswith(", ".join(reward_names())), "rule verifiers and reward models"


def test_without_a_spec_check_the_verifier_field_is_only_required_to_be_text(tmp_path, tokenizer):
    """megarl.data imports nothing of megarl.reward: the caller brings the reward spec's check."""
    path = write_lines(tmp_path, [row("1+1=", "2", verifier="sympy")])
    (r,) = load_prompts(path, tokenizer, **KEYS)
    assert r.verifier == "sympy"


def test_unknown_default_verifier_is_an_error(tmp_path, tokenizer):
    path = write_lines(tmp_path, [row("1+1=", "2", verifier=None)])
    with pytest.raises(ConfigError, match=r":1: unknown verifier 'geometry'"):
        load(path, tokenizer, default_verifier="geometry")


def test_missing_file(tmp_path, tokenizer):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match=f"--eval-data {missing}: no such file"):
        load(missing, tokenizer, flag="--eval-data")


def test_empty_path_is_required(tokenizer):
    with pytest.raises(ConfigError, match="--prompt-data is required"):
        load("", tokenizer)


@pytest.mark.parametrize("lines", [[], ["", "  "]])
def test_file_without_rows(tmp_path, tokenizer, lines):
    path = write_lines(tmp_path, lines)
    with pytest.raises(ConfigError, match=f"--prompt-data {path}: the file has no rows"):
        load(path, tokenizer)


# ------------------------------------------------------------------------------------------------ PromptSampler


def draw(sampler: PromptSampler, sizes: list[int]) -> list[list[int]]:
    return [sampler.next_indices(n) for n in sizes]


def test_each_epoch_covers_every_prompt_once():
    sampler = PromptSampler(10, seed=3)
    epoch0 = sum(draw(sampler, [4, 4, 2]), [])
    epoch1 = sum(draw(sampler, [5, 5]), [])
    assert sorted(epoch0) == list(range(10))
    assert sorted(epoch1) == list(range(10))
    assert epoch0 != list(range(10))  # shuffled
    assert epoch0 != epoch1  # reshuffled each epoch
    assert sampler.state_dict() == {"epoch": 1, "position": 10}


def test_same_seed_same_order_different_seed_different_order():
    a = draw(PromptSampler(50, seed=7), [20, 20, 20])
    b = draw(PromptSampler(50, seed=7), [20, 20, 20])
    c = draw(PromptSampler(50, seed=8), [20, 20, 20])
    assert a == b
    assert a != c


def test_without_shuffle_the_order_is_the_file_order():
    sampler = PromptSampler(5, seed=1, shuffle=False)
    assert draw(sampler, [3, 3, 3, 3]) == [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4, 0, 1]]


def test_epoch_rolls_over_mid_batch():
    sampler = PromptSampler(6, seed=11)
    first = sampler.next_indices(4)
    straddling = sampler.next_indices(4)  # the last 2 of epoch 0, then the first 2 of epoch 1
    rest = sampler.next_indices(4)  # the remaining 4 of epoch 1
    assert sorted(first + straddling[:2]) == list(range(6))
    assert sorted(straddling[2:] + rest) == list(range(6))
    assert sampler.state_dict() == {"epoch": 1, "position": 6}


def test_batch_larger_than_dataset_spans_epochs():
    sampler = PromptSampler(3, seed=0)
    batch = sampler.next_indices(7)
    assert sorted(batch[:3]) == sorted(batch[3:6]) == [0, 1, 2]
    assert sampler.state_dict() == {"epoch": 2, "position": 1}


@pytest.mark.parametrize("consumed", [0, 3, 7, 10, 13, 25])
def test_state_dict_resume_continues_identically(consumed):
    original = PromptSampler(10, seed=5)
    original.next_indices(consumed)
    state = original.state_dict()
    # A fresh sampler (as after a restart) that loads the state continues with the same indices.
    resumed = PromptSampler(10, seed=5)
    resumed.load_state_dict(dict(state))
    sizes = [4, 7, 3, 9]
    assert draw(resumed, sizes) == draw(original, sizes)


def test_state_dict_is_plain_and_json_serialisable():
    sampler = PromptSampler(8, seed=2)
    sampler.next_indices(11)
    state = json.loads(json.dumps(sampler.state_dict()))
    resumed = PromptSampler(8, seed=2)
    resumed.load_state_dict(state)
    assert resumed.next_indices(20) == sampler.next_indices(20)

"""Prompt sources beyond plain jsonl strings: parquet files and chat `messages` rendered through the tokenizer's
chat template. Expected token ids come from the tokenizer's own `apply_chat_template(..., tokenize=True)`."""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path

import pytest

from megarl.config import ConfigError
from megarl.data import load_prompts
from megarl.reward.compose import spec_error

KEYS = dict(input_key="prompt", label_key="answer", verifier_key="verifier")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "system", "content": "Answer with the number only."}, {"role": "user", "content": "What is 12+7?"}]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A character-level tokenizer over printable ASCII plus ChatML's two special tokens and template, saved and
    loaded back through AutoTokenizer as a checkpoint's tokenizer would be."""
    transformers = pytest.importorskip("transformers")
    from megarl.tasks.arithmetic import build_tokenizer

    out = tmp_path_factory.mktemp("chat_tok")
    tok = build_tokenizer(chars="".join(c for c in string.printable if c not in "\x0b\x0c\r"))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(str(out))
    return transformers.AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from megarl.tasks.arithmetic import build_tokenizer

    out = tmp_path_factory.mktemp("plain_tok")
    build_tokenizer(out)
    return transformers.AutoTokenizer.from_pretrained(out)


def template_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path: Path, rows: list[dict]) -> str:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


# -- chat messages ---------------------------------------------------------------------------------------------


def test_messages_are_rendered_through_the_chat_template(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT, "answer": "19", "verifier": "arithmetic"}])
    (record,) = load_prompts(path, chat_tokenizer, **{**KEYS, "input_key": "messages"})
    assert record.prompt_ids == template_ids(chat_tokenizer, CHAT)
    assert record.prompt == ("<|im_start|>system\nAnswer with the number only.<|im_end|>\n"
                             "<|im_start|>user\nWhat is 12+7?<|im_end|>\n<|im_start|>assistant\n")
    # The special tokens are single ids, not spelled out character by character.
    start = chat_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert record.prompt_ids.count(start) == 3 and record.prompt_ids[0] == start
    assert (record.label, record.verifier) == ("19", "arithmetic")


def test_apply_chat_template_wraps_a_string_prompt_as_a_user_turn(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "What is 2+3?", "answer": "5", "verifier": "arithmetic"}])
    (raw,) = load_prompts(path, chat_tokenizer, **KEYS)
    (chat,) = load_prompts(path, chat_tokenizer, **KEYS, apply_chat_template=True)
    assert raw.prompt == "What is 2+3?" and raw.prompt_ids == chat_tokenizer.encode("What is 2+3?")
    assert chat.prompt_ids == template_ids(chat_tokenizer, [{"role": "user", "content": "What is 2+3?"}])


def test_chat_without_a_chat_template_is_a_clear_error(tmp_path, plain_tokenizer):
    assert not plain_tokenizer.chat_template
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": CHAT, "answer": "19", "verifier": "arithmetic"}])
    with pytest.raises(ConfigError, match=r"chat.jsonl:1: field 'prompt' is a chat \(a list of messages\), but the "
                                          r"--hf-checkpoint's tokenizer has no chat template"):
        load_prompts(path, plain_tokenizer, **KEYS)


def test_apply_chat_template_without_a_chat_template_names_the_flag(tmp_path, plain_tokenizer):
    path = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "What is 2+3?", "answer": "5", "verifier": "arithmetic"}])
    with pytest.raises(ConfigError) as e:
        load_prompts(path, plain_tokenizer, **KEYS, apply_chat_template=True)
    assert str(e.value).startswith("--apply-chat-template: the --hf-checkpoint's tokenizer has no chat template")
    assert "is a chat" not in str(e.value) and "drop --apply-chat-template" in str(e.value)


@pytest.mark.parametrize("messages, pattern", [
    ([{"role": "user"}], r"message 0 must be an object with string 'role' and 'content'"),
    ([{"role": "user", "content": "hi"}, "hello"], r"message 1 must be an object"),
    ([], r"must be a non-empty string or a list of chat messages"),
])
def test_malformed_messages_name_the_line(tmp_path, chat_tokenizer, messages, pattern):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "1+1=", "answer": "2", "verifier": "arithmetic"},
                                                 {"prompt": messages, "answer": "2", "verifier": "arithmetic"}])
    with pytest.raises(ConfigError, match=pattern) as e:
        load_prompts(path, chat_tokenizer, **KEYS)
    assert str(e.value).startswith(f"{path}:2: field 'prompt'")


def test_missing_prompt_field_hints_at_messages(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT, "answer": "19", "verifier": "arithmetic"}])
    with pytest.raises(ConfigError, match=r"missing field 'prompt' .*; for chat data pass --input-key messages"):
        load_prompts(path, chat_tokenizer, **KEYS)


# -- parquet ---------------------------------------------------------------------------------------------------


def test_parquet_rows_match_the_same_rows_in_jsonl(tmp_path, chat_tokenizer):
    rows = [{"prompt": "12+7=", "answer": 19, "verifier": "arithmetic"},
            {"prompt": "50-8=", "answer": 42, "verifier": None},  # a null verifier falls back to the default
            {"prompt": "3+3=", "answer": 6, "verifier": "arithmetic"}]
    from_parquet = load_prompts(write_parquet(tmp_path / "d.parquet", rows), chat_tokenizer, **KEYS,
                                default_verifier="arithmetic")
    from_jsonl = load_prompts(write_jsonl(tmp_path / "d.jsonl", rows), chat_tokenizer, **KEYS,
                              default_verifier="arithmetic")
    assert from_parquet == from_jsonl
    assert [r.label for r in from_parquet] == [19, 42, 6]  # plain Python ints, not numpy scalars
    assert from_parquet[1].prompt_ids == chat_tokenizer.encode("50-8=")


def test_parquet_messages_column_is_rendered_through_the_chat_template(tmp_path, chat_tokenizer):
    other = [{"role": "user", "content": "What is 9-4?"}]
    rows = [{"messages": CHAT, "answer": "19", "verifier": "arithmetic"},
            {"messages": other, "answer": "5", "verifier": "arithmetic"}]
    path = write_parquet(tmp_path / "chat.parquet", rows)
    records = load_prompts(path, chat_tokenizer, **{**KEYS, "input_key": "messages"})
    assert [r.prompt_ids for r in records] == [template_ids(chat_tokenizer, CHAT), template_ids(chat_tokenizer, other)]
    assert [r.index for r in records] == [0, 1]


def test_parquet_errors_name_the_row(tmp_path, chat_tokenizer):
    rows = [{"prompt": "1+1=", "answer": "2", "verifier": "arithmetic"},
            {"prompt": "2+2=", "answer": "4", "verifier": "nope"}]
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ConfigError, match=r"unknown verifier 'nope'") as e:
        load_prompts(path, chat_tokenizer, **KEYS, spec_error=spec_error)
    assert str(e.value).startswith(f"{path}: row 1: ")


def test_a_file_that_is_not_parquet_is_a_clear_error(tmp_path, chat_tokenizer):
    pytest.importorskip("pyarrow")
    path = tmp_path / "broken.parquet"
    path.write_text('{"prompt": "1+1="}\n')
    with pytest.raises(ConfigError, match=r"--prompt-data .*broken.parquet: not a readable parquet file"):
        load_prompts(str(path), chat_tokenizer, **KEYS)


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, chat_tokenizer, monkeypatch):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError, match=r"reading parquet needs pyarrow \(pip install pyarrow\)"):
        load_prompts(str(path), chat_tokenizer, **KEYS)

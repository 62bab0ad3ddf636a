"""The reasoning-gym demo's starter builder: its tokenizer keeps every row's text, its batches label only the
answer and EOS, its near misses come in the noise share and are scored wrong by the verifier. Seconds: no model
is trained here."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is the rg extra: pip install megarl[rg]")

from megarl.tasks import reasoning_gym as rg_task
from megarl.tasks.arithmetic import build_tokenizer


@pytest.fixture(scope="module")
def rows():
    from tools.make_rg_starter_model import CONFIG, TASK, TEMPLATE

    return [json.loads(json.dumps(r)) for r in rg_task.rows([TASK], {TASK: CONFIG}, 1, 40, TEMPLATE)]


def test_tokenizer_keeps_every_row_one_token_a_character(tmp_path, rows):
    from transformers import AutoTokenizer

    from tools.make_rg_starter_model import CHARS, POSITIONS, check_rows, response

    build_tokenizer(tmp_path, chars=CHARS)
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')  # as the starter's (arithmetic.build_tokenizer)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    for row in rows:
        text = row["prompt"] + response(row["answer"]["answer"], random.Random(0), 0.0)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text) and tok.decode(ids) == text
    assert check_rows(rows) <= POSITIONS
    with pytest.raises(ValueError, match="outside the tokenizer's"):
        check_rows([{**rows[0], "prompt": "§"}])


def test_batches_label_the_answer_and_eos_only(rows):
    from tools.make_rg_starter_model import CHARS, make_batch

    tok = build_tokenizer(chars=CHARS)
    batch = make_batch(rows[:4], tok, random.Random(0), noise_p=0.0)
    for row, ids, labels in zip(rows, batch["input_ids"].tolist(), batch["labels"].tolist()):
        n = len(row["prompt"])
        assert labels[:n] == [-100] * n
        answer = [t for t in labels[n:] if t != -100]
        assert answer[-1] == tok.eos_token_id
        assert tok.decode(answer[:-1]) == f"<answer>{row['answer']['answer']}</answer>"
        assert ids[: n + len(answer)] == tok(row["prompt"], add_special_tokens=False)["input_ids"] + answer


def test_near_misses_come_in_the_noise_share_and_score_wrong(rows):
    from megarl.verifiers import VERIFIERS
    from tools.make_rg_starter_model import response

    verifier = VERIFIERS.build("reasoning_gym")
    row = rows[3]
    rng = random.Random(1)
    drawn = [response(row["answer"]["answer"], rng, noise_p=0.3) for _ in range(2000)]
    outcomes = [verifier.verify(r, row["answer"]).outcome for r in drawn]
    assert 0.26 < outcomes.count("incorrect") / len(drawn) < 0.34  # 0.3 +/- ~4 standard errors
    assert set(outcomes) == {"correct", "incorrect"}

"""The math demo's starter builder: its tokenizer keeps the task's text, its rows label only the response, and
its positions cover the longest row. Seconds: no model is trained here."""

from __future__ import annotations

import random

from megarl.tasks.arithmetic import build_tokenizer
from megarl.tasks.math_forms import CHARS, all_problems, forms, solution, wrong_forms


def test_tokenizer_round_trips_the_task_text_through_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path, chars=CHARS)
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')  # as the starter's: the 5.x trap (arithmetic.py)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    for p in all_problems()[::97]:
        for text in [p.prompt + solution(p), *forms(p), *wrong_forms(p)]:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert len(ids) == len(text) and tok.decode(ids) == text, text  # one token a character, none lost


def test_rows_label_the_response_and_eos_only():
    from tools.make_math_starter_model import make_batch

    tok = build_tokenizer(chars=CHARS)
    problems = all_problems()[1000:1004]
    batch = make_batch(problems, tok, random.Random(0), noise_p=0.0)
    for p, ids, labels in zip(problems, batch["input_ids"].tolist(), batch["labels"].tolist()):
        n_prompt = len(p.prompt)
        assert labels[:n_prompt] == [-100] * n_prompt
        answer = [t for t in labels[n_prompt:] if t != -100]
        text = tok.decode(answer[:-1])
        assert answer[-1] == tok.eos_token_id and text in [solution(p), *forms(p)]  # noise 0: a right spelling
        assert ids[: n_prompt + len(answer)] == tok(p.prompt, add_special_tokens=False)["input_ids"] + answer


def test_mistakes_come_in_the_noise_share_and_positions_cover_every_row():
    from tools.make_math_starter_model import POSITIONS, longest_row, response

    problems = all_problems()
    p = problems[42]
    rng = random.Random(1)
    drawn = [response(p, rng, noise_p=0.3) for _ in range(2000)]
    wrong = sum(r in wrong_forms(p) for r in drawn) / len(drawn)
    assert 0.26 < wrong < 0.34  # 0.3 +/- ~4 standard errors
    assert {r for r in drawn if r not in wrong_forms(p)} == {solution(p), *forms(p)}  # every right spelling
    # one token a character (the round trip above): the longest row in characters, + EOS, over every problem
    longest = max(len(q.prompt) + max(map(len, [solution(q), *forms(q), *wrong_forms(q)])) + 1 for q in problems)
    assert longest == 103 <= POSITIONS
    sample = [q for q in problems if len(q.prompt) + len(max([solution(q), *forms(q)], key=len)) >= 95]
    assert longest_row(sample, build_tokenizer(chars=CHARS)) == longest

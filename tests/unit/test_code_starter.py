"""The code demo's starter builder (tools/make_code_starter_model.py) and its independent verdict check
(tools/check_code_verdicts.py): rows labelled only on the program, a build of two steps that writes what the
trainer reads, and the plain-Python re-check agreeing and disagreeing where it should."""

from __future__ import annotations

import json
import random

import pytest

from megarl.tasks import code_functions as cf
from megarl.tasks.arithmetic import build_tokenizer


def test_rows_label_the_program_and_eos_only():
    from tools.make_code_starter_model import make_batch

    tok = build_tokenizer(chars=cf.CHARS)
    p = cf.all_problems(max_steps=2)[40]
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    batch = make_batch([p], tok, random.Random(0), wrong_p=0.0)
    prompt, program = enc(p.prompt), enc(p.solution) + [tok.eos_token_id]
    assert batch["input_ids"][0].tolist() == prompt + program
    assert batch["labels"][0].tolist() == [-100] * len(prompt) + program
    # wrong_p = 1: the program is the task's wrong one for the same rng draws
    rng = random.Random(3)
    batch = make_batch([p], tok, rng, wrong_p=1.0)
    rng = random.Random(3)
    rng.random()  # make_batch's coin
    wrong = cf.wrong_solution(p, rng)
    assert wrong != p.solution
    assert tok.decode(batch["input_ids"][0].tolist()[len(prompt):-1]) == wrong


def test_two_step_build_writes_what_the_trainer_reads(tmp_path):
    from transformers import AutoTokenizer

    from tools.make_code_starter_model import MAX_NEW_TOKENS, POSITIONS, main

    out = tmp_path / "starter"
    main(["--out", str(out), "--steps", "2", "--no-eval"])
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == POSITIONS
    assert config["hidden_size"] == 128 and config["num_hidden_layers"] == 2
    heldout = [json.loads(line) for line in (out / "heldout.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(heldout) == cf.NUM_HELDOUT and len(train) + len(heldout) == len(cf.all_problems())
    assert not {r["id"] for r in heldout} & {r["id"] for r in train}
    assert {r["verifier"] for r in heldout} == {"code"} and set(heldout[0]["answer"]) == {"test", "entry_point"}
    # The saved tokenizer, loaded as the trainer loads it, round-trips prompts and programs exactly (the trap
    # `megarl.tasks.arithmetic.build_tokenizer` avoids: spaces and newlines lost), and leaves room to answer
    tok = AutoTokenizer.from_pretrained(str(out))
    for row in heldout[:20]:
        text = row["prompt"] + row["solution"]
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
        assert len(tok(row["prompt"], add_special_tokens=False)["input_ids"]) + MAX_NEW_TOKENS <= POSITIONS


def _row(program: str, outcome: str) -> dict:
    return {"verifier": "code", "outcome": outcome, "prompt": "# f(x: int) -> int: plus 1\n", "step": 0,
            "answer": {"test": "assert f(1) == 2\nassert f(-3) == -2\n", "entry_point": "f"}, "response": program}


@pytest.mark.parametrize("program, outcome, agrees", [
    ("def f(x):\n    return x + 1\n", "correct", True),
    ("def f(x):\n    return x + 2\n", "incorrect", True),
    ("def f(x):\n    return x +\n", "parse_error", True),
    ("def f(x):\n    return x + 1\n", "incorrect", False),  # a verifier that failed a good program is caught
    ("def f(x):\n    return x * 2\n", "correct", False),    # and one that passed a bad one
])
def test_plain_python_recheck(program, outcome, agrees):
    from tools.check_code_verdicts import check

    [(_, said, passed)] = check([_row(program, outcome)], timeout=10)
    assert (said == passed) is agrees


@pytest.mark.parametrize("metric", ["accuracy", "pass@1"])
def test_the_held_out_report_names_its_metric(metric):
    """`--eval-metric-name` only renames the report's lines; with the default they are the arithmetic demo's."""
    from types import SimpleNamespace

    from megarl.trainer.log import _report

    lines: list[str] = []
    cfg = SimpleNamespace(rollout=SimpleNamespace(rollout_temperature=1.0),
                          logging=SimpleNamespace(eval_samples_per_prompt=4, eval_metric_name=metric))
    _report(lines.append, SimpleNamespace(enabled=False), {"sampled": 0.112, "greedy": 0.37},
            {"sampled": 0.356, "greedy": 0.5}, 19.0, 300, 200, cfg)
    assert lines == ["", f"held-out {metric} on 200 prompts never trained on (300 steps, 19.0 min of training):",
                     f"  {'':<30}  before   after",
                     "  sampled (temp 1, 4/prompt)       11.2%   35.6%",
                     "  greedy                           37.0%   50.0%",
                     f"held-out {metric} (sampled): before 11.2% -> after 35.6%"]

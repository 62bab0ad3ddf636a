"""`train.py` on math-verifier data: rows with `prompt`/`answer` and `"verifier": "math"`, scored by the reward
pool, with its health metrics in metrics.jsonl."""

from __future__ import annotations

import json

import pytest
from helpers import train_two_steps_through_the_pool

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_train_on_math_rows_through_the_reward_pool(starter, tmp_path):
    rows = [json.loads(line) for line in (starter / "train.jsonl").read_text().splitlines()[:64]]
    data = tmp_path / "math.jsonl"
    # the arithmetic task's rows, relabelled for the math verifier (the starter answers with bare numbers)
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": str(r["answer"]), "verifier": "math"}) + "\n"
                            for r in rows))
    # a timeout far above a verdict's cost (milliseconds): on cores starved by a whole CI beside it, 20 s was missed
    metrics = train_two_steps_through_the_pool(starter, data, tmp_path / "run", reward_timeout=90)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["reward_mean"] == pytest.approx(m["accuracy"])  # reward 1 exactly when the verdict is correct
        assert m["reward_timeout_rate"] == 0.0 and m["reward_parse_error_rate"] == 0.0
        assert m["reward_worker_restarts"] == 0
        assert 0.0 < m["reward_latency_p50"] <= m["reward_latency_p99"] < 90.0
        assert 0.0 <= m["uniform_group_frac"] <= 1.0

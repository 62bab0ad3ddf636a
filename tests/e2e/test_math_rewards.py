"""`train.py` on math-verifier data: rows with `prompt`/`answer` and `"verifier": "math"`, scored by the reward
pool, with its health metrics in metrics.jsonl."""

from __future__ import annotations

import json

import pytest
from helpers import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_train_on_math_rows_through_the_reward_pool(starter, tmp_path):
    rows = [json.loads(line) for line in (starter / "train.jsonl").read_text().splitlines()[:64]]
    data = tmp_path / "math.jsonl"
    # the arithmetic task's rows, relabelled for the math verifier (the starter answers with bare numbers)
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": str(r["answer"]), "verifier": "math"}) + "\n"
                            for r in rows))
    out = tmp_path / "run"
    torchrun(2, "megarl/train.py", "recipes/tiny_cpu.sh", "--hf-checkpoint", starter, "--prompt-data", data,
             "--eval-data", "", "--max-train-minutes", "0", "--num-steps", 2, "--rollout-batch-size", 8,
             "--n-samples-per-prompt", 4, "--micro-batch-size", 16, "--reward-workers", 2, "--reward-timeout", 20,
             "--output-dir", out, "--log-interval", 1, timeout=400)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["reward_mean"] == pytest.approx(m["accuracy"])  # reward 1 exactly when the verdict is correct
        assert m["reward_timeout_rate"] == 0.0 and m["reward_parse_error_rate"] == 0.0
        assert m["reward_worker_restarts"] == 0
        assert 0.0 < m["reward_latency_p50"] <= m["reward_latency_p99"] < 20.0
        assert 0.0 <= m["uniform_group_frac"] <= 1.0

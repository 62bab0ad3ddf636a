"""`train.py` on code-verifier data: rows with `"verifier": "code"`, scored by the reward pool, whose workers
each start a local sandbox with its persistent harness; nothing of it outlives the run."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers import train_two_steps_through_the_pool

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _harnesses() -> set[str]:
    out = subprocess.run(["pgrep", "-f", "guest/harness.py --serve"], capture_output=True, text=True).stdout
    return set(out.split())


def test_train_on_code_rows_through_the_reward_pool(starter, tmp_path):
    rows = [json.loads(line) for line in (starter / "train.jsonl").read_text().splitlines()[:64]]
    data = tmp_path / "code.jsonl"
    # The starter answers `a+b=` with a number, which is a Python program printing nothing: it passes the rows
    # whose test expects no output and fails those expecting "odd" (half the rows, by the answer's parity), and a
    # response that is not Python (e.g. "1-") is a parse error.
    def gold(answer):
        return {"inputs": [""], "outputs": ["odd\n" if int(answer) % 2 else ""], "time_s": 2}

    data.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": gold(r["answer"]), "verifier": "code"})
                            + "\n" for r in rows))
    before = _harnesses()
    metrics = train_two_steps_through_the_pool(starter, data, tmp_path / "run", reward_timeout=30)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["reward_mean"] == pytest.approx(m["accuracy"])  # reward 1 exactly when the verdict is correct
        assert m["reward_timeout_rate"] == 0.0 and m["reward_worker_restarts"] == 0
        assert 0.0 < m["reward_latency_p50"] <= m["reward_latency_p99"] < 30.0
    mean = sum(m["reward_mean"] for m in metrics) / len(metrics)
    assert 0.2 < mean < 0.8, f"about half the rows are passable, got a mean reward of {mean}"
    assert _harnesses() <= before, "a persistent code harness outlived the run"

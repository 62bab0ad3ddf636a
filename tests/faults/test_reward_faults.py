"""A reward worker that dies mid-scoring (`MEGARL_FAULT=reward_worker_crash@S`, `megarl/faults.py`): the pool
replaces it and scores the lost sample again, so every sample gets one result, the one an unharmed pool gives,
and the row counts the restart. Checked on the pool itself (fast) and in a real run on the tiny starter, whose
metrics match an uninterrupted run's bitwise (the arithmetic verifier is deterministic)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, env, free_port

from megarl import faults
from megarl.reward.pool import RewardPool

pytestmark = [pytest.mark.faults, pytest.mark.distributed]
COMPARED = ("reward_mean", "accuracy", "loss", "kl", "clip_frac", "grad_norm", "response_len", "lr", "entropy",
            "reward_timeout_rate", "reward_parse_error_rate", "reward_no_answer_rate")


def _verdicts(results):
    return [(r.score, r.outcome, r.extracted, r.normalized) for r in results]


def test_a_worker_killed_mid_scoring_is_replaced_and_its_sample_scored_again(monkeypatch):
    requests = [("arithmetic", str(a), 7) for a in range(8)] + [("math", r"$\boxed{\frac12}$", "0.5")]
    with RewardPool(workers=2, timeout_s=30) as pool:
        expected, health = pool.score(requests, group_size=3)
        assert health["reward_worker_restarts"] == 0

        monkeypatch.setenv(faults.ENV, "reward_worker_crash@2")
        assert not faults.fire("reward_worker_crash", 1) and faults.fire("reward_worker_crash", 2)
        t0 = time.monotonic()
        got, health = pool.score(requests, group_size=3)
        print(f"reward worker killed mid-scoring: batch of {len(requests)} scored in {time.monotonic() - t0:.1f} s")
    assert _verdicts(got) == _verdicts(expected), "no sample lost, changed or counted twice"
    assert health["reward_worker_restarts"] == 1 and health["reward_n"] == len(requests)
    assert health["reward_n_parse_error"] == 0 and not faults.take("reward_worker_crash")


def _run(starter: Path, out: Path, fault: str = "") -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port()),
           "megarl/train.py", "recipes/tiny_cpu.sh", "--hf-checkpoint", str(starter), "--prompt-data",
           str(starter / "train.jsonl"), "--eval-data", "", "--max-train-minutes", "0", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "4", "--micro-batch-size", "8", "--lr", "3e-4", "--num-steps", "2",
           "--reward-workers", "1", "--output-dir", str(out), "--log-interval", "1"]
    return subprocess.Popen(cmd, cwd=REPO, env={**env(), **({"MEGARL_FAULT": fault} if fault else {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_a_run_whose_reward_worker_dies_ends_as_the_uninterrupted_run(starter, tmp_path):
    t0 = time.monotonic()
    runs = [_run(starter, tmp_path / "full"), _run(starter, tmp_path / "fault", "reward_worker_crash@2")]
    logs = [p.communicate(timeout=300)[0] for p in runs]  # side by side: one process each, 2 cores
    assert [p.returncode for p in runs] == [0, 0], logs[1][-4000:] + logs[0][-2000:]
    print(f"two 2-step runs side by side, one with a reward worker killed at step 2: {time.monotonic() - t0:.0f} s")
    assert "megarl: fault injected: reward_worker_crash at step 2 on rank 0" in logs[1]
    assert "megarl: reward worker died scoring a 'arithmetic' sample" in logs[1]
    full, hurt = _rows(tmp_path / "full"), _rows(tmp_path / "fault")
    assert [r["step"] for r in hurt] == [1, 2], "each step logged once"
    assert [r["reward_worker_restarts"] for r in hurt] == [0, 1]
    assert [r["reward_worker_restarts"] for r in full] == [0, 0]
    for a, b in zip(full, hurt):
        for key in COMPARED:
            assert a[key] == b[key], (a["step"], key)

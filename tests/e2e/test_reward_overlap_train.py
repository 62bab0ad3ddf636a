"""`train.py` with --reward-overlap on and off: the same rewards, advantages and losses for a fixed seed (only the
order rows are scored in differs), and `t_reward_exposed` logged beside `t_reward`, never above it."""

from __future__ import annotations

import json

import pytest
from helpers import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
COMPARED = ("reward_mean", "accuracy", "loss", "kl", "grad_norm", "entropy", "response_len", "uniform_group_frac",
            "reward_no_answer_rate", "reward_timeout_rate", "reward_parse_error_rate")


def _train(starter, out, overlap: str) -> tuple[list[dict], list[dict], str]:
    proc = torchrun(1, "megarl/train.py", "recipes/tiny_cpu.sh", "--hf-checkpoint", starter, "--prompt-data",
                    starter / "train.jsonl", "--eval-data", "", "--max-train-minutes", "0", "--num-steps", 2,
                    "--rollout-batch-size", 4, "--n-samples-per-prompt", 4, "--micro-batch-size", 16,
                    "--reward-overlap", overlap, "--output-dir", out, "--log-interval", 1,
                    "--log-samples-interval", 1, "--log-samples-count", 16, timeout=400)

    def rows(name):
        return [json.loads(line) for line in (out / name).read_text().splitlines()]

    return rows("metrics.jsonl"), rows("samples.jsonl"), proc.stdout


def test_overlapped_and_serial_rewards_give_the_same_numbers(starter, tmp_path):
    serial, serial_samples, _ = _train(starter, tmp_path / "off", "off")
    overlapped, overlapped_samples, console = _train(starter, tmp_path / "on", "on")
    assert [r["step"] for r in serial] == [r["step"] for r in overlapped] == [1, 2]
    for s, o in zip(serial, overlapped):
        assert {k: s[k] for k in COMPARED} == {k: o[k] for k in COMPARED}
        assert 0.0 <= o["t_reward_exposed"] <= o["t_reward"]
        assert s["t_reward_exposed"] == s["t_reward"] > 0  # serial: the step waits on all of it
    def per_sample(rows):
        return [(r["step"], r["prompt_index"], r["response"], r["reward"], r["advantage"]) for r in rows]

    assert per_sample(serial_samples) == per_sample(overlapped_samples)
    assert len({r[3] for r in per_sample(serial_samples)}) > 1, "every reward equal: nothing was compared"
    assert "exposed)" in console  # the console line gives both: "reward 0.01 (0.00 exposed)"

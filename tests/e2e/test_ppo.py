"""PPO with a critic through `megarl/train.py` at DP=2 on the starter model: the critic trains, its metrics are
logged, its checkpoint sits next to the actor's, and a run resumed from step 2 repeats steps 3-4 exactly."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
from helpers import metrics_by_step, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TRAIN = "megarl/train.py"
CRITIC_KEYS = ("value_loss", "value_mean", "return_mean", "explained_variance", "critic_grad_norm")


def _args(starter: Path, out: Path) -> list:
    return ["recipes/tiny_cpu_ppo.sh", "--hf-checkpoint", starter, "--prompt-data", starter / "train.jsonl",
            "--eval-data", "", "--max-train-minutes", "0", "--num-steps", 4, "--rollout-batch-size", 8,
            "--n-samples-per-prompt", 8, "--micro-batch-size", 16, "--critic-lr", "1e-3", "--output-dir", out,
            "--log-interval", 1]


def test_ppo_steps_at_dp2_and_exact_resume(starter, tmp_path):
    full, resumed, ckpt = tmp_path / "full", tmp_path / "resumed", tmp_path / "ckpt"
    torchrun(2, TRAIN, *_args(starter, full), "--save", ckpt, "--save-interval", 2, "--keep-last", 3, timeout=300)
    rows = metrics_by_step(full)
    assert sorted(rows) == [1, 2, 3, 4]
    for row in rows.values():
        assert all(math.isfinite(row[k]) for k in CRITIC_KEYS), row
    assert rows[1]["value_mean"] == 0.0, "the value head starts at zero"
    # The critic only moves once some return is non-zero (a correct answer): from the next step on, values do.
    first = next((s for s in (1, 2, 3) if rows[s]["return_mean"] != 0.0), None)
    assert first is not None, "no correct answer in 3 steps: the critic check would be vacuous"
    assert rows[first]["critic_grad_norm"] > 0 and rows[first + 1]["value_mean"] != 0.0
    assert (ckpt / "critic" / "iter_0000002").is_dir() and (ckpt / "critic" / "iter_0000004").is_dir()

    at2 = tmp_path / "at2"
    (at2 / "critic").mkdir(parents=True)
    shutil.copytree(ckpt / "iter_0000002", at2 / "iter_0000002")
    shutil.copytree(ckpt / "critic" / "iter_0000002", at2 / "critic" / "iter_0000002")
    (at2 / "latest").write_text("iter_0000002\n")
    torchrun(2, TRAIN, *_args(starter, resumed), "--load", at2, timeout=300)
    again = metrics_by_step(resumed)
    assert sorted(again) == [3, 4]
    for step in (3, 4):
        for key in ("reward_mean", "loss", "grad_norm") + CRITIC_KEYS:
            assert again[step][key] == rows[step][key], (step, key)  # bitwise on CPU, same seeds

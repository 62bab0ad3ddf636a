"""Every algorithm option wired through `megarl/train.py`: a short DP=2 run per combination, checking that the
options reach the metrics (a flag that is parsed but ignored would pass a parse-only test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _run(starter: Path, out: Path, *extra) -> list[dict]:
    torchrun(2, "megarl/train.py", "recipes/tiny_cpu.sh", "--hf-checkpoint", starter, "--prompt-data",
             starter / "train.jsonl", "--eval-data", "", "--max-train-minutes", "0", "--num-steps", 2,
             "--rollout-batch-size", 4, "--output-dir", out, *extra, timeout=400)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_rloo_dual_clip_tis_kl_in_reward_overlong_and_token_budget(starter, tmp_path):
    rows = _run(starter, tmp_path / "a", "--advantage-estimator", "rloo", "--policy-loss", "dual_clip",
                "--tis-cap", 2.0, "--kl-coef", 0.05, "--kl-in-reward", "--overlong-buffer-len", 4,
                "--max-response-len", 6, "--mask-truncated", "--max-tokens-per-micro-batch", 64,
                "--loss-aggregation", "seq-mean-token-sum-norm", "--entropy-coef", 0.01)
    for r in rows:
        assert 0 < r["tis_weight_mean"] <= 2.0
        assert r["entropy"] > 0 and r["kl"] >= 0
        assert r["is_weight_min"] <= r["is_weight_mean"] <= r["is_weight_max"]
        assert r["rollout_actor_kl"] >= 0


def test_gspo_reinforce_pp_and_dynamic_sampling(starter, tmp_path):
    rows = _run(starter, tmp_path / "b", "--advantage-estimator", "reinforce_pp_baseline", "--policy-loss", "gspo",
                "--eps-clip", 3e-4, "--eps-clip-high", 4e-4, "--dynamic-sampling", "--max-sampling-rounds", 3,
                "--loss-aggregation", "seq-mean-token-mean")
    for r in rows:
        assert r["ds_prompts_drawn"] >= 4 and 1 <= r["ds_rounds"] <= 3
        # after dynamic sampling, only groups with mixed outcomes remain unless the rounds ran out
        assert r["uniform_group_frac"] <= r["ds_groups_filled"] / 4 + 1e-9

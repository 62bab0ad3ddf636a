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
        assert 0 < r["tis_weight_mean"] <= r["tis_weight_max"] <= 2.0 and 0 <= r["tis_clip_frac"] <= 1
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


def test_decoupled_off_policy_correction(starter, tmp_path):
    # Two updates per rollout, so the proximal policy (the actor before the update) is computed by its own forward
    # pass; a cap of 1 truncates every token whose proximal/behaviour weight the engine's arithmetic puts above 1.
    # decoupled, the former name of tis, runs as tis at --decoupled-is-cap and logs tis_*.
    rows = _run(starter, tmp_path / "c", "--off-policy-correction", "decoupled", "--decoupled-is-cap", 1.0,
                "--updates-per-rollout", 2)
    for r in rows:
        assert not any(k.startswith("decoupled_") for k in r)
        assert 0 < r["tis_weight_mean"] <= r["tis_weight_max"] <= 1.0
        assert 0 < r["tis_clip_frac"] < 1, "the cap reached the loss"
        # the behaviour policy is the built-in fp32 engine: the weights stay within rounding of 1
        assert r["tis_weight_mean"] == pytest.approx(1.0, abs=1e-3)

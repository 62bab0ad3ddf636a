"""`megarl/train.py` end to end on the starter model: exact resume, and bad input that fails cleanly."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, env, metrics_by_step, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TRAIN = "megarl/train.py"
COMPARED = ("reward_mean", "accuracy", "loss", "kl", "clip_frac", "grad_norm", "response_len")


def _common(starter: Path, out: Path) -> list[str]:
    return ["recipes/tiny_cpu.sh", "--hf-checkpoint", starter, "--prompt-data", starter / "train.jsonl",
            "--eval-data", "", "--max-train-minutes", "0", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
            "--micro-batch-size", "16", "--lr", "3e-4", "--kl-coef", "0.01", "--output-dir", out, "--log-interval", "1"]


@pytest.fixture(scope="module")
def runs(starter, tmp_path_factory):
    """An uninterrupted 6-step run that checkpoints at step 3, and a run resumed from that step-3 checkpoint.

    The resumed run gets the same flags (the same 6-step learning-rate schedule), as a preempted job would.
    """
    root = tmp_path_factory.mktemp("runs")
    full, resumed, ckpt = root / "full", root / "resumed", root / "ckpt"
    torchrun(2, TRAIN, *_common(starter, full), "--num-steps", 6, "--save", ckpt, "--save-interval", 3, timeout=400)
    # The state of the uninterrupted run at step 3, as if it had been killed right after saving it.
    at_step3 = root / "ckpt_step3"
    at_step3.mkdir()
    shutil.copytree(ckpt / "iter_0000003", at_step3 / "iter_0000003")
    (at_step3 / "latest").write_text("iter_0000003\n")
    torchrun(2, TRAIN, *_common(starter, resumed), "--num-steps", 6, "--load", at_step3, timeout=400)
    return {"full": metrics_by_step(full), "resumed": metrics_by_step(resumed), "ckpt": ckpt, "starter": starter}


def test_resumed_run_matches_uninterrupted(runs):
    full, resumed = runs["full"], runs["resumed"]
    assert sorted(resumed) == [4, 5, 6], "the resumed run starts after the checkpointed step"
    assert any(full[s]["loss"] != 0.0 for s in full), "all-zero losses would make the comparison vacuous"
    assert full[6]["lr"] < full[1]["lr"], "the schedule decays, so a lost scheduler state would show"
    for step in (4, 5, 6):
        for key in COMPARED + ("lr",):
            assert resumed[step][key] == full[step][key], (step, key)  # bitwise on CPU, same seeds


def _fingerprint(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _train_single(*args) -> subprocess.CompletedProcess:
    """One process, as `python megarl/train.py ...` (torchrun's environment is optional for one rank)."""
    e = env()
    e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    return subprocess.run([sys.executable, TRAIN, *map(str, args)], cwd=REPO, env=e, capture_output=True,
                          text=True, timeout=300)


def test_bad_input_fails_clearly_and_keeps_checkpoint(runs, tmp_path):
    starter, ckpt = runs["starter"], runs["ckpt"]
    before = _fingerprint(ckpt)
    base = _common(starter, tmp_path / "out") + ["--save", ckpt]

    bad_flag = _train_single(*base, "--learning-rate", "1e-3")
    assert bad_flag.returncode == 2
    assert "unknown flag --learning-rate" in bad_flag.stderr and "command line" in bad_flag.stderr

    bad_choice = _train_single(*base, "--advantage-estimator", "ppo2")
    assert bad_choice.returncode == 2
    assert "--advantage-estimator 'ppo2' is not registered; choose one of: dr_grpo, gae, grpo" in bad_choice.stderr

    recipe = tmp_path / "typo.sh"
    recipe.write_text("TRAINING_ARGS=(--num-step 5)\n")
    bad_recipe = _train_single(recipe)
    assert bad_recipe.returncode == 2
    assert f"recipe {recipe}: unknown flag --num-step" in bad_recipe.stderr and "--num-steps" in bad_recipe.stderr

    # A --load with no checkpoint starts afresh, but not over the checkpoints --save already holds.
    missing = _train_single(*base, "--load", tmp_path / "no-such-ckpt")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert f"--load {tmp_path / 'no-such-ckpt'} holds no checkpoint, but --save {ckpt} does" in missing.stderr

    data = tmp_path / "bad.jsonl"
    lines = (starter / "train.jsonl").read_text().splitlines()[:5]
    lines[2] = '{"prompt": "1+1=", "answer": 2'  # line 3: truncated JSON
    data.write_text("\n".join(lines) + "\n")
    malformed = _train_single(*base, "--load", ckpt, "--prompt-data", data)
    assert malformed.returncode == 2
    assert f"{data}:3: not valid JSON" in malformed.stderr

    assert _fingerprint(ckpt) == before, "a failed start must not touch the existing checkpoint"


def test_gpu_recipe_parses_and_fails_clearly_on_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-machine message")
    proc = _train_single("recipes/r1_math.sh")
    assert proc.returncode == 2
    # SGLang runs on CPU too (make sglang-env); where it is not installed, the message says how to get it
    assert "--rollout-backend sglang: sglang is not importable" in proc.stderr
    assert "no CUDA GPU" in proc.stderr and "make sglang-env" in proc.stderr
    assert "--rollout-backend builtin" in proc.stderr


def test_tp2_and_pp2_steps_match_tp1(starter, tmp_path):
    """The same seeds give the same rollouts and the same first update at TP=1, TP=2 and PP=2 (DP=1 in each)."""
    layouts = {"tp1": (1, []), "tp2": (2, ["--tensor-model-parallel-size", 2]),
               "pp2": (2, ["--pipeline-model-parallel-size", 2])}
    got = {}
    for name, (nproc, extra) in layouts.items():
        torchrun(nproc, TRAIN, *_common(starter, tmp_path / name), "--num-steps", 2, *extra, timeout=400)
        got[name] = metrics_by_step(tmp_path / name)
    base = got["tp1"][1]
    assert base["loss"] != 0.0
    for name in ("tp2", "pp2"):
        step = got[name][1]
        assert step["reward_mean"] == base["reward_mean"] and step["response_len"] == base["response_len"], name
        assert abs(step["loss"] - base["loss"]) < 1e-5, name
        assert abs(step["grad_norm"] - base["grad_norm"]) < 1e-4 * max(1.0, base["grad_norm"]), name
        assert step["rollout_actor_logp_absdiff_max"] < 1e-4, name  # engine and actor agree token by token

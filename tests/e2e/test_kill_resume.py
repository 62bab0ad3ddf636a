"""A run killed with SIGKILL right after a checkpoint and resumed with `--load` logs the same per-step metrics as
an uninterrupted run (bitwise on CPU, same seeds): synchronous on one process, asynchronous (`--async-staleness 2`
at DP=2: the batches in flight are part of the checkpoint)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, env, free_port, latest_step, torchrun

from megarl.procs import descendants

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TRAIN = "megarl/train.py"
COMPARED = ("reward_mean", "accuracy", "loss", "kl", "clip_frac", "grad_norm", "response_len", "lr", "entropy",
            "rollout_actor_logp_absdiff_mean")
STEPS, KILL_AFTER = 6, 3


def _args(starter: Path, out: Path) -> list[str]:
    return ["recipes/tiny_cpu.sh", "--hf-checkpoint", starter, "--prompt-data", starter / "train.jsonl",
            "--eval-data", "", "--max-train-minutes", "0", "--rollout-batch-size", "4", "--n-samples-per-prompt", "8",
            "--micro-batch-size", "16", "--lr", "3e-4", "--kl-coef", "0.01", "--dynamic-sampling",
            "--max-sampling-rounds", "2", "--num-steps", STEPS, "--output-dir", out, "--log-interval", "1"]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process under it at once, as a node's loss would: torchrun starts each worker in a
    session of its own, so the agent's process group (`killpg`) holds the agent alone, and its workers went on
    training and saving after it died (steps 4 to 6 within a second, measured). All are stopped first, so none
    moves on while the others are being killed."""
    tree = [pid, *descendants(pid)]
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in tree:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass


def _run_and_kill(nproc: int, args: list, ckpt: Path, timeout: float = 400) -> int:
    """Start a run that saves every step; SIGKILL its agent and its workers once step KILL_AFTER is saved."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), TRAIN, *map(str, args), "--save", str(ckpt), "--save-interval", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while latest_step(ckpt) < KILL_AFTER:
            if proc.poll() is not None:
                raise AssertionError(f"the run ended before step {KILL_AFTER} was saved:\n{proc.stderr.read()[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no checkpoint of step {KILL_AFTER} after {timeout} s")
            time.sleep(0.05)
    finally:
        _kill_tree(proc.pid)
        proc.wait(timeout=60)
    return latest_step(ckpt)


# Asynchronous at DP=2 (each rank's queue and dynamic-sampling buffer) with two batches in flight: the kill lands
# with the most state in flight. The synchronous run on one process (`single`) passes too and is kept out of
# `make test` for CI's time (~75 s; MEGARL_KILL_RESUME_SINGLE=1 runs it): synchronous resumes are tested at DP=2 by
# test_train_cli.py and test_ppo.py. K = 1 passes here too: `--async-staleness 1` on one process and at DP=2 was
# measured bitwise when asynchronous training landed.
CASES = [pytest.param(1, 0, id="single", marks=pytest.mark.skipif(
             os.environ.get("MEGARL_KILL_RESUME_SINGLE") != "1",
             reason="kept out of make test for CI's time; MEGARL_KILL_RESUME_SINGLE=1 runs it")),
         pytest.param(2, 2, id="dp2-async2")]


@pytest.mark.parametrize("nproc,staleness", CASES)
def test_sigkill_then_resume_matches_uninterrupted_run(starter, tmp_path, nproc, staleness):
    full_out, out, ckpt = tmp_path / "full", tmp_path / "run", tmp_path / "ckpt"
    extra = ["--async-staleness", staleness, "--tis-cap", 2] if staleness else []
    torchrun(nproc, TRAIN, *_args(starter, full_out), *extra, timeout=400)
    full = {r["step"]: r for r in _rows(full_out)}
    assert sorted(full) == list(range(1, STEPS + 1))
    if staleness:  # every batch within the bound, and older than the step's weights (dynamic sampling's extra
        # rounds take the queue faster than one batch a step, so its batches can be fresher than the bound)
        assert all(0 <= r["staleness_max"] <= staleness for r in full.values())
        assert max(r["staleness_max"] for r in full.values()) >= 1
        assert full[1]["staleness_max"] == 0  # the first batches use the starting weights

    killed_at = _run_and_kill(nproc, [*_args(starter, out), *extra], ckpt)
    assert KILL_AFTER <= killed_at < STEPS, "the kill should land mid-run"

    time.sleep(1.5)  # nothing of the killed run may write on: its checkpoints stay as the kill left them
    assert latest_step(ckpt) == killed_at
    resumed = torchrun(nproc, TRAIN, *_args(starter, out), *extra, "--save", ckpt, "--save-interval", 1, "--load",
                       ckpt, timeout=400)
    assert f"resumed from {ckpt / f'iter_{killed_at:07d}'} at step {killed_at}" in resumed.stdout, resumed.stdout
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "each step logged exactly once after the resume"
    assert any(full[s]["loss"] != 0.0 for s in full), "all-zero losses would make the comparison vacuous"
    assert any(r.get("ds_groups_dropped", 0) > 0 for r in full.values()), "dynamic sampling never dropped a group"
    for r in rows:
        for key in COMPARED:
            assert r[key] == full[r["step"]][key], (r["step"], key)  # bitwise on CPU, same seeds

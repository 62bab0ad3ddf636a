"""A torchrun agent killed alone (SIGKILL: `kill -9` of the torchrun pid, the OOM killer) takes its workers with it.

torchrun starts each worker in a session of its own, so the agent's death used to leave them training and saving
under --save as orphans, while a run started again read the same directory (its ranks then resumed from different
steps). Now each worker watches its agent (`megarl.procs.stop_with_agent`) and ends, saying so, within half a second;
and a run whose ranks found different checkpoints under --load stops before loading any
(`megarl.trainer.checkpoints.agreed_resume`), naming what each rank saw."""

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

from megarl.procs import descendants, running

pytestmark = [pytest.mark.faults, pytest.mark.distributed, pytest.mark.slow]
STEPS = 40


def _of_run(tmp_path: Path) -> list[int]:
    """Every process whose command line names the test's directory (the workers and whatever they forked)."""
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if str(tmp_path) in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace"):
                out.append(int(p))
        except OSError:
            continue
    return out


def test_a_killed_torchrun_agent_takes_its_workers_with_it(starter, tmp_path):
    out, ckpt, log_path = tmp_path / "out", tmp_path / "ckpt", tmp_path / "run.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "megarl/train.py", "recipes/tiny_cpu.sh", "--hf-checkpoint", str(starter), "--prompt-data",
           str(starter / "train.jsonl"), "--eval-data", "", "--max-train-minutes", "0", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "4", "--micro-batch-size", "8", "--num-steps", str(STEPS), "--output-dir",
           str(out), "--log-interval", "1", "--save", str(ckpt), "--save-interval", "1"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while latest_step(ckpt) < 1:
            assert proc.poll() is None, f"the run ended before its first checkpoint:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint after 300 s"
            time.sleep(0.05)
        workers = [p for p in descendants(proc.pid) if "megarl/train.py" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(workers) == 2, workers
        os.kill(proc.pid, signal.SIGKILL)  # the agent alone: its workers are in sessions of their own
        proc.wait(timeout=60)
        killed_at, t0 = latest_step(ckpt), time.monotonic()
        while any(map(running, workers)) and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        gone_after = time.monotonic() - t0
        time.sleep(1.0)  # a process on its way out can read as gone for a moment: look again after a second
        assert not any(map(running, workers)), f"workers {workers} still running {gone_after + 1:.0f} s after " \
                                               "their agent died"
        text = log_path.read_text()
        # the first watch to fire ends its rank; the other may meet that first, as a closed gloo connection
        said = [r for r in (0, 1) if f"megarl: rank {r}: its torchrun agent (pid {proc.pid}) is gone: this worker "
                                     "stops now" in text]
        assert said, text[-3000:]
        assert latest_step(ckpt) <= killed_at + 1, "the workers went on saving after their agent died"
        left = [p for p in _of_run(tmp_path) if running(p)]  # the engine, reward and checkpoint-writer processes
        assert not left, f"processes of the run outlived its workers: {left}"
        assert latest_step(ckpt) < STEPS
        print(f"workers gone {gone_after:.2f} s after their agent; checkpoint at the kill {killed_at}, "
              f"after {latest_step(ckpt)}")
    finally:
        for p in [proc.pid, *workers, *(descendants(*workers) if workers else []), *_of_run(tmp_path)]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _agree(tmp_path: Path, *seen: str) -> list[dict]:
    out = tmp_path / f"agree-{len(list(tmp_path.glob('agree-*')))}"
    out.mkdir()
    torchrun(2, "tests/distributed/agreed_resume_worker.py", "--load", tmp_path, "--seen", *seen, "--out", out,
             timeout=120)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_ranks_that_found_the_same_checkpoint_resume_from_it(tmp_path):
    same = str(tmp_path / "iter_0000005")
    assert [r.get("path") for r in _agree(tmp_path, same, same)] == [same, same]
    assert [r.get("path") for r in _agree(tmp_path, "", "")] == ["None", "None"]


@pytest.mark.parametrize("seen", [("iter_0000005", "iter_0000006"), ("iter_0000002", "")], ids=["newer", "none"])
def test_ranks_that_found_different_checkpoints_stop_before_loading_naming_each(tmp_path, seen):
    paths = [str(tmp_path / s) if s else "" for s in seen]
    rows = _agree(tmp_path, *paths)
    assert len(rows) == 2 and all("error" in r for r in rows), rows
    for r in rows:
        assert f"--load {tmp_path} changed while this run started" in r["error"]
        assert f"rank 0: {paths[0]}" in r["error"]
        assert f"rank 1: {paths[1] or 'no checkpoint'}" in r["error"]
        assert "nothing was loaded or written" in r["error"]

"""Faults injected into real runs (`MEGARL_FAULT`, `megarl/faults.py`) on the tiny starter, each run ending where
one uninterrupted run ends: every step logged once, every metric bitwise equal (CPU, same seeds; the runs save every
step, as the uninterrupted one does), and the fault named in the log. One uninterrupted run serves the module; the
faults are chained on one checkpoint directory to keep CI short:

  disk_full_on_save@2            the save of step 2 fails: the run stops (exit 3) naming the path and the cause,
                                 iter_1 intact
  kill_during_save@3             resumed, then SIGKILLed inside the save of step 3: iter_3.tmp left, latest iter_2
  slow_node@3 + trainer_sigkill@3  resumed under an elastic torchrun (--max-restarts 1): rank 0 sleeps before
                                 step 3, dies after it; torchrun restarts the worker, which resumes from iter_3 and
                                 finishes
  a truncated file in iter_4     named and skipped; the resume takes iter_3 and logs step 4 as before

and, on a checkpoint directory of its own, reward_worker_crash@2 with --reward-workers 1: the sample is scored
again on a fresh worker, and the run matches the uninterrupted one (whose rewards come from this process: the same
verdicts, the verifier being deterministic). sandbox_kill@2 runs on code rows (the starter's prompts, each answer
checked by a program's stdout in the local sandbox) against an uninterrupted run of its own on the same rows.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, env, free_port

pytestmark = [pytest.mark.faults, pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(1500)]
TRAIN = "megarl/train.py"
STEPS = 4
COMPARED = ("reward_mean", "accuracy", "loss", "kl", "clip_frac", "grad_norm", "response_len", "lr", "entropy")


def _args(starter: Path, out: Path, ckpt: Path) -> list:
    return ["recipes/tiny_cpu.sh", "--hf-checkpoint", starter, "--prompt-data", starter / "train.jsonl",
            "--eval-data", "", "--max-train-minutes", "0", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
            "--micro-batch-size", "8", "--lr", "3e-4", "--kl-coef", "0.01", "--num-steps", STEPS, "--output-dir", out,
            "--log-interval", "1", "--save", ckpt, "--save-interval", "1", "--load", ckpt]


class _Done:
    def __init__(self, returncode: int, log: str):
        self.returncode, self.stdout, self.stderr = returncode, log, log


def _torchrun(args: list, fault: str = "", elastic: bool = False, timeout: float = 500, **extra) -> _Done:
    """train.py under torchrun (one process; `elastic`: c10d rendezvous, --max-restarts 1), its output in a file;
    afterwards its whole process group is killed: a worker killed by a fault leaves helpers (reward workers) that
    would otherwise hold the output open."""
    launch = (["--nnodes", "1:1", "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{free_port()}"] if elastic else ["--master-port", str(free_port())])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", *launch, TRAIN, *map(str, args)]
    log_path = Path(str(args[args.index("--output-dir") + 1]) + f".{fault or 'plain'}.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**env(), **({"MEGARL_FAULT": fault} if fault else {}), **extra},
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=60)
    return _Done(rc, log_path.read_text())


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _latest(ckpt: Path) -> str:
    return (ckpt / "latest").read_text().strip()


@pytest.fixture(scope="module")
def baseline(starter, tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    done = _torchrun(_args(starter, root / "out", root / "ckpt"))
    assert done.returncode == 0, done.stdout[-4000:]
    rows = {r["step"]: r for r in _rows(root / "out")}
    assert sorted(rows) == list(range(1, STEPS + 1))
    assert any(r["loss"] != 0.0 for r in rows.values()), "all-zero losses would make the comparison vacuous"
    return rows


def _same(rows: list[dict], baseline: dict, steps=range(1, STEPS + 1)) -> None:
    assert [r["step"] for r in rows] == list(steps), "each step logged exactly once"
    for r in rows:
        for key in COMPARED:
            assert r[key] == baseline[r["step"]][key], (r["step"], key)


@pytest.mark.skipif(os.environ.get("MEGARL_FAULTS_LONG") != "1",
                    reason="four fault runs after each other (~2 min on 2 cores), kept out of make test for CI's time; "
                           "MEGARL_FAULTS_LONG=1 runs it")
def test_disk_full_then_kill_in_save_then_elastic_restart_end_where_an_uninterrupted_run_ends(starter, tmp_path,
                                                                                             baseline):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    args = _args(starter, out, ckpt)

    proc = _torchrun(args, "disk_full_on_save@2")
    assert proc.returncode != 0
    assert "megarl: fault injected: disk_full_on_save at step 2 on rank 0" in proc.stderr
    assert (f"megarl: error: the checkpoint of step 2 could not be saved under --save {ckpt}: rank 0: "
            f"{ckpt / 'iter_0000002.tmp'}: OSError: No space left on device") in proc.stderr, proc.stderr[-3000:]
    assert f"{ckpt / 'iter_0000001'} is intact" in proc.stderr
    assert _latest(ckpt) == "iter_0000001" and not (ckpt / "iter_0000002.tmp").exists()

    t0 = time.monotonic()
    proc = _torchrun(args, "kill_during_save@3")
    assert proc.returncode != 0 and "megarl: fault injected: kill_during_save at step 3 on rank 0" in proc.stderr
    assert "resumed from" in proc.stdout + proc.stderr
    assert _latest(ckpt) == "iter_0000002" and (ckpt / "iter_0000003.tmp").is_dir()

    # an elastic torchrun restarts the killed worker by itself; it resumes from the checkpoint of step 3
    t1 = time.monotonic()
    proc = _torchrun(args, "slow_node@3,trainer_sigkill@3", elastic=True, MEGARL_FAULT_SLOW_S="2")
    log = proc.stdout
    assert proc.returncode == 0, log[-5000:]
    assert "iter_0000003.tmp: an interrupted save (killed while saving): skipped, never loaded" in log
    assert "megarl: fault injected: slow_node at step 3 on rank 0" in log
    assert "megarl: fault injected: trainer_sigkill at step 3 on rank 0" in log
    assert "resumed from" in log and "at step 3" in log
    print(f"kill_during_save -> resumed: {t1 - t0:.0f} s; elastic run with a restart: {time.monotonic() - t1:.0f} s")
    _same(_rows(out), baseline)

    # a checkpoint truncated on disk is named and skipped; the resume from the one before logs the same step 4
    shutil.rmtree(out)
    victim = next((ckpt / "iter_0000004").rglob("*.distcp"))
    victim.write_bytes(victim.read_bytes()[:-1])
    proc = _torchrun(args)
    log = proc.stdout
    assert proc.returncode == 0, log[-4000:]
    assert f"iter_0000004: corrupt or partial ({victim.relative_to(ckpt / 'iter_0000004')} holds" in log, log[-3000:]
    assert "at step 3" in log
    _same(_rows(out), baseline, steps=[4])


def test_a_reward_worker_killed_mid_scoring_changes_nothing_but_its_count(starter, tmp_path, baseline):
    t0 = time.monotonic()
    proc = _torchrun(_args(starter, tmp_path / "out", tmp_path / "ckpt") + ["--reward-workers", "1"],
                     "reward_worker_crash@2")
    log = proc.stdout
    assert proc.returncode == 0, log[-5000:]
    print(f"4-step run with a reward worker killed at step 2: {time.monotonic() - t0:.0f} s")
    assert "megarl: fault injected: reward_worker_crash at step 2 on rank 0" in log
    assert "megarl: reward worker died scoring a 'arithmetic' sample" in log and "scored again" in log
    rows = _rows(tmp_path / "out")
    _same(rows, baseline)
    for r in rows:
        for key in ("reward_timeout_rate", "reward_parse_error_rate", "reward_no_answer_rate"):
            assert r[key] == baseline[r["step"]][key], (r["step"], key)
    assert [r["reward_worker_restarts"] for r in rows] == [0, 1, 0, 0]


def _code_rows(starter: Path, out: Path) -> Path:
    """The starter's prompts as code rows (as tests/e2e/test_code_rewards.py makes them): its answer, a number, is
    a program printing nothing, which passes the rows expecting no output and fails those expecting "odd"."""
    rows = [json.loads(line) for line in (starter / "train.jsonl").read_text().splitlines()[:64]]
    gold = [{"inputs": [""], "outputs": ["odd\n" if int(r["answer"]) % 2 else ""], "time_s": 2} for r in rows]
    out.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": g, "verifier": "code"}) + "\n"
                           for r, g in zip(rows, gold)))
    return out


def test_a_sandbox_killed_mid_case_changes_nothing_but_its_count(starter, tmp_path):
    data = _code_rows(starter, tmp_path / "code.jsonl")
    steps = 3

    def run(name: str, fault: str = "") -> tuple[_Done, list[dict]]:
        args = _args(starter, tmp_path / name, tmp_path / f"{name}-ckpt") + [
            "--prompt-data", data, "--reward-workers", "1", "--num-steps", steps]
        t0 = time.monotonic()
        done = _torchrun(args, fault)
        assert done.returncode == 0, done.stdout[-5000:]
        print(f"{steps}-step code run{' with ' + fault if fault else ''}: {time.monotonic() - t0:.0f} s")
        return done, _rows(tmp_path / name)

    _, baseline = run("uninterrupted")
    assert [r["reward_sandbox_reruns"] for r in baseline] == [0] * steps
    assert any(0 < r["reward_mean"] < 1 for r in baseline), "rewards all equal would make the comparison vacuous"
    proc, rows = run("killed", "sandbox_kill@2")
    log = proc.stdout
    assert "megarl: fault injected: sandbox_kill at step 2 on rank 0" in log
    assert "megarl: sandbox_kill: SIGKILLed the local sandbox's worker (pid " in log
    assert "megarl: the local sandbox failed on 1 code case(s) (first: worker failed: " in log
    _same(rows, {r["step"]: r for r in baseline}, steps=range(1, steps + 1))
    for r, b in zip(rows, baseline):
        for key in ("reward_timeout_rate", "reward_parse_error_rate", "reward_no_answer_rate"):
            assert r[key] == b[key], (r["step"], key)
    assert [r["reward_sandbox_reruns"] for r in rows] == [0, 1, 0]
    assert [r["reward_worker_restarts"] for r in rows] == [0, 0, 0]
    print("t_reward per step, uninterrupted / sandbox killed at step 2:",
          [round(r["t_reward"], 2) for r in baseline], [round(r["t_reward"], 2) for r in rows])

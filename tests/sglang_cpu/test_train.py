"""The first milestone of SGLang on CPU: recipes/tiny_cpu.sh trains 2 steps with `--rollout-backend sglang` on the
test starter, end to end under torchrun in the SGLang environment: the in-process engine (not colocated on CPU)
generates every rollout, takes the actor's weights in buckets after each step, and passes --verify-weight-sync and
the top-k mismatch check (--mismatch-check-interval 1)."""

import json
import socket
import subprocess

from conftest import REPO, env_dir, sglang_env_vars


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tiny_cpu_two_steps_through_sglang(sglang_python, starter, standin_log, tmp_path):
    out = tmp_path / "run"
    env = {**sglang_env_vars(standin_log), "STARTER_DIR": str(starter)}
    cmd = [str(env_dir() / "bin" / "torchrun"), "--nproc-per-node", "1", "--master-port", str(_free_port()),
           str(REPO / "megarl/train.py"), str(REPO / "recipes/tiny_cpu.sh"), "--rollout-backend", "sglang",
           "--num-steps", "2", "--rollout-batch-size", "2", "--verify-weight-sync", "--mismatch-check-interval", "1",
           "--log-interval", "1", "--output-dir", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "megarl: sglang: CPU engine, not colocated" in log, log[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["weight_version"] for r in rows] == [1, 2]
    # the probe of sync 1, scored by the engine before step 2's rollout; the mismatch of the same step's batch
    assert rows[1]["sync_probe_version"] == 1 and rows[1]["sync_probe_absdiff_mean"] < 1e-2, rows[1]
    assert rows[1]["mismatch_kl_fwd"] < 1e-4 and rows[1]["mismatch_top1"] > 0.9, rows[1]
    assert all(r["aborted_frac"] == 0 for r in rows)

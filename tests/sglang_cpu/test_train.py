"""The first milestone of SGLang on CPU: recipes/tiny_cpu.sh trains 2 steps with `--rollout-backend sglang` on the
test starter, end to end under torchrun in the SGLang environment: the in-process engine (not colocated on CPU)
generates every rollout, takes the actor's weights in buckets after each step, and passes --verify-weight-sync and
the top-k mismatch check (--mismatch-check-interval 1)."""

import json
import socket
import subprocess
import time
import urllib.request

from checks_servers import CPU_SGLANG_ARGS
from sglang_env import REPO, env_dir, sglang_env_vars


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(standin_log, starter, out, *flags) -> tuple[str, list[dict]]:
    env = {**sglang_env_vars(standin_log), "STARTER_DIR": str(starter)}
    cmd = [str(env_dir() / "bin" / "torchrun"), "--nproc-per-node", "1", "--master-port", str(_free_port()),
           str(REPO / "megarl/train.py"), str(REPO / "recipes/tiny_cpu.sh"), "--rollout-backend", "sglang",
           "--num-steps", "2", "--rollout-batch-size", "2", "--verify-weight-sync", "--log-interval", "1",
           "--output-dir", str(out), *flags]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return log, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tiny_cpu_two_steps_through_sglang(sglang_python, starter, standin_log, tmp_path):
    log, rows = _train(standin_log, starter, tmp_path / "run", "--mismatch-check-interval", "1")
    assert "megarl: sglang: CPU engine, not colocated" in log, log[-3000:]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["weight_version"] for r in rows] == [1, 2]
    # the probe of sync 1, scored by the engine before step 2's rollout; the mismatch of the same step's batch
    assert rows[1]["sync_probe_version"] == 1 and rows[1]["sync_probe_absdiff_mean"] < 1e-2, rows[1]
    assert rows[1]["mismatch_kl_fwd"] < 1e-4 and rows[1]["mismatch_top1"] > 0.9, rows[1]
    assert all(r["aborted_frac"] == 0 for r in rows)


def test_tiny_cpu_two_steps_through_an_sglang_server(sglang_python, starter, standin_log, tmp_path):
    """The same with `--rollout-servers`: SGLang's own HTTP server, launched as launch/slurm/disaggregated.sbatch
    launches it (CPU settings as SGLANG_ARGS); the trainer pushes over a gloo weight-update group."""
    port = _free_port()
    log_path = tmp_path / "server.log"
    server = subprocess.Popen(
        [str(sglang_python), "-m", "sglang.launch_server", "--model-path", str(starter), "--host", "127.0.0.1",
         "--port", str(port), "--tp-size", "1", "--mem-fraction-static", "0.05", *CPU_SGLANG_ARGS],
        stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=sglang_env_vars(standin_log), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health_generate", timeout=10) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(1.0)
        log, rows = _train(standin_log, starter, tmp_path / "run", "--rollout-servers", f"127.0.0.1:{port}",
                           "--weight-sync-port", str(_free_port()))
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert [r["weight_version"] for r in rows] == [1, 2]
    assert rows[1]["sync_probe_version"] == 1 and rows[1]["sync_probe_absdiff_mean"] < 1e-2, rows[1]

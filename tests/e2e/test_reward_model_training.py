"""The four-model PPO through `megarl/train.py` at DP=2: actor, critic, reference and a learned reward model
(`hf_rm`, resident in a reward server per data-parallel rank) beside the rule verifier. Rows are scored by the
spec 'hf_rm + 0*arithmetic': the reward model's score is the reward, the arithmetic verifier's outcome the accuracy,
and metrics.jsonl carries the reward model's score mean/std and its agreement with the verifier every step."""

from __future__ import annotations

import json
import math

import pytest
from helpers import make_tiny_hf_model, make_tiny_reward_model, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _tiny_rm(out):
    return make_tiny_reward_model(out, seed=4)


def test_ppo_with_a_reward_model_logs_its_health_every_step(tmp_path):
    from megarl.tasks.arithmetic import all_problems, write_jsonl

    actor = make_tiny_hf_model(tmp_path / "actor", "qwen2", with_tokenizer=True, seed=2)
    rm = _tiny_rm(tmp_path / "rm")
    data = tmp_path / "train.jsonl"
    write_jsonl(data, all_problems()[:64])
    out = tmp_path / "run"
    torchrun(2, "megarl/train.py", "recipes/tiny_cpu_ppo.sh", "--hf-checkpoint", actor, "--prompt-data", data,
             "--eval-data", "", "--max-train-minutes", "0", "--num-steps", 2, "--rollout-batch-size", 4,
             "--n-samples-per-prompt", 4, "--micro-batch-size", 16, "--max-response-len", 4,
             "--verifier-key", "reward_spec", "--default-verifier", "hf_rm + 0*arithmetic", "--reward-model", rm,
             "--output-dir", out, "--log-interval", 1, timeout=600)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("rm_score_mean", "rm_score_std", "rm_agreement", "rm_seconds", "value_loss"):
            assert math.isfinite(row[key]), (key, row)
        assert 0.0 <= row["rm_agreement"] <= 1.0 and row["rm_score_std"] > 0, row
        assert row["reward_parse_error_rate"] == 0.0 and row["reward_timeout_rate"] == 0.0
        assert row["reward_mean"] == pytest.approx(row["rm_score_mean"], abs=1e-6), "0 * arithmetic: the RM's score"


def test_a_remote_reward_server_that_fails_hangs_and_sends_garbage_does_not_stop_training(tmp_path):
    """Requests take turns: one hangs past the timeout, one gets broken JSON, one HTTP 500, one a score. With three
    attempts a row scores when one of them lands on a good turn, else it is a timeout or parse_error row; the run
    completes its steps."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from megarl.tasks.arithmetic import all_problems, write_jsonl

    count = [0]
    lock, stop = threading.Lock(), threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                count[0] += 1
                n = count[0]
            if n % 4 == 0:
                data = json.dumps({"score": len(body["response"]) / 10}).encode()
            elif n % 4 == 1:
                stop.wait(5)
                return
            else:
                data = b"{oops" if n % 4 == 2 else b""
            self.send_response(200 if n % 4 != 3 else 500)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    actor = make_tiny_hf_model(tmp_path / "actor", "qwen2", with_tokenizer=True, seed=2)
    data = tmp_path / "train.jsonl"
    write_jsonl(data, all_problems()[:64])
    out = tmp_path / "run"
    try:
        torchrun(2, "megarl/train.py", "recipes/tiny_cpu.sh", "--hf-checkpoint", actor, "--prompt-data", data,
                 "--eval-data", "", "--max-train-minutes", "0", "--num-steps", 2, "--rollout-batch-size", 4,
                 "--n-samples-per-prompt", 4, "--micro-batch-size", 16, "--max-response-len", 4,
                 "--verifier-key", "reward_spec", "--default-verifier", "arithmetic > remote_rm",
                 "--remote-rm-url", f"http://127.0.0.1:{server.server_address[1]}/", "--remote-rm-timeout", "0.5",
                 "--remote-rm-retries", "2", "--remote-rm-backoff", "0.01", "--output-dir", out, "--log-interval", 1,
                 timeout=600)
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2], "the run went on"
    n = len(rows) * 16  # 4 prompts x 4 samples a step
    failed = sum((r["reward_timeout_rate"] + r["reward_parse_error_rate"]) * 16 for r in rows)
    assert 0 < failed < n, "some rows failed after their retries, some scored"
    assert sum(r["reward_timeout_rate"] for r in rows) > 0 and sum(r["reward_parse_error_rate"] for r in rows) > 0
    assert count[0] > n, "failed attempts were retried"

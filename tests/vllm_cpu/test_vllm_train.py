"""recipes/tiny_cpu.sh trains 2 steps with `--rollout-backend vllm` on the test starter, end to end under torchrun in
the vLLM environment: vLLM's engine (beside the actor on CPU) generates every rollout and the held-out evaluation,
takes the actor's weights in buckets after each step, and passes --verify-weight-sync and the top-k mismatch check."""

import json
import socket

from vllm_env import REPO, run_in_vllm_env
from helpers import build_test_starter


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tiny_cpu_two_steps_through_vllm(vllm_python, tmp_path):
    starter, out = build_test_starter(), tmp_path / "run"
    run_in_vllm_env(vllm_python.parent / "python",
                    ["-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(_free_port()),
                     str(REPO / "megarl/train.py"), str(REPO / "recipes/tiny_cpu.sh"), "--rollout-backend", "vllm",
                     "--num-steps", "2", "--rollout-batch-size", "2", "--verify-weight-sync", "--log-interval", "1",
                     "--mismatch-check-interval", "1", "--output-dir", str(out)],
                    tmp_path / "train.log", STARTER_DIR=str(starter))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["weight_version"] for r in rows] == [1, 2]
    # the probe of sync 1, scored by the engine before step 2's rollout; the mismatch of the same step's batch
    assert rows[1]["sync_probe_version"] == 1 and rows[1]["sync_probe_absdiff_mean"] < 1e-4, rows[1]
    assert rows[1]["mismatch_kl_fwd"] < 1e-6 and rows[1]["mismatch_top1"] > 0.99, rows[1]
    assert all(r["aborted_frac"] == 0 for r in rows)

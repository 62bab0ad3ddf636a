"""`train.py` with `--rollout-function tool_use` end to end on 2 ranks: a scripted policy (a plugin backend) calls
the real python tool, which runs in the local sandbox; the step's tool metrics, the samples' masked spans and the
held-out tool-call rate come out as the policy's script says they must, synchronous and asynchronous."""

from __future__ import annotations

import json

import pytest
from helpers import make_tiny_hf_model, torchrun

from megarl.tasks.arithmetic import build_tokenizer, write_jsonl
from megarl.tasks.multiplication import CHARS, split_problems, tool_output

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("staleness", [0, 1], ids=["sync", "async1"])
def test_train_with_tool_use(tmp_path, staleness):
    """Also asynchronous: the rollout function, its tool calls and their sandbox run in the rollout worker thread."""
    model = make_tiny_hf_model(tmp_path / "m", vocab=96, max_position_embeddings=128)
    build_tokenizer(model, chars=CHARS)
    train, held = split_problems()
    write_jsonl(model / "train.jsonl", train[:64])
    write_jsonl(model / "heldout.jsonl", held[:8])
    out = tmp_path / "run"
    proc = torchrun(2, "megarl/train.py", "recipes/tiny_cpu_tool.sh", "--hf-checkpoint", model,
                    "--prompt-data", model / "train.jsonl", "--eval-data", model / "heldout.jsonl",
                    "--plugins", "tests/e2e/tool_engine_plugin.py", "--rollout-backend", "scripted_tool_engine",
                    "--num-steps", 2, "--rollout-batch-size", 4, "--n-samples-per-prompt", 4,
                    "--micro-batch-size", 8, "--output-dir", out, "--log-interval", 1, "--log-samples-interval", 1,
                    "--log-samples-count", 8, "--eval-samples-per-prompt", 2, "--async-staleness", staleness,
                    timeout=400)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:  # even samples call and copy the product (right), odd ones answer 0 (wrong)
        assert (m["tool_call_rate"], m["accuracy"], m["sample_turns"]) == (0.5, 0.5, 1.5)
        assert (m["tool_error_rate"], m["tool_timeout_rate"]) == (0.0, 0.0)
        assert 0 < m["tool_latency_p50"] <= m["tool_latency_p99"] < 5
        assert 0 < m["tool_output_frac"] < 1
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    called = [s for s in samples if s["tool_calls"]]
    assert len(called) == len(samples) // 2 > 0
    for s in called:
        a, b = s["prompt"][:-1].split("*")
        assert [span["mask"] for span in s["trajectory"]] == [1, 0, 1]
        assert s["trajectory"][1]["text"] == tool_output(str(int(a) * int(b)))
        assert s["response"] == s["answer"] and s["outcome"] == "correct"
    assert "tool-call rate: before 50.0% -> after 50.0%" in proc.stdout
    assert "held-out accuracy (sampled): before 50.0% -> after 50.0%" in proc.stdout

"""Multi-turn tool use with SGLang generating every turn: recipes/tiny_cpu_tool.sh, 2 steps, `--rollout-backend
sglang`, on a tiny model that learned by heart to answer four products by calling the python tool
(`tool_model.py`). SGLang ends the first turn at the python parser's stop string (matched on text, so the engine
runs with its tokenizer), the real tool runs in the local sandbox, its output goes back into the context and SGLang
writes the answer after it; the weights are pushed and verified after each step."""

import json
import subprocess

from helpers import free_port
from sglang_env import REPO, env_dir, sglang_env_vars
from tool_model import PROBLEMS, build_tool_model

from megarl.tasks.multiplication import tool_call, tool_output


def test_tool_calls_through_sglang(sglang_python, standin_log, tmp_path):
    model, loss = build_tool_model(tmp_path / "tool_model")
    assert loss < 0.05, loss  # learned by heart: the policy calls the tool on (nearly) every sample
    out = tmp_path / "run"
    env = {**sglang_env_vars(standin_log), "TOOL_STARTER_DIR": str(model)}
    cmd = [str(env_dir() / "bin" / "torchrun"), "--nproc-per-node", "1", "--master-port", str(free_port()),
           str(REPO / "megarl/train.py"), str(REPO / "recipes/tiny_cpu_tool.sh"), "--rollout-backend", "sglang",
           "--num-steps", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--micro-batch-size", "8",
           "--eval-data", str(model / "train.jsonl"), "--eval-samples-per-prompt", "1", "--log-interval", "1",
           "--log-samples-interval", "1", "--log-samples-count", "8", "--verify-weight-sync", "--output-dir", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "megarl: sglang: CPU engine, not colocated" in log, log[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in rows] == [1, 2]
    assert rows[1]["sync_probe_version"] == 1 and rows[1]["sync_probe_absdiff_mean"] < 1e-2, rows[1]
    for r in rows:
        assert r["tool_call_rate"] >= 0.5 and r["tool_error_rate"] == 0 and r["tool_timeout_rate"] == 0, r
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    called = [s for s in samples if s.get("tool_calls")]
    assert len(called) >= len(samples) // 2 > 0
    products = {p.prompt: p for p in PROBLEMS}
    for s in called:  # SGLang's call, stopped at the parser's stop string; the tool's real output; SGLang's answer
        problem = products[s["prompt"]]
        spans = s["trajectory"]
        assert [span["mask"] for span in spans] == [1, 0, 1], spans
        assert spans[0]["text"] == tool_call(problem), spans
        assert spans[1]["text"] == tool_output(problem.answer), spans
    assert any(s["outcome"] == "correct" and s["response"] == products[s["prompt"]].answer for s in called)

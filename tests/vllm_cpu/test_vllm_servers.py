"""megarl's client of `vllm serve` servers (`--rollout-backend vllm --rollout-servers`) against vLLM's own HTTP
server, started in the vLLM environment as `python -m megarl.rollout.vllm_servers` starts it; the client runs here
(it needs no vLLM). Every figure is checked against `transformers` on the same weights."""

import json
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from helpers import build_test_starter, free_port, make_tiny_hf_model, torchrun
from vllm_env import REPO, vllm_env_vars

from megarl.rollout.base import SamplingParams
from megarl.rollout.server_health import ServerDeadError
from megarl.rollout.vllm_servers import VLLMServers

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]


def start_server(python: Path, model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen(
        [str(python), "-m", "megarl.rollout.vllm_servers", str(model), "--port", str(port), "--host", "127.0.0.1",
         "--dtype", "float32", "--max-model-len", "64", "--kv-cache-bytes", str(64 << 20)],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, env=vllm_env_vars(), cwd=REPO)
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return server, f"127.0.0.1:{port}"
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail(f"the vLLM server did not start:\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(1.0)


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()


@pytest.fixture(scope="module")
def served(vllm_python, tmp_path_factory):
    """A tiny random Qwen2 (head size 32: vLLM's CPU attention takes a few sizes only) behind a server."""
    d = tmp_path_factory.mktemp("vllm_server")
    model = make_tiny_hf_model(d / "model", num_attention_heads=2, num_key_value_heads=1)
    server, url = start_server(vllm_python, model, d / "server.log")
    try:
        yield model, VLLMServers([url], timeout_s=120)
    finally:
        stop_server(server)


def hf_model(model_dir, state=None):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        hf.load_state_dict(state)
    return hf


def hf_logprobs(hf, prompt, tokens, temperature):
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def test_sampled_tokens_and_logprobs_match_transformers(served):
    model, servers = served
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=6, seed=3)
    groups = servers.generate(PROMPTS, params)
    assert [len(g) for g in groups] == [2, 2, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for g in groups for c in g)
    hf = hf_model(model)
    worst = max(abs(a - b) for p, g in zip(PROMPTS, groups) for c in g
                for a, b in zip(c.logprobs, hf_logprobs(hf, p, c.token_ids, 0.8)))
    assert worst < 1e-5
    again = servers.generate(PROMPTS, params)  # per-sample seeds: the same samples
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in groups]


def test_score_and_topk_match_transformers(served):
    model, servers = served
    hf = hf_model(model)
    seqs = [p + [20, 30, 40] for p in PROMPTS]
    lens = [len(p) for p in PROMPTS]
    scored = servers.score(seqs, lens)
    worst = max(abs(a - b) for s, p, row in zip(seqs, PROMPTS, scored)
                for a, b in zip(row, hf_logprobs(hf, p, s[len(p):], 1.0)))
    assert worst < 1e-5
    for (ids, logp), s, p in zip(servers.score_topk(seqs, lens, 3), seqs, lens):
        with torch.no_grad():
            ref = hf(torch.tensor([s])).logits[0, p - 1 : -1].double().log_softmax(-1).topk(3)
        assert ids.tolist() == ref.indices.tolist()
        assert torch.allclose(logp, ref.values, atol=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        servers.score(seqs, lens, temperature=0.5)


def test_weights_pushed_in_buckets_are_the_ones_generating(served):
    """New weights in several buckets (one reload), then greedy tokens and log-probs equal transformers' with those
    weights, and the server stamps the version."""
    model, servers = served
    hf = hf_model(model)
    torch.manual_seed(1)
    new = {k: v + 0.05 * torch.randn_like(v) if v.dim() == 2 else v.clone() for k, v in hf.state_dict().items()}
    from megarl.rollout.weight_sync import pack_buckets

    buckets = list(pack_buckets(new.items(), 16 << 10, None))  # small buckets: a layer's tensors span several
    assert len(buckets) > 3
    servers.load_weight_buckets(buckets, version=7)
    hf = hf_model(model, new)
    greedy = servers.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=6))
    for p, (c,) in zip(PROMPTS, greedy):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p):].tolist()
        assert c.token_ids == ref and c.weight_version == 7
        assert max(abs(a - b) for a, b in zip(c.logprobs, hf_logprobs(hf, p, c.token_ids, 1.0))) < 1e-5
    with urllib.request.urlopen(f"{servers.urls[0]}/weight_info", timeout=10) as r:
        assert json.loads(r.read())["weight_version"] == "7"


def test_refusals_name_the_problem(served):
    _, servers = served
    with pytest.raises(ValueError, match="stop strings"):
        servers.generate(PROMPTS, SamplingParams(stop=("</tool>",)))
    with pytest.raises(ValueError, match="top_k"):
        servers.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=5))
    dead = VLLMServers([f"127.0.0.1:{free_port()}"], timeout_s=2)  # --engine-max-restarts 0: the first failure
    with pytest.raises(ServerDeadError, match=r"vLLM server http://127\.0\.0\.1:\d+ stopped the run after 0 server "
                                              r"failure\(s\) .* did not answer within 2 s"):
        dead.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))


def test_tiny_cpu_two_steps_through_a_vllm_server(vllm_python, tmp_path):
    """recipes/tiny_cpu.sh, 2 steps, every rollout from a `vllm serve` server: the trainer (this venv, no vLLM)
    pushes its weights after each step and verifies them (--verify-weight-sync), with the top-k mismatch check."""
    starter = build_test_starter()
    server, url = start_server(vllm_python, starter, tmp_path / "server.log")
    out = tmp_path / "run"
    try:
        torchrun(1, "megarl/train.py", "recipes/tiny_cpu.sh", "--rollout-backend", "vllm", "--rollout-servers", url,
                 "--num-steps", 2,
                 "--rollout-batch-size", 2, "--verify-weight-sync", "--log-interval", 1,
                 "--mismatch-check-interval", 1, "--output-dir", out, timeout=600,
                 extra_env={"STARTER_DIR": str(starter)})
    finally:
        stop_server(server)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in rows] == [1, 2]
    assert rows[1]["sync_probe_version"] == 1 and rows[1]["sync_probe_absdiff_mean"] < 1e-4, rows[1]
    assert rows[1]["mismatch_kl_fwd"] < 1e-6 and rows[1]["mismatch_top1"] > 0.99, rows[1]
    assert all(r["aborted_frac"] == 0 for r in rows)

"""A Qwen3-MoE checkpoint as `transformers` saves it trains with `megarl/train.py` at EP = 2 with no other change:
the dense demo recipe on 2 processes with `--expert-model-parallel-size 2`, and the MoE recipe (EP 2, routing
replay); the engine checked against the actor after every weight sync, the final actor exported with `--save-hf`."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_tiny_hf_model, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("recipe", ["recipes/tiny_cpu.sh", "recipes/tiny_cpu_moe.sh"])
def test_tiny_qwen3_moe_trains_at_ep2(recipe, tmp_path):
    from transformers import AutoModelForCausalLM

    from megarl.tasks.arithmetic import all_problems, write_jsonl

    hf = make_tiny_hf_model(tmp_path / "moe", "qwen3_moe", layers=2, with_tokenizer=True)
    write_jsonl(tmp_path / "train.jsonl", all_problems()[:64])
    out = tmp_path / "run"
    proc = torchrun(2, "megarl/train.py", recipe, "--hf-checkpoint", hf,
                    "--prompt-data", tmp_path / "train.jsonl", "--eval-data", "", "--num-steps", 2,
                    "--expert-model-parallel-size", 2, "--verify-weight-sync", "--verify-sync-tolerance", 1e-5,
                    "--micro-batch-size", 16, "--rollout-batch-size", 8, "--lr", 1e-3, "--output-dir", out,
                    "--save-hf", out / "hf",
                    # a random model earns no reward (every advantage 0): the entropy bonus gives the update a gradient
                    "--entropy-coef", 0.01, timeout=400)
    assert "EP 2" in proc.stdout and "4 experts (top-2) in 2 layers" in proc.stdout, proc.stdout[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["grad_norm"] > 0 for r in rows)
    assert all(r["sync_probe_absdiff_max"] < 1e-5 for r in rows)  # the engine scores as the EP 2 actor does
    # fp32 engine and actor route alike; the routing metrics are logged either way
    assert all(r["routing_topk_disagree_frac"] == 0 and r["router_entropy"] > 0 for r in rows)
    assert all(r["routing_replayed_frac"] == 0 for r in rows)
    trained = AutoModelForCausalLM.from_pretrained(out / "hf").float().eval()
    start = AutoModelForCausalLM.from_pretrained(hf).float().eval()
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    moved = (trained.state_dict()[experts] - start.state_dict()[experts]).abs().max()
    assert moved > 0, "the experts did not train"
    tokens = torch.randint(0, start.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(trained(tokens).logits).all()


def test_tiny_deepseek_v3_trains_at_ep2_with_routing_replay(tmp_path):
    """DeepSeek-V3 (MLA, a dense first layer, grouped sigmoid router with its bias, a shared expert) through
    `megarl/train.py` with the MoE recipe (EP 2, routing replay): 2 GRPO steps, the built-in engine scoring as the
    actor after each sync, the experts and MLA moved, the router bias kept (Megatron's update rate is 0)."""
    from safetensors.torch import load_file

    from megarl.tasks.arithmetic import all_problems, write_jsonl

    hf = make_tiny_hf_model(tmp_path / "deepseek_v3", "deepseek_v3", layers=3, with_tokenizer=True)
    write_jsonl(tmp_path / "train.jsonl", all_problems()[:64])
    out = tmp_path / "run"
    proc = torchrun(2, "megarl/train.py", "recipes/tiny_cpu_moe.sh", "--hf-checkpoint", hf,
                    "--prompt-data", tmp_path / "train.jsonl", "--eval-data", "", "--num-steps", 2,
                    "--expert-model-parallel-size", 2, "--verify-weight-sync", "--verify-sync-tolerance", 1e-5,
                    "--micro-batch-size", 16, "--rollout-batch-size", 8, "--lr", 1e-3, "--output-dir", out,
                    "--save-hf", out / "hf", "--entropy-coef", 0.01, timeout=400)
    assert "deepseek_v3 3 layers" in proc.stdout and "4 experts (top-2) in 2 layers" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["grad_norm"] > 0 for r in rows)
    assert all(r["sync_probe_absdiff_max"] < 1e-5 for r in rows)
    assert all(r["routing_topk_disagree_frac"] == 0 and 0 < r["router_entropy"] for r in rows)
    start = load_file(str(hf / "model.safetensors"))
    trained = {}
    for shard in (out / "hf").glob("*.safetensors"):
        trained.update(load_file(str(shard)))
    assert set(trained) == set(start)
    for name in ("model.layers.2.mlp.experts.0.gate_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight",
                 "model.layers.0.self_attn.kv_b_proj.weight", "model.layers.2.self_attn.q_a_layernorm.weight"):
        assert (trained[name] - start[name]).abs().max() > 0, f"{name} did not train"
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    assert torch.equal(trained[bias], start[bias])

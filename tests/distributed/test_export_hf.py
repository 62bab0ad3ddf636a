"""`--save-hf` streamed shard by shard: the exported directory loads in `transformers` and gives the source
model's logits, at TP 1, with the pipeline stages' tensors arriving one at a time (PP 2), and for Qwen3-MoE with
its experts gathered over expert-parallel ranks (EP 2)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_tiny_hf_model, torchrun
from safetensors.torch import load_file

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_save_hf_in_shards_loads_back_in_transformers(tp, pp, ep, tiny_qwen2, tmp_path):
    from transformers import AutoModelForCausalLM

    source = tiny_qwen2
    if ep > 1:
        source = make_tiny_hf_model(tmp_path / "qwen3_moe", "qwen3_moe", layers=3, mlp_only_layers=[1])
    out = tmp_path / "exported"
    torchrun(max(tp * pp, ep), "tests/distributed/export_worker.py", "--hf", source, "--out", out, "--tp", tp,
             "--pp", pp, "--ep", ep, "--shard-bytes", 64 << 10, timeout=240)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert not list(out.glob("*.tmp"))
    ref = AutoModelForCausalLM.from_pretrained(source).float().eval()
    got = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert set(index["weight_map"]) == set(load_file(str(source / "model.safetensors")))  # HF's on-disk names
    tokens = torch.randint(0, ref.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(got(tokens).logits, ref(tokens).logits)


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 1)])
def test_save_hf_deepseek_v3_is_the_checkpoint_bitwise(tp, ep, tmp_path):
    """DeepSeek-V3 (MLA, a dense first layer, routed experts in groups, a shared expert and the router's bias, a
    buffer): `--save-hf` at EP 2 or TP 2 writes exactly the checkpoint's tensors, which load back in transformers."""
    from transformers import AutoModelForCausalLM

    source = make_tiny_hf_model(tmp_path / "deepseek_v3", "deepseek_v3", layers=3, seed=2)
    out = tmp_path / "exported"
    torchrun(max(tp, ep), "tests/distributed/export_worker.py", "--hf", source, "--out", out, "--tp", tp,
             "--ep", ep, "--shard-bytes", 64 << 10, timeout=240)
    original = load_file(str(source / "model.safetensors"))
    exported = {}
    for shard in out.glob("model-*.safetensors"):
        exported.update(load_file(str(shard)))
    assert set(exported) == set(original)
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    ref = AutoModelForCausalLM.from_pretrained(source).float().eval()
    got = AutoModelForCausalLM.from_pretrained(out).float().eval()
    tokens = torch.randint(0, ref.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(got(tokens).logits, ref(tokens).logits)

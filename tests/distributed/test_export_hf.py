"""`--save-hf` streamed shard by shard: the exported directory loads in `transformers` and gives the source
model's logits, at TP 1 and with the pipeline stages' tensors arriving one at a time (PP 2)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import torchrun


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2)])
def test_save_hf_in_shards_loads_back_in_transformers(tp, pp, tiny_qwen2, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "exported"
    torchrun(tp * pp, "tests/distributed/export_worker.py", "--hf", tiny_qwen2, "--out", out, "--tp", tp, "--pp", pp,
             "--shard-bytes", 64 << 10, timeout=240)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert not list(out.glob("*.tmp"))
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen2).float().eval()
    got = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert set(index["weight_map"]) == set(ref.state_dict())
    tokens = torch.randint(0, ref.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(got(tokens).logits, ref(tokens).logits)

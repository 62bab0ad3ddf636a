"""The distributed parity checks on GPUs: NCCL, the CUDA path of megatron-core (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from helpers import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = "tests/distributed/worker.py"


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_logits_match_hf_on_gpu(tp, tiny_qwen2, tmp_path):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    from transformers import AutoModelForCausalLM

    torchrun(tp, WORKER, "forward", "--hf", tiny_qwen2, "--out", tmp_path, "--tp", tp, "--pp", 1)
    result = torch.load(tmp_path / "forward-rank0.pt", weights_only=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2).float().eval()
    tokens = torch.randint(0, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1234))
    with torch.no_grad():
        ref = model(tokens).logits
    assert (result["logits"].cpu() - ref).abs().max() < 1e-3  # TF32 matmuls on GPU

"""Llama-3.1 ("llama3") RoPE scaling: megarl's frequencies against transformers' and Megatron's own."""

from __future__ import annotations

import pytest
import torch

from megarl.model_shape import ModelShape

LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _config(rope=LLAMA31_ROPE, head_dim=64):
    return {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 4 * head_dim, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 96, "max_position_embeddings": 131072,
            "rope_parameters": rope}


def test_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    shape = ModelShape.from_hf_config(_config())
    assert shape.rope_scaling_factor == 8.0 and shape.rope_theta == 500000.0
    hf_config = LlamaConfig(**{k: v for k, v in _config().items() if k != "model_type"})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    got = shape.rope_inv_freq()
    assert not torch.allclose(want, plain), "the scaling must change some frequencies for the test to mean anything"
    assert (want < plain).any() and (want == plain).any()  # scaled, interpolated and untouched bands all present
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)


def test_inv_freq_matches_megatron():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    shape = ModelShape.from_hf_config(_config())
    rope = RotaryEmbedding(kv_channels=64, rotary_percent=1.0, rotary_base=500000, rope_scaling=True,
                           rope_scaling_factor=8.0, use_cpu_initialization=True)
    torch.testing.assert_close(shape.rope_inv_freq(), rope.inv_freq.float().cpu(), rtol=1e-6, atol=0)


def test_unsupported_llama3_constants_are_refused():
    with pytest.raises(ValueError, match="high_freq_factor=2.0"):
        ModelShape.from_hf_config(_config({**LLAMA31_ROPE, "high_freq_factor": 2.0}))
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        ModelShape.from_hf_config(_config({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}))


def test_builtin_engine_matches_hf_with_llama3_scaling(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from megarl.rollout.builtin import BuiltinEngine

    cfg = LlamaConfig(**{k: v for k, v in _config(head_dim=16).items() if k != "model_type"})
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).float().eval()
    hf.save_pretrained(tmp_path)
    engine = BuiltinEngine.from_pretrained(tmp_path)
    seq = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logp = torch.log_softmax(hf(seq).logits[0].float(), -1)
    want = [logp[i - 1, seq[0, i]].item() for i in range(1, 40)]
    got = engine.score(seq.tolist(), [1])[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)

"""Does megatron-core 0.16.1's multi-latent attention (DeepSeek-V3's MLA) build and run on CPU with the local
(non-Transformer Engine) layer spec? Run: `.venv/bin/python tools/probe_mla_cpu.py` (one process, gloo).

Found for issue 45 (megatron-core 0.16.1, torch 2.13.0+cpu, no Transformer Engine). The plain call

    GPTModel(config=MLATransformerConfig(..., multi_latent_attention=True, use_cpu_initialization=True),
             transformer_layer_spec=get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True), ...)

fails in three places, each fixed here without editing megatron:
1. `MLASelfAttention.__init__` builds `RotaryEmbedding(...)` without `use_cpu_initialization`, which then calls
   `torch.cuda.current_device()`: "AssertionError: Torch not compiled with CUDA enabled". megarl's
   `cpu_compat.install()` + `megatron_scope()` (already used for GPTModel) answers that.
2. `MLASelfAttention` builds its core attention with `k_channels=` and `v_channels=`, which only
   `TEDotProductAttention` takes: "TypeError: DotProductAttention.__init__() got an unexpected keyword argument
   'k_channels'". The local spec is broken for MLA; a `DotProductAttention` subclass that accepts both and sizes
   its output by `v_channels` (`MLADotProductAttention` below) fixes it.
3. Without Transformer Engine, megatron's `extensions.transformer_engine` imports with MagicMock stand-ins, so
   `multi_latent_attention.HAVE_TE` is True and `isinstance(self.linear_proj, TELinear)` raises "TypeError:
   isinstance() arg 2 must be a type, a tuple of types, or a union". Setting `multi_latent_attention.HAVE_TE =
   False` (nothing of TE is used on CPU) fixes it.
With the three, a 2-layer MLA GPTModel builds and runs its forward on CPU (the script prints the parameter names,
the megatron side of DeepSeek-V3's weight table). megarl's own layer is `megarl/mcore/mla.py` (these shims, YaRN on
the CPU, and replicated down projections, without which the update at TP > 1 is wrong); the family, checked against
transformers' DeepseekV3ForCausalLM, is `megarl/models/deepseek_v3/` (docs/guide.md, "DeepSeek-V3 and multi-latent
attention").
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


def mla_local_spec():
    """The local GPT layer spec with MLA, its core attention replaced by one that takes MLA's arguments."""
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:  # the context is heads x v_head_dim wide, not heads x kv_channels
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    mla.HAVE_TE = False  # obstacle 3: TE's names are MagicMocks when TE is absent
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = MLADotProductAttention
    return spec


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29711")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megarl.mcore import cpu_compat

    cpu_compat.install()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    ps.initialize_model_parallel(1, 1)
    cfg = MLATransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, q_lora_rank=32, kv_lora_rank=16,
        qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, rope_type="rope", rotary_base=10000,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, multi_latent_attention=True, params_dtype=torch.float32)
    with cpu_compat.megatron_scope():
        model_parallel_cuda_manual_seed(0)
        model = GPTModel(config=cfg, transformer_layer_spec=mla_local_spec(), vocab_size=50, max_sequence_length=64,
                         position_embedding_type="rope", parallel_output=True)
        for name, p in model.named_parameters():
            print(name, tuple(p.shape))
        ids = torch.randint(0, 50, (1, 7))
        out = model(ids, torch.arange(7)[None], attention_mask=None)
    print("forward ok:", tuple(out.shape), "finite:", bool(torch.isfinite(out).all()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Megatron's multi-latent attention (DeepSeek-V3, `megarl/models/deepseek_v3`) on the local layer spec.

megatron-core 0.16.1's local spec for MLA does not build without Transformer Engine (`tools/probe_mla_cpu.py`
found the three places); this module holds the two that are the spec's, the third (`torch.cuda.current_device()`
in MLA's RotaryEmbedding) is `cpu_compat`'s:
- `MLASelfAttention` builds its core attention with `k_channels=` / `v_channels=`, which only
  `TEDotProductAttention` takes: `MLADotProductAttention` accepts both and sizes its context by `v_channels`
  (heads x v_head_dim, not heads x kv_channels).
- Without TE, `extensions.transformer_engine` fills TE's names with MagicMocks, so
  `multi_latent_attention.HAVE_TE` is True and `isinstance(self.linear_proj, TELinear)` raises; nothing of TE runs
  on the local spec, so `local_spec` sets it False.
- With YaRN, MLA builds `YarnRotaryEmbedding` without `use_cpu_initialization`, which then enters
  `torch.device(torch.cuda.current_device())`: "RuntimeError: Cannot access accelerator device when none is
  available". Without a GPU, `local_spec` hands MLA a subclass that initialises on the CPU.

And one that is not about building: the local spec makes the down projections (`linear_q_down_proj`,
`linear_kv_down_proj`) column-parallel, and MLA then gathers their output over TP
(`gather_from_tensor_model_parallel_region`) and uses the RoPE key `k_pos_emb` sliced from it by this rank's heads
only. The backward of that gather takes this rank's slice of the gradient and sums nothing, so at TP > 1 the RoPE
key's gradient holds one rank's heads' contribution: the logits are right, the update is not (measured: at TP 2 x EP 2
with sequence parallelism the loss equals TP 1's, the weights after one step differ by up to 9e-3). `local_spec`
gives both down projections megatron's replicated `Linear` instead (as the TE spec's `TELinear(duplicated)`): their
weight gradients, from this rank's tokens under sequence parallelism, are summed over TP (the parameters are marked
`sequence_parallel`), and MLA gathers `k_pos_emb` over the sequence, whose backward sums over TP.
The TE spec (a GPU with Transformer Engine) is Megatron's own and needs none of these.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _mla_dot_product_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        """Megatron's `DotProductAttention` taking MLA's key and value widths (values narrower than keys)."""

        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLADotProductAttention


@functools.cache
def _cpu_yarn():
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    class CpuYarnRotaryEmbedding(YarnRotaryEmbedding):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "use_cpu_initialization": True})

    return CpuYarnRotaryEmbedding


def _replicated_linear(mla):
    """The replicated linear layer MLA accepts for its down projections (it checks the class by identity)."""
    if mla.Linear is not None:
        return mla.Linear
    from megatron.core.post_training.modelopt.layers import Linear

    mla.Linear = Linear
    return Linear


def local_spec(*, num_experts: int | None = None, norm=None):
    """Megatron's local GPT layer spec with MLA (its q / kv latent norms included), a mixture of experts with
    `num_experts`; `norm`: the RMSNorm module for every norm of the layer (megarl's, `local_kernels.RMSNorm`), or
    Megatron's torch norm when None."""
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    mla.HAVE_TE = False
    if not torch.cuda.is_available():
        mla.YarnRotaryEmbedding = _cpu_yarn()
    spec = get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=True, multi_latent_attention=True,
                                    normalization="RMSNorm")
    layer = spec.submodules
    attention = layer.self_attention.submodules
    attention.core_attention = _mla_dot_product_attention()
    attention.linear_q_down_proj = attention.linear_kv_down_proj = _replicated_linear(mla)
    if norm is not None:
        layer.input_layernorm = layer.pre_mlp_layernorm = norm
        attention.q_layernorm = attention.kv_layernorm = norm
    return spec


def config_fields(shape) -> dict:
    """`MLATransformerConfig` fields for `shape` (`megarl.model_shape.ModelShape` with `is_mla`). Megatron's
    `qk_head_dim` is HF's `qk_nope_head_dim`, `qk_pos_emb_head_dim` HF's `qk_rope_head_dim`. RoPE is never
    fused here: Megatron's fused MLA RoPE is a Triton kernel."""
    fields = dict(
        multi_latent_attention=True,
        q_lora_rank=shape.q_lora_rank or None,
        kv_lora_rank=shape.kv_lora_rank,
        qk_head_dim=shape.qk_nope_head_dim,
        qk_pos_emb_head_dim=shape.head_dim,
        v_head_dim=shape.v_head_dim,
        rotary_base=shape.rope_theta,
        rope_type="rope",
        apply_rope_fusion=False,
        rotary_interleaved=False,  # HF's interleaved pairs are de-interleaved by Megatron's MLA RoPE itself
        mscale=1.0,
        mscale_all_dim=0.0,
    )
    if shape.yarn_factor:
        fields.update(rope_type="yarn", rotary_scaling_factor=shape.yarn_factor,
                      original_max_position_embeddings=shape.yarn_original_max_position_embeddings,
                      beta_fast=shape.yarn_beta_fast, beta_slow=shape.yarn_beta_slow, mscale=shape.yarn_mscale,
                      mscale_all_dim=shape.yarn_mscale_all_dim)
    return fields

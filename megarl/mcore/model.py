"""Build a Megatron `GPTModel` for a Hugging Face checkpoint's architecture (Llama, Qwen2, Qwen3, Qwen3-MoE,
DeepSeek-V3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megarl.mcore import cpu_compat, parallel
from megarl.model_shape import ModelShape


@dataclass(frozen=True)
class MoEOptions:
    """How a mixture-of-experts model is split and routed (`--expert-model-parallel-size`, ...)."""

    ep: int = 1  # expert-parallel size: each rank holds num_experts / ep experts
    etp: int = 0  # expert-tensor-parallel size; 0 = the TP size (Megatron's default)
    dispatcher: str = "allgather"  # Megatron's token dispatcher: allgather or alltoall
    aux_loss_coeff: float = 0.0  # load-balancing loss weight (RL post-training uses 0)

    @classmethod
    def from_config(cls, m) -> "MoEOptions":
        """From `megarl.config.ModelConfig`'s flags."""
        return cls(ep=m.expert_model_parallel_size, etp=m.expert_tensor_parallel_size, dispatcher=m.token_dispatcher,
                   aux_loss_coeff=m.moe_aux_loss_coeff)


def moe_config(shape: ModelShape, tp: int, moe: MoEOptions) -> dict:
    """`TransformerConfig` fields for `shape`'s experts: HF's `norm_topk_prob` is Megatron's
    `moe_router_pre_softmax=False` (top-k, then a softmax over the k: the renormalised probabilities); without it,
    a softmax over every expert, then top-k. The router computes in fp32, as transformers does."""
    if not shape.is_moe:
        if moe.ep != 1 or moe.etp not in (0, 1, tp):
            raise ValueError(f"--expert-model-parallel-size {moe.ep} / --expert-tensor-parallel-size {moe.etp}: the "
                             f"{shape.family} model has no experts; leave them at 1 and 0")
        return {}
    if shape.num_experts % moe.ep:
        raise ValueError(f"{shape.num_experts} experts are not divisible by --expert-model-parallel-size {moe.ep}")
    etp = moe.etp or tp
    if shape.moe_ffn_hidden_size % etp:
        raise ValueError(f"moe_intermediate_size {shape.moe_ffn_hidden_size} is not divisible by "
                         f"--expert-tensor-parallel-size {etp}")
    return dict(
        **_deepseek_router(shape),
        num_moe_experts=shape.num_experts,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
        moe_router_topk=shape.moe_top_k,
        moe_router_pre_softmax=not shape.moe_norm_topk_prob and shape.moe_score_function == "softmax",
        moe_router_dtype="fp32",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff > 0 else "none",
        moe_token_dispatcher_type=moe.dispatcher,
        expert_model_parallel_size=moe.ep,
        expert_tensor_parallel_size=etp,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        # Which layers are sparse (`parallel.decoder_block_spec` builds them); a list also makes checkpoints keep
        # per-layer keys, which layers of two kinds need.
        moe_layer_freq=[int(shape.is_moe_layer(i)) for i in range(shape.num_layers)],
    )


def _deepseek_router(shape: ModelShape) -> dict:
    """DeepSeek's router (`megarl/models/deepseek_v3`): sigmoid scores, the expert bias (a buffer, loaded from HF's
    `e_score_correction_bias` and kept: an update rate of 0), group-limited top-k, the scaling factor, the shared
    expert. A sigmoid router with top-k > 1 always renormalises the chosen scores in Megatron."""
    if shape.moe_score_function == "softmax":
        return {}
    if not shape.moe_norm_topk_prob and shape.moe_top_k > 1:
        raise ValueError(f"a sigmoid router with norm_topk_prob=false is not supported: Megatron renormalises the "
                         f"{shape.moe_top_k} chosen scores")
    fields = dict(moe_router_score_function=shape.moe_score_function,
                  moe_router_enable_expert_bias=shape.moe_expert_bias, moe_router_bias_update_rate=0.0,
                  moe_router_topk_scaling_factor=shape.moe_routed_scaling_factor)
    if shape.moe_num_groups:
        fields.update(moe_router_num_groups=shape.moe_num_groups, moe_router_group_topk=shape.moe_group_topk)
    if shape.moe_shared_ffn_hidden_size:
        fields.update(moe_shared_expert_intermediate_size=shape.moe_shared_ffn_hidden_size)
    return fields


def fused_softmax_available() -> bool:
    """Whether Megatron's fused masked-softmax kernels import. They are built from megatron's or apex's sources
    and megatron-core's wheels do not ship them; with `masked_softmax_fusion` on and the kernels absent,
    `FusedScaleMaskSoftmax.is_kernel_available` dies importing `scaled_masked_softmax_cuda` on the local
    (non-Transformer Engine) attention path."""
    import importlib

    for kernel in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda"):
        try:
            importlib.import_module(kernel)
        except Exception:  # noqa: BLE001 - ImportError, or an extension built for another torch or CUDA
            return False
    return True


def transformer_config(shape: ModelShape, *, tp: int, pp: int, params_dtype=torch.float32, bf16=False,
                       local_kernels: bool = False, moe: MoEOptions | None = None, **overrides):
    """The Megatron `TransformerConfig` for `shape`; fusions that need CUDA are off on a CPU machine, the masked
    softmax fusion also where its kernels are not installed (`fused_softmax_available`). With
    `local_kernels` (the local spec with megarl's kernels, `parallel.layer_spec`) the config routes RoPE to
    megarl's fused RoPE. `moe`: how a mixture-of-experts model is split and routed (`moe_config`)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    if shape.num_kv_heads % tp:
        raise ValueError(f"{shape.num_kv_heads} KV heads are not divisible by --tensor-model-parallel-size {tp}")
    if shape.num_layers % pp:
        raise ValueError(f"{shape.num_layers} layers are not divisible by --pipeline-model-parallel-size {pp}")
    on_gpu = torch.cuda.is_available()
    kwargs = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        use_cpu_initialization=not on_gpu,
        # Per-token loss: the trainer returns (loss sum, token count) and Megatron divides once by the
        # global count, so DP=2 and DP=1 give the same update.
        calculate_per_token_loss=True,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        bias_activation_fusion=on_gpu,
        masked_softmax_fusion=on_gpu and fused_softmax_available(),
        bias_dropout_fusion=on_gpu,
        attention_softmax_in_fp32=True,
        qk_layernorm=shape.qk_norm,
        **moe_config(shape, tp, moe or MoEOptions()),
    )
    if local_kernels and not getattr(shape, "is_mla", False):
        from megarl.mcore import local_kernels as kernels

        kwargs.update(kernels.transformer_config_overrides())
    if getattr(shape, "is_mla", False):
        from megarl.mcore import mla

        kwargs.update(mla.config_fields(shape))
    kwargs.update(overrides)
    return (MLATransformerConfig if getattr(shape, "is_mla", False) else TransformerConfig)(**kwargs)


def recompute_options(granularity: str) -> dict:
    """`TransformerConfig` fields for `--recompute-granularity`. full: every layer's input is kept and the layer
    recomputed in the backward pass (Megatron's uniform method, one layer per checkpoint); selective: only the
    core attention, whose activations grow with the square of the sequence length."""
    if granularity == "none":
        return {}
    if granularity == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if granularity == "selective":
        return dict(recompute_granularity="selective")
    raise ValueError(f"recompute granularity {granularity!r}; choose one of: none, selective, full")


@cpu_compat.in_megatron_scope
def build_gpt_model(shape: ModelShape, config, *, use_transformer_engine: bool | None = None,
                    local_kernels: bool = False, vocab_size: int = 0):
    """A `GPTModel` holding this rank's TP shard of this rank's PP stage, randomly initialised; `vocab_size`:
    the padded vocabulary (0 = the model's own)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if shape.is_moe or (config.sequence_parallel and local_kernels):
        spec = parallel.decoder_block_spec(config, shape.moe_layers, use_transformer_engine,
                                           local_kernels=local_kernels, qk_layernorm=shape.qk_norm,
                                           multi_latent_attention=getattr(shape, "is_mla", False))
    else:
        spec = parallel.layer_spec(use_transformer_engine, local_kernels=local_kernels, qk_layernorm=shape.qk_norm,
                                   multi_latent_attention=getattr(shape, "is_mla", False))
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size or shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta) if float(shape.rope_theta).is_integer() else shape.rope_theta,
        rope_scaling=bool(shape.rope_scaling_factor),
        rope_scaling_factor=shape.rope_scaling_factor or 8.0,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def in_model_precision(module: torch.nn.Module, config) -> torch.nn.Module:
    """`module` as Megatron trains it in `config`'s precision: with bf16, wrapped in `Float16Module`, which casts
    every parameter to bf16 (the local spec's torch norms are created in fp32 whatever `params_dtype` says) and
    hands the last stage's output back in fp32. The optimizer keeps fp32 main params and DDP reduces gradients in
    fp32; the log-prob and loss math after the model runs in fp32 (`actor.token_logprobs`)."""
    if not config.bf16:
        return module
    from megatron.core.transformer.module import Float16Module

    return Float16Module(config, module)

"""Qwen3-MoE (HF `Qwen3MoeForCausalLM`): Qwen3's attention, a softmax router and per-expert SwiGLU experts; its
dense layers (`mlp_only_layers`, `decoder_sparse_step`) keep the dense MLP's names."""

from megarl.models import ModelFamily, register_family
from megarl.models.weights import DECODER_RULES, MOE_RULES, QK_NORM_RULES

FAMILY = register_family(ModelFamily(name="qwen3_moe", weight_rules=DECODER_RULES + QK_NORM_RULES + MOE_RULES,
                                     qk_norm=True, moe=True, hf_config_class="Qwen3MoeConfig",
                                     hf_model_class="Qwen3MoeForCausalLM",
                                     tiny_config={"head_dim": 24, "num_experts": 4, "num_experts_per_tok": 2,
                                                  "moe_intermediate_size": 32, "norm_topk_prob": True}))

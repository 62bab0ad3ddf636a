"""Qwen3 (HF `Qwen3ForCausalLM`): Llama's layout with a per-head RMSNorm on queries and keys."""

from megarl.models import ModelFamily, register_family
from megarl.models.weights import DECODER_RULES, QK_NORM_RULES

FAMILY = register_family(ModelFamily(name="qwen3", weight_rules=DECODER_RULES + QK_NORM_RULES, qk_norm=True,
                                     hf_config_class="Qwen3Config", hf_model_class="Qwen3ForCausalLM",
                                     tiny_config={"head_dim": 24}))  # not hidden / heads, as Qwen3-8B

"""Qwen2 / Qwen2.5 (HF `Qwen2ForCausalLM`): Llama's layout with q/k/v biases, always present."""

from megarl.models import ModelFamily, register_family
from megarl.models.weights import DECODER_RULES

FAMILY = register_family(ModelFamily(name="qwen2", weight_rules=DECODER_RULES, qkv_bias=True,
                                     hf_config_class="Qwen2Config", hf_model_class="Qwen2ForCausalLM"))

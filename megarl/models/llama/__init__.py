"""Llama (HF `LlamaForCausalLM`): the plain decoder; Llama-3.1's RoPE scaling is read by `megarl.model_shape`."""

from megarl.models import ModelFamily, register_family
from megarl.models.weights import DECODER_RULES

FAMILY = register_family(ModelFamily(name="llama", weight_rules=DECODER_RULES, hf_config_class="LlamaConfig",
                                     hf_model_class="LlamaForCausalLM"))

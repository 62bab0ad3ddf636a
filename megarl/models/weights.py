"""The pieces of the HF <-> Megatron weight tables families are made of (pure Python; the reshapes and the
TP/PP/EP splits that read them are `megarl.mcore.convert`'s).

Megatron names are those of the local layer spec, with `{i}` the global layer index and `{e}` the global expert
index; HF names use the same placeholders. `kind` picks the reshape: copy, qkv (separate q/k/v -> the fused
`linear_qkv`, grouped by KV head), gate_up (gate/up -> the fused `linear_fc1`), vocab (embedding and output layer,
padded rows appended / dropped). `when` names a flag of `megarl.mcore.convert.rules_for` that must be true.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    mcore: str  # Megatron name; {i} is the global layer index, {e} the global expert index
    hf: tuple[str, ...]  # HF names, in the order the reshape expects
    kind: str = "copy"  # copy | qkv | gate_up | vocab
    when: str | None = None  # a flag of `rules_for` that must be true for the rule to apply


LAYER = "decoder.layers.{i}."
HF_LAYER = "model.layers.{i}."

# Llama's layout, which Qwen2 shares (its q/k/v biases are the `qkv_bias` rule).
DECODER_RULES = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), kind="vocab"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), kind="vocab", when="untied"),
    Rule(LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",)),
    Rule(
        LAYER + "self_attention.linear_qkv.weight",
        tuple(HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
        kind="qkv",
    ),
    Rule(
        LAYER + "self_attention.linear_qkv.bias",
        tuple(HF_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv"),
        kind="qkv",
        when="qkv_bias",
    ),
    Rule(LAYER + "self_attention.linear_proj.weight", (HF_LAYER + "self_attn.o_proj.weight",)),
    Rule(LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "post_attention_layernorm.weight",)),
    Rule(
        LAYER + "mlp.linear_fc1.weight",
        (HF_LAYER + "mlp.gate_proj.weight", HF_LAYER + "mlp.up_proj.weight"),
        kind="gate_up",
    ),
    Rule(LAYER + "mlp.linear_fc2.weight", (HF_LAYER + "mlp.down_proj.weight",)),
)

# Qwen3: per-head RMSNorm of queries and keys, applied before RoPE in both implementations.
QK_NORM_RULES = (
    Rule(LAYER + "self_attention.q_layernorm.weight", (HF_LAYER + "self_attn.q_norm.weight",)),
    Rule(LAYER + "self_attention.k_layernorm.weight", (HF_LAYER + "self_attn.k_norm.weight",)),
)

EXPERT = LAYER + "mlp.experts.local_experts.{e}."
HF_EXPERT = HF_LAYER + "mlp.experts.{e}."
# A router and per-expert SwiGLU experts (Qwen3-MoE's names); dense layers keep `DECODER_RULES`' MLP names.
MOE_RULES = (
    Rule(LAYER + "mlp.router.weight", (HF_LAYER + "mlp.gate.weight",)),
    Rule(EXPERT + "linear_fc1.weight", (HF_EXPERT + "gate_proj.weight", HF_EXPERT + "up_proj.weight"),
         kind="gate_up"),
    Rule(EXPERT + "linear_fc2.weight", (HF_EXPERT + "down_proj.weight",)),
)

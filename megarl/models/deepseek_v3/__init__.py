"""DeepSeek-V3 (HF `DeepseekV3ForCausalLM`; Moonlight and Kimi-K2 share it): multi-latent attention, dense first
layers, then mixtures of experts with a shared expert and DeepSeek's router.

- Attention (MLA): the query goes through a low-rank bottleneck (`q_a_proj`, an RMSNorm, `q_b_proj`; a full-rank
  `q_proj` when `q_lora_rank` is null); keys and values through a compressed latent (`kv_a_proj_with_mqa` gives
  `kv_lora_rank` latent features and one `qk_rope_head_dim`-wide RoPE key shared by all heads, the latent is
  normalised and expanded by `kv_b_proj` into each head's `qk_nope_head_dim` key and `v_head_dim` value).
  Megatron's `MLASelfAttention` has the same tensors under other names and the same per-head row order, so every
  tensor is a plain copy. HF's `rope_interleave` rotates the pairs (x0, x1), (x2, x3), ...; Megatron's MLA RoPE
  de-interleaves the same way (`rope_utils._apply_rotary_pos_emb_bshd(multi_latent_attention=True)`), so the
  logits agree with `rotary_interleaved=False`.
- Layers 0 .. first_k_dense_replace - 1 have a dense SwiGLU MLP, the others `n_routed_experts` experts and
  `n_shared_experts` shared ones (one SwiGLU of n_shared_experts x moe_intermediate_size), always added.
- The router: sigmoid scores; the experts are chosen on score + `e_score_correction_bias` (a buffer in both
  implementations, Megatron's `router.expert_bias`), among the `topk_group` of `n_group` groups whose two best
  scores sum highest; the chosen experts' plain scores are renormalised (`norm_topk_prob`) and multiplied by
  `routed_scaling_factor`. The bias is not trained here (Megatron's update rate is 0): RL keeps the pretrained
  routing.
- YaRN RoPE scaling (`rope_parameters.rope_type: yarn`) scales the RoPE frequencies, cos/sin, and the softmax
  scale by mscale(factor, mscale_all_dim)^2, as DeepSeek's reference does.

Not read: multi-token prediction layers (`num_nextn_predict_layers`; transformers drops them too).
"""

from __future__ import annotations

from megarl.models import ModelFamily, register_family
from megarl.models.weights import DECODER_RULES, EXPERT, HF_EXPERT, HF_LAYER, LAYER, Rule

ATTN, HF_ATTN = LAYER + "self_attention.", HF_LAYER + "self_attn."
SHARED, HF_SHARED = LAYER + "mlp.shared_experts.", HF_LAYER + "mlp.shared_experts."

# Megatron's `MLASelfAttention` (local and TE specs name them alike; TE folds q_layernorm / kv_layernorm into
# `linear_q_up_proj.layer_norm_weight` / `linear_kv_up_proj.layer_norm_weight`).
MLA_RULES = (
    Rule(ATTN + "linear_q_down_proj.weight", (HF_ATTN + "q_a_proj.weight",), when="q_lora"),
    Rule(ATTN + "q_layernorm.weight", (HF_ATTN + "q_a_layernorm.weight",), when="q_lora"),
    Rule(ATTN + "linear_q_up_proj.weight", (HF_ATTN + "q_b_proj.weight",), when="q_lora"),
    Rule(ATTN + "linear_q_proj.weight", (HF_ATTN + "q_proj.weight",), when="q_full"),
    Rule(ATTN + "linear_kv_down_proj.weight", (HF_ATTN + "kv_a_proj_with_mqa.weight",)),
    Rule(ATTN + "kv_layernorm.weight", (HF_ATTN + "kv_a_layernorm.weight",)),
    Rule(ATTN + "linear_kv_up_proj.weight", (HF_ATTN + "kv_b_proj.weight",)),
    Rule(ATTN + "linear_proj.weight", (HF_ATTN + "o_proj.weight",)),
)

# The router with its expert bias, the routed experts (HF's per-expert names) and the shared expert.
DEEPSEEK_MOE_RULES = (
    Rule(LAYER + "mlp.router.weight", (HF_LAYER + "mlp.gate.weight",)),
    Rule(LAYER + "mlp.router.expert_bias", (HF_LAYER + "mlp.gate.e_score_correction_bias",)),
    Rule(EXPERT + "linear_fc1.weight", (HF_EXPERT + "gate_proj.weight", HF_EXPERT + "up_proj.weight"),
         kind="gate_up"),
    Rule(EXPERT + "linear_fc2.weight", (HF_EXPERT + "down_proj.weight",)),
    Rule(SHARED + "linear_fc1.weight", (HF_SHARED + "gate_proj.weight", HF_SHARED + "up_proj.weight"),
         kind="gate_up"),
    Rule(SHARED + "linear_fc2.weight", (HF_SHARED + "down_proj.weight",)),
)

# Embedding, norms, output layer and the dense layers' MLP are Llama's; its q/k/v and o projections are not here.
_DENSE = tuple(r for r in DECODER_RULES if ".self_attention." not in r.mcore)


def read_config(cfg: dict, layers: int, source: str) -> dict:
    """DeepSeek-V3's config.json -> its `ModelShape` fields: MLA widths, experts, router, YaRN."""
    experts = cfg.get("n_routed_experts") or 0
    top_k = cfg.get("num_experts_per_tok") or 0
    if experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"{source}: n_routed_experts={experts}, num_experts_per_tok={top_k}: deepseek_v3 needs "
                         "1 <= num_experts_per_tok <= n_routed_experts")
    groups, group_topk = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    if experts % groups or not 1 <= group_topk <= groups:
        raise ValueError(f"{source}: n_group={groups}, topk_group={group_topk} with {experts} experts: the groups "
                         "must divide the experts and topk_group be within 1..n_group")
    if group_topk < groups and top_k // group_topk != 2:
        # transformers scores a group by its 2 best experts, Megatron by its top_k / topk_group best.
        raise ValueError(f"{source}: num_experts_per_tok={top_k} / topk_group={group_topk} is not 2: Megatron's "
                         "group-limited routing would score groups differently from DeepSeek's (top-2 per group)")
    if cfg.get("attention_bias", False):
        raise ValueError(f"{source}: attention_bias=true is not supported for deepseek_v3")
    if not cfg.get("rope_interleave", True):
        raise ValueError(f"{source}: rope_interleave=false is not supported: Megatron's MLA always rotates "
                         "interleaved pairs")
    first_dense = cfg.get("first_k_dense_replace", 0) or 0
    rope_dim = cfg["qk_rope_head_dim"]
    return dict(
        head_dim=rope_dim,
        num_kv_heads=cfg["num_attention_heads"],  # MLA expands the latent into every head
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        num_experts=experts,
        moe_top_k=top_k,
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        moe_layers=tuple(range(min(first_dense, layers), layers)),
        moe_score_function="sigmoid",
        moe_expert_bias=True,
        moe_num_groups=groups if group_topk < groups else 0,  # all groups kept: plain top-k
        moe_group_topk=group_topk if group_topk < groups else 0,
        moe_routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0) or 1.0),
        moe_shared_ffn_hidden_size=(cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"],
        **_yarn(cfg, source),
    )


def _yarn(cfg: dict, source: str) -> dict:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {}
    if kind != "yarn":
        raise ValueError(f"{source}: rope type {kind!r} is not supported for deepseek_v3; supported: default, yarn")
    if rope.get("attention_factor") is not None or not rope.get("truncate", True):
        raise ValueError(f"{source}: YaRN with attention_factor or truncate=false is not supported (Megatron "
                         "derives the factor from mscale / mscale_all_dim and rounds the correction range)")
    original = rope.get("original_max_position_embeddings") or cfg.get("max_position_embeddings")
    factor = rope.get("factor") or cfg["max_position_embeddings"] / original
    mscale, mscale_all_dim = rope.get("mscale") or 0.0, rope.get("mscale_all_dim") or 0.0
    if mscale_all_dim and not mscale:
        raise ValueError(f"{source}: YaRN with mscale_all_dim but no mscale is not supported (transformers then "
                         "scales cos/sin by mscale(factor), Megatron by mscale(factor) / mscale(factor, all_dim))")
    if not mscale_all_dim:
        mscale = 1.0  # transformers: cos/sin scaled by mscale(factor, 1) unless both are given
    return dict(yarn_factor=float(factor), yarn_original_max_position_embeddings=int(original),
                yarn_beta_fast=float(rope.get("beta_fast") or 32), yarn_beta_slow=float(rope.get("beta_slow") or 1),
                yarn_mscale=float(mscale), yarn_mscale_all_dim=float(mscale_all_dim))


FAMILY = register_family(ModelFamily(
    name="deepseek_v3", weight_rules=_DENSE + MLA_RULES + DEEPSEEK_MOE_RULES, moe=True, mla=True,
    hf_config_class="DeepseekV3Config", hf_model_class="DeepseekV3ForCausalLM", read_config=read_config,
    tiny_config={"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                 "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
                 "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True}))

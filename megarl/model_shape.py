"""The architecture of a Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE / DeepSeek-V3 checkpoint, read once from its
`config.json`.

The single source of these facts for both sides: the Megatron actor (`megarl.mcore`) and the rollout engines,
which must not depend on each other. Unsupported features fail here, naming the config field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megarl.models import FAMILIES

# The built-in families (`megarl/models/<family>/`), kept for importers; what is supported, plugins included, is
# `megarl.models.FAMILIES`, whose entries also say which have q/k norms (`ModelFamily.qk_norm`).
SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")  # per-head RMSNorm on queries and keys (`self_attn.q_norm` / `k_norm`)
# Llama-3.1's RoPE scaling constants; Megatron's GPTModel (`rope_scaling=True`) hard-codes these three and takes
# only the factor, so a checkpoint with other values is refused rather than silently computed differently.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class ModelShape:
    family: str  # HF model_type
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_scaling_factor: float = 0.0  # Llama-3.1 ("llama3") RoPE frequency scaling; 0 = none
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head (Megatron's qk_layernorm)
    # Mixture of experts (qwen3_moe): 0 experts = a dense model.
    num_experts: int = 0
    moe_top_k: int = 0  # experts per token
    moe_ffn_hidden_size: int = 0  # each expert's SwiGLU width
    moe_norm_topk_prob: bool = True  # renormalise the top-k probabilities (False: softmax over all, then top-k)
    moe_layers: tuple[int, ...] = ()  # global indices of the layers whose MLP is the mixture of experts
    # DeepSeek's router (deepseek_v3): sigmoid scores, a bias that only steers the choice, group-limited top-k,
    # the chosen scores scaled; and a shared expert every token goes through.
    moe_score_function: str = "softmax"  # softmax | sigmoid
    moe_expert_bias: bool = False  # experts are chosen on score + bias (HF `e_score_correction_bias`)
    moe_num_groups: int = 0  # experts split into this many groups, of which `moe_group_topk` are searched; 0: none
    moe_group_topk: int = 0
    moe_routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights
    moe_shared_ffn_hidden_size: int = 0  # the shared expert's SwiGLU width; 0 = none
    # Multi-latent attention (deepseek_v3); kv_lora_rank 0 = ordinary attention. head_dim is then the RoPE part.
    q_lora_rank: int = 0  # the query's low-rank bottleneck; 0 = a full-rank query projection
    kv_lora_rank: int = 0  # the compressed key/value latent
    qk_nope_head_dim: int = 0  # each head's query/key width without RoPE (the RoPE part is head_dim)
    v_head_dim: int = 0
    # YaRN RoPE scaling (deepseek_v3); factor 0 = none.
    yarn_factor: float = 0.0
    yarn_original_max_position_embeddings: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def attention_params(self) -> int:
        """One layer's attention: q/k/v/o projections, Qwen2's q/k/v biases, Qwen3's q/k norms; MLA's down and
        up projections and latent norms."""
        if self.is_mla:
            h, heads, qk = self.hidden_size, self.num_attention_heads, self.qk_nope_head_dim + self.head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk if self.q_lora_rank
                 else h * heads * qk)
            kv = (h * (self.kv_lora_rank + self.head_dim) + self.kv_lora_rank
                  + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim))
            return q + kv + heads * self.v_head_dim * h
        q, kv, h = self.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.hidden_size
        bias, norms = (q + 2 * kv) if self.qkv_bias else 0, 2 * self.head_dim if self.qk_norm else 0
        return h * (q + 2 * kv) + q * h + bias + norms

    def mlp_params(self, layer: int, active: bool = False) -> int:
        """Layer `layer`'s MLP: dense SwiGLU, or the router and every expert (`active`: the top-k a token uses)."""
        if not self.is_moe_layer(layer):
            return 3 * self.hidden_size * self.ffn_hidden_size
        experts = self.moe_top_k if active else self.num_experts
        return (self.num_experts * self.hidden_size + experts * 3 * self.hidden_size * self.moe_ffn_hidden_size
                + 3 * self.hidden_size * self.moe_shared_ffn_hidden_size)

    def param_count(self, active: bool = False) -> int:
        """Parameters of the Hugging Face model, tied embeddings counted once; `active`: those one token runs
        through (a mixture of experts' top-k experts, not all of them)."""
        layers = sum(2 * self.hidden_size + self.attention_params() + self.mlp_params(i, active)
                     for i in range(self.num_layers))
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + layers + self.hidden_size

    def rope_inv_freq(self):
        """RoPE inverse frequencies [head_dim / 2] (float32), with Llama-3.1's scaling when the model has it:
        wavelengths shorter than 8192 / 4 keep their frequency, longer than 8192 / 1 are slowed by the factor, and
        the band between is interpolated smoothly (Meta's reference; the constants Megatron's GPTModel uses)."""
        import math

        import torch

        inv = 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        if self.yarn_factor:
            return self._yarn_inv_freq(inv)
        if not self.rope_scaling_factor:
            return inv
        low, high, old_ctx = LLAMA3_ROPE["low_freq_factor"], LLAMA3_ROPE["high_freq_factor"], \
            LLAMA3_ROPE["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        scaled = (1 - smooth) * inv / self.rope_scaling_factor + smooth * inv
        return torch.where(wavelen < old_ctx / high, inv, torch.where(wavelen > old_ctx / low,
                                                                      inv / self.rope_scaling_factor, scaled))

    def _yarn_inv_freq(self, inv):
        """YaRN (transformers' `_compute_yarn_parameters`, truncated correction range): frequencies of more than
        `beta_fast` rotations over the original context keep their value, of fewer than `beta_slow` are divided by
        the factor, and a linear ramp over the dimensions between blends the two."""
        import math

        import torch

        dim, base, ctx = self.head_dim, self.rope_theta, self.yarn_original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(self.yarn_beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.yarn_beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
        keep = 1 - ramp
        return inv / self.yarn_factor * (1 - keep) + inv * keep

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> "ModelShape":
        family = cfg.get("model_type")
        if not isinstance(family, str) or family not in FAMILIES:
            raise ValueError(f"{source}: model_type {family!r} is not supported; "
                             f"supported: {', '.join(FAMILIES.names())}")
        spec = FAMILIES.get(family)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported; supported: silu (SwiGLU)")
        if cfg.get("mlp_bias", False):
            raise ValueError(f"{source}: mlp_bias=true is not supported")
        if not spec.qkv_bias and cfg.get("attention_bias", False):
            raise ValueError(f"{source}: attention_bias=true (a bias on o_proj too) is not supported for {family}")
        if cfg.get("use_sliding_window", False) or any(t != "full_attention" for t in cfg.get("layer_types") or ()):
            raise ValueError(f"{source}: sliding-window attention layers are not supported; supported: full_attention")
        heads = cfg["num_attention_heads"]
        layers = cfg["num_hidden_layers"]
        if spec.read_config is not None:
            own = spec.read_config(cfg, layers, source)
        else:
            own = _moe_fields(cfg, layers, source, family) if spec.moe else {}
        shared = dict(
            family=family,
            num_layers=layers,
            hidden_size=cfg["hidden_size"],
            num_attention_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            ffn_hidden_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_theta=_rope_theta(cfg, source, ("default", "yarn") if spec.mla else ("default", "llama3")),
            rope_scaling_factor=_rope_scaling_factor(cfg, source),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=spec.qkv_bias,  # Qwen2 always has q/k/v biases
            qk_norm=spec.qk_norm,
        )
        return cls(**{**shared, **own})

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelShape":
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{path}: no config.json there (expected an HF checkpoint directory)")
        return cls.from_hf_config(json.loads(config_path.read_text()), source=str(config_path))


def _moe_fields(cfg: dict, layers: int, source: str, family: str = "qwen3_moe") -> dict:
    """Qwen3-MoE's experts: a layer i is sparse unless listed in `mlp_only_layers` or (i + 1) is not a multiple of
    `decoder_sparse_step` (transformers' rule); the softmax runs over all experts, then top-k, renormalised only
    with `norm_topk_prob`. What megarl does not compute (a shared expert) is refused by name."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts")) or 0
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if cfg.get(key):
            raise ValueError(f"{source}: {key}={cfg[key]}: shared experts are not supported for {family}")
    if experts < 1:
        raise ValueError(f"{source}: {family} with num_experts={experts}; a dense Qwen3 is model_type qwen3")
    top_k = cfg.get("num_experts_per_tok", 0)
    if not 1 <= top_k <= experts:
        raise ValueError(f"{source}: num_experts_per_tok={top_k} must be within 1..num_experts={experts}")
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or ())
    if any(not 0 <= i < layers for i in dense):
        raise ValueError(f"{source}: mlp_only_layers={sorted(dense)} names layers outside 0..{layers - 1}")
    return dict(num_experts=experts, moe_top_k=top_k, moe_ffn_hidden_size=cfg["moe_intermediate_size"],
                moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                moe_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0))


def _rope_settings(cfg: dict) -> dict:
    """transformers >= 5 nests RoPE settings in `rope_parameters`; 4.x has `rope_theta` and `rope_scaling`."""
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def _rope_type(cfg: dict) -> str:
    rope = _rope_settings(cfg)
    return rope.get("rope_type", rope.get("type", "default"))


def _rope_theta(cfg: dict, source: str, supported: tuple[str, ...] = ("default", "llama3")) -> float:
    if _rope_type(cfg) not in supported:
        raise ValueError(f"{source}: rope type {_rope_type(cfg)!r} is not supported yet; supported: "
                         f"{', '.join(supported)}")
    return float(_rope_settings(cfg).get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _rope_scaling_factor(cfg: dict, source: str) -> float:
    if _rope_type(cfg) != "llama3":
        return 0.0
    rope = _rope_settings(cfg)
    for key, expected in LLAMA3_ROPE.items():
        if float(rope.get(key, expected)) != expected:
            raise ValueError(f"{source}: llama3 rope scaling with {key}={rope[key]} is not supported; Megatron's "
                             f"GPTModel computes it with {key}={expected:g}")
    return float(rope.get("factor", 8.0))

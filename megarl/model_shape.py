"""The architecture of a Hugging Face Llama / Qwen2 checkpoint, read once from its `config.json`.

The single source of these facts for both sides: the Megatron actor (`megarl.mcore`) and the rollout engines,
which must not depend on each other. Unsupported features fail here, naming the config field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_FAMILIES = ("llama", "qwen2")
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

    def rope_inv_freq(self):
        """RoPE inverse frequencies [head_dim / 2] (float32), with Llama-3.1's scaling when the model has it:
        wavelengths shorter than 8192 / 4 keep their frequency, longer than 8192 / 1 are slowed by the factor, and
        the band between is interpolated smoothly (Meta's reference; the constants Megatron's GPTModel uses)."""
        import math

        import torch

        inv = 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        if not self.rope_scaling_factor:
            return inv
        low, high, old_ctx = LLAMA3_ROPE["low_freq_factor"], LLAMA3_ROPE["high_freq_factor"], \
            LLAMA3_ROPE["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        scaled = (1 - smooth) * inv / self.rope_scaling_factor + smooth * inv
        return torch.where(wavelen < old_ctx / high, inv, torch.where(wavelen > old_ctx / low,
                                                                      inv / self.rope_scaling_factor, scaled))

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> "ModelShape":
        family = cfg.get("model_type")
        if family not in SUPPORTED_FAMILIES:
            raise ValueError(f"{source}: model_type {family!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported; supported: silu (SwiGLU)")
        if cfg.get("mlp_bias", False):
            raise ValueError(f"{source}: mlp_bias=true is not supported")
        if family == "llama" and cfg.get("attention_bias", False):
            raise ValueError(f"{source}: attention_bias=true (a bias on o_proj too) is not supported for llama")
        if cfg.get("use_sliding_window", False) or any(t != "full_attention" for t in cfg.get("layer_types") or ()):
            raise ValueError(f"{source}: sliding-window attention layers are not supported; supported: full_attention")
        heads = cfg["num_attention_heads"]
        return cls(
            family=family,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            num_attention_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            ffn_hidden_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_theta=_rope_theta(cfg, source),
            rope_scaling_factor=_rope_scaling_factor(cfg, source),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",  # Qwen2 always has q/k/v biases
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelShape":
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{path}: no config.json there (expected an HF checkpoint directory)")
        return cls.from_hf_config(json.loads(config_path.read_text()), source=str(config_path))


def _rope_settings(cfg: dict) -> dict:
    """transformers >= 5 nests RoPE settings in `rope_parameters`; 4.x has `rope_theta` and `rope_scaling`."""
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def _rope_type(cfg: dict) -> str:
    rope = _rope_settings(cfg)
    return rope.get("rope_type", rope.get("type", "default"))


def _rope_theta(cfg: dict, source: str) -> float:
    if _rope_type(cfg) not in ("default", "llama3"):
        raise ValueError(f"{source}: rope type {_rope_type(cfg)!r} is not supported yet; supported: default, llama3")
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

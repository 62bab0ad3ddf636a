"""DeepSeek-V3's multi-latent attention and router for the built-in engine (`megarl.rollout.builtin`): plain
PyTorch over Hugging Face's tensors, no Megatron.

The KV cache holds each head's expanded key (nope + RoPE part) and value, not the compressed latent: the same
numerics as transformers and the engine's cache layout (keys transposed); the latent cache that makes MLA cheap to
decode is left to SGLang. The RoPE part of q and k arrives in DeepSeek's interleaved pairs and is de-interleaved
before the engine's half-split rotation, as transformers' `apply_rotary_pos_emb_interleave` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass
class MLAWeights:
    """One layer's attention in HF's layout ([out, in] weights)."""

    q_a: torch.Tensor | None  # [q_lora_rank, hidden]; None: a full-rank query (`q_b` is then HF's q_proj)
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q_b: torch.Tensor  # [heads * (nope + rope), q_lora_rank or hidden]
    kv_a: torch.Tensor  # [kv_lora_rank + rope, hidden]: the latent, then the shared RoPE key
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    kv_b: torch.Tensor  # [heads * (nope + v), kv_lora_rank]: per head, its key (nope part), then its value
    o: torch.Tensor  # [hidden, heads * v]


def allocate(shape, zeros: Callable[..., torch.Tensor]) -> MLAWeights:
    h, heads, rope = shape.hidden_size, shape.num_attention_heads, shape.head_dim
    q_in = shape.q_lora_rank or h
    return MLAWeights(
        q_a=zeros(shape.q_lora_rank, h) if shape.q_lora_rank else None,
        q_a_norm=zeros(shape.q_lora_rank) if shape.q_lora_rank else None,
        q_b=zeros(heads * (shape.qk_nope_head_dim + rope), q_in),
        kv_a=zeros(shape.kv_lora_rank + rope, h),
        kv_a_norm=zeros(shape.kv_lora_rank),
        kv_b=zeros(heads * (shape.qk_nope_head_dim + shape.v_head_dim), shape.kv_lora_rank),
        o=zeros(h, heads * shape.v_head_dim),
    )


def hf_views(w: MLAWeights, prefix: str) -> dict[str, torch.Tensor]:
    """HF names of layer `prefix` ("model.layers.L.") -> the engine's tensors."""
    p = prefix + "self_attn."
    views = {p + "kv_a_proj_with_mqa.weight": w.kv_a, p + "kv_a_layernorm.weight": w.kv_a_norm,
             p + "kv_b_proj.weight": w.kv_b, p + "o_proj.weight": w.o}
    if w.q_a is None:
        views[p + "q_proj.weight"] = w.q_b
    else:
        views.update({p + "q_a_proj.weight": w.q_a, p + "q_a_layernorm.weight": w.q_a_norm,
                      p + "q_b_proj.weight": w.q_b})
    return views


def cache_dims(shape) -> tuple[int, int, int]:
    """(cached heads, key width, value width) of one layer's KV cache."""
    return shape.num_attention_heads, shape.qk_nope_head_dim + shape.head_dim, shape.v_head_dim


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(shape) -> float:
    """1 / sqrt(nope + rope), times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's reference)."""
    scale = (shape.qk_nope_head_dim + shape.head_dim) ** -0.5
    if shape.yarn_factor and shape.yarn_mscale_all_dim:
        scale *= _yarn_mscale(shape.yarn_factor, shape.yarn_mscale_all_dim) ** 2
    return scale


def rope_scaling(shape) -> float:
    """YaRN's factor on cos and sin (1 without YaRN)."""
    if not shape.yarn_factor:
        return 1.0
    return _yarn_mscale(shape.yarn_factor, shape.yarn_mscale) / _yarn_mscale(shape.yarn_factor,
                                                                             shape.yarn_mscale_all_dim)


def _rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved pairs -> the half-split layout, rotated by the engine's (cos, signed sin) table."""
    x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    return torch.addcmul(x * rope[..., 0, :], x.roll(x.shape[-1] // 2, dims=-1), rope[..., 1, :])


def attention(engine, x: torch.Tensor, w: MLAWeights, rope: torch.Tensor, mask: torch.Tensor,
              kv: tuple[torch.Tensor, torch.Tensor] | None, start: int) -> torch.Tensor:
    """`BuiltinEngine._attention` for MLA: x [B, T, hidden], rope [B, T, 1, 2, rope], the engine's masks; with one
    layer's cache `kv` (keys [B, heads, nope + rope, L], values [B, heads, L, v]) the new keys and values go to
    columns start..start+T."""
    s, lin, norm = engine.shape, engine._linear, engine._rms_norm
    B, T, _ = x.shape
    heads, nope, r, vd = s.num_attention_heads, s.qk_nope_head_dim, s.head_dim, s.v_head_dim
    q = lin(norm(lin(x, w.q_a), w.q_a_norm), w.q_b) if w.q_a is not None else lin(x, w.q_b)
    q = q.view(B, T, heads, nope + r)
    latent, k_rot = lin(x, w.kv_a).split([s.kv_lora_rank, r], dim=-1)
    k_nope, v = lin(norm(latent, w.kv_a_norm), w.kv_b).view(B, T, heads, nope + vd).split([nope, vd], dim=-1)
    q = torch.cat([q[..., :nope], _rotate(q[..., nope:], rope)], dim=-1).transpose(1, 2)
    k_rot = _rotate(k_rot[:, :, None], rope).expand(B, T, heads, r)
    k, v = torch.cat([k_nope, k_rot], dim=-1).transpose(1, 2), v.transpose(1, 2)
    scale = softmax_scale(s)
    if kv is not None:
        k_cache, v_cache = kv
        end = start + T
        k_cache[..., start:end] = k.transpose(2, 3)
        v_cache[:, :, start:end] = v
        if T == 1:  # one query per head: two batched matmuls, the mask [B * heads, 1, L] folded in
            scores = torch.baddbmm(mask, q.reshape(B * heads, 1, nope + r), k_cache[..., :end].flatten(0, 1),
                                   alpha=scale)
            probs = scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype)
            out = torch.bmm(probs, v_cache[:, :, :end].flatten(0, 1)).view(B, 1, heads * vd)
            return lin(out, w.o)
        k, v = k_cache[..., :end].transpose(2, 3), v_cache[:, :, :end]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return lin(out.transpose(1, 2).reshape(B, T, heads * vd), w.o)


def route(shape, logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's router on fp32 logits [N, experts]: sigmoid scores; experts chosen on score + bias among the
    `moe_group_topk` groups whose two best biased scores sum highest; their plain scores renormalised and scaled.
    Returns (weights, experts), each [N, k]."""
    scores = logits.sigmoid()
    choice = scores + bias.float()
    if shape.moe_num_groups:
        n, groups = choice.shape[0], shape.moe_num_groups
        group_scores = choice.view(n, groups, -1).topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(shape.moe_group_topk, dim=-1).indices, 1)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(choice.shape[1] // groups, dim=1), float("-inf"))
    experts = choice.topk(shape.moe_top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if shape.moe_norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * shape.moe_routed_scaling_factor, experts

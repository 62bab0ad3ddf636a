"""Fused pieces for Megatron's local (non-Transformer-Engine) layer spec: what TE provides on a GPU, in PyTorch.

Without TE (every CPU run, and GPUs without transformer-engine) Megatron's local spec assembles attention, RoPE
and RMSNorm from many small ops under autograd: on a CPU a 30M-parameter model's update spent about a third
of its time outside matrix multiplies. Each piece here is one `torch.autograd.Function` with a hand-written
backward, plugged in where Megatron expects TE's kernels (`local_spec`, `transformer_config_overrides`):

- `CausalAttention`: causal grouped-query attention without repeating K/V heads (the query heads of a group are
  stacked as extra query rows), the scale and the causal mask folded into one `baddbmm`, a softmax that computes
  in fp32 inside (Megatron's `attention_softmax_in_fp32`), and a backward of four batched matmuls. Any other case
  (padding masks, packed sequences, dropout, softmax offsets) goes to Megatron's `DotProductAttention`.
- `fused_rope`: Megatron's `fused_apply_rotary_pos_emb` slot (TE's, when TE is absent): x cos + rotate_half(x) sin
  as one multiply, one roll and one `addcmul`.
- `RMSNorm`: the same numerics as `torch.nn.RMSNorm` (normalise in fp32, round, then scale), with a backward of a
  few fused-shape ops instead of autograd's graph of the composite.

Outputs equal Megatron's local modules' up to the rounding of the compute dtype. `tests/unit/test_local_kernels.py`
checks each piece against an independent reference; tests/distributed/test_parallel_equivalence.py checks the whole
model against `transformers` at TP 1 / TP 2 / PP 2, and TRL's GRPO loss and gradient.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# -- attention -------------------------------------------------------------------------------------------------

_causal_bias: dict[tuple, torch.Tensor] = {}


def _stacked_causal_bias(seq: int, rows_per_group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive causal mask [rows_per_group * seq, seq]: row r * seq + i may see keys 0..i."""
    key = (seq, rows_per_group, dtype, device)
    bias = _causal_bias.get(key)
    if bias is None:
        if len(_causal_bias) > 64:
            _causal_bias.clear()
        bias = torch.full((seq, seq), float("-inf"), dtype=dtype, device=device).triu_(1).repeat(rows_per_group, 1)
        _causal_bias[key] = bias
    return bias


class _CausalGQA(torch.autograd.Function):
    """q [s, b, heads, d], k and v [s, b, groups, d] -> [s, b, heads * d]; query heads g * r .. g * r + r - 1 share
    K/V group g (Megatron's layout). Computed per (batch, group) with the group's r query heads as r * s rows."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float):
        s, b, heads, d = q.shape
        groups = k.shape[2]
        r = heads // groups
        qh = q.permute(1, 2, 0, 3).reshape(b * groups, r * s, d)
        kt = k.permute(1, 2, 3, 0).reshape(b * groups, d, s)
        vh = v.permute(1, 2, 0, 3).reshape(b * groups, s, d)
        scores = torch.baddbmm(_stacked_causal_bias(s, r, q.dtype, q.device), qh, kt, alpha=scale)
        # bf16 scores in, bf16 probabilities out: torch's CPU and CUDA softmax kernels compute in fp32 inside, so
        # this rounds once, as Megatron's fp32 softmax followed by a cast does, without an fp32 copy in memory.
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs, vh)
        ctx.save_for_backward(qh, kt, vh, probs)
        ctx.scale = scale
        return out.view(b, groups, r, s, d).permute(3, 0, 1, 2, 4).reshape(s, b, heads * d)

    @staticmethod
    def backward(ctx, grad):
        qh, kt, vh, probs = ctx.saved_tensors
        s, b = grad.shape[0], grad.shape[1]
        bg, d = vh.shape[0], vh.shape[2]
        groups = bg // b
        r = qh.shape[1] // s
        gh = grad.reshape(s, b, groups, r, d).permute(1, 2, 3, 0, 4).reshape(bg, r * s, d)
        dv = torch.bmm(probs.transpose(1, 2), gh)
        dprobs = torch.bmm(gh, vh.transpose(1, 2))
        dscores = torch.ops.aten._softmax_backward_data(dprobs, probs, -1, probs.dtype)
        dq = torch.bmm(dscores, kt.transpose(1, 2)).mul_(ctx.scale)
        dk = torch.bmm(dscores.transpose(1, 2), qh).mul_(ctx.scale)
        dq = dq.view(b, groups * r, s, d).permute(2, 0, 1, 3)
        dk = dk.view(b, groups, s, d).permute(2, 0, 1, 3)
        dv = dv.view(b, groups, s, d).permute(2, 0, 1, 3)
        return dq, dk, dv, None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return _CausalGQA.apply(q, k, v, scale)


@functools.cache
def _dot_product_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class CausalAttention(DotProductAttention):
        """Megatron's `DotProductAttention` with the common case (causal, no extra mask, no dropout) fused."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            from megatron.core.transformer.enums import AttnMaskType

            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            fast = (
                attention_mask is None and mask_type == AttnMaskType.causal and attention_bias is None
                and packed_seq_params is None and getattr(self, "softmax_offset", None) is None
                and (self.config.attention_dropout == 0.0 or not self.training)
                and query.shape[0] == key.shape[0] and self.config.attention_softmax_in_fp32
            )
            if not fast:
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params)
            return causal_attention(query, key, value, self.softmax_scale)

    return CausalAttention


# -- RoPE ------------------------------------------------------------------------------------------------------


class _Rope(torch.autograd.Function):
    """x cos + rotate_half(x) sin, rotate_half(x) = cat(-x2, x1) = roll(x, d / 2) * [-1 .. -1, 1 .. 1]."""

    @staticmethod
    def forward(ctx, x, cos, signed_sin):
        ctx.save_for_backward(cos, signed_sin)
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)

    @staticmethod
    def backward(ctx, grad):
        cos, signed_sin = ctx.saved_tensors
        # roll by d / 2 is its own inverse
        rolled = (grad * signed_sin).roll(grad.shape[-1] // 2, dims=-1)
        return rolled.addcmul_(grad, cos), None, None


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False, **_) -> torch.Tensor:
    """Megatron's `fused_apply_rotary_pos_emb(t [s, b, h, d], freqs [s, 1, 1, rot_dim])`, half-split rotation."""
    if interleaved:
        raise NotImplementedError("megarl's fused RoPE does the half-split rotation only (rotary_interleaved=False)")
    rot = freqs.shape[-1]
    cos = torch.cos(freqs).to(t.dtype)
    sin = torch.sin(freqs)
    half = rot // 2
    signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).to(t.dtype)
    if rot == t.shape[-1]:
        return _Rope.apply(t, cos, signed_sin)
    return torch.cat([_Rope.apply(t[..., :rot], cos, signed_sin), t[..., rot:]], dim=-1)


# -- RMSNorm ---------------------------------------------------------------------------------------------------


class _RMSNorm(torch.autograd.Function):
    """y = round(x * rstd) * w with x * rstd in fp32 (torch.nn.RMSNorm's and Hugging Face's order)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        normed, rstd = torch.ops.aten._fused_rms_norm(x.float(), [x.shape[-1]], None, eps)
        normed = normed.to(x.dtype)
        ctx.save_for_backward(normed, rstd, weight)
        return normed * weight

    @staticmethod
    def backward(ctx, grad):
        normed, rstd, weight = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        dweight = (flat.float() * normed.reshape(flat.shape)).sum(0).to(weight.dtype)
        dnormed = (grad * weight).float()
        xhat = normed.float()
        # d/dx of x * rstd: rstd * (g - xhat * mean(g * xhat)); xhat is the rounded x * rstd that the forward used
        dot = (dnormed * xhat).mean(-1, keepdim=True)
        dx = dnormed.sub_(xhat.mul_(dot)).mul_(rstd)
        return dx.to(grad.dtype), dweight, None


class RMSNorm(torch.nn.Module):
    """Drop-in for Megatron's `WrappedTorchNorm` with `normalization="RMSNorm"` (same `weight` parameter), which
    also works under sequence parallelism (Megatron's torch norm refuses it): the norm is per token, so a TP rank
    normalises its own slice of the sequence, and the weight's gradient, a sum over tokens, is completed by
    Megatron's all-reduce over TP of the parameters marked `sequence_parallel` (as TE's and Apex's norms are)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.normalization != "RMSNorm":
            from megatron.core.transformer.torch_norm import WrappedTorchNorm

            return WrappedTorchNorm(config, hidden_size, eps, **kwargs)
        return super().__new__(cls)

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:  # mixed dtypes: torch.nn.RMSNorm's own promotion rules
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return _RMSNorm.apply(x, self.weight, self.eps)


# -- wiring ----------------------------------------------------------------------------------------------------


def install_rope() -> bool:
    """Put `fused_rope` in Megatron's fused-RoPE slot when TE has not filled it; True if the slot is ours."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_rope
    return rope_utils.fused_apply_rotary_pos_emb is fused_rope


def transformer_config_overrides() -> dict:
    """TransformerConfig fields that route Megatron's local spec through these kernels."""
    return dict(apply_rope_fusion=install_rope())


def local_spec(normalization: str = "RMSNorm", **options):
    """Megatron's local GPT layer spec with the attention and norms above (RoPE comes through the config);
    `options`: `get_gpt_layer_local_spec`'s (`qk_layernorm`, `num_experts`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization=normalization, **options)
    layer = spec.submodules
    layer.input_layernorm = RMSNorm
    layer.pre_mlp_layernorm = RMSNorm
    attention = layer.self_attention.submodules
    attention.core_attention = _dot_product_attention()
    if options.get("qk_layernorm"):
        attention.q_layernorm = attention.k_layernorm = RMSNorm
    return spec

"""megarl's fused kernels for Megatron's local spec (`megarl/mcore/local_kernels.py`), each against an independent
reference: attention against softmax(QK^T)V written out in float64, RoPE against Megatron's own unfused RoPE and
`transformers`' `apply_rotary_pos_emb`, RMSNorm against `torch.nn.RMSNorm`; forward values and gradients. The whole
model against `transformers` is tests/distributed/test_parallel_equivalence.py (it runs these kernels: they are the
default without TE)."""

from __future__ import annotations

import pytest
import torch

from megarl.mcore import local_kernels as K


def _grads(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


def _reference_attention(q, k, v, scale):
    """[s, b, heads, d] x [s, b, groups, d] -> [s, b, heads * d]: K/V repeated per group, causal, plain softmax."""
    s, b, heads, d = q.shape
    r = heads // k.shape[2]
    k, v = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v)
    return out.reshape(s, b, heads * d)


@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 4), (6, 1)])
def test_causal_attention_matches_the_float64_reference(heads, groups):
    torch.manual_seed(0)
    s, b, d = 7, 3, 8
    q, k, v = torch.randn(s, b, heads, d), torch.randn(s, b, groups, d), torch.randn(s, b, groups, d)
    grad = torch.randn(s, b, heads * d)
    out, grads = _grads(lambda *t: K.causal_attention(*t, d**-0.5), (q, k, v), grad)
    ref, ref_grads = _grads(lambda *t: _reference_attention(*t, d**-0.5), (q.double(), k.double(), v.double()),
                            grad.double())
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


def test_causal_attention_is_causal():
    """Changing the last position's keys and values changes no earlier output."""
    torch.manual_seed(1)
    q, k, v = torch.randn(5, 2, 4, 8), torch.randn(5, 2, 2, 8), torch.randn(5, 2, 2, 8)
    k2, v2 = k.clone(), v.clone()
    k2[-1] += 3.0
    v2[-1] -= 3.0
    a, b = K.causal_attention(q, k, v, 0.3), K.causal_attention(q, k2, v2, 0.3)
    torch.testing.assert_close(a[:-1], b[:-1], rtol=0, atol=0)
    assert not torch.allclose(a[-1], b[-1])


def test_causal_attention_bf16_stays_close_to_float64():
    torch.manual_seed(2)
    s, b, d = 33, 2, 16
    q, k, v = torch.randn(s, b, 4, d), torch.randn(s, b, 2, d), torch.randn(s, b, 2, d)
    grad = torch.randn(s, b, 4 * d)
    out, grads = _grads(lambda *t: K.causal_attention(*t, d**-0.5), (q.bfloat16(), k.bfloat16(), v.bfloat16()),
                        grad.bfloat16())
    ref, ref_grads = _grads(lambda *t: _reference_attention(*t, d**-0.5), (q.double(), k.double(), v.double()),
                            grad.double())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=0.02, atol=0.02)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, rtol=0.05, atol=0.05)


def _freqs(s, dim, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    f = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    return torch.cat([f, f], dim=-1)[:, None, None, :]  # Megatron's [s, 1, 1, dim]


def test_rope_matches_megatron_and_transformers():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    torch.manual_seed(3)
    s, b, h, d = 9, 2, 3, 16
    x, grad, freqs = torch.randn(s, b, h, d), torch.randn(s, b, h, d), _freqs(s, d)
    out, (dx,) = _grads(lambda t: K.fused_rope(t, freqs), (x,), grad)
    ref, (ref_dx,) = _grads(lambda t: _apply_rotary_pos_emb_bshd(t, freqs), (x,), grad)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-6, atol=1e-6)
    # transformers: [b, h, s, d] with cos/sin [b, s, d]
    cos, sin = freqs[:, 0, 0].cos()[None], freqs[:, 0, 0].sin()[None]
    hf, _ = apply_rotary_pos_emb(x.permute(1, 2, 0, 3), x.permute(1, 2, 0, 3), cos, sin)
    torch.testing.assert_close(out, hf.permute(2, 0, 1, 3), rtol=1e-6, atol=1e-6)


def test_rope_partial_rotary_keeps_the_rest():
    torch.manual_seed(4)
    x, freqs = torch.randn(4, 1, 2, 16), _freqs(4, 8)
    out = K.fused_rope(x, freqs)
    torch.testing.assert_close(out[..., 8:], x[..., 8:], rtol=0, atol=0)
    torch.testing.assert_close(out[..., :8], K.fused_rope(x[..., :8].contiguous(), freqs), rtol=0, atol=0)


def test_rope_interleaved_is_refused():
    with pytest.raises(NotImplementedError, match="half-split"):
        K.fused_rope(torch.zeros(2, 1, 1, 4), _freqs(2, 4), interleaved=True)


class _Config:
    normalization, sequence_parallel, params_dtype = "RMSNorm", False, torch.float32


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rmsnorm_matches_torch(dtype, tol):
    torch.manual_seed(5)
    hidden = 32
    cfg = _Config()
    cfg.params_dtype = dtype
    ours = K.RMSNorm(cfg, hidden, eps=1e-6)
    theirs = torch.nn.RMSNorm(hidden, eps=1e-6, dtype=dtype)
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    for m in (ours, theirs):
        m.weight.data.copy_(weight)
    x, grad = torch.randn(6, 3, hidden).to(dtype), torch.randn(6, 3, hidden).to(dtype)
    outs = []
    for m in (ours, theirs):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(grad)
        outs.append((y.detach(), xi.grad, m.weight.grad))
    for got, want in zip(*outs):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * max(1.0, want.abs().max().item()))


def test_rmsnorm_state_dict_is_megatrons():
    assert list(K.RMSNorm(_Config(), 8).state_dict()) == ["weight"]


def test_local_spec_uses_the_kernels():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    layer = K.local_spec().submodules
    assert layer.input_layernorm is K.RMSNorm and layer.pre_mlp_layernorm is K.RMSNorm
    core = layer.self_attention.submodules.core_attention
    assert issubclass(core, DotProductAttention) and core is not DotProductAttention
    from megatron.core.models.common.embeddings import rope_utils

    # megarl fills Megatron's fused-RoPE slot only where Transformer Engine has not
    te_rope = rope_utils.fused_apply_rotary_pos_emb not in (None, K.fused_rope)
    assert K.install_rope() == (not te_rope)
    assert (rope_utils.fused_apply_rotary_pos_emb is K.fused_rope) == (not te_rope)

"""LoRA on Transformer Engine's layer shapes, on CPU: TE itself cannot be installed here (its kernels need CUDA), so
these stand-ins have the attributes megarl's LoRA reads from TE's layers.

- TE's `TELayerNormColumnParallelLinear` fuses the input RMSNorm into qkv and fc1: the adapter's input must be the
  normalised hidden states, as PEFT's projection sees them after the model's own norm. Checked against a float64
  hand computation, with and without TE's zero-centred gamma.
- A norm other than RMSNorm fused there, and TE's grouped experts (`TEGroupedMLP`, no `local_experts`) under expert
  targets, are refused by name (the experts used to be left out without a word).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from megarl.mcore import lora

IN, FFN, RANK, EPS = 12, 8, 4, 1e-6


class FusedNormColumnLinear(torch.nn.Module):
    """What TE's TELayerNormColumnParallelLinear computes at TP 1: `linear(rms_norm(x))`, returning (out, bias)."""

    def __init__(self, zero_centered: bool, normalization: str = "RMSNorm"):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.weight = torch.nn.Parameter(torch.randn(2 * FFN, IN, generator=g))
        self.layer_norm_weight = torch.nn.Parameter(torch.randn(IN, generator=g) * 0.2 + (0 if zero_centered else 1))
        self.config = types.SimpleNamespace(layernorm_epsilon=EPS, layernorm_zero_centered_gamma=zero_centered,
                                            normalization=normalization, sequence_parallel=False)

    def forward(self, x):
        gamma = self.layer_norm_weight + 1 if self.config.layernorm_zero_centered_gamma else self.layer_norm_weight
        return F.linear(F.rms_norm(x, (IN,), gamma, EPS), self.weight), None


@pytest.mark.parametrize("zero_centered", [False, True])
def test_adapter_on_a_fused_norm_layer_sees_the_normalised_input(process_group, zero_centered):
    layer = FusedNormColumnLinear(zero_centered)
    opts = lora.LoRAOptions(rank=RANK, alpha=8.0, targets=("gate_proj", "up_proj"))
    adapter = lora.LoRAAdapter(layer, "column", ("gate_proj", "up_proj"), opts.targets, opts, {"kind": "concat"},
                               "model.layers.0.mlp.linear_fc1")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for key in adapter.B:
            adapter.B[key].copy_(torch.randn(adapter.B[key].shape, generator=g))
    layer.lora = adapter
    layer.register_forward_hook(lora._hook)
    x = torch.randn(3, 5, IN, generator=g)
    out, _ = layer(x)

    d = torch.float64
    gamma = layer.layer_norm_weight.detach().to(d) + (1 if zero_centered else 0)
    xd = x.to(d)
    n = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * gamma
    parts = [n @ adapter.A[k].detach().to(d).T @ adapter.B[k].detach().to(d).T for k in ("gate", "up")]
    want = n @ layer.weight.detach().to(d).T + 2.0 * torch.cat(parts, dim=-1)  # scale = alpha / rank = 2
    assert torch.allclose(out.to(d), want, rtol=1e-5, atol=1e-5), (out.to(d) - want).abs().max()
    # the raw (un-normalised) input would give another answer: the check can fail
    raw = 2.0 * torch.cat([xd @ adapter.A[k].detach().to(d).T @ adapter.B[k].detach().to(d).T
                           for k in ("gate", "up")], dim=-1)
    assert not torch.allclose(out.to(d), n @ layer.weight.detach().to(d).T + raw, rtol=1e-3, atol=1e-3)


def _model(*named: tuple[str, torch.nn.Module]) -> torch.nn.Module:
    model = torch.nn.Module()
    for name, module in named:
        parent = model
        *path, last = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(last, module)
    return model


def test_grouped_experts_are_refused_under_expert_targets(process_group):
    class TEGroupedMLP(torch.nn.Module):  # TE's grouped experts: weight0..N on one module, no local_experts
        pass

    model = _model(("decoder.layers.0.mlp.experts", TEGroupedMLP()))
    shape = types.SimpleNamespace(is_moe=True, family="qwen3_moe")
    opts = lora.LoRAOptions(rank=RANK, targets=("q_proj", "experts.gate_up_proj"))
    with pytest.raises(ValueError, match="experts are TEGroupedMLP"):
        lora.attach(model, shape, opts)


def test_a_fused_layernorm_is_refused(process_group):
    model = _model(("decoder.layers.0.self_attention.linear_qkv", FusedNormColumnLinear(False, "LayerNorm")))
    shape = types.SimpleNamespace(is_moe=False, family="llama")
    with pytest.raises(ValueError, match="fuses a LayerNorm"):
        lora.attach(model, shape, lora.LoRAOptions(rank=RANK, targets=("q_proj",)))

"""megarl's local-spec kernels (`megarl/mcore/local_kernels.py`) against the Megatron modules they replace, side by
side in one process: forward + backward milliseconds per call at one layer and micro-batch of the step bench's
30M model (8 sequences of 134 tokens, hidden 512, 8 query heads / 2 KV heads of 64), and the ratio.

    python tools/bench/local_kernels.py                     # bf16, one thread
    python tools/bench/local_kernels.py --dtype fp32 --seq 512

Megatron's side: `DotProductAttention` (causal, fp32 softmax), `_apply_rotary_pos_emb_bshd` (its unfused RoPE),
`WrappedTorchNorm` (torch.nn.RMSNorm), as megatron-core ships them and as its local spec runs them without
Transformer Engine. The two sides alternate call by call; the median of `--repeats` timed calls after a warm-up is
reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megarl.mcore import cpu_compat, parallel
from megarl.mcore import local_kernels as K
from megarl.model_shape import ModelShape


def fwd_bwd_ms(fn, inputs: list[torch.Tensor]) -> float:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    start = time.perf_counter()
    out = fn(*leaves)
    out.backward(torch.ones_like(out))
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--seq", type=int, default=134)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megarl.mcore.model import transformer_config

    parallel.init_distributed(1, 1)
    from step import QWEN2_30M  # tools/bench/step.py's 30m model

    shape = ModelShape.from_hf_config({**QWEN2_30M, "model_type": "qwen2"})
    config = transformer_config(shape, tp=1, pp=1, params_dtype=dtype, bf16=dtype == torch.bfloat16)
    s, b, h, g, d = args.seq, args.batch, shape.num_attention_heads, shape.num_kv_heads, shape.head_dim
    torch.manual_seed(0)
    randn = lambda *size: torch.randn(*size, dtype=dtype)

    stock_attention = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                          attention_type="self")
    ours_attention = K._dot_product_attention()(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                                attention_type="self")
    stock_norm = WrappedTorchNorm(config, shape.hidden_size, eps=shape.norm_eps).to(dtype)
    ours_norm = K.RMSNorm(config, shape.hidden_size, eps=shape.norm_eps)
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    freqs = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]

    cases = [
        ("attention", lambda q, k, v: stock_attention(q, k, v, None), lambda q, k, v: ours_attention(q, k, v, None),
         [randn(s, b, h, d), randn(s, b, g, d), randn(s, b, g, d)]),
        ("rope (q)", lambda x: _apply_rotary_pos_emb_bshd(x, freqs), lambda x: K.fused_rope(x, freqs),
         [randn(s, b, h, d)]),
        ("rmsnorm", stock_norm, ours_norm, [randn(s, b, shape.hidden_size)]),
    ]
    print(f"{args.dtype}, {args.threads} thread(s), [seq {s}, batch {b}], fwd + bwd per call, median of "
          f"{args.repeats}, the two alternating")
    print(f"  {'kernel':<11}{'megatron ms':>12}{'megarl ms':>11}{'ratio':>8}")
    per_layer = {"rmsnorm": 2}  # two norms per layer; one RoPE call of each kind (q) shown
    total_stock = total_ours = 0.0
    with cpu_compat.megatron_scope():  # Megatron's attention takes its buffers from the "current device"
        for name, stock, ours, inputs in cases:
            for _ in range(3):
                fwd_bwd_ms(stock, inputs), fwd_bwd_ms(ours, inputs)
            a, c = [], []
            for _ in range(args.repeats):
                a.append(fwd_bwd_ms(stock, inputs))
                c.append(fwd_bwd_ms(ours, inputs))
            ms_stock, ms_ours = statistics.median(a), statistics.median(c)
            total_stock += ms_stock * per_layer.get(name, 1)
            total_ours += ms_ours * per_layer.get(name, 1)
            print(f"  {name:<11}{ms_stock:>12.2f}{ms_ours:>11.2f}{ms_stock / ms_ours:>7.2f}x")
    print(f"  {'layer':<11}{total_stock:>12.2f}{total_ours:>11.2f}{total_stock / total_ours:>7.2f}x  "
          "(the rows above, the norm counted twice)")


if __name__ == "__main__":
    main()

"""Log-probs and entropy straight from the hidden states, in chunks of tokens, fused with the output layer.

Today's head (`megarl.mcore.actor.label_logprobs`, `position_entropy`) takes the logits [tokens, v/tp] that the
output layer wrote and makes fp32 copies of them: a scaled copy, the cross-entropy's own, `exp(x - m)` and `e * x`
for the entropy, and autograd keeps what the backward pass needs. At 16k tokens and a 152k vocabulary one fp32
copy is 9.3 GiB. `ChunkedLogprobs` never holds more than one chunk's logits: it multiplies `chunk_tokens` hidden
states by the output-weight shard, reduces them to one log-prob (and one entropy) per token, and drops them; the
backward pass recomputes each chunk's logits and turns them into that chunk's gradient with respect to the hidden
states and the weight. Memory then depends on the chunk, not on the sequence, for one more output-layer matmul per
chunk in the backward pass.

It stays vocab-parallel as Megatron's output layer is: each TP rank holds rows [rank * v/tp, (rank + 1) * v/tp) of
the weight, and the max, the sum of exponentials, the label's logit and sum p * x are all-reduced over the TP
group (two all-reduces per chunk). The gradient it returns for the hidden states is this rank's part (its
vocabulary shard's): the caller sums it over TP ranks, as `ColumnParallelLinear` does
(`copy_to_tensor_model_parallel_region` before the call).

With x the temperature-scaled logits of one token, lse = log sum_j e^(x_j), p = e^(x - lse), E = sum_j p_j x_j:
    logp = x_label - lse,  H = lse - E,
    d logp / dx_j = [j = label] - p_j,  dH / dx_j = -p_j (x_j - E).
On-policy distillation's top-K KL (`--distill-topk`) also asks for the log-probs of K given ids a token (the
teacher's top-K): each is gathered from the same chunk's logits (0 on ranks whose shard does not hold it, summed in
the same all-reduce), `x_id - lse`, and its gradient adds `[j = id] - p_j` times its own upstream gradient.
Vocabulary-padding rows (`megarl.preflight.padded_vocab_size`) get the dtype's lowest value, as
`actor.mask_vocab_padding` gives them, and no gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ChunkedLogprobs", "chunked_logprobs", "chunked_topk_logprobs"]


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _Shard:
    """Where this rank's vocabulary rows sit and which of them are padding."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, group):
        self.local = weight.shape[0]
        rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
        self.start = rank * self.local
        # Columns from `pad_from` on are padding rows (vocab_size 0: none).
        self.pad_from = max(0, vocab_size - self.start) if vocab_size and self.start + self.local > vocab_size else None

    def logits(self, h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
        """One chunk's scaled, masked fp32 logits [c, v/tp], as `actor._scaled` makes them from the full ones."""
        x = torch.matmul(h.to(weight.dtype), weight.t()).float().div_(temperature)
        if self.pad_from is not None:
            x[:, self.pad_from:] = torch.finfo(x.dtype).min
        return x

    def label_index(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Labels as columns of this shard (clamped) and whether the shard holds them."""
        local = labels - self.start
        inside = (local >= 0) & (local < self.local)
        return local.clamp(0, self.local - 1), inside


class ChunkedLogprobs(torch.autograd.Function):
    """(hidden [N, h], weight [v/tp, h], labels [N], topk_ids [N, K] or None) -> (logp [N], entropy [N],
    topk_logp [N, K] (log p of each of `topk_ids`; [N, 0] without them)); see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature: float, vocab_size: int, chunk_tokens: int,
                with_entropy: bool, group, topk_ids=None):
        shard = _Shard(weight, vocab_size, group)
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        logp = torch.empty_like(lse)
        entropy = torch.empty_like(lse) if with_entropy else lse.new_zeros(n)
        k = 0 if topk_ids is None else topk_ids.shape[1]
        topk_logp = lse.new_zeros(n, k)
        base = 3 if with_entropy else 2  # rows of `sums`: sum e, the label's logit, (sum e x,) the top-K's logits
        for a in range(0, n, chunk_tokens):
            b = min(n, a + chunk_tokens)
            x = shard.logits(hidden[a:b], weight, temperature)
            m = _all_reduce(x.max(dim=-1).values, dist.ReduceOp.MAX, group)
            col, inside = shard.label_index(labels[a:b])
            sums = torch.empty(base + k, b - a, dtype=torch.float32, device=x.device)
            sums[1] = x.gather(1, col.unsqueeze(1)).squeeze(1).masked_fill_(~inside, 0.0)
            if k:  # each id's logit from the rank whose shard holds it, 0 elsewhere (summed below)
                tcol, tin = shard.label_index(topk_ids[a:b])
                sums[base:] = x.gather(1, tcol).masked_fill_(~tin, 0.0).t()
            e = x.sub(m.unsqueeze(1)).exp_()
            sums[0] = e.sum(dim=-1)
            if with_entropy:
                sums[2] = e.mul_(x).sum(dim=-1)
            del e, x
            _all_reduce(sums, dist.ReduceOp.SUM, group)
            lse[a:b] = sums[0].log() + m
            logp[a:b] = sums[1] - lse[a:b]
            if with_entropy:
                entropy[a:b] = lse[a:b] - sums[2] / sums[0]
            if k:
                topk_logp[a:b] = sums[base:].t() - lse[a:b].unsqueeze(1)
        ctx.save_for_backward(hidden, weight, labels, lse, entropy, topk_ids)
        ctx.shard, ctx.temperature, ctx.chunk_tokens, ctx.with_entropy = shard, temperature, chunk_tokens, with_entropy
        return logp, entropy, topk_logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, grad_topk=None):
        hidden, weight, labels, lse, entropy, topk_ids = ctx.saved_tensors
        use_topk = topk_ids is not None and grad_topk is not None
        shard, temperature, chunk = ctx.shard, ctx.temperature, ctx.chunk_tokens
        use_entropy = ctx.with_entropy and grad_entropy is not None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                       if ctx.needs_input_grad[1] else None)
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        n = hidden.shape[0]
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            x = shard.logits(hidden[a:b], weight, temperature)
            g_lp = grad_logp[a:b].float().unsqueeze(1)
            # d log p(id) / dx_j = [j = id] - p_j: every log-prob's gradient adds to the -p_j term
            g_p = g_lp + grad_topk[a:b].float().sum(dim=1, keepdim=True) if use_topk else g_lp
            if use_entropy:
                mean_x = (lse[a:b] - entropy[a:b]).unsqueeze(1)  # E = sum p x = lse - H
                x.sub_(mean_x)                                   # x - E
                g = x.sub(entropy[a:b].unsqueeze(1)).exp_()      # p = e^(x - lse) = e^((x - E) - H)
                x.mul_(grad_entropy[a:b].float().unsqueeze(1)).add_(g_p)
                g.mul_(x).neg_()                                 # -p (g_lp + g_H (x - E))
            else:
                g = x.sub_(lse[a:b].unsqueeze(1)).exp_().mul_(g_p).neg_()  # -p g_lp
            del x
            col, inside = shard.label_index(labels[a:b])
            g.scatter_add_(1, col.unsqueeze(1), (g_lp.squeeze(1) * inside).unsqueeze(1))
            if use_topk:
                tcol, tin = shard.label_index(topk_ids[a:b])
                g.scatter_add_(1, tcol, grad_topk[a:b].float() * tin)
            if shard.pad_from is not None:
                g[:, shard.pad_from:] = 0.0
            g = g.div_(temperature).to(weight.dtype)
            h = hidden[a:b].to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[a:b] = torch.matmul(g, weight)
            if grad_weight is not None:
                if weight.dtype == torch.float32:
                    grad_weight.addmm_(g.t(), h)
                else:  # one low-precision matmul per chunk (fp32 accumulation inside), summed in fp32
                    grad_weight.add_(torch.matmul(g.t(), h))
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, temperature: float,
                     chunk_tokens: int, vocab_size: int = 0, with_entropy: bool = False,
                     group=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(labels) and (with `with_entropy`) the entropy at every position, from hidden states [..., h] and this
    TP rank's output-weight shard [v/tp, h]; labels [...]; both results [...], differentiable with respect to the
    hidden states and the weight. `temperature` <= 0 means 1 (as `actor._scaled`); `vocab_size`: the real vocabulary
    of a padded one (0 = no padding); `group`: the TP group (None or one rank: no all-reduce). The hidden states'
    gradient is this rank's part (see the module docstring)."""
    logp, entropy, _ = chunked_topk_logprobs(hidden, weight, labels, None, temperature=temperature,
                                             chunk_tokens=chunk_tokens, vocab_size=vocab_size,
                                             with_entropy=with_entropy, group=group)
    return logp, entropy


def chunked_topk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          topk_ids: torch.Tensor | None, *, temperature: float, chunk_tokens: int, vocab_size: int = 0,
                          with_entropy: bool = False, group=None):
    """`chunked_logprobs` and, with `topk_ids` [..., K] (on-policy distillation's teacher top-K, `--distill-topk`),
    the log-probs of those ids [..., K] from the same chunks (None without them), differentiable as the rest:
    (logp, entropy or None, topk_logp or None)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunked log-probs need --logprob-chunk-tokens >= 1, got {chunk_tokens}")
    lead = labels.shape
    ids = None if topk_ids is None else topk_ids.reshape(-1, topk_ids.shape[-1]).long()
    logp, entropy, topk = ChunkedLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                                temperature if temperature > 0 else 1.0, vocab_size, chunk_tokens,
                                                with_entropy, group, ids)
    return (logp.view(lead), entropy.view(lead) if with_entropy else None,
            None if ids is None else topk.view(*lead, ids.shape[1]))

"""The top-K distillation loss as the actor computes it (`--distill-topk`), and the float64 hand computation it is
held to: shared by the TP 1 unit test (tests/unit/test_distill_topk.py) and the TP 2 worker (tests/distributed).

The case: full student logits [B, S, 100] of which the last 4 rows are vocabulary padding (`vocab_size` 96), the
teacher's top-4 of a random distribution over the 96 real tokens at each position, a loss mask with holes, the
token-mean of `distill_coef * KL_k` (`--distill-only`: the advantages are 0, so the policy-gradient term is 0)."""

from __future__ import annotations

import math

import numpy as np
import torch

B, S, V, REAL, K = 3, 7, 100, 96, 4
COEF, TEMPERATURE, TAIL_FLOOR = 0.5, 0.7, 1e-8


def case(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S, V, generator=g, dtype=torch.float64) * 2
    tokens = torch.randint(0, REAL, (B, S), generator=g)
    teacher = torch.log_softmax(torch.randn(B, S - 1, REAL, generator=g, dtype=torch.float64) * 3, dim=-1)
    top_logp, top_ids = teacher.topk(K, dim=-1)
    mask = torch.ones(B, S - 1)
    mask[0, :2] = 0  # a prompt
    mask[2, 4:] = 0  # padding after a short row
    return {"logits": logits, "tokens": tokens, "loss_mask": mask, "teacher_topk_ids": top_ids,
            "teacher_topk_logp": top_logp.float(), "rollout_logp": torch.zeros(B, S - 1),
            "advantages": torch.zeros(B)}


def wired_loss(logits_shard: torch.Tensor, c: dict) -> tuple[torch.Tensor, dict]:
    """The actor's loss on this TP rank's logits shard [B, S, V / tp] as training computes it: the head's log-probs
    and top-K log-probs (`megarl.mcore.actor`), then `make_loss_fn`'s loss; (num / den, metrics). Needs Megatron's
    parallel state."""
    from megarl.config import AlgorithmConfig
    from megarl.mcore.actor import token_logprobs, topk_label_logprobs
    from megarl.stages.update import make_loss_fn

    a = AlgorithmConfig(distill_coef=COEF, distill_only=True, distill_topk=K)
    loss_fn = make_loss_fn(a, max_response_len=S)
    assert loss_fn.needs_topk
    mb = {k: v for k, v in c.items() if k != "logits"}
    mb["_real_rows"] = B
    mb["topk_logp"] = topk_label_logprobs(logits_shard[:, :-1], c["teacher_topk_ids"], TEMPERATURE, REAL)
    logp = token_logprobs(logits_shard, c["tokens"], TEMPERATURE, REAL)
    num, den, metrics = loss_fn(logp, mb)
    return num / den, metrics


def hand(c: dict) -> tuple[float, np.ndarray, float]:
    """(loss, its gradient in the full logits [B, S, V], the per-token mean KL) by loops in float64."""
    x = c["logits"].numpy()
    ids, lt, m = c["teacher_topk_ids"].numpy(), c["teacher_topk_logp"].double().numpy(), c["loss_mask"].numpy()
    n = m.sum()
    loss, kl_sum, grad = 0.0, 0.0, np.zeros_like(x)
    for b in range(B):
        for t in range(S - 1):
            if not m[b, t]:
                continue
            z = x[b, t, :REAL] / TEMPERATURE
            p = np.exp(z - z.max())
            p /= p.sum()
            logp = np.log(p)
            q, lq, tl = p[ids[b, t]], logp[ids[b, t]], lt[b, t]
            head = float((q * (lq - tl)).sum())
            tail_s, tail_t = 1 - q.sum(), 1 - np.exp(tl).sum()
            tail_s_c, tail_t_c = max(tail_s, TAIL_FLOOR), max(tail_t, TAIL_FLOOR)
            kl = head + tail_s_c * (math.log(tail_s_c) - math.log(tail_t_c))
            kl_sum += kl
            loss += COEF * kl / n
            # d/dz_j: q_i (d l_i / dz_j) = q_i ([j = id_i] - p_j); the head gives q_i (l_i - tl_i + 1) per unit of it,
            # the tail (unfloored) (log tail_s - log tail_t + 1) times d tail_s / dz_j = -sum_i q_i ([j = id_i] - p_j).
            w = q * (lq - tl + 1)
            if tail_s > TAIL_FLOOR:
                w = w - q * (math.log(tail_s_c) - math.log(tail_t_c) + 1)
            g = -p * w.sum()
            np.add.at(g, ids[b, t], w)
            grad[b, t, :REAL] = COEF * g / TEMPERATURE / n
    return loss, grad, kl_sum / n


def chunked_vs_full(tp: int, rank: int, group) -> dict[str, float]:
    """`--logprob-chunk-tokens`' head (`chunked_topk_logprobs`, chunks of 5 of 18 tokens) against the full one
    (logits = hidden @ W.T, then `topk_label_logprobs`, `label_logprobs`, `position_entropy`) on this TP rank's
    shard of a [100, 16] output weight (vocabulary 96): the largest |chunked - full| / max(1, max |full|) of the
    top-K log-probs, log-probs, this rank's part of the hidden-state gradient and its weight-shard gradient, on a
    loss of all three (with and without the entropy)."""
    from megarl.mcore.actor import label_logprobs, position_entropy, topk_label_logprobs
    from megarl.mcore.chunked_logprobs import chunked_topk_logprobs

    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(B, S - 1, 16, generator=g)
    shard = (torch.randn(V, 16, generator=g) * 0.5).chunk(tp)[rank].contiguous()
    labels = torch.randint(0, REAL, (B, S - 1), generator=g)
    ids = case(seed=0)["teacher_topk_ids"]
    wa, wb, wc = (torch.randn(B, S - 1, K, generator=g), torch.randn(B, S - 1, generator=g),
                  torch.randn(B, S - 1, generator=g))
    out = {}
    for with_entropy in (True, False):
        results = []
        for chunked in (False, True):
            h, w = hidden.clone().requires_grad_(), shard.clone().requires_grad_()
            if chunked:
                logp, ent, topk = chunked_topk_logprobs(h, w, labels, ids, temperature=TEMPERATURE, chunk_tokens=5,
                                                        vocab_size=REAL, with_entropy=with_entropy, group=group)
            else:
                logits = h @ w.t()
                topk = topk_label_logprobs(logits, ids, TEMPERATURE, REAL)
                logp = label_logprobs(logits, labels, TEMPERATURE, REAL)
                ent = position_entropy(logits, TEMPERATURE, REAL) if with_entropy else None
            loss = (topk * wa).sum() + (logp * wb).sum() + ((ent * wc).sum() if with_entropy else 0.0)
            loss.backward()
            results.append([topk.detach(), logp.detach(), h.grad, w.grad])
        tag = "entropy" if with_entropy else "no_entropy"
        for part, full, chunk in zip(("topk_logp", "logp", "grad_hidden", "grad_weight"), *results):
            out[f"{tag}_{part}"] = (full - chunk).abs().max().item() / max(1.0, full.abs().max().item())
        out[f"{tag}_grad_weight_norm"] = results[0][3].norm().item()
    return out

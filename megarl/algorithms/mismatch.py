"""Train-inference mismatch over the whole next-token distribution (`--mismatch-check-interval`).

The per-step mismatch metrics (`megarl.stages.mismatch.mismatch_metrics`) compare the engine's and the actor's
log-probs of the *sampled* token only: one number per position out of a distribution over the vocabulary. Two
distributions can agree on the sampled token and differ elsewhere (a bf16 engine reshuffling the tail), and that is
what a sampler with top-p, a later step or an importance weight meets. Here, at the same positions, the two whole
distributions are compared:

    KL_fwd = sum_v p_e(v) (log p_e(v) - log p_a(v))    KL(engine || actor): the engine samples, the actor trains
    KL_rev = sum_v p_a(v) (log p_a(v) - log p_e(v))
    TV     = 1/2 sum_v |p_e(v) - p_a(v)|,              top1 = [argmax p_e == argmax p_a]

An engine that returns only its top-k log-probs (SGLang) gives bounds instead, by merging the tokens outside its
top k into one "rest" outcome (mass r_e = 1 - sum_topk p_e for the engine, r_a = 1 - sum_{same k tokens} p_a for
the actor): KL of the merged distributions is a lower bound of each KL (data-processing inequality), and TV lies in

    [1/2 (sum_topk |p_e - p_a| + |r_e - r_a|),  1/2 (sum_topk |p_e - p_a| + r_e + r_a)].

`mismatch_remaining_mass` (mean r_e) says how loose they are. Pure tensor functions: no megatron, no engine.
"""

from __future__ import annotations

import torch
from torch import Tensor

WORST = 3  # positions reported by their KL_fwd, worst first
REST_RESOLUTION = 1e-6  # an engine's mass outside its top k below this is float32 rounding (`topk_mismatch`)


def _plogp_diff(logp: Tensor, other: Tensor) -> Tensor:
    """sum_v p(v) (logp(v) - other(v)) per row, with 0 log 0 = 0 (a token the first gives no mass adds nothing)."""
    p = logp.exp()
    return torch.where(p > 0, p * (logp - other), torch.zeros_like(p)).sum(dim=-1)


def _first_row(n: int) -> Tensor:
    """(row, position) of n positions when the caller gives none: row 0, positions 0..n-1."""
    return torch.stack([torch.zeros(n), torch.arange(n)], dim=-1)


def _summary(kl_fwd: Tensor, kl_rev: Tensor, tv: Tensor, top1: Tensor, where: Tensor) -> dict[str, float]:
    """Means over positions, the worst KL_fwd, and the `WORST` worst positions as (row, position) pairs."""
    out = {"mismatch_kl_fwd": float(kl_fwd.mean()), "mismatch_kl_rev": float(kl_rev.mean()),
           "mismatch_tv": float(tv.mean()), "mismatch_top1": float(top1.float().mean()),
           "mismatch_kl_fwd_max": float(kl_fwd.max()), "mismatch_positions": float(kl_fwd.numel())}
    order = torch.argsort(kl_fwd, descending=True)[:WORST]
    for rank, i in enumerate(order.tolist(), start=1):
        out[f"mismatch_worst{rank}_kl_fwd"] = float(kl_fwd[i])
        out[f"mismatch_worst{rank}_row"], out[f"mismatch_worst{rank}_pos"] = (float(x) for x in where[i])
    return out


def full_mismatch(engine_logp: Tensor, actor_logp: Tensor, where: Tensor | None = None) -> dict[str, float]:
    """Both full distributions as log-probs [N, V] (N positions; float64 inside). `where` [N, 2]: each position's
    (row, column) for the worst-position report (default (0, n)). Returns the `mismatch_*` metrics."""
    if engine_logp.shape != actor_logp.shape or engine_logp.dim() != 2:
        raise ValueError(f"full_mismatch needs two [N, V] log-prob tensors, got {tuple(engine_logp.shape)} and "
                         f"{tuple(actor_logp.shape)}")
    # Renormalised in float64: float32 log-probs sum to 1 only to ~1e-8, enough to make a KL of ~1e-8 negative.
    e, a = torch.log_softmax(engine_logp.double(), -1), torch.log_softmax(actor_logp.double(), -1)
    tv = 0.5 * (e.exp() - a.exp()).abs().sum(dim=-1)
    top1 = e.argmax(dim=-1) == a.argmax(dim=-1)
    where = where if where is not None else _first_row(len(e))
    return _summary(_plogp_diff(e, a), _plogp_diff(a, e), tv, top1, where)


def topk_mismatch(engine_ids: Tensor, engine_topk_logp: Tensor, actor_logp: Tensor,
                  where: Tensor | None = None) -> dict[str, float]:
    """The bounded form for an engine that returns its top-k log-probs only: `engine_ids`, `engine_topk_logp`
    [N, k] (its k likeliest tokens and their log-probs), `actor_logp` [N, V] the actor's full distribution.
    `mismatch_kl_fwd`, `mismatch_kl_rev` and `mismatch_tv` are lower bounds, `mismatch_tv_upper` an upper one;
    `mismatch_remaining_mass` is the engine's mass outside its top k (see the module docstring)."""
    e = engine_topk_logp.double()
    full = torch.log_softmax(actor_logp.double(), -1)  # renormalised in float64, as in `full_mismatch`
    a = full.gather(1, engine_ids.long())
    # The engine's rest is all it tells of its tail: below float32's resolution of a sum of probabilities it is
    # rounding, not mass (else a k = vocab answer would give r_e ~1e-8 against r_a = 0, an infinite bound).
    r_e = 1 - e.exp().sum(dim=-1)
    r_e = torch.where(r_e < REST_RESOLUTION, torch.zeros_like(r_e), r_e)
    r_a = full.exp().scatter(1, engine_ids.long(), 0.0).sum(dim=-1)  # the actor's own tail, summed exactly
    # The merged distributions: the k tokens, then "rest" (log 0 = -inf where a side has no rest).
    e_m = torch.cat([e, r_e.log()[:, None]], dim=-1)
    a_m = torch.cat([a, r_a.log()[:, None]], dim=-1)
    diff = (e.exp() - a.exp()).abs().sum(dim=-1)
    top1 = engine_ids.long().gather(1, e.argmax(dim=-1, keepdim=True)).squeeze(1) == actor_logp.argmax(dim=-1)
    where = where if where is not None else _first_row(len(e))
    out = _summary(_plogp_diff(e_m, a_m), _plogp_diff(a_m, e_m), 0.5 * (diff + (r_e - r_a).abs()), top1, where)
    out["mismatch_tv_upper"] = float((0.5 * (diff + r_e + r_a)).mean())
    out["mismatch_remaining_mass"] = float(r_e.mean())
    return out

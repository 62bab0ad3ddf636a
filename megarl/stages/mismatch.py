"""Train-inference mismatch, the stage's side (the formulas are `megarl.algorithms.mismatch`).

Every step, on the sampled tokens (`mismatch_metrics`, inside the actor's loss): |actor - rollout| log-prob, the
KL of the two and the importance weight, as sums over tokens.

`--mismatch-check-interval N`: every N steps, the engine's and the actor's whole next-token distributions at the
sampled positions of a few rows of the step's batch.

Split like --verify-weight-sync's probe (`megarl.stages.colocation.WeightSync`): the actor's side is computed at the
weight sync, while the actor holds the GPU (its forward is collective) and with the weights just sent to the engine;
the engine's side when it next takes the GPU, before it generates. Both sides see the same weights, so what is
measured is the implementations' and precisions' difference, not staleness. Both are at temperature 1 (the model's
own distribution; SGLang scores at temperature 1 only). Off (N = 0), nothing here runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.mcore import parallel
from megarl.mcore.actor import MegatronPolicy
from megarl.algorithms.mismatch import full_mismatch, topk_mismatch
from megarl.rollout.base import EngineCapabilities
from megarl.samples import PackedSamples


@dataclass(frozen=True)
class ActorSide:
    """The actor's distributions at the sampled positions of a few rows, kept on the replica's leader."""

    sequences: list[list[int]]  # each row's prompt + response tokens
    columns: list[torch.Tensor]  # each row's sampled positions as columns t (predicting token t + 1)
    actor_logp: list[torch.Tensor]  # each row's [len(columns), vocab] log-probs, on the CPU


def sampled_rows(packed: PackedSamples, rows: int) -> list[int]:
    """The first `rows` rows with a sampled (loss-masked) token."""
    return [b for b in range(packed.tokens.shape[0]) if packed.loss_mask[b].any()][:rows]


def actor_side(actor: MegatronPolicy, packed: PackedSamples, rows: int, gather: bool) -> ActorSide | None:
    """Every model-parallel rank calls this (the forward is collective); the leader gets the result (with `gather`,
    from the last pipeline stage), None elsewhere or when no row has a sampled token."""
    picked = sampled_rows(packed, rows)
    if not picked:
        return None
    width = int(packed.lengths[picked].max())
    tokens = packed.tokens[picked, :width].to(parallel.device())
    full = actor.next_token_distributions(tokens)
    columns = [packed.loss_mask[b, : width - 1].nonzero().squeeze(1) for b in picked]
    local = None if full is None else [full[i, c].cpu() for i, c in enumerate(columns)]
    if gather:
        gathered = [None] * dist.get_world_size(parallel.mp_group())
        dist.all_gather_object(gathered, local, group=parallel.mp_group())
        local = next(g for g in gathered if g is not None)
    sequences = [packed.tokens[b, : int(packed.lengths[b])].tolist() for b in picked]
    return ActorSide(sequences, columns, local)


def engine_side(engine: EngineCapabilities, actor: ActorSide, topk: int) -> dict[str, float]:
    """The engine's distributions at the same positions against the actor's: the full vocabulary from an engine
    that declares `scores_distributions` (the built-in one), bounds from one that declares `scores_topk` (SGLang);
    {} from others."""
    n = len(actor.sequences)
    where = torch.cat([torch.stack([torch.full_like(c, i), c], dim=-1) for i, c in enumerate(actor.columns)])
    actor_logp = torch.cat(actor.actor_logp)
    if engine.scores_distributions:
        # prompt length 1: rows j = columns j, the distribution of token j + 1
        got = engine.score_distributions(actor.sequences, [1] * n, temperature=1.0)
        engine_logp = torch.cat([g[c] for g, c in zip(got, actor.columns)])
        return {**full_mismatch(engine_logp, actor_logp, where), "mismatch_bounded": 0.0}
    if engine.scores_topk:
        got = engine.score_topk(actor.sequences, [1] * n, topk)
        ids = torch.cat([i[c] for (i, _), c in zip(got, actor.columns)])
        logp = torch.cat([lp[c] for (_, lp), c in zip(got, actor.columns)])
        return {**topk_mismatch(ids, logp, actor_logp, where), "mismatch_bounded": 1.0}
    return {}


def mismatch_metrics(actor_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    """Train/rollout mismatch on the sampled tokens, as sums over masked tokens (divided by the token count once
    all ranks are summed): |actor - rollout| (mean and max), KL(rollout || actor) by the k3 estimator (samples come
    from the rollout engine), and the importance weight exp(actor - rollout) (mean, max, min)."""
    m = mask.bool()
    if not m.any():
        return {"mismatch_abs_sum": 0.0, "mismatch_abs_max": 0.0, "mismatch_kl_sum": 0.0, "is_weight_sum": 0.0}
    d = (actor_logp - rollout_logp)[m]
    w = torch.exp(d)
    return {
        "mismatch_abs_sum": d.abs().sum(), "mismatch_abs_max": d.abs().max(),
        "mismatch_kl_sum": (w - d - 1).sum(), "is_weight_sum": w.sum(), "is_weight_max": w.max(),
        "is_weight_negmin_max": (-w).max(),
    }

"""The actor's update: its loss over a `TrainBatch`, and `--updates-per-rollout` optimizer steps."""

from __future__ import annotations

import torch

from megarl.algorithms import OFF_POLICY_CORRECTIONS, POLICY_LOSSES, aggregate, grpo_token_loss
from megarl.algorithms.distill import topk_reverse_kl_from_logprobs
from megarl.config import AlgorithmConfig, Config
from megarl.mcore.actor import ActorLoss, MegatronPolicy
from megarl.samples import TrainBatch
from megarl.stages.mismatch import mismatch_metrics  # also importable from here, as before


def make_loss_fn(a: AlgorithmConfig, max_response_len: int, cfg: Config | None = None):
    """The actor's `loss_fn(logp, micro_batch)` for `MegatronPolicy.train_step`: the registered policy loss,
    KL and entropy terms per token (`grpo_token_loss`), with --distill-topk the top-K KL to the teacher weighted by
    --distill-coef (`megarl.algorithms.distill`), aggregated as `--loss-aggregation` says, with the step's
    metrics as sums (divided once all ranks are summed, `megarl.stages.report`). The policy loss and the
    off-policy correction each get their own options from `cfg` (their defaults without it)."""
    kl_coef = 0.0 if a.kl_in_reward else a.kl_coef  # folded into the reward instead (`megarl.stages.algorithm`)
    loss_options = POLICY_LOSSES.kwargs_of(cfg, a.policy_loss)
    correction_options = OFF_POLICY_CORRECTIONS.kwargs_of(cfg, a.off_policy_correction)
    topk = a.distill_topk > 0

    def loss_fn(logp: torch.Tensor, mb: dict):
        n = mb["_real_rows"]
        logp, mask = logp[:n], mb["loss_mask"][:n]
        old = mb["old_logp"][:n] if "old_logp" in mb else logp.detach()
        ref = mb["ref_logp"][:n] if "ref_logp" in mb else None
        rollout_logp = mb["rollout_logp"][:n]
        entropy = mb["entropy"][:n] if "entropy" in mb else None
        per_token, m = grpo_token_loss(
            logp, old, ref, mb["advantages"][:n], mask, a.eps_clip, a.eps_clip_high, kl_coef, a.kl_estimator,
            a.policy_loss, rollout_logp=rollout_logp, off_policy_correction=a.off_policy_correction,
            correction_options=correction_options, entropy=entropy, entropy_coef=a.entropy_coef, **loss_options,
        )
        if topk:  # on-policy distillation's top-K KL, a term of the loss in the student's distribution
            kl = topk_reverse_kl_from_logprobs(mb["topk_logp"][:n], mb["teacher_topk_logp"][:n], mask)
            per_token = per_token + a.distill_coef * kl
        num, den = aggregate(per_token, mask, a.loss_aggregation, max_len=max_response_len)
        tokens = mask.sum()
        metrics = {
            "loss_num": num.detach(), "loss_den": den.detach(), "tokens": tokens,
            "clip_frac_sum": m["clip_frac"] * tokens, "kl_sum": m.get("kl_mean", 0.0) * tokens,
            "entropy_sum": m.get("entropy_mean", 0.0) * tokens,
            **mismatch_metrics(logp.detach(), rollout_logp, mask),
        }
        if topk:
            metrics["distill_topk_kl_sum"] = torch.where(mask.bool(), kl.detach(), torch.zeros_like(kl)).sum()
            metrics["distill_topk_tokens"] = tokens
        if (c := a.off_policy_correction) != "none":  # its weights: the keys of `megarl.stages.report`
            metrics[f"{c}_tokens"] = tokens
            metrics[f"{c}_weight_sum"] = m[f"{c}_weight_mean"] * tokens
            metrics[f"{c}_weight_max"] = m[f"{c}_weight_max"]
            metrics[f"{c}_clip_sum"] = m[f"{c}_clip_frac"] * tokens
            metrics[f"{c}_masked_sum"] = m[f"{c}_masked_frac"] * tokens
        return num, den, metrics

    # the entropy is reported every step; differentiated only when there is an entropy bonus
    return ActorLoss(loss_fn, needs_entropy=True, entropy_grad=a.entropy_coef != 0, needs_topk=topk)


def update(actor: MegatronPolicy, batch: TrainBatch, cfg: Config) -> dict[str, float]:
    """`--updates-per-rollout` optimizer steps over consecutive slices of this rank's batch."""
    a, t, r = cfg.algorithm, cfg.training, cfg.rollout
    tensors, k = batch.tensors(), t.updates_per_rollout
    rows = batch.tokens.shape[0]
    if rows % k:
        raise ValueError(f"{rows} samples per rank cannot be split into --updates-per-rollout {k} mini-batches")
    size = rows // k
    totals: dict[str, float] = {}
    loss_fn = make_loss_fn(a, r.max_response_len, cfg)
    for i in range(k):
        mini = {key: v[i * size : (i + 1) * size] for key, v in tensors.items()}
        out = actor.train_step(mini, loss_fn, micro_batch_size=t.micro_batch_size, temperature=r.rollout_temperature,
                               max_tokens_per_micro_batch=t.max_tokens_per_micro_batch)
        for key, v in out.items():
            totals[key] = max(totals.get(key, v), v) if key.endswith("_max") else totals.get(key, 0.0) + v
    totals["grad_norm"] /= k
    totals["lr"] = out["lr"]
    return totals

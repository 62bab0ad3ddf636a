"""Per-token policy losses, KL estimators and loss aggregation for GRPO-style training.

Pure tensor functions over one micro-batch. Shapes: `B` sequences (completions) by `T` completion tokens;
`logp`, `old_logp`, `ref_logp` are log-probs of the sampled tokens under the current actor, the actor that
produced the rollout (or the one before this update) and the frozen reference; `mask` is true (or 1) for the
completion tokens that count. Masked-out positions may hold anything finite or not (padding): they are kept
out of every exp(), give 0 loss and 0 gradient.

Two registries, one signature each: policy losses (`@register_policy_loss`, `POLICY_LOSSES`) and KL
estimators (`@register_kl`, `KL_ESTIMATORS`); the third slot of the per-token loss, rollout corrections, has its
own module (`megarl.algorithms.corrections`). `aggregate` returns a (numerator, denominator) pair instead of a
mean, so that means are taken once over the whole optimizer step (see its docstring).
"""

from __future__ import annotations

from typing import Callable, Literal, Protocol

import torch
from torch import Tensor

from megarl.algorithms import slots
from megarl.algorithms.corrections import OFF_POLICY_CORRECTIONS
from megarl.registry import Registry

AggregationMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGGREGATION_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                      "seq-mean-token-sum-norm")


class PolicyLossFn(Protocol):
    """`options` carries the loss's own settings, the fields of the options it declares (`dual_clip`'s
    `clip_ratio_c`); a loss ignores any other."""

    def __call__(
        self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float, clip_high: float,
        **options,
    ) -> tuple[Tensor, dict[str, float]]: ...


KLFn = Callable[[Tensor, Tensor], Tensor]

# The registries, and the built-ins' options (`dual_clip`'s `--clip-ratio-c`), live in `megarl.algorithms.slots`.
POLICY_LOSSES: Registry[PolicyLossFn] = slots.POLICY_LOSSES
KL_ESTIMATORS: Registry[KLFn] = slots.KL_ESTIMATORS  # `fn(logp, ref_logp) -> Tensor`, per token

register_policy_loss = POLICY_LOSSES.register
register_kl = KL_ESTIMATORS.register


# KL(actor || reference) estimators from samples of the actor (Schulman, "Approximating KL divergence", 2020).
# With d = ref_logp - logp per sampled token: k1 = -d (unbiased, high variance, can be negative),
# k2 = d^2 / 2 (biased, low variance), k3 = exp(d) - d - 1 (unbiased, low variance, always >= 0).


@register_kl("k1")
def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token `logp - ref_logp`. Shapes: any, same for both; result has that shape."""
    return logp - ref_logp


@register_kl("k2")
def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token `0.5 * (logp - ref_logp)^2`. Shapes: any, same for both; result has that shape."""
    return 0.5 * (logp - ref_logp).square()


@register_kl("k3")
def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token `exp(ref_logp - logp) - (ref_logp - logp) - 1`, the estimator of GRPO and TRL.
    Shapes: any, same for both; result has that shape."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def _per_token_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    """Broadcast one advantage per sequence ([B]) to its tokens ([B, T]); [B, T] passes through."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    if advantages.dim() != 2 or advantages.shape[0] != like.shape[0]:
        raise ValueError(f"advantages must be [B] or [B, T] for log-probs {tuple(like.shape)}, "
                         f"got {tuple(advantages.shape)}")
    return advantages.expand_as(like)


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    """Mean over masked positions as a float; 0.0 when nothing is masked in (an all-padding micro-batch)."""
    return float((values * mask).sum() / mask.sum().clamp(min=1))


def _clipped_surrogate(ratio: Tensor, adv: Tensor, mask: Tensor, clip_low: float,
                       clip_high: float) -> tuple[Tensor, dict[str, float]]:
    """`-min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A)` per token, 0 at masked positions, and the
    clipping metrics over masked tokens (see `policy_loss_clip`). Shapes: all [B, T]; `mask` bool."""
    clipped_ratio = ratio.clamp(1 - clip_low, 1 + clip_high)
    pg = -torch.minimum(ratio * adv, clipped_ratio * adv)
    with torch.no_grad():
        clipped_low = (ratio < 1 - clip_low) & (adv < 0)
        clipped_high = (ratio > 1 + clip_high) & (adv > 0)
        metrics = {
            "clip_frac": _masked_mean((clipped_low | clipped_high).float(), mask),
            "clip_frac_low": _masked_mean(clipped_low.float(), mask),
            "clip_frac_high": _masked_mean(clipped_high.float(), mask),
            "ratio_mean": _masked_mean(ratio, mask),
        }
    return torch.where(mask, pg, torch.zeros_like(pg)), metrics


@register_policy_loss("clip")
def policy_loss_clip(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    **options,
) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped surrogate, per token (Schulman et al. 2017; asymmetric "clip-higher" as in DAPO).

        ratio = exp(logp - old_logp)
        pg    = -min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A)

    Shapes: logp, old_logp, mask [B, T]; advantages [B] (broadcast over tokens) or [B, T].
    Returns the per-token loss [B, T] (0 at masked positions) and float metrics over masked tokens:
    `clip_frac` (share of tokens where the clipped branch is taken, so the token gives no gradient; split into
    `clip_frac_low`, A < 0 with ratio < 1 - clip_low, and `clip_frac_high`, A > 0 with ratio > 1 + clip_high)
    and `ratio_mean`.
    """
    mask = mask.bool()
    adv = _per_token_advantages(advantages, logp)
    # Masking the log-ratio (not just the loss) keeps padding out of exp(): inf * 0 would be NaN in the
    # forward pass and in the gradient.
    ratio = torch.exp(torch.where(mask, logp - old_logp, torch.zeros_like(logp)))
    return _clipped_surrogate(ratio, adv, mask, clip_low, clip_high)


@register_policy_loss("dual_clip")
def policy_loss_dual_clip(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    **options,
) -> tuple[Tensor, dict[str, float]]:
    """Dual-clip PPO (Ye et al. 2020): PPO clip, and for negative advantages the loss is also capped at
    `-clip_ratio_c * A`, so a token whose ratio has exploded (ratio >> 1 with A < 0) cannot dominate the update.

        pg      = -min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A)
        pg_dual = min(pg, -clip_ratio_c * A)    where A < 0;   pg elsewhere

    `clip_ratio_c` must be > 1. Shapes and metrics as `policy_loss_clip`, plus `clip_frac_dual` (tokens where
    the cap is taken; they give no gradient).
    """
    if clip_ratio_c <= 1:
        raise ValueError(f"dual-clip needs clip_ratio_c > 1, got {clip_ratio_c}")
    pg, metrics = policy_loss_clip(logp, old_logp, advantages, mask, clip_low, clip_high)
    mask = mask.bool()
    adv = _per_token_advantages(advantages, logp)
    cap = -clip_ratio_c * adv
    capped = (adv < 0) & (pg > cap) & mask
    pg = torch.where(capped, cap, pg)
    metrics["clip_frac_dual"] = _masked_mean(capped.float(), mask)
    return torch.where(mask, pg, torch.zeros_like(pg)), metrics


@register_policy_loss("gspo")
def policy_loss_gspo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    **options,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025): one importance ratio per *sequence*, the geometric mean of its token ratios,

        s_i = exp( mean_{t in mask_i} (logp[i, t] - old_logp[i, t]) )

    clipped as in PPO (GSPO's ranges are ~1e-4, far tighter than token-level PPO's). Written per token in the
    "GSPO-token" form, ratio_t = sg(s_i) * exp(logp_t - sg(logp_t)): its value is s_i on every token and its
    gradient is s_i * grad(logp_t), so with per-sequence token-mean aggregation the update is exactly GSPO's
    s_i * A_i * mean_t grad(logp_t). Shapes and metrics as `policy_loss_clip`.
    """
    mask = mask.bool()
    adv = _per_token_advantages(advantages, logp)
    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp))
    counts = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    seq_log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / counts).detach()
    safe = torch.where(mask, logp, torch.zeros_like(logp))  # padding may hold -inf: inf - inf would be NaN
    ratio = torch.exp(seq_log_ratio + safe - safe.detach())
    ratio = torch.where(mask, ratio, torch.ones_like(ratio))
    return _clipped_surrogate(ratio, adv, mask, clip_low, clip_high)


@register_policy_loss("cispo")
def policy_loss_cispo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    **options,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, Chen et al. 2025, eq. 4; slime's `cispo`): clip the importance weight, not the update.
    Every token keeps its gradient, scaled by its clipped, stop-gradient ratio,

        ratio = exp(logp - old_logp),    w = sg(clamp(ratio, 1 - clip_low, 1 + clip_high))
        loss  = -w * A * log pi(token)   (gradient -w * A * grad logp)

    where PPO's clip zeroes the gradient of a token outside the trust region (often the rare "However", "Wait"
    tokens a long reasoning chain forks at). Written `-w * A * exp(logp - sg(logp))`: the same gradient, and a
    value of -w * A, on the scale of PPO's. slime's `compute_cispo_loss` (THUDM/slime 624b824,
    `slime/utils/ppo_utils.py`) writes `-sg(clamp(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * logp`: the same
    ratio (exp(logp - old)), bounds and gradient, and a value scaled by logp (tests/unit/test_rollout_corrections.py
    compares the gradients). The paper sets no lower bound (a large epsilon_low, here `--eps-clip` >= 1; slime
    warns below 1) and tunes only `--eps-clip-high`. Shapes as `policy_loss_clip`; metrics `clip_frac` (share
    of tokens whose weight was clipped; they still give a gradient), `clip_frac_low`, `clip_frac_high`,
    `ratio_mean`.
    """
    mask = mask.bool()
    adv = _per_token_advantages(advantages, logp)
    ratio = torch.exp(torch.where(mask, logp - old_logp, torch.zeros_like(logp)))
    weight = ratio.clamp(1 - clip_low, 1 + clip_high).detach()
    safe = torch.where(mask, logp, torch.zeros_like(logp))  # padding may hold -inf
    pg = -weight * adv * torch.exp(safe - safe.detach())
    with torch.no_grad():
        low, high = ratio < 1 - clip_low, ratio > 1 + clip_high
        metrics = {"clip_frac": _masked_mean((low | high).float(), mask),
                   "clip_frac_low": _masked_mean(low.float(), mask),
                   "clip_frac_high": _masked_mean(high.float(), mask), "ratio_mean": _masked_mean(ratio, mask)}
    return torch.where(mask, pg, torch.zeros_like(pg)), metrics


def grpo_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_coef: float = 0.0,
    kl_type: str = "k3",
    policy_loss: str = "clip",
    *,
    rollout_logp: Tensor | None = None,
    off_policy_correction: str = "none",
    is_cap: float = 0.0,
    correction_options: dict | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    **options,
) -> tuple[Tensor, dict[str, float]]:
    """The per-token loss of GRPO-style training: `l_t = w_t * pg_t + kl_coef * kl_t - entropy_coef * H_t`, 0 at
    masked positions.

    `pg_t` is the registered policy loss `policy_loss` (PPO clip by default; `options` go to it: its own options,
    `POLICY_LOSSES.kwargs_of(cfg, name)`, e.g. `clip_ratio_c`), `kl_t` the registered KL estimator `kl_type` of
    KL(actor || reference). As in TRL (without its `use_bias_correction_kl`), the KL term is added per token
    before aggregation, so it is normalised exactly like the policy term. `ref_logp` may be None only when
    `kl_coef == 0` (no reference model is run then).
    `w_t` is the registered off-policy correction `off_policy_correction` (`megarl.algorithms.corrections`; "none"
    gives w_t = 1), computed against `rollout_logp`, the behaviour policy's log-probs (required unless "none"), with
    `correction_options` its keyword arguments (`OFF_POLICY_CORRECTIONS.kwargs_of(cfg, name)`); without them,
    `is_cap` is the cap of "tis":

        l_t = min(exp(old_t - behav_t), is_cap) * pg_t(ratio = exp(logp_t - old_t)).

    `old_logp` being the actor before the update (the proximal policy), not the engine's log-probs, this is also
    AReaL's decoupled PPO objective (Fu et al. 2025, eq. 5). (AReaL's code drops a token whose weight exceeds the
    cap; "tis" truncates it, "mis" at level token drops it.) The older spellings (`--tis-cap C` alone,
    `--off-policy-correction decoupled`) are resolved by tis's options (`megarl.algorithms.slots`), once; this
    function takes the correction by name only.
    `entropy` [B, T] is the actor's per-token entropy (differentiable); with `entropy_coef > 0` it is a bonus
    (subtracted from the loss); it is reported whenever given.

    Shapes: logp, old_logp, ref_logp, rollout_logp, entropy, mask [B, T]; advantages [B] or [B, T]. Returns the
    per-token loss [B, T] and float metrics (those of the policy loss, `kl_mean` over masked tokens when
    `ref_logp` is given, `entropy_mean` when `entropy` is, the weights' `<correction>_weight_mean`, `_weight_max`,
    `_clip_frac` and `_masked_frac` when a correction is on).
    """
    mask = mask.bool()
    if "tis_cap" in options:  # the policy losses take **options: a stale call would silently lose its weights
        raise TypeError("grpo_token_loss takes off_policy_correction='tis', is_cap=C, not tis_cap")
    correct = OFF_POLICY_CORRECTIONS.get(off_policy_correction)
    per_token, metrics = POLICY_LOSSES.get(policy_loss)(logp, old_logp, advantages, mask, clip_low, clip_high,
                                                         **options)
    zero = torch.zeros_like(logp)
    if off_policy_correction != "none":
        if rollout_logp is None:
            raise ValueError(f"off-policy correction {off_policy_correction!r} needs the rollout engine's log-probs")
        options = {"cap": is_cap} if correction_options is None else correction_options
        weights, is_metrics = correct(old_logp.detach(), rollout_logp, mask, **options)
        per_token = per_token * weights
        metrics.update(is_metrics)
    if entropy is not None:
        metrics["entropy_mean"] = _masked_mean(entropy.detach(), mask)
        if entropy_coef != 0:
            per_token = per_token - entropy_coef * torch.where(mask, entropy, zero)
    elif entropy_coef != 0:
        raise ValueError(f"entropy_coef={entropy_coef} needs the per-token entropy, got entropy=None")
    if ref_logp is None:
        if kl_coef != 0:
            raise ValueError(f"kl_coef={kl_coef} needs reference log-probs, got ref_logp=None")
        return torch.where(mask, per_token, zero), metrics

    # Both arguments are zeroed at padding so that the KL there is exactly 0 with a finite gradient.
    kl = KL_ESTIMATORS.get(kl_type)(torch.where(mask, logp, zero), torch.where(mask, ref_logp, zero))
    metrics["kl_mean"] = _masked_mean(kl.detach(), mask)
    if kl_coef != 0:
        per_token = per_token + kl_coef * kl
    return torch.where(mask, per_token, zero), metrics


def aggregate(per_token_loss: Tensor, mask: Tensor, mode: AggregationMode = "token-mean",
              max_len: int | None = None) -> tuple[Tensor, Tensor]:
    """Reduce a per-token loss [B, T] to a (numerator, denominator) pair of scalar tensors.

        token-mean:               num = sum_{i,t} l[i,t] m[i,t]                       den = sum_{i,t} m[i,t]
        seq-mean-token-mean:      num = sum_i (sum_t l[i,t] m[i,t] / sum_t m[i,t])    den = B
        seq-mean-token-sum:       num = sum_{i,t} l[i,t] m[i,t]                       den = B
        seq-mean-token-sum-norm:  num = sum_{i,t} l[i,t] m[i,t]                       den = B * max_len

    The loss of an optimizer step is sum(numerators) / sum(denominators), summed over all micro-batches and
    data-parallel ranks, divided once. Averaging per-micro-batch means instead would weight a token by the size
    of the micro-batch it landed in. "token-mean" over the whole step is TRL's default `dapo` loss (and DAPO's
    token-level loss); "seq-mean-token-mean" is TRL's `grpo` loss (the GRPO paper's 1/G sum_i 1/|o_i| sum_t);
    "seq-mean-token-sum-norm" is Dr. GRPO's constant normaliser (TRL's `dr_grpo`: `max_len` is the configured
    maximum response length, a constant, not the realised one), so no sequence's tokens are up- or down-weighted
    by its length. A sequence with no masked-in token adds 0 to the numerator and still counts in the per-sequence
    denominators, as in TRL. Gradients flow through the numerator only; the denominator is a count.
    """
    mask = mask.bool()
    masked = torch.where(mask, per_token_loss, torch.zeros_like(per_token_loss))
    counts = mask.sum(dim=-1).to(per_token_loss.dtype)

    def count(x: float) -> Tensor:
        return torch.tensor(float(x), dtype=per_token_loss.dtype, device=per_token_loss.device)

    rows = mask.shape[0]
    if mode == "token-mean":
        return masked.sum(), counts.sum()
    if mode == "seq-mean-token-mean":
        return (masked.sum(dim=-1) / counts.clamp(min=1)).sum(), count(rows)
    if mode == "seq-mean-token-sum":
        return masked.sum(), count(rows)
    if mode == "seq-mean-token-sum-norm":
        if not max_len or max_len <= 0:
            raise ValueError("seq-mean-token-sum-norm needs max_len, the configured maximum response length")
        return masked.sum(), count(rows * max_len)
    raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGGREGATION_MODES)}")

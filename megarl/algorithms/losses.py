"""Per-token policy losses, KL estimators and loss aggregation for GRPO-style training.

Pure tensor functions over one micro-batch. Shapes: `B` sequences (completions) by `T` completion tokens;
`logp`, `old_logp`, `ref_logp` are log-probs of the sampled tokens under the current actor, the actor that
produced the rollout (or the one before this update) and the frozen reference; `mask` is true (or 1) for the
completion tokens that count. Masked-out positions may hold anything finite or not (padding): they are kept
out of every exp(), give 0 loss and 0 gradient.

Two registries, one signature each: policy losses (`@register_policy_loss`, `get_policy_loss_fn`) and KL
estimators (`@register_kl`, `get_kl_fn`). `aggregate` returns a (numerator, denominator) pair instead of a
mean, so that means are taken once over the whole optimizer step (see its docstring).
"""

from __future__ import annotations

from typing import Callable, Literal, Protocol

import torch
from torch import Tensor

from megarl.registry import Registry

AggregationMode = Literal["token-mean", "seq-mean-token-mean"]
AGGREGATION_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean")


class PolicyLossFn(Protocol):
    def __call__(
        self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float, clip_high: float
    ) -> tuple[Tensor, dict[str, float]]: ...


KLFn = Callable[[Tensor, Tensor], Tensor]

_POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
_KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a per-token policy loss under `name`."""
    return _POLICY_LOSSES.register(name)


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered as `name`; an unknown name raises ValueError listing the valid ones."""
    return _POLICY_LOSSES.get(name)


def register_kl(name: str) -> Callable[[KLFn], KLFn]:
    """Register a per-token KL estimator `fn(logp, ref_logp) -> Tensor` under `name`."""
    return _KL_ESTIMATORS.register(name)


def get_kl_fn(name: str) -> KLFn:
    """The KL estimator registered as `name`; an unknown name raises ValueError listing the valid ones."""
    return _KL_ESTIMATORS.get(name)


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


@register_policy_loss("clip")
def policy_loss_clip(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
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
) -> tuple[Tensor, dict[str, float]]:
    """The GRPO per-token loss: `l_t = pg_t + kl_coef * kl_t`, 0 at masked positions.

    `pg_t` is the registered policy loss `policy_loss` (PPO clip by default), `kl_t` the registered KL
    estimator `kl_type` of KL(actor || reference). As in TRL (without its `use_bias_correction_kl`), the KL term
    is added per token before aggregation, so it is normalised exactly like the policy term.
    `ref_logp` may be None only when `kl_coef == 0` (no reference model is run then).

    Shapes: logp, old_logp, ref_logp, mask [B, T]; advantages [B] or [B, T]. Returns the per-token loss [B, T]
    and float metrics (those of the policy loss, plus `kl_mean` over masked tokens when `ref_logp` is given).
    """
    mask = mask.bool()
    per_token, metrics = get_policy_loss_fn(policy_loss)(logp, old_logp, advantages, mask, clip_low, clip_high)
    if ref_logp is None:
        if kl_coef != 0:
            raise ValueError(f"kl_coef={kl_coef} needs reference log-probs, got ref_logp=None")
        return per_token, metrics

    zero = torch.zeros_like(logp)
    # Both arguments are zeroed at padding so that the KL there is exactly 0 with a finite gradient.
    kl = get_kl_fn(kl_type)(torch.where(mask, logp, zero), torch.where(mask, ref_logp, zero))
    metrics["kl_mean"] = _masked_mean(kl.detach(), mask)
    if kl_coef != 0:
        per_token = per_token + kl_coef * kl
    return per_token, metrics


def aggregate(per_token_loss: Tensor, mask: Tensor, mode: AggregationMode = "token-mean") -> tuple[Tensor, Tensor]:
    """Reduce a per-token loss [B, T] to a (numerator, denominator) pair of scalar tensors.

        token-mean:           numerator = sum_{i,t} l[i,t] m[i,t]                 denominator = sum_{i,t} m[i,t]
        seq-mean-token-mean:  numerator = sum_i (sum_t l[i,t] m[i,t] / sum_t m[i,t])   denominator = B

    The loss of an optimizer step is sum(numerators) / sum(denominators), summed over all micro-batches and
    data-parallel ranks, divided once. Averaging per-micro-batch means instead would weight a token by the size
    of the micro-batch it landed in. "token-mean" over the whole step is TRL's default `dapo` loss (and DAPO's
    token-level loss); "seq-mean-token-mean" is TRL's `grpo` loss (the GRPO paper's 1/G sum_i 1/|o_i| sum_t).
    A sequence with no masked-in token adds 0 to the numerator and still counts in the seq-mean denominator,
    as in TRL. Gradients flow through the numerator only; the denominator is a count.
    """
    mask = mask.bool()
    masked = torch.where(mask, per_token_loss, torch.zeros_like(per_token_loss))
    counts = mask.sum(dim=-1).to(per_token_loss.dtype)
    if mode == "token-mean":
        return masked.sum(), counts.sum()
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=-1) / counts.clamp(min=1)
        return per_seq.sum(), torch.tensor(float(mask.shape[0]), dtype=per_token_loss.dtype,
                                           device=per_token_loss.device)
    raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGGREGATION_MODES)}")

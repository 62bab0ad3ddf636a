"""Rollout corrections: per-token weights that account for the rollout engine sampling from a distribution that is
not quite the trainer's (other kernels, other precision, older weights).

Pure tensor functions over one micro-batch, one registry (`@register_correction`, `OFF_POLICY_CORRECTIONS`), one
signature: `fn(old_logp, rollout_logp, mask, **options) -> (weights, metrics)`. `old_logp` [B, T] are the trainer's
log-probs of the sampled tokens before the update (the proximal policy; the current actor, detached, when no
separate pass computes them), `rollout_logp` [B, T] the engine's, `mask` [B, T] the tokens that count. The
per-token ratio is

    r_t = exp(old_logp_t - rollout_logp_t)       (trainer over engine; masked-out positions never enter exp())

and a sequence's log-ratio `s_i = sum_{t in mask_i} log r_t`. `weights` [B, T] carry no gradient and multiply the
policy loss per token (`megarl.algorithms.losses.grpo_token_loss`); they are 1 at masked-out positions. A token or
sequence a correction *drops* gets weight 0: its loss and gradient are 0, and it still counts in the loss's
denominator, as in TRL's `*_mask` modes and IcePop's `M(k) = 0` inside its 1/|y| sum (verl instead removes rejected
tokens from the denominator; with token-mean aggregation that rescales the step by the kept share).

The sources read, and re-derived in tests/unit/test_rollout_corrections.py (commits as read):
TRL huggingface/trl f2cd577 (`trl/trainer/grpo_trainer.py`, `vllm_importance_sampling_mode`; ratio
exp(old - rollout), `*_mask` multiply the per-token loss by 0, the denominator unchanged); verl volcengine/verl
b178a3c (`verl/trainer/ppo/rollout_corr_helper.py`, presets in `verl/trainer/config/algorithm.py`,
`docs/algo/rollout_corr.md`; rejection edits the response mask, so the denominator too, and log-ratios are
clamped to [-20, 20], which matters only for a log-ratio beyond that); slime THUDM/slime 624b824
(`slime/backends/megatron_utils/loss.py` `icepop_function`); IcePop: Ring-1T, arXiv 2510.18855, and
https://ringtech.notion.site/icepop.

Every correction reports, over masked-in tokens: `<name>_weight_mean`, `<name>_weight_max`, `<name>_clip_frac`
(share whose weight was truncated) and `<name>_masked_frac` (share dropped: weight 0).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from megarl.algorithms import slots
from megarl.registry import Registry


class CorrectionFn(Protocol):
    def __call__(self, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor,
                 **options) -> tuple[Tensor, dict[str, float]]: ...


# The registry, and the built-ins' options (`--tis-cap`, `--mis-low`, ...: each correction's keyword arguments), live
# in `megarl.algorithms.slots`; `register_correction(name, options=...)` declares a plugin's.
OFF_POLICY_CORRECTIONS: Registry[CorrectionFn] = slots.OFF_POLICY_CORRECTIONS
register_correction = OFF_POLICY_CORRECTIONS.register


def _log_ratio(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> Tensor:
    """log r_t at masked-in positions, 0 elsewhere (padding may hold -inf or nan)."""
    return torch.where(mask, old_logp - rollout_logp, torch.zeros_like(old_logp))


def _metrics(name: str, w: Tensor, mask: Tensor, truncated: Tensor, dropped: Tensor) -> dict[str, float]:
    n = mask.sum().clamp(min=1)
    return {
        f"{name}_weight_mean": float((w * mask).sum() / n),
        f"{name}_weight_max": float(torch.where(mask, w, torch.zeros_like(w)).max()) if mask.any() else 0.0,
        f"{name}_clip_frac": float((truncated & mask).sum() / n),
        f"{name}_masked_frac": float((dropped & mask).sum() / n),
    }


def _band(name: str, low: float, high: float) -> None:
    if not (0 <= low < high):
        raise ValueError(f"off-policy correction {name!r} needs 0 <= low < high, got low={low}, high={high}")


@register_correction("none")
def no_correction(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, **options) -> tuple[Tensor, dict]:
    """w_t = 1: the engine's samples are taken as the trainer's own."""
    return torch.ones_like(old_logp), {}


@register_correction("tis")
def truncated_is_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float,
                         name: str = "tis") -> tuple[Tensor, dict]:
    """Token-level truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"; verl's `rollout_is: token`, TRL's `token_truncate`):

        w_t = min(r_t, cap)

    With `old_logp` the actor before the update (not the engine's log-probs) this is also AReaL's decoupled PPO
    objective (Fu et al. 2025, eq. 5). Shapes: [B, T] each. Metrics as the module docstring says.
    """
    if not cap > 0:
        raise ValueError(f"off-policy correction {name!r} needs a weight cap > 0, got {cap}")
    mask = mask.bool()
    with torch.no_grad():
        raw = torch.exp(_log_ratio(old_logp, rollout_logp, mask))
        w = raw.clamp(max=cap)
        metrics = _metrics(name, w, mask, raw > cap, torch.zeros_like(mask))
    return torch.where(mask, w, torch.ones_like(w)), metrics


@register_correction("seq_tis")
def sequence_truncated_is_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor,
                                  cap: float) -> tuple[Tensor, dict]:
    """Sequence-level truncated importance sampling (verl's `seq_is` preset, `rollout_is: sequence`; TRL's
    `sequence_truncate`): one weight per sequence, the product of its token ratios, truncated, on every token,

        w_i = min(exp(s_i), cap) = min(prod_{t in mask_i} r_t, cap)

    Unbiased below the cap for a sequence-level objective (the sequence is what was sampled), at the price of a
    variance that grows with length; `cap` ~2-10 (verl). TRL's `sequence_truncate` is this (with an optional
    floor, `vllm_importance_sampling_clip_min`, not taken here); verl's `rollout_is: sequence` clamps s_i to
    [-20, 20] before exp(), which differs from this only for a weight below 2e-9. Shapes: [B, T] each.
    """
    if not cap > 0:
        raise ValueError(f"off-policy correction 'seq_tis' needs a weight cap > 0, got {cap}")
    mask = mask.bool()
    with torch.no_grad():
        raw = torch.exp(_log_ratio(old_logp, rollout_logp, mask).sum(dim=-1, keepdim=True)).expand_as(old_logp)
        w = raw.clamp(max=cap)  # exp() may overflow to inf for a long sequence: inf.clamp(max=cap) is cap
        metrics = _metrics("seq_tis", w, mask, raw > cap, torch.zeros_like(mask))
    return torch.where(mask, w, torch.ones_like(w)), metrics


def _masked_ratio(name: str, ratio: Tensor, mask: Tensor, low: float, high: float) -> tuple[Tensor, dict]:
    """w = ratio inside [low, high], 0 outside (and 1 at padding)."""
    keep = (ratio >= low) & (ratio <= high)
    w = torch.where(keep, ratio, torch.zeros_like(ratio))
    metrics = _metrics(name, w, mask, torch.zeros_like(mask), ~keep)
    return torch.where(mask, w, torch.ones_like(w)), metrics


@register_correction("mis")
def masked_is_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, level: str, low: float,
                      high: float) -> tuple[Tensor, dict]:
    """Masked importance sampling (MIS; TRL's `token_mask` / `sequence_mask`, verl's `seq_mis` preset): the ratio
    as it is inside a band, and the token or sequence dropped when it leaves the band, instead of truncated:

        level "token":     w_t = r_t       if low <= r_t <= high,        else 0
        level "sequence":  w_t = exp(s_i)  if low <= exp(s_i) <= high,   else 0    (every token of sequence i)

    TRL's `*_mask` modes are exactly this (TRL's default `vllm_importance_sampling_clip_min` is None, low = 0
    here; its `clip_max` defaults to 3). verl's `decoupled_seq_is_rs(is_threshold=C, rs_threshold="L_U")` (default
    2.0 and "0.5_2.0", two-sided) weights a kept sequence min(exp(s_i), C) and rejects by `seq_sum_k1`, which
    reads its band on the inverse ratio pi_rollout / pi_old: verl's "L_U" is low = 1/U, high = 1/L here, and the
    weights agree when 1/L <= C. verl also removes rejected tokens from the denominator (see the module
    docstring). Truncation keeps a biased contribution of a sample the engine made far likelier than the trainer
    would; masking drops it (Liu, Li et al. 2025, "When speed kills stability"). Shapes: [B, T] each.
    """
    _band("mis", low, high)
    if level not in ("token", "sequence"):
        raise ValueError(f"off-policy correction 'mis' level must be token or sequence, got {level!r}")
    mask = mask.bool()
    with torch.no_grad():
        log_r = _log_ratio(old_logp, rollout_logp, mask)
        if level == "sequence":
            log_r = log_r.sum(dim=-1, keepdim=True).expand_as(log_r)
        return _masked_ratio("mis", torch.exp(log_r), mask, low, high)


@register_correction("geo_rs")
def geometric_rejection_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, low: float,
                                high: float) -> tuple[Tensor, dict]:
    """Geometric-mean rejection sampling (Geo-RS; verl's `decoupled_geo_rs()` preset, `rollout_rs: seq_mean_k1`,
    and `docs/algo/rollout_corr_math.md` section 3.3.3): a sequence is kept or rejected whole by the geometric mean
    of its token ratios, and kept sequences are not reweighted,

        g_i = exp(s_i / |mask_i|),     w_t = 1 if low <= g_i <= high, else 0

    The geometric mean does not grow with length as the product does, so one band fits short and long
    sequences; it is a per-token average, so the band is tight (verl's preset: "0.999_1.001"). The band is read
    on g_i, as verl's math document writes it; verl's code reads it on 1/g_i (`seq_mean_k1` bounds the mean of
    -log r_t), so its "L_U" is low = 1/U, high = 1/L here (the same rows for a band symmetric in log). verl
    removes a rejected sequence's tokens from the denominator; here they count with weight 0. Shapes: [B, T] each.
    """
    _band("geo_rs", low, high)
    mask = mask.bool()
    with torch.no_grad():
        counts = mask.sum(dim=-1, keepdim=True).clamp(min=1)
        g = torch.exp(_log_ratio(old_logp, rollout_logp, mask).sum(dim=-1, keepdim=True) / counts)
        keep = ((g >= low) & (g <= high)).expand_as(old_logp)
        w = keep.to(old_logp.dtype)
        metrics = _metrics("geo_rs", w, mask, torch.zeros_like(mask), ~keep)
    return torch.where(mask, w, torch.ones_like(w)), metrics


@register_correction("icepop")
def icepop_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, low: float,
                   high: float) -> tuple[Tensor, dict]:
    """IcePop (Ling team, "Small leak can sink a great ship", https://ringtech.notion.site/icepop, 2025; the
    Ring-1T report, arXiv 2510.18855, J_IcePop): token-level masking with a two-sided band, the calibration factor
    kept inside it,

        w_t = M(r_t; low, high),    M(k) = k if low <= k <= high, else 0,    r_t = pi_train / pi_infer at theta_old

    multiplying the PPO term of token t inside the paper's 1/|y_i| sum: a masked token's term is 0 and it still
    counts in |y_i| (the numerator only). slime's `icepop_function` is the same: ratio exp(old - rollout), kept
    (not clipped) inside [--tis-clip-low, --tis-clip], bounds inclusive, loss masks untouched. TRL runs it as
    `token_mask` with (C_min, C_max) = (alpha, beta) (its tests label (0.5, 5.0) IcePop; the defaults here).
    The same weights as `mis` at level token with that band: a registered name of its own so that a run says
    which published recipe it follows. Shapes: [B, T] each.
    """
    _band("icepop", low, high)
    mask = mask.bool()
    with torch.no_grad():
        return _masked_ratio("icepop", torch.exp(_log_ratio(old_logp, rollout_logp, mask)), mask, low, high)


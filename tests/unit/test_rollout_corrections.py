"""The rollout corrections (`seq_tis`, `mis`, `geo_rs`, `icepop`) and the CISPO policy loss against float64 hand
computations of their published formulas: loss and gradient, several seeds, once with the band wide enough that
nothing is dropped or truncated and once with it tight enough that some tokens or sequences are.

Expected values are computed elementwise on Python floats, never by calling the code under test.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from megarl.algorithms import OFF_POLICY_CORRECTIONS, aggregate, grpo_token_loss
from megarl.algorithms.slots import IcePopOptions, SeqTISOptions
from megarl.arguments import components, parse_args
from megarl.config import build_config
from megarl.errors import ConfigError

F64 = torch.float64
EPS_LOW, EPS_HIGH = 0.2, 0.28


def _batch(seed: int):
    """4 rows of 1-6 tokens: actor, proximal and behaviour log-probs as nested float lists (padding -inf), one
    advantage per row. The behaviour policy is 0-0.6 nats off the proximal one per token."""
    rng = random.Random(seed)
    lengths = [6, 3, 1, 5]
    mask = [[1 if j < n else 0 for j in range(6)] for n in lengths]
    prox = [[-rng.uniform(0.1, 3.0) for _ in range(6)] for _ in lengths]
    logp = [[p + rng.uniform(-0.4, 0.4) for p in row] for row in prox]
    behav = [[p + rng.uniform(-0.6, 0.6) for p in row] for row in prox]
    for i, row in enumerate(mask):
        for j, m in enumerate(row):
            if not m:
                logp[i][j], behav[i][j] = -math.inf, math.nan
    adv = [rng.uniform(-2, 2) for _ in lengths]
    return logp, prox, behav, adv, mask


def _hand_weights(name: str, opts: dict, prox, behav, mask):
    """The published weight of each masked-in token, on floats, from the formulas the docstrings quote."""
    out = []
    for i, row in enumerate(mask):
        idx = [j for j, m in enumerate(row) if m]
        logr = {j: prox[i][j] - behav[i][j] for j in idx}
        s = sum(logr.values())
        if name == "seq_tis":  # min(prod_t r_t, C)
            w = {j: min(math.exp(s), opts["cap"]) for j in idx}
        elif name == "mis" and opts["level"] == "sequence":  # r_seq inside the band, else 0
            r = math.exp(s)
            w = {j: r if opts["low"] <= r <= opts["high"] else 0.0 for j in idx}
        elif name in ("mis", "icepop"):  # M(k) = k inside [low, high], 0 outside, per token
            w = {j: math.exp(logr[j]) if opts["low"] <= math.exp(logr[j]) <= opts["high"] else 0.0 for j in idx}
        elif name == "geo_rs":  # keep (weight 1) iff the geometric mean exp(s / n) is inside the band
            g = math.exp(s / len(idx)) if idx else 1.0
            w = {j: 1.0 if opts["low"] <= g <= opts["high"] else 0.0 for j in idx}
        out.append(w)
    return out


def _hand_clip_loss(weights, logp, prox, adv, mask):
    """Token-mean of w_t * -min(r A, clip(r) A), r = exp(logp - prox), and its gradient in logp: -w A r where the
    unclipped branch is taken, 0 where the clipped one is."""
    n = sum(map(sum, mask))
    loss, grad = 0.0, [[0.0] * len(row) for row in mask]
    for i, w in enumerate(weights):
        for j, wt in w.items():
            r, a = math.exp(logp[i][j] - prox[i][j]), adv[i]
            loss += wt * -min(r * a, min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH) * a) / n
            clipped = (a > 0 and r > 1 + EPS_HIGH) or (a < 0 and r < 1 - EPS_LOW)
            grad[i][j] = 0.0 if clipped else -wt * a * r / n
    return loss, grad


def _row_ratios(prox, behav, mask):
    """Each row's product of token ratios and their geometric mean, on floats (to set a band some row leaves)."""
    logs = [[prox[i][j] - behav[i][j] for j, m in enumerate(row) if m] for i, row in enumerate(mask)]
    return [math.exp(sum(x)) for x in logs], [math.exp(sum(x) / len(x)) for x in logs]


# (name, options with nothing dropped or truncated, options where some are: from the rows' ratios, so that the
# largest leaves the band whatever the seed)
CASES = [
    ("seq_tis", {"cap": 1e6}, lambda seq, geo: {"cap": max(seq) * 0.9}),
    ("mis", {"level": "token", "low": 0.0, "high": 1e6}, lambda seq, geo: {"level": "token", "low": 0.8,
                                                                          "high": 1.25}),
    ("mis", {"level": "sequence", "low": 0.0, "high": 1e6},
     lambda seq, geo: {"level": "sequence", "low": min(seq) * 0.9, "high": max(seq) * 0.9}),
    ("geo_rs", {"low": 0.0, "high": 1e6}, lambda seq, geo: {"low": min(geo) * 0.999, "high": max(geo) * 0.999}),
    ("icepop", {"low": 0.0, "high": 1e6}, lambda seq, geo: {"low": 0.8, "high": 1.25}),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name, wide, tight", CASES)
def test_correction_loss_and_gradient_equal_the_published_formula(name, wide, tight, seed):
    logp, prox, behav, adv, mask = _batch(seed)
    m = torch.tensor(mask, dtype=torch.bool)
    for opts, triggered in ((wide, False), (tight(*_row_ratios(prox, behav, mask)), True)):
        lp = torch.tensor(logp, dtype=F64).requires_grad_()
        per_token, metrics = grpo_token_loss(
            lp, torch.tensor(prox, dtype=F64), None, torch.tensor(adv, dtype=F64), m, EPS_LOW, EPS_HIGH,
            rollout_logp=torch.tensor(behav, dtype=F64), off_policy_correction=name, correction_options=opts)
        num, den = aggregate(per_token, m, "token-mean")
        (num / den).backward()
        weights = _hand_weights(name, opts, prox, behav, mask)
        want_loss, want_grad = _hand_clip_loss(weights, logp, prox, adv, mask)
        torch.testing.assert_close(num / den, torch.tensor(want_loss, dtype=F64), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lp.grad, torch.tensor(want_grad, dtype=F64), rtol=1e-12, atol=1e-12)

        flat = [x for w in weights for x in w.values()]
        assert metrics[f"{name}_weight_mean"] == pytest.approx(sum(flat) / len(flat), rel=1e-12)
        assert metrics[f"{name}_weight_max"] == pytest.approx(max(flat), rel=1e-12)
        dropped, cut = metrics[f"{name}_masked_frac"], metrics[f"{name}_clip_frac"]
        if name == "seq_tis":
            assert dropped == 0 and (cut > 0) == triggered
            assert cut == pytest.approx(sum(x == opts["cap"] for x in flat) / len(flat))
        else:
            assert cut == 0 and (dropped > 0) == triggered
            assert dropped == pytest.approx(sum(x == 0 for x in flat) / len(flat))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clip_low, clip_high", [(10.0, 10.0), (1.0, 0.05), (0.02, 0.02)])
def test_cispo_loss_and_gradient_equal_the_published_formula(seed, clip_low, clip_high):
    """MiniMax-M1 eq. 4: J = sum_t sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A log pi(token), token-mean. The
    gradient of the loss in logp_t is -w_t A / N for every token, clipped or not; the loss value is -w_t A / N."""
    logp, prox, _, adv, mask = _batch(seed)
    m = torch.tensor(mask, dtype=torch.bool)
    lp = torch.tensor(logp, dtype=F64).requires_grad_()
    per_token, metrics = grpo_token_loss(lp, torch.tensor(prox, dtype=F64), None, torch.tensor(adv, dtype=F64), m,
                                         clip_low, clip_high, policy_loss="cispo")
    num, den = aggregate(per_token, m, "token-mean")
    (num / den).backward()
    n = sum(map(sum, mask))
    want_loss, want_grad, clipped = 0.0, [[0.0] * 6 for _ in mask], 0
    for i, row in enumerate(mask):
        for j, mm in enumerate(row):
            if mm:
                r = math.exp(logp[i][j] - prox[i][j])
                w = min(max(r, 1 - clip_low), 1 + clip_high)
                clipped += w != r
                want_loss += -w * adv[i] / n
                want_grad[i][j] = -w * adv[i] / n
    torch.testing.assert_close(num / den, torch.tensor(want_loss, dtype=F64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp.grad, torch.tensor(want_grad, dtype=F64), rtol=1e-12, atol=1e-12)
    assert metrics["clip_frac"] == pytest.approx(clipped / n)
    assert (clipped > 0) == (clip_high < 1), "the wide band clips nothing, the tight ones clip some tokens"
    assert all(g != 0 for row, mr in zip(lp.grad.tolist(), mask) for g, mm in zip(row, mr) if mm and adv), \
        "unlike PPO's clip, no token loses its gradient"


def test_each_correction_gets_its_own_options_and_checks_them():
    # The choices are the registry's (no second list), and each correction is called with its own options only.
    with pytest.raises(ConfigError, match="choose one of: " + ", ".join(OFF_POLICY_CORRECTIONS.names()) + r" \("):
        parse_args(["--off-policy-correction", "icepo"])
    cfg = build_config({"seq_tis_cap": 3.0}, components())
    assert {name: OFF_POLICY_CORRECTIONS.kwargs_of(cfg, name) for name in OFF_POLICY_CORRECTIONS.names()} == {
        "none": {}, "tis": {"cap": 0.0}, "seq_tis": {"cap": 3.0}, "mis": {"level": "sequence", "low": 0.0, "high": 2.0},
        "geo_rs": {"low": 0.999, "high": 1.001}, "icepop": {"low": 0.5, "high": 5.0}}
    with pytest.raises(ConfigError, match="--icepop-low and --icepop-high must satisfy 0 <= low < high, got 5.0"):
        IcePopOptions(icepop_low=5.0)
    with pytest.raises(ConfigError, match="--seq-tis-cap must be > 0, got 0"):
        SeqTISOptions(seq_tis_cap=0.0)
    with pytest.raises(ConfigError, match="--mis-level 'row' is not valid; choose one of: token, sequence"):
        parse_args(["--mis-level", "row"])


# Per-token log(pi_old / pi_rollout) of four rows, chosen so that an asymmetric band read on the ratio or on its
# inverse keeps different rows (geometric means 1.30, 0.71, 1.11, 1.06; products 1.69, 0.36, 1.11, 1.26).
VERL_ROWS = [[0.3, 0.225], [-0.4, -0.3, -0.33], [0.1], [0.05, -0.02, 0.3, -0.1]]


def _verl_keep(option: str, band: str, log_ratio: list[float]) -> bool:
    """verl's `compute_rollout_rejection_mask` (volcengine/verl b178a3c, verl/trainer/ppo/rollout_corr_helper.py),
    re-derived for its k1 options: the statistic is -log r per token (clamped to [-20, 20]), summed (`seq_sum_k1`)
    or averaged (`seq_mean_k1`) over the sequence, and kept iff log L <= statistic <= log U for a band "L_U"."""
    low, high = (float(x) for x in band.split("_"))
    k1 = [-min(max(x, -20.0), 20.0) for x in log_ratio]
    stat = sum(k1) if option == "seq_sum_k1" else sum(k1) / len(k1)
    return math.log(low) <= stat <= math.log(high)


@pytest.mark.parametrize("name, option, band, is_cap", [
    ("geo_rs", "seq_mean_k1", "0.6_1.2", None),  # verl's decoupled_geo_rs() preset shape (its default 0.999_1.001)
    ("mis", "seq_sum_k1", "0.6_1.2", 2.0),  # decoupled_seq_is_rs(is_threshold, rs_threshold) (default 2.0, 0.5_2.0)
])
def test_sequence_rejection_reproduces_verl_with_the_band_inverted(name, option, band, is_cap):
    """verl reads a k1 band "L_U" on pi_rollout / pi_old, the inverse of the ratio megarl (as TRL, IcePop and verl's
    own rollout_corr_math.md) bands: its "L_U" is megarl's [1/U, 1/L]. Taken literally, the same numbers keep other
    rows. verl's Seq-MIS weight is min(exp(s), C) on kept sequences, equal to megarl's exp(s) when 1/L <= C. verl
    then drops rejected tokens from the loss's denominator, megarl keeps them: verl's token-mean is megarl's
    numerator over the kept tokens only."""
    low, high = (float(x) for x in band.split("_"))
    width = max(map(len, VERL_ROWS))
    mask = [[1 if j < len(r) else 0 for j in range(width)] for r in VERL_ROWS]
    prox = [[-1.0 - 0.1 * j for j in range(width)] for _ in VERL_ROWS]
    behav = [[p - (r[j] if j < len(r) else 0.0) for j, p in enumerate(row)] for row, r in zip(prox, VERL_ROWS)]
    logp = [[p + 0.05 * ((i + j) % 3 - 1) for j, p in enumerate(row)] for i, row in enumerate(prox)]
    adv = [1.0, -0.5, 2.0, -1.5]
    m = torch.tensor(mask, dtype=torch.bool)
    opts = {"low": 1 / high, "high": 1 / low} | ({"level": "sequence"} if name == "mis" else {})

    keep = [_verl_keep(option, band, r) for r in VERL_ROWS]
    literal = OFF_POLICY_CORRECTIONS.get(name)(torch.tensor(prox, dtype=F64), torch.tensor(behav, dtype=F64), m,
                                               **opts | {"low": low, "high": high})[0]
    assert [bool(literal[i, 0] > 0) for i in range(len(VERL_ROWS))] != keep, "the band's reading must matter here"

    lp = torch.tensor(logp, dtype=F64).requires_grad_()
    per_token, _ = grpo_token_loss(lp, torch.tensor(prox, dtype=F64), None, torch.tensor(adv, dtype=F64), m,
                                   EPS_LOW, EPS_HIGH, rollout_logp=torch.tensor(behav, dtype=F64),
                                   off_policy_correction=name, correction_options=opts)
    num, _ = aggregate(per_token, m, "token-mean")
    num.backward()
    verl_w = [(min(math.exp(sum(r)), is_cap) if is_cap else 1.0) if k else 0.0 for r, k in zip(VERL_ROWS, keep)]
    kept = sum(len(r) for r, k in zip(VERL_ROWS, keep) if k)
    want_loss, want_grad = _hand_clip_loss([{j: w for j in range(len(r))} for r, w in zip(VERL_ROWS, verl_w)],
                                           logp, prox, adv, mask)
    n = sum(map(len, VERL_ROWS))
    # `_hand_clip_loss` divides by every masked-in token; verl's denominator counts the kept ones only.
    torch.testing.assert_close(num / kept, torch.tensor(want_loss * n / kept, dtype=F64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp.grad, torch.tensor(want_grad, dtype=F64) * n, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_cispo_gradient_equals_slimes_loss(seed):
    """slime's `compute_cispo_loss` (THUDM/slime 624b824, slime/utils/ppo_utils.py), re-derived: per token
    -sg(clamp(r, 1 - eps_clip, 1 + eps_clip_high)) * A * logp, r = exp(logp - old). Its gradient is megarl's; its
    value (scaled by logp) is not: megarl reports -w * A, on PPO's scale, so only the gradients are compared."""
    logp, prox, _, adv, mask = _batch(seed)
    m = torch.tensor(mask, dtype=torch.bool)
    ours, theirs = (torch.tensor(logp, dtype=F64).requires_grad_() for _ in range(2))
    old, a = torch.tensor(prox, dtype=F64), torch.tensor(adv, dtype=F64)[:, None].expand(-1, 6)
    per_token, _ = grpo_token_loss(ours, old, None, torch.tensor(adv, dtype=F64), m, 1.0, 0.05, policy_loss="cispo")
    num, den = aggregate(per_token, m, "token-mean")
    (num / den).backward()
    safe = torch.where(m, theirs, torch.zeros_like(theirs))
    w = torch.exp(safe - torch.where(m, old, torch.zeros_like(old))).clamp(1 - 1.0, 1 + 0.05).detach()
    (torch.where(m, -w * a * safe, torch.zeros_like(safe)).sum() / m.sum()).backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=1e-12)
    assert (w[m] == 1.05).any() and (w[m] < 1.05).any(), "some tokens clipped, some not"

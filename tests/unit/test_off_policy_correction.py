"""`--off-policy-correction tis`: against a hand computation and against AReaL's own decoupled PPO formula (the
clip taken against the proximal policy, the actor before the update, the term weighted by the truncated
proximal/behaviour ratio), its reduction to plain PPO-clip when the behaviour policy is the proximal one, and
`--off-policy-correction decoupled`, the former name of the same loss, resolved by the config into tis.

Expected values are computed elementwise on Python floats (or, for AReaL, by a re-implementation of its published
function), never by calling the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import OFF_POLICY_CORRECTIONS, aggregate, grpo_token_loss, policy_loss_clip
from megarl.arguments import components
from megarl.config import Config, build_config

F64 = torch.float64
EPS_LOW, EPS_HIGH, CAP = 0.2, 0.28, 5.0


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def hand_decoupled(logp, prox, behav, adv, mask, cap, eps_low, eps_high):
    """Per token, on floats: l = min(exp(prox - behav), cap) * -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
    with r = exp(logp - prox), and dl/dlogp = -w A r where the unclipped branch is taken, 0 where the clipped one
    is. Returns token-mean loss and its gradient over masked tokens, as nested lists."""
    n = sum(m for row in mask for m in row)
    loss, grad = 0.0, []
    for i, row in enumerate(mask):
        grad.append([])
        for j, m in enumerate(row):
            if not m:
                grad[i].append(0.0)
                continue
            a = adv[i]
            r = math.exp(logp[i][j] - prox[i][j])
            w = min(math.exp(prox[i][j] - behav[i][j]), cap)
            clipped_r = min(max(r, 1 - eps_low), 1 + eps_high)
            loss += w * -min(r * a, clipped_r * a) / n
            clipped = (a > 0 and r > 1 + eps_high) or (a < 0 and r < 1 - eps_low)
            grad[i].append(0.0 if clipped else -w * a * r / n)
    return loss, grad


def test_tis_loss_and_gradient_by_hand():
    # Row 0 (A = +1.5): ratios 1.0, 1.5 (clipped high), 0.9; weights 2, 8 -> truncated at 5, 0.5.
    # Row 1 (A = -0.7): ratios 0.5 (clipped low), 1.1, then a padding position holding -inf.
    prox = [[-1.0, -2.0, -0.5], [-1.2, -0.3, -1.0]]
    logp = [[-1.0, -2.0 + math.log(1.5), -0.5 + math.log(0.9)], [-1.2 + math.log(0.5), -0.3 + math.log(1.1), -math.inf]]
    behav = [[-1.0 - math.log(2.0), -2.0 - math.log(8.0), -0.5 - math.log(0.5)], [-1.2 - 0.4, -0.3 + 0.25, 0.0]]
    adv, mask = [1.5, -0.7], [[1, 1, 1], [1, 1, 0]]

    lp = t(logp).requires_grad_()
    per_token, m = grpo_token_loss(lp, t(prox), None, t(adv), torch.tensor(mask), EPS_LOW, EPS_HIGH,
                                   rollout_logp=t(behav), off_policy_correction="tis", is_cap=CAP)
    num, den = aggregate(per_token, torch.tensor(mask), "token-mean")
    (num / den).backward()

    want_loss, want_grad = hand_decoupled(logp, prox, behav, adv, mask, CAP, EPS_LOW, EPS_HIGH)
    torch.testing.assert_close(num / den, t(want_loss), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp.grad, t(want_grad), rtol=1e-12, atol=1e-12)
    assert lp.grad[0, 1] == 0 and lp.grad[1, 0] == 0, "the clipped tokens give no gradient"
    # Weights over the 5 tokens: 2, 5 (8 truncated), 0.5, exp(0.4), exp(-0.25).
    weights = [2.0, 5.0, 0.5, math.exp(0.4), math.exp(-0.25)]
    assert m["tis_weight_mean"] == pytest.approx(sum(weights) / 5, rel=1e-12)
    assert m["tis_weight_max"] == 5.0 and m["tis_clip_frac"] == pytest.approx(1 / 5)


def test_tis_with_one_update_per_rollout_weights_the_on_policy_gradient():
    # One update per rollout: the proximal policy is the actor itself (old = logp.detach(), ratio 1), so each
    # token's gradient is -w A / N with w = min(exp(logp - behav), cap), and no gradient flows through w.
    logp = [[-0.5, -1.0, -2.0]]
    behav = [[-0.5 - math.log(3.0), -1.0 - math.log(7.0), -2.0 + 0.3]]
    lp = t(logp).requires_grad_()
    per_token, _ = grpo_token_loss(lp, lp.detach(), None, t([2.0]), torch.ones(1, 3), rollout_logp=t(behav),
                                   off_policy_correction="tis", is_cap=CAP)
    num, den = aggregate(per_token, torch.ones(1, 3), "token-mean")
    (num / den).backward()
    w = [3.0, 5.0, math.exp(-0.3)]
    torch.testing.assert_close(num / den, t(sum(-2.0 * x for x in w) / 3), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp.grad, t([[-2.0 * x / 3 for x in w]]), rtol=1e-12, atol=1e-12)


def areal_ppo_actor_loss(logprobs, proximal_logprobs, old_logprobs, advantages, eps_clip, loss_mask,
                         eps_clip_higher=None, behav_imp_weight_cap=None):
    """AReaL's decoupled PPO objective as published: Fu et al. 2025, "AReaL: A Large-Scale Asynchronous
    Reinforcement Learning System for Language Reasoning" (arXiv:2505.24298), eq. 5,

        J(theta) = E[ sum_t pi_prox / pi_behav * min(u_t A_t, clip(u_t, 1 - eps, 1 + eps) A_t) ],
        u_t = pi_theta / pi_prox,

    as its repository writes it (inclusionAI/AReaL, areal/utils/functional.py, `ppo_actor_loss_fn`, without the
    dual clip): `old_logprobs` are the behaviour policy's (the inference engine's), a token whose behaviour
    weight exceeds `behav_imp_weight_cap` is dropped (weight 0), and the loss is the token mean. Returns the loss
    and the per-token terms."""
    count = loss_mask.count_nonzero() or 1
    ratio = torch.where(loss_mask, torch.exp(logprobs - proximal_logprobs), 0)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + (eps_clip if eps_clip_higher is None else eps_clip_higher))
    pg_loss = torch.max(-advantages * ratio, -advantages * clipped_ratio)
    behav_imp_weight = (proximal_logprobs - old_logprobs).exp()
    behav_mask = (behav_imp_weight <= behav_imp_weight_cap).logical_and(loss_mask) \
        if behav_imp_weight_cap is not None else loss_mask
    pg_loss = pg_loss * torch.where(behav_mask, behav_imp_weight, 0.0)
    per_token = torch.where(loss_mask, pg_loss, 0)
    return per_token.sum() / count, per_token


def _random_batch(seed: int, rows: int = 6, steps: int = 7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, steps, generator=g, dtype=F64) * 3
    prox = logp + 0.25 * torch.randn(rows, steps, generator=g, dtype=F64)
    behav = prox + 1.5 * torch.randn(rows, steps, generator=g, dtype=F64)
    adv = torch.randn(rows, 1, generator=g, dtype=F64)
    mask = torch.arange(steps)[None, :] < torch.tensor([7, 5, 1, 6, 3, 7])[:rows, None]
    return logp, prox, behav, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tis_equals_areal_decoupled_formula_below_the_cap(seed):
    logp, prox, behav, adv, mask = _random_batch(seed)
    # With no cap (AReaL's default, None) the two are the same objective: loss and gradient.
    a = logp.clone().requires_grad_()
    want, _ = areal_ppo_actor_loss(a, prox, behav, adv, 0.2, mask, 0.28)
    (want_grad,) = torch.autograd.grad(want, a)
    b = logp.clone().requires_grad_()
    per_token, _ = grpo_token_loss(b, prox, None, adv, mask, 0.2, 0.28, rollout_logp=behav,
                                   off_policy_correction="tis", is_cap=math.inf)
    num, den = aggregate(per_token, mask, "token-mean")
    (got_grad,) = torch.autograd.grad(num / den, b)
    torch.testing.assert_close(num / den, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)

    # With AReaL's recipes' cap 5.0 the terms agree on every token whose weight is within the cap; beyond it AReaL
    # drops the token and megarl truncates its weight to the cap (as TIS does), which the guide says.
    _, areal_terms = areal_ppo_actor_loss(logp, prox, behav, adv, 0.2, mask, 0.28, behav_imp_weight_cap=CAP)
    ours, _ = grpo_token_loss(logp, prox, None, adv, mask, 0.2, 0.28, rollout_logp=behav,
                              off_policy_correction="tis", is_cap=CAP)
    over = mask & (torch.exp(prox - behav) > CAP)
    assert over.any() and (mask & ~over).any(), "the batch must hold tokens on both sides of the cap"
    torch.testing.assert_close(ours[~over], areal_terms[~over], rtol=1e-12, atol=1e-12)
    assert torch.equal(areal_terms[over], torch.zeros(int(over.sum()), dtype=F64))
    _, uncapped = areal_ppo_actor_loss(logp, prox, behav, adv, 0.2, mask, 0.28)
    ratio_over = (uncapped / torch.exp(prox - behav))[over]  # the clipped surrogate of those tokens
    torch.testing.assert_close(ours[over], CAP * ratio_over, rtol=1e-12, atol=1e-12)


def test_tis_is_plain_ppo_clip_when_behaviour_is_proximal():
    logp, prox, _, adv, mask = _random_batch(3)
    a, b = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    plain, plain_m = policy_loss_clip(a, prox, adv, mask, EPS_LOW, EPS_HIGH)
    tis, m = grpo_token_loss(b, prox, None, adv, mask, EPS_LOW, EPS_HIGH, rollout_logp=prox.clone(),
                             off_policy_correction="tis", is_cap=CAP)
    assert torch.equal(tis, plain)  # weight exp(0) = 1 exactly
    plain.sum().backward()
    tis.sum().backward()
    assert torch.equal(a.grad, b.grad)
    assert m["tis_weight_mean"] == 1.0 and m["tis_clip_frac"] == 0.0
    assert m["clip_frac"] == plain_m["clip_frac"] > 0, "a comparison where something is clipped"


def _config(**values) -> Config:
    """A run's config from flag values, with every component's options (their rules resolved)."""
    return build_config(values, components())


def _actor_loss_and_grad(cfg: Config, logp, old, behav, adv, mask):
    """The per-token loss and gradient the trainer's actor loss (`megarl.stages.update`) computes under `cfg`: the
    correction it names, called with its own options."""
    a = cfg.algorithm
    lp = logp.clone().requires_grad_()
    per_token, m = grpo_token_loss(lp, old, None, adv, mask, a.eps_clip, a.eps_clip_high, rollout_logp=behav,
                                   off_policy_correction=a.off_policy_correction,
                                   correction_options=OFF_POLICY_CORRECTIONS.kwargs_of(cfg, a.off_policy_correction))
    num, den = aggregate(per_token, mask, cfg.algorithm.loss_aggregation)
    (num / den).backward()
    return per_token.detach(), lp.grad, m


@pytest.mark.parametrize("updates_per_rollout", [1, 2])
def test_decoupled_is_tis_at_its_cap_loss_and_gradient(updates_per_rollout):
    # In megarl the proximal policy is always the actor before the update: its own forward pass with two updates per
    # rollout, the actor itself (logp.detach()) with one. TIS's weight already has it as its numerator, so AReaL's
    # decoupled objective and TIS were one loss; `decoupled` is now a spelling of tis at --decoupled-is-cap.
    logp, prox, behav, adv, mask = _random_batch(4)
    old = prox if updates_per_rollout > 1 else logp
    decoupled = _config(off_policy_correction="decoupled", decoupled_is_cap=2.0, eps_clip_high=0.28)
    tis = _config(off_policy_correction="tis", tis_cap=2.0, eps_clip_high=0.28)
    assert (decoupled.algorithm.off_policy_correction, OFF_POLICY_CORRECTIONS.kwargs_of(decoupled, "tis")) == \
        ("tis", {"cap": 2.0})
    d_loss, d_grad, dm = _actor_loss_and_grad(decoupled, logp, old, behav, adv, mask)
    t_loss, t_grad, tm = _actor_loss_and_grad(tis, logp, old, behav, adv, mask)
    assert torch.equal(d_loss, t_loss) and torch.equal(d_grad, t_grad)
    assert dm == tm and 0 < tm["tis_clip_frac"] < 1, "a comparison where the cap truncates some weights"
    # and the weight is the one the config's cap sets: AReaL's formula with that cap on the tokens within it
    _, areal_terms = areal_ppo_actor_loss(logp, old, behav, adv, 0.2, mask, 0.28, behav_imp_weight_cap=2.0)
    within = mask & (torch.exp(old - behav) <= 2.0)
    torch.testing.assert_close(d_loss[within], areal_terms[within], rtol=1e-12, atol=1e-12)


def test_tis_cap_alone_is_resolved_by_the_config_not_the_loss():
    # `--tis-cap C` alone means tis: tis's options say so, once (`resolve`); the loss takes the correction by name
    # only, and refuses the old keyword instead of passing it on to the policy loss, which would ignore it.
    logp, prox, behav, adv, mask = _random_batch(6)
    cfg = _config(tis_cap=2.0)
    assert (cfg.algorithm.off_policy_correction, OFF_POLICY_CORRECTIONS.kwargs_of(cfg, "tis")) == ("tis", {"cap": 2.0})
    got, _, _ = _actor_loss_and_grad(cfg, logp, prox, behav, adv, mask)
    want, _ = grpo_token_loss(logp, prox, None, adv, mask, rollout_logp=behav, off_policy_correction="tis", is_cap=2.0)
    assert torch.equal(got, want) and not torch.equal(want, grpo_token_loss(logp, prox, None, adv, mask)[0])
    with pytest.raises(TypeError, match="off_policy_correction='tis', is_cap=C, not tis_cap"):
        grpo_token_loss(logp, prox, None, adv, mask, rollout_logp=behav, tis_cap=2.0)


def test_none_leaves_the_loss_alone_and_bad_inputs_are_named():
    logp, prox, behav, adv, mask = _random_batch(5)
    none, m = grpo_token_loss(logp, prox, None, adv, mask, rollout_logp=behav, off_policy_correction="none",
                              is_cap=CAP)
    assert torch.equal(none, grpo_token_loss(logp, prox, None, adv, mask)[0])
    assert not any(k.startswith("tis_") for k in m)
    with pytest.raises(ValueError, match="'tis' needs the rollout engine's log-probs"):
        grpo_token_loss(logp, prox, None, adv, mask, off_policy_correction="tis", is_cap=CAP)
    with pytest.raises(ValueError, match="'tis' needs a weight cap > 0, got 0"):
        grpo_token_loss(logp, prox, None, adv, mask, rollout_logp=behav, off_policy_correction="tis")
    # the older name is the config's to resolve; the loss knows only what it computes
    with pytest.raises(ValueError, match="'decoupled'; valid names: geo_rs, icepop, mis, none, seq_tis, tis$"):
        grpo_token_loss(logp, prox, None, adv, mask, rollout_logp=behav, off_policy_correction="decoupled", is_cap=1)
    assert "decoupled" not in OFF_POLICY_CORRECTIONS

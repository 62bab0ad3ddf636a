"""Advantage estimators, KL estimators, the clipped policy loss and aggregation against hand-computed numbers.

Expected values are written out (or computed with `math` on plain floats), never by calling the function under
test; the TRL parity test re-implements TRL 1.16's formulas as described in
docs/trl-grpo.md.
"""

import math

import pytest
import torch

from megarl.algorithms import (
    ADVANTAGES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    aggregate,
    compute_dr_grpo_advantages,
    compute_grpo_advantages,
    grpo_token_loss,
    kl_k1,
    kl_k2,
    kl_k3,
    policy_loss_clip,
)

F64 = torch.float64


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def logps_with_ratios(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, old_logp) of shape [1, len(ratios)] whose exp-difference is the given ratios; logp requires grad."""
    old = t([[-1.0] * len(ratios)])
    logp = (old + t([[math.log(r) for r in ratios]])).requires_grad_()
    return logp, old


# ---------------------------------------------------------------------------------------------------- advantages


def test_grpo_advantages_use_bessel_corrected_group_std():
    # Group [3, 1, 2]: mean 2, squared deviations 1 + 1 + 0 = 2, unbiased variance 2 / (3 - 1) = 1.
    # Group [1, 0, 0, 1]: mean 0.5, unbiased variance 4 * 0.25 / 3 = 1/3 (the biased std, 0.5, would give +-1).
    eps = 1e-6
    got_a = compute_grpo_advantages(t([[3.0, 1.0, 2.0]]), eps=eps)
    got_b = compute_grpo_advantages(t([[1.0, 0.0, 0.0, 1.0]]), eps=eps)
    a = 1 / (1 + eps)
    b = 0.5 / (math.sqrt(1 / 3) + eps)
    torch.testing.assert_close(got_a, t([[a, -a, 0.0]]))
    torch.testing.assert_close(got_b, t([[b, -b, -b, b]]))


def test_grpo_advantages_are_exactly_zero_for_uniform_groups():
    # 0.1 is not exact in binary, so mean([0.1] * 3) - 0.1 may be a round-off residual; the result must still be 0.
    rewards = torch.tensor([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    got = compute_grpo_advantages(rewards)
    assert torch.equal(got[:2], torch.zeros(2, 3))
    assert got[2, 1] > 0 > got[2, 0]


def test_grpo_advantages_of_a_single_completion_are_zero_not_nan():
    assert torch.equal(compute_grpo_advantages(t([[5.0], [2.0]])), t([[0.0], [0.0]]))


def test_grpo_advantages_accept_integer_rewards_and_reject_flat_input():
    got = compute_grpo_advantages(torch.tensor([[1, 0]]), eps=0.0)
    # mean 0.5, unbiased std sqrt(0.5) -> 0.5 / sqrt(0.5) = sqrt(0.5).
    torch.testing.assert_close(got, torch.tensor([[math.sqrt(0.5), -math.sqrt(0.5)]]))
    with pytest.raises(ValueError, match="num_groups, group_size"):
        compute_grpo_advantages(torch.tensor([1.0, 0.0]))


def test_dr_grpo_advantages_only_center():
    got = compute_dr_grpo_advantages(t([[3.0, 1.0, 2.0], [4.0, 0.0, 2.0], [7.0, 7.0, 7.0]]))
    torch.testing.assert_close(got, t([[1.0, -1.0, 0.0], [2.0, -2.0, 0.0], [0.0, 0.0, 0.0]]))


def test_advantage_registry():
    assert ADVANTAGES.get("grpo").fn is compute_grpo_advantages
    assert ADVANTAGES.get("dr_grpo").fn is compute_dr_grpo_advantages
    with pytest.raises(ValueError, match="'ppo'.*valid names: dr_grpo, gae, grpo"):
        ADVANTAGES.get("ppo")


# ---------------------------------------------------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    # Token 0: logp -1.0, ref -1.5 (d = ref - logp = -0.5). Token 1: logp -2.0, ref -1.0 (d = 1). Token 2: equal.
    logp, ref = t([-1.0, -2.0, -0.3]), t([-1.5, -1.0, -0.3])
    torch.testing.assert_close(kl_k1(logp, ref), t([0.5, -1.0, 0.0]))
    torch.testing.assert_close(kl_k2(logp, ref), t([0.125, 0.5, 0.0]))
    torch.testing.assert_close(kl_k3(logp, ref), t([math.exp(-0.5) - 0.5, math.e - 2, 0.0]))


def test_kl_registry():
    assert (KL_ESTIMATORS.get("k1"), KL_ESTIMATORS.get("k2"), KL_ESTIMATORS.get("k3")) == (kl_k1, kl_k2, kl_k3)
    with pytest.raises(ValueError, match="'k4'.*valid names: k1, k2, k3"):
        KL_ESTIMATORS.get("k4")


# ----------------------------------------------------------------------------------------------- clipped loss


def test_clip_loss_symmetric_on_both_sides_of_the_range():
    # (A, ratio) -> -min(ratio * A, clamp(ratio, 0.8, 1.2) * A), clipped branch taken?
    #   (+1, 1.5) -> -min(1.5, 1.2)   = -1.2  clipped (high)
    #   (+1, 0.5) -> -min(0.5, 0.8)   = -0.5  not clipped
    #   (-1, 1.5) -> -min(-1.5, -1.2) =  1.5  not clipped
    #   (-1, 0.5) -> -min(-0.5, -0.8) =  0.8  clipped (low)
    #   (+2, 1.1) -> -min(2.2, 2.2)   = -2.2  inside the range
    logp, old = logps_with_ratios([1.5, 0.5, 1.5, 0.5, 1.1])
    adv = t([[1.0, 1.0, -1.0, -1.0, 2.0]])
    loss, metrics = policy_loss_clip(logp, old, adv, torch.ones(1, 5, dtype=torch.bool), 0.2, 0.2)
    torch.testing.assert_close(loss, t([[-1.2, -0.5, 1.5, 0.8, -2.2]]))
    assert metrics["clip_frac"] == pytest.approx(2 / 5)
    assert metrics["clip_frac_high"] == pytest.approx(1 / 5)
    assert metrics["clip_frac_low"] == pytest.approx(1 / 5)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.5 + 0.5 + 1.1) / 5)

    # A clipped token gives no gradient; otherwise d(-ratio * A)/dlogp = -ratio * A.
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, t([[0.0, -0.5, 1.5, 0.0, -2.2]]))


def test_clip_loss_asymmetric_clip_higher():
    # clip_low 0.2, clip_high 0.28, so the range is [0.8, 1.28]:
    #   (+1, 1.25) -> -1.25 not clipped (a symmetric 0.2 would clip it to -1.2)
    #   (+1, 1.5)  -> -1.28 clipped (high)
    #   (-1, 0.7)  -> -min(-0.7, -0.8) = 0.8 clipped (low)
    #   (-1, 1.25) -> -min(-1.25, -1.25) = 1.25 inside the range
    logp, old = logps_with_ratios([1.25, 1.5, 0.7, 1.25])
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    loss, metrics = policy_loss_clip(logp, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, t([[-1.25, -1.28, 0.8, 1.25]]))
    assert metrics["clip_frac"] == pytest.approx(2 / 4)


def test_clip_loss_broadcasts_one_advantage_per_sequence():
    logp, old = t([[-1.0, -2.0], [-0.5, -0.7]]), t([[-1.0, -2.0], [-0.5, -0.7]])
    loss, _ = policy_loss_clip(logp, old, t([2.0, -3.0]), torch.ones(2, 2))
    torch.testing.assert_close(loss, t([[-2.0, -2.0], [3.0, 3.0]]))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss_clip(logp, old, t([1.0, 2.0, 3.0]), torch.ones(2, 2))


def test_masked_tokens_contribute_nothing_and_get_zero_gradient():
    # Padding holds junk log-probs, including ones whose exp overflows; they must not leak into loss or grad.
    logp = t([[-1.0, 100.0, -0.5], [-2.0, -3.0, float("-inf")]]).requires_grad_()
    old = t([[-1.0, -1000.0, -0.5], [-2.0, -3.0, 0.0]])  # exp(1100) overflows float64
    ref = t([[-1.2, 80.0, -0.5], [-2.1, -3.0, -4.0]])
    mask = torch.tensor([[True, False, True], [True, True, False]])
    loss, metrics = grpo_token_loss(logp, old, ref, t([1.0, -1.0]), mask, kl_coef=0.1)
    assert torch.isfinite(loss).all()
    assert loss[0, 1] == 0 and loss[1, 2] == 0
    loss.sum().backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 1] == 0 and logp.grad[1, 2] == 0
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    # kl_mean over the 4 real tokens: k3 at d = -0.2 and d = -0.1, 0 elsewhere.
    k3 = lambda d: math.exp(d) - d - 1
    assert metrics["kl_mean"] == pytest.approx((k3(-0.2) + k3(-0.1)) / 4)


def test_policy_loss_registry():
    assert POLICY_LOSSES.get("clip") is policy_loss_clip
    with pytest.raises(ValueError, match="'sapo'.*valid names: cispo, clip"):
        POLICY_LOSSES.get("sapo")


# ---------------------------------------------------------------------------------------------- GRPO loss


def test_grpo_token_loss_adds_kl_per_token():
    # ratio 1 everywhere; A = 0.5 for the sequence; logp - ref = 0.5 (k3: exp(-0.5) + 0.5 - 1) and 0.
    logp = t([[-1.0, -2.0]])
    ref = t([[-1.5, -2.0]])
    loss, metrics = grpo_token_loss(logp, logp, ref, t([0.5]), torch.ones(1, 2), 0.2, 0.2, kl_coef=0.1)
    kl0 = math.exp(-0.5) + 0.5 - 1
    torch.testing.assert_close(loss, t([[-0.5 + 0.1 * kl0, -0.5]]))
    assert metrics["kl_mean"] == pytest.approx(kl0 / 2)

    loss_k1, _ = grpo_token_loss(logp, logp, ref, t([0.5]), torch.ones(1, 2), kl_coef=0.1, kl_type="k1")
    torch.testing.assert_close(loss_k1, t([[-0.5 + 0.1 * 0.5, -0.5]]))


def test_grpo_token_loss_without_reference():
    logp = t([[-1.0, -2.0]])
    loss, metrics = grpo_token_loss(logp, logp, None, t([0.5]), torch.ones(1, 2), kl_coef=0.0)
    torch.testing.assert_close(loss, t([[-0.5, -0.5]]))
    assert "kl_mean" not in metrics
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_token_loss(logp, logp, None, t([0.5]), torch.ones(1, 2), kl_coef=0.1)


# ---------------------------------------------------------------------------------------------- aggregation

LOSS = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


def test_aggregate_token_mean():
    num, den = aggregate(LOSS, MASK, "token-mean")
    assert (num.item(), den.item()) == (1 + 2 + 4, 3)


def test_aggregate_seq_mean_token_mean():
    # Per-sequence token means 1.5 and 4; the empty third sequence adds 0 and still counts (as in TRL's "grpo").
    num, den = aggregate(LOSS, MASK, "seq-mean-token-mean")
    assert (num.item(), den.item()) == (1.5 + 4.0, 3)


def test_aggregate_sums_across_micro_batches():
    # Summing numerators and denominators of micro-batches reproduces the whole-batch value.
    for mode in ("token-mean", "seq-mean-token-mean"):
        whole = aggregate(LOSS, MASK, mode)
        parts = [aggregate(LOSS[i : i + 1], MASK[i : i + 1], mode) for i in range(3)]
        assert sum(p[0] for p in parts) / sum(p[1] for p in parts) == pytest.approx((whole[0] / whole[1]).item())


def test_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError, match="'mean'.*valid modes: token-mean, seq-mean-token-mean"):
        aggregate(LOSS, MASK, "mean")  # type: ignore[arg-type]


def test_on_policy_gradient_is_minus_advantage_over_token_count():
    # At ratio 1 (old_logp = logp.detach()) both branches agree, so d(loss)/d(logp_t) = -A_i * m_t / N.
    logp = t([[-1.0, -2.0, -3.0], [-0.5, -0.6, -0.7]]).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    per_token, _ = grpo_token_loss(logp, logp.detach(), None, t([2.0, -1.0]), mask)
    num, den = aggregate(per_token, mask, "token-mean")
    (num / den).backward()
    n = 5
    torch.testing.assert_close(logp.grad, t([[-2 / n, -2 / n, 0.0], [1 / n, 1 / n, 1 / n]]))


# --------------------------------------------------------------------------------------------- TRL parity


def trl_loss(logp, old_logp, ref_logp, rewards, mask, beta, eps_low, eps_high, loss_type):
    """TRL 1.16 GRPOTrainer._compute_loss for one micro-batch that is the whole generation batch (GA = S = 1,
    one process), use_bias_correction_kl=False, as described in the reference note."""
    grouped = rewards.view(-1, rewards.shape[-1])
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True)  # torch's default is Bessel-corrected
    advantages = ((grouped - mean) / (std + 1e-4)).reshape(-1, 1)
    ratio = torch.exp(logp - old_logp)
    per_token = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages)
    per_token = per_token + beta * (torch.exp(ref_logp - logp) - (ref_logp - logp) - 1)
    if loss_type == "dapo":
        return (per_token * mask).sum() / mask.sum()
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()  # "grpo"


@pytest.mark.parametrize(("loss_type", "mode"), [("dapo", "token-mean"), ("grpo", "seq-mean-token-mean")])
def test_parity_with_trl_formula(loss_type, mode):
    gen = torch.Generator().manual_seed(0)
    groups, g, steps = 2, 4, 6
    logp = (-torch.rand(groups * g, steps, generator=gen, dtype=F64) * 3).requires_grad_()
    old_logp = logp.detach() + 0.3 * torch.randn(groups * g, steps, generator=gen, dtype=F64)
    ref_logp = logp.detach() + 0.2 * torch.randn(groups * g, steps, generator=gen, dtype=F64)
    rewards = t([[1.0, 0.0, 0.0, 1.0], [0.2, 0.9, 0.4, 0.4]])
    lengths = torch.tensor([6, 3, 1, 5, 6, 2, 4, 6])  # completion tokens up to and including EOS
    mask = (torch.arange(steps) < lengths[:, None]).to(F64)

    expected = trl_loss(logp, old_logp, ref_logp, rewards, mask, 0.04, 0.2, 0.28, loss_type)
    (expected_grad,) = torch.autograd.grad(expected, logp)

    advantages = compute_grpo_advantages(rewards, eps=1e-4).reshape(-1)
    per_token, _ = grpo_token_loss(logp, old_logp, ref_logp, advantages, mask, 0.2, 0.28, kl_coef=0.04)
    num, den = aggregate(per_token, mask, mode)
    got = num / den
    (got_grad,) = torch.autograd.grad(got, logp)

    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_grad, expected_grad)

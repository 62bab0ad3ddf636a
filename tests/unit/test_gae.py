"""GAE, per-token rewards, whitening and the clipped value loss against hand computations.

Expected numbers are unrolled by hand in the comments, never computed by calling the function under test.
"""

import pytest
import torch

from megarl.algorithms.gae import (
    compute_gae,
    masked_moments,
    mean_var,
    terminal_token_rewards,
    value_loss_clipped,
    whiten,
)

F64 = torch.float64


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def test_gae_three_tokens_hand_unrolled():
    # One row: a 2-token prompt (position 0 predicts a prompt token, unmasked), 3 response tokens at t = 1, 2, 3,
    # then 2 padding positions whose values are garbage and must be ignored. Score 1 on the last token.
    mask = t([[0, 1, 1, 1, 0, 0]])
    values = t([[9.0, 0.5, 0.2, -0.1, 7.0, 7.0]])
    rewards = terminal_token_rewards(t([1.0]), mask)
    torch.testing.assert_close(rewards, t([[0, 0, 0, 1.0, 0, 0]]))
    gamma, lam = 0.9, 0.8
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    # t=3: delta = 1 + 0.9 * 0 - (-0.1) = 1.1;             A3 = 1.1
    # t=2: delta = 0 + 0.9 * (-0.1) - 0.2 = -0.29;         A2 = -0.29 + 0.72 * 1.1 = 0.502
    # t=1: delta = 0 + 0.9 * 0.2 - 0.5 = -0.32;            A1 = -0.32 + 0.72 * 0.502 = 0.04144
    torch.testing.assert_close(adv, t([[0, 0.04144, 0.502, 1.1, 0, 0]]))
    torch.testing.assert_close(ret, t([[0, 0.54144, 0.702, 1.0, 0, 0]]))


def test_gae_gamma_lambda_one_is_reward_to_go_minus_value():
    # Per-token rewards (a KL penalty on every token plus the score at the end): A_t = sum_{j >= t} r_j - V_t.
    mask = t([[1, 1, 1, 0], [0, 1, 1, 1]])
    values = t([[0.3, -0.2, 0.4, 5.0], [5.0, 0.1, 0.2, 0.3]])
    kl = t([[0.1, 0.2, 0.3, 9.0], [9.0, 0.5, 0.0, 0.1]])
    rewards = terminal_token_rewards(t([1.0, 0.0]), mask, kl=kl, kl_coef=0.5)
    # row 0: rewards -0.05, -0.1, 1 - 0.15 = 0.85; reward-to-go 0.7, 0.75, 0.85
    # row 1: rewards -0.25, 0, -0.05;              reward-to-go -0.3, -0.05, -0.05
    torch.testing.assert_close(rewards, t([[-0.05, -0.1, 0.85, 0], [0, -0.25, 0.0, -0.05]]))
    adv, ret = compute_gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv, t([[0.7 - 0.3, 0.75 + 0.2, 0.85 - 0.4, 0],
                                       [0, -0.3 - 0.1, -0.05 - 0.2, -0.05 - 0.3]]))
    torch.testing.assert_close(ret, t([[0.7, 0.75, 0.85, 0], [0, -0.3, -0.05, -0.05]]))


def test_gae_lambda_zero_is_one_step_td():
    mask = t([[1, 1]])
    values = t([[0.25, 0.5]])
    adv, _ = compute_gae(terminal_token_rewards(t([2.0]), mask), values, mask, gamma=0.5, lam=0.0)
    # t=0: 0 + 0.5 * 0.5 - 0.25 = 0;  t=1: 2 + 0 - 0.5 = 1.5
    torch.testing.assert_close(adv, t([[0.0, 1.5]]))


def test_zero_length_response_gets_nothing():
    mask = t([[0, 0, 0], [1, 1, 0]])
    values = t([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    rewards = terminal_token_rewards(t([5.0, 1.0]), mask)
    torch.testing.assert_close(rewards, t([[0, 0, 0], [0, 1.0, 0]]))
    adv, ret = compute_gae(rewards, values, mask, 1.0, 0.95)
    torch.testing.assert_close(adv[0], t([0, 0, 0]))
    torch.testing.assert_close(ret[0], t([0, 0, 0]))
    # An all-empty batch (a fully masked micro-batch) is all zeros, not an error.
    empty = torch.zeros(2, 3, dtype=F64)
    adv, ret = compute_gae(terminal_token_rewards(t([1.0, 1.0]), empty), values, empty)
    assert torch.equal(adv, empty) and torch.equal(ret, empty)


def test_whiten_over_masked_tokens():
    x = t([[1.0, 3.0, 100.0], [5.0, 100.0, 100.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    moments = masked_moments(x, mask)
    torch.testing.assert_close(moments, t([3.0, 9.0, 35.0]))
    mean, var = mean_var(moments)
    # values 1, 3, 5: mean 3, biased variance (4 + 0 + 4) / 3 = 8/3
    assert mean == pytest.approx(3.0) and var == pytest.approx(8 / 3)
    got = whiten(x, mask, mean, var, eps=0.0)
    s = (8 / 3) ** 0.5
    torch.testing.assert_close(got, t([[-2 / s, 0.0, 0.0], [2 / s, 0.0, 0.0]]))
    assert mean_var(masked_moments(x, torch.zeros_like(mask))) == (0.0, 0.0)


def test_value_loss_clipped_hand_computed():
    # token 0: V moved +0.5 from 0 (clip 0.2 -> 0.2); R = 1: unclipped (0.5-1)^2 = 0.25, clipped (0.2-1)^2 = 0.64
    #          -> the clipped branch, 0.32, and its gradient w.r.t. V is 0.
    # token 1: V moved -0.1 from 0 (inside the clip), R = -1: both (−0.1+1)^2 = 0.81 -> 0.405, gradient V - R = 0.9
    # token 2: masked out.
    values = t([[0.5, -0.1, 3.0]]).requires_grad_()
    old = t([[0.0, 0.0, 0.0]])
    returns = t([[1.0, -1.0, 0.0]])
    mask = t([[1, 1, 0]])
    loss, m = value_loss_clipped(values, old, returns, mask, clip=0.2)
    torch.testing.assert_close(loss, t([[0.32, 0.405, 0.0]]))
    assert float(m["clipped"]) == 1.0
    loss.sum().backward()
    torch.testing.assert_close(values.grad, t([[0.0, 0.9, 0.0]]))


def test_registered_gae_estimator_matches_compute_gae():
    from megarl.algorithms import ADVANTAGES
    from megarl.algorithms.gae import gae_returns

    mask = t([[0, 1, 1, 1, 0, 0]])
    values = t([[9.0, 0.5, 0.2, -0.1, 7.0, 7.0]])
    fn = ADVANTAGES.get("gae").fn
    adv = fn(t([[1.0]]), 1e-6, values=values, mask=mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, t([[0, 0.04144, 0.502, 1.1, 0, 0]]))
    torch.testing.assert_close(gae_returns(adv, values, mask), t([[0, 0.54144, 0.702, 1.0, 0, 0]]))
    with pytest.raises(ValueError, match="needs the critic's per-token values"):
        fn(t([[1.0]]), 1e-6)

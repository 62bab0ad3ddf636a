"""On-policy distillation's objective (`megarl.algorithms.distill`) against float64 hand computations of the
published objective: the per-token reverse-KL advantage through the PPO policy loss and token-mean aggregation
(loss and gradient), alone and beside GRPO's advantage, and the top-k reverse KL with a tail bucket (loss against a
loop over positions, gradient against central finite differences of that loop)."""

import math

import numpy as np
import pytest
import torch

from megarl.algorithms.advantages import compute_grpo_advantages
from megarl.algorithms.distill import distill_advantages, reverse_kl_per_token, topk_reverse_kl
from megarl.algorithms.losses import aggregate, policy_loss_clip

SEEDS = (0, 1, 2)


def _batch(seed, groups=2, group_size=3, T=7):  # noqa: N803
    g = torch.Generator().manual_seed(seed)
    B = groups * group_size
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old_logp = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 0.6  # some ratios clip
    teacher = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    # Padding holds garbage, including -inf, which must not leak.
    logp = torch.where(mask, logp, torch.full_like(logp, -math.inf))
    teacher = torch.where(mask, teacher, torch.full_like(teacher, -math.inf))
    rewards = torch.randint(0, 2, (groups, group_size), generator=g).double()
    return logp, old_logp, teacher, mask, rewards


def _hand_loss_and_grad(logp, old_logp, teacher, mask, coef, outcome, clip=0.2):
    """Token-mean PPO-clip loss of the advantage A[i,t] = -coef (logp - teacher)[i,t] (+ outcome[i]) with A a
    constant, and its gradient in logp, by loops in float64."""
    lp, olp, tl, m = (x.numpy() for x in (logp.detach(), old_logp, teacher, mask))
    B, T = lp.shape
    n = m.sum()
    loss, grad = 0.0, np.zeros((B, T))
    for i in range(B):
        for t in range(T):
            if not m[i, t]:
                continue
            a = -coef * (lp[i, t] - tl[i, t]) + (0.0 if outcome is None else float(outcome[i]))
            r = math.exp(lp[i, t] - olp[i, t])
            rc = min(max(r, 1 - clip), 1 + clip)
            unclipped, clipped = r * a, rc * a
            loss += -min(unclipped, clipped) / n
            # d/dlogp of -min(r a, rc a): the unclipped branch gives -r a; the clipped branch is constant in logp
            # outside the band.
            if unclipped <= clipped:
                grad[i, t] = -r * a / n
            else:
                grad[i, t] = 0.0 if (r < 1 - clip or r > 1 + clip) else -r * a / n
    return loss, grad


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("with_grpo", [False, True])
def test_distill_advantage_loss_and_gradient_match_hand_computation(seed, with_grpo):
    logp, old_logp, teacher, mask, rewards = _batch(seed)
    coef = 0.7
    outcome = compute_grpo_advantages(rewards).flatten() if with_grpo else None
    logp = logp.clone().requires_grad_(True)
    adv = distill_advantages(logp, teacher, mask, coef, outcome=outcome)
    assert not adv.requires_grad
    per_token, _ = policy_loss_clip(logp, old_logp, adv, mask, 0.2, 0.2)
    num, den = aggregate(per_token, mask, "token-mean")
    loss = num / den
    loss.backward()
    want_loss, want_grad = _hand_loss_and_grad(logp, old_logp, teacher, mask, coef, outcome)
    assert abs(loss.item() - want_loss) < 1e-12
    assert np.allclose(logp.grad.numpy(), want_grad, atol=1e-12, rtol=0)
    assert torch.isfinite(logp.grad).all()


@pytest.mark.parametrize("seed", SEEDS)
def test_reverse_kl_and_advantage_values(seed):
    logp, _, teacher, mask, rewards = _batch(seed)
    kl = reverse_kl_per_token(logp, teacher, mask)
    lp, tl, m = logp.numpy(), teacher.numpy(), mask.numpy()
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            assert kl[i, t].item() == (lp[i, t] - tl[i, t] if m[i, t] else 0.0)
    # Distillation only: -coef * kl; coefficient 0 leaves GRPO's advantage alone (broadcast, 0 at padding).
    assert torch.equal(distill_advantages(logp, teacher, mask, 0.5), -0.5 * kl)
    grpo = compute_grpo_advantages(rewards).flatten()
    both = distill_advantages(logp, teacher, mask, 0.0, outcome=grpo)
    assert torch.equal(both, torch.where(mask, grpo.unsqueeze(1).expand_as(kl), torch.zeros_like(kl)))
    with pytest.raises(ValueError, match="distill-coef"):
        distill_advantages(logp, teacher, mask, -1.0)
    with pytest.raises(ValueError, match="outcome advantages"):
        distill_advantages(logp, teacher, mask, 1.0, outcome=grpo[:2])


def _hand_topk(logits, ids, tlogp, mask, floor, temperature):
    """Top-k reverse KL with a tail bucket, per position, by loops in float64 (numpy)."""
    B, T, V = logits.shape
    out = np.zeros((B, T))
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            z = logits[i, t] / temperature
            z = z - z.max()
            ps = np.exp(z) / np.exp(z).sum()
            head, mass_s, mass_t = 0.0, 0.0, 0.0
            for k, j in enumerate(ids[i, t]):
                head += ps[j] * (math.log(ps[j]) - tlogp[i, t, k])
                mass_s += ps[j]
                mass_t += math.exp(tlogp[i, t, k])
            ts, tt = max(1 - mass_s, floor), max(1 - mass_t, floor)
            out[i, t] = head + ts * (math.log(ts) - math.log(tt))
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_topk_reverse_kl_matches_hand_computation_and_bounds_full_kl(seed):
    g = torch.Generator().manual_seed(seed)
    B, T, V, K = 3, 4, 11, 4
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    teacher_full = torch.log_softmax(torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2, dim=-1)
    tlogp, ids = teacher_full.topk(K, dim=-1)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0, 0] = True
    floor, temperature = 1e-8, 0.8
    x = logits.clone().requires_grad_(True)
    kl = topk_reverse_kl(x, ids, tlogp, mask, tail_floor=floor, temperature=temperature)
    want = _hand_topk(logits.numpy(), ids.numpy(), tlogp.numpy(), mask.numpy(), floor, temperature)
    assert np.allclose(kl.detach().numpy(), want, atol=1e-12, rtol=0)

    # Gradient of the token mean against central differences of the hand computation.
    weights = mask.double() / mask.sum()
    (kl * weights).sum().backward()
    h, num_grad = 1e-6, np.zeros((B, T, V))
    base = logits.numpy()
    w = weights.numpy()
    for idx in np.ndindex(B, T, V):
        if not mask[idx[0], idx[1]]:
            continue
        up, down = base.copy(), base.copy()
        up[idx] += h
        down[idx] -= h
        f = lambda z: (_hand_topk(z, ids.numpy(), tlogp.numpy(), mask.numpy(), floor, temperature) * w).sum()
        num_grad[idx] = (f(up) - f(down)) / (2 * h)
    assert np.allclose(x.grad.numpy(), num_grad, atol=1e-8, rtol=0)

    # A lower bound of the full reverse KL, equal to it when k covers the vocabulary.
    ps_full = torch.log_softmax(logits / temperature, dim=-1)
    full = (ps_full.exp() * (ps_full - teacher_full)).sum(-1)
    assert (kl.detach()[mask] <= full[mask] + 1e-12).all()
    all_t, all_ids = teacher_full.topk(V, dim=-1)
    covered = topk_reverse_kl(logits, all_ids, all_t, mask, tail_floor=floor, temperature=temperature)
    assert torch.allclose(covered[mask], full[mask], atol=1e-7)


def test_teachers_chosen_per_row_and_parsed():
    from megarl.errors import ConfigError
    from megarl.teacher import Teachers, parse_teachers

    assert parse_teachers("/m/7b") == {"": "/m/7b"}
    assert parse_teachers("http://h:1/x") == {"": "http://h:1/x"}
    assert parse_teachers("math=/m/a, code=http://h:2") == {"math": "/m/a", "code": "http://h:2"}
    for bad in ("math=/m/a,math=/m/b", "math=/m/a,/m/b", "/m/a,/m/b"):
        with pytest.raises(ConfigError, match="--teacher"):
            parse_teachers(bad)

    class Fake:  # log-prob of token t+1 = offset + token id, so each row shows who scored it
        def __init__(self, offset):
            self.offset, self.calls = offset, []

        def logprobs(self, tokens, *, lengths=None, temperature=1.0):
            self.calls.append(tokens.shape[0])
            return (tokens[:, 1:] + self.offset).float() / temperature

    math_t, code_t = Fake(100), Fake(200)
    teachers = Teachers({"math": math_t, "code": code_t}, ["code", "", "math", "code"])
    tokens = torch.arange(20).view(5, 4)
    got = teachers.logprobs(tokens, rows=[0, 1, 2, 3, 1], lengths=torch.full((5,), 4), temperature=0.5)
    want_offset = torch.tensor([200, 100, 100, 200, 100]).unsqueeze(1)  # row 1 names none: the first, math
    assert torch.equal(got, (tokens[:, 1:] + want_offset).float() / 0.5)
    assert math_t.calls == [3] and code_t.calls == [2]  # each teacher scores its own rows only
    with pytest.raises(ConfigError, match=r"teachers \['physics'\]"):
        Teachers({"math": math_t}, ["physics"])

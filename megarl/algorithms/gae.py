"""PPO with a learned critic: per-token rewards, GAE advantages and returns, and the clipped value loss.

Pure tensor functions over right-padded token rows, laid out like the actor's log-probs: `[B, T]` with
`T = S - 1`, where `mask[b, t]` marks `tokens[b, t + 1]` as a response token and `values[b, t]` is the critic's
value of the state `tokens[b, :t + 1]`, i.e. the state in which that token is chosen. The response positions of a
row are one contiguous run (after the prompt, before the padding); positions outside the mask are ignored and get
0 in every output.

GAE (Schulman et al. 2016, "High-dimensional continuous control using generalized advantage estimation"), per
row, over its response tokens t_1 < ... < t_L only (prompt and padding positions are skipped, not stepped over):

    delta_i = r_i + gamma * V_{i+1} - V_i          (V_{L+1} = 0: the episode ends after the last token)
    A_i     = delta_i + gamma * lambda * A_{i+1}   (A_{L+1} = 0)
    R_i     = A_i + V_i                             (the critic's regression target)

With gamma = lambda = 1, A_i = (sum_{j >= i} r_j) - V_i: reward-to-go minus value.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megarl.algorithms.advantages import Needs, register_advantage


def terminal_token_rewards(scores: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """Per-token rewards [B, T]: each sequence's score on its last response token, minus `kl_coef * kl` on every
    response token when a per-token KL(actor || reference) estimate `kl` [B, T] is given (the KL penalty folded
    into the reward, as in InstructGPT-style PPO). A row with no response token gets no reward.

    Shapes: scores [B]; mask, kl [B, T]. Returns [B, T], 0 outside the mask.
    """
    mask = mask.bool()
    t = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, t, torch.full_like(t, -1)).max(dim=1).values  # -1 for an empty row
    rewards = torch.zeros(mask.shape, dtype=scores.dtype if scores.is_floating_point() else torch.float32,
                          device=mask.device)
    rows = torch.nonzero(last >= 0).squeeze(1)
    rewards[rows, last[rows]] = scores[rows].to(rewards.dtype)
    if kl is not None and kl_coef != 0:
        rewards = rewards - kl_coef * torch.where(mask, kl.to(rewards.dtype), torch.zeros_like(rewards))
    return rewards


@torch.no_grad()
def compute_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0,
                lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """GAE advantages and returns (see the module docstring), both [B, T] and 0 outside the mask.

    Shapes: rewards, values, mask [B, T]. The backward pass carries the next response token's value and
    advantage through unmasked positions, so trailing padding acts as the end of the episode.
    """
    mask = mask.bool()
    values = torch.where(mask, values, torch.zeros_like(values)).to(rewards.dtype)
    next_value = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        if not m.any():
            continue
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(m, adv, advantages[:, t])
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, adv, next_adv)
    returns = torch.where(mask, advantages + values, torch.zeros_like(advantages))
    return advantages, returns


@register_advantage("gae", needs=Needs(critic=True, token_level=True))
def compute_gae_advantages(rewards: Tensor, eps: float = 1e-6, *, values: Tensor | None = None,
                           mask: Tensor | None = None, gamma: float = 1.0, lam: float = 1.0, kl: Tensor | None = None,
                           kl_coef: float = 0.0, **inputs) -> Tensor:
    """The registry's GAE estimator: one score per completion (`rewards`, any shape with N elements, in the
    order of the rows of `values`) placed on its last response token (minus `kl_coef * kl` per token when
    given), then `compute_gae`. Needs the critic's `values` and the response `mask`, both [N, T]; returns the
    advantages [N, T] (returns are `gae_returns(advantages, values, mask)`). `eps` is unused."""
    if values is None or mask is None:
        raise ValueError("the gae advantage estimator needs the critic's per-token values and the response mask")
    token_rewards = terminal_token_rewards(rewards.flatten(), mask, kl=kl, kl_coef=kl_coef)
    return compute_gae(token_rewards, values.to(token_rewards.dtype), mask, gamma, lam)[0]


def gae_returns(advantages: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """The critic's targets `A + V` [B, T], 0 outside the mask."""
    mask = mask.bool()
    return torch.where(mask, advantages + values.to(advantages.dtype), torch.zeros_like(advantages))


def whiten(x: Tensor, mask: Tensor, mean: Tensor | float, var: Tensor | float, eps: float = 1e-8) -> Tensor:
    """`(x - mean) / sqrt(var + eps)` at masked positions, 0 elsewhere. The statistics are passed in so the
    caller can take them over the whole global batch (all data-parallel ranks); see `masked_moments`."""
    mask = mask.bool()
    out = (x - mean) / torch.sqrt(torch.as_tensor(var, dtype=x.dtype) + eps)
    return torch.where(mask, out, torch.zeros_like(out))


def masked_moments(x: Tensor, mask: Tensor) -> Tensor:
    """`[count, sum, sum of squares]` of `x` over masked positions (float64), to be summed over ranks."""
    m = mask.bool()
    v = x[m].double()
    return torch.stack([torch.tensor(float(v.numel()), dtype=torch.float64), v.sum(), v.square().sum()])


def mean_var(moments: Tensor) -> tuple[float, float]:
    """Mean and (biased) variance from `masked_moments` (0, 0 for no elements)."""
    n, s, sq = (float(v) for v in moments)
    if n == 0:
        return 0.0, 0.0
    mean = s / n
    return mean, max(sq / n - mean * mean, 0.0)


def value_loss_clipped(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
                       clip: float) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss, per token:

        V_clip = old_V + clamp(V - old_V, -clip, clip)
        l_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)

    The max keeps one update from moving the value far from the one that produced the advantages.
    Shapes: all [B, T]. Returns the per-token loss [B, T] (0 outside the mask; aggregate it with
    `megarl.algorithms.aggregate`) and the count of masked tokens where the clipped branch is larger
    (`clipped`, a tensor, to be summed over micro-batches).
    """
    mask = mask.bool()
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    unclipped = (values - returns).square()
    clipped = (clipped_values - returns).square()
    loss = 0.5 * torch.maximum(unclipped, clipped)
    with torch.no_grad():
        clipped_count = ((clipped > unclipped) & mask).sum().to(values.dtype)
    return torch.where(mask, loss, torch.zeros_like(loss)), {"clipped": clipped_count}

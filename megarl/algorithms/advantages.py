"""Advantage estimators: rewards of G completions per prompt in, one advantage per completion out.

Every estimator has one signature, `fn(rewards: Tensor[num_groups, group_size], eps: float, **inputs) -> Tensor`,
and is registered by name with `@register_advantage(name, needs=Needs(...))`; the trainer looks it up with
`ADVANTAGES.get(name)` and never switches on the name itself. `Needs` declares what the estimator uses besides the
rewards, and the trainer provides exactly that (`megarl.stages.advantages`):

- nothing: outcome estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++) return one advantage per completion,
  [num_groups, group_size], broadcast over its tokens by the policy loss, and ignore `inputs`;
- `critic`: a learned value model; its per-token values arrive as `inputs["values"]` and it is trained on
  `advantages + values` (GAE, `gae.py`);
- `reference`: the frozen reference model's per-token log-probs, as `inputs["ref_logp"]` (a reference is run for
  it even without a KL penalty);
- `token_level`: the result is per token, [num_completions, T], aligned with `inputs["mask"]` (the response
  tokens).

An estimator's own settings are its options (`register_advantage(name, options=...)`, `megarl.registry`), passed to
it as keyword arguments: `gae`'s `gamma` and `lam` (`--gae-gamma`, `--gae-lambda`, declared in
`megarl.algorithms.slots`). No estimator gets another's.

Row `g` of `rewards` holds the rewards of the completions sampled for prompt `g`.

Rewards must be finite: turning unscorable samples into a reward (or dropping them) is the scorer's job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import Tensor

from megarl.algorithms import slots
from megarl.registry import Registry


class AdvantageFn(Protocol):
    def __call__(self, rewards: Tensor, eps: float = ..., **inputs) -> Tensor: ...


@dataclass(frozen=True)
class Needs:
    """What an advantage estimator uses besides the rewards (see the module docstring)."""

    critic: bool = False
    reference: bool = False
    token_level: bool = False


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    fn: AdvantageFn
    needs: Needs


# The estimators below, and GAE (PPO with a critic) in its own module, imported on first lookup; the registry and
# the built-ins' options live in `megarl.algorithms.slots` (pure Python, for the command line).
ADVANTAGES: Registry[AdvantageEstimator] = slots.ADVANTAGES


def register_advantage(name: str, needs: Needs = Needs(),
                       options: type | None = None) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register an advantage estimator under `name`, with what it needs (a second registration of a name is an
    error) and its options dataclass (`megarl.registry`): its fields' values are passed to the estimator as
    keyword arguments (or what the dataclass's `kwargs(cfg)` returns)."""
    if needs.critic and not needs.token_level:
        raise ValueError(f"advantage estimator {name!r}: a critic gives per-token values; declare token_level=True")

    def decorate(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGES.add(name, AdvantageEstimator(name, fn, needs), options=options)
        return fn

    return decorate


def _check_grouped(rewards: Tensor) -> Tensor:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [num_groups, group_size], got {tuple(rewards.shape)}")
    # Integer rewards (0/1 correctness) are common; the arithmetic below needs a floating dtype.
    return rewards if rewards.is_floating_point() else rewards.float()


@register_advantage("grpo")
def compute_grpo_advantages(rewards: Tensor, eps: float = 1e-6, normalize_std: bool = True, **inputs) -> Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024, DeepSeekMath).

        A[g, i] = (r[g, i] - mean_g) / (std_g + eps)      if normalize_std
        A[g, i] =  r[g, i] - mean_g                        otherwise (Dr. GRPO, Liu et al. 2025)

    `std_g` is the per-group standard deviation with Bessel's correction (divides by group_size - 1), as in
    TRL's default `scale_rewards="group"` (TRL uses eps=1e-4). A group whose rewards are all equal, including
    a group of one, carries no learning signal and gets exactly 0 (not round-off / eps).

    Shapes: rewards [num_groups, group_size] -> advantages [num_groups, group_size].
    """
    rewards = _check_grouped(rewards)
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if normalize_std and rewards.shape[1] > 1:
        centered = centered / (rewards.std(dim=1, keepdim=True, unbiased=True) + eps)
    # The mean of equal floats need not equal them bit for bit, and a tiny residual divided by eps is not
    # small, so equal-reward groups are zeroed explicitly.
    uniform = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(uniform, torch.zeros_like(centered), centered)


@register_advantage("dr_grpo")
def compute_dr_grpo_advantages(rewards: Tensor, eps: float = 1e-6, **inputs) -> Tensor:
    """Dr. GRPO advantages (Liu et al. 2025): `r - mean_g`, without dividing by the group std, which biases
    updates towards prompts that are nearly always or nearly never solved. `eps` is unused; it keeps the
    registry's one signature. Shapes as `compute_grpo_advantages`."""
    return compute_grpo_advantages(rewards, eps=eps, normalize_std=False)


def _zero_uniform_groups(rewards: Tensor, advantages: Tensor) -> Tensor:
    uniform = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(uniform, torch.zeros_like(advantages), advantages)


@register_advantage("rloo")
def compute_rloo_advantages(rewards: Tensor, eps: float = 1e-6, **inputs) -> Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024): each completion's baseline is the mean
    reward of the *other* completions of its prompt.

        A[g, i] = r[g, i] - (sum_j r[g, j] - r[g, i]) / (n - 1)  =  n / (n - 1) * (r[g, i] - mean_g)

    A group of one has no other completion to compare with and gets 0, as does a group of equal rewards.
    `eps` is unused. Shapes as `compute_grpo_advantages`.
    """
    rewards = _check_grouped(rewards)
    n = rewards.shape[1]
    if n == 1:
        return torch.zeros_like(rewards)
    baseline = (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)
    return _zero_uniform_groups(rewards, rewards - baseline)


@register_advantage("reinforce_pp")
def compute_reinforce_pp_advantages(rewards: Tensor, eps: float = 1e-6, **inputs) -> Tensor:
    """REINFORCE++ (Hu 2025): no per-prompt baseline; the rewards of the whole batch are whitened,

        A[g, i] = (r[g, i] - mean_batch) / (std_batch + eps)

    (std with Bessel's correction). A batch whose rewards are all equal gets 0. Shapes as GRPO's.
    """
    rewards = _check_grouped(rewards)
    flat = rewards.flatten()
    if flat.numel() < 2 or bool((flat == flat[0]).all()):
        return torch.zeros_like(rewards)
    return (rewards - flat.mean()) / (flat.std(unbiased=True) + eps)


@register_advantage("reinforce_pp_baseline")
def compute_reinforce_pp_baseline_advantages(rewards: Tensor, eps: float = 1e-6, **inputs) -> Tensor:
    """REINFORCE++-baseline: subtract the per-prompt mean, then divide by the std of those centred rewards over
    the whole batch (not per group, so prompts that are nearly always or never solved are not up-weighted).

        c[g, i] = r[g, i] - mean_g;   A[g, i] = c[g, i] / (std_batch(c) + eps)

    Groups of equal rewards get exactly 0. Shapes as GRPO's.
    """
    rewards = _check_grouped(rewards)
    centered = _zero_uniform_groups(rewards, rewards - rewards.mean(dim=1, keepdim=True))
    flat = centered.flatten()
    if flat.numel() < 2 or bool((flat == 0).all()):
        return torch.zeros_like(rewards)
    return centered / (flat.std(unbiased=True) + eps)

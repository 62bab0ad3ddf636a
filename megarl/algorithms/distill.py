"""On-policy distillation: a teacher's log-probs on the student's own samples as a dense per-token signal.

The student samples completions; a teacher scores each sampled token; the student is trained towards the teacher
by minimising the reverse KL, KL(student || teacher), estimated on its own samples (on-policy distillation:
Agarwal et al. 2024, GKD; Gu et al. 2024, MiniLLM; Thinking Machines, "On-Policy Distillation", 2025). Per sampled
token `x_t` of a completion,

    kl_t = log p_student(x_t | x_<t) - log p_teacher(x_t | x_<t)        (the k1 estimator of the reverse KL)
    A_t  = -coef * kl_t                                                  (the per-token distillation advantage)

`A_t` is a constant (no gradient flows through either log-prob): it is the reward of a policy-gradient step, used by
the policy loss exactly as a per-token advantage, so `-A_t * grad log p_student(x_t)` is the update, and its
expectation over the student's samples is `coef` times the gradient of the per-token reverse KL. Alone it is
distillation only; beside verifiable rewards it is added to the group-normalised outcome advantage (GRPO's),
broadcast over the completion's tokens (`distill_advantages`).

Where the teacher gives its top-k log-probs at each position (`topk_reverse_kl`), the reverse KL is computed
analytically over the teacher's top-k support with the rest of the vocabulary lumped into one "tail" bucket:

    KL_k = sum_{j in topk} p_s(j) (log p_s(j) - log p_t(j)) + p_s(tail) (log p_s(tail) - log p_t(tail))

with p(tail) = 1 - sum_{j in topk} p(j). Lumping outcomes never increases a KL (log-sum inequality), so KL_k is a
lower bound of the full reverse KL at that position, and it equals it when k covers the vocabulary; the teacher's
tail mass is floored at `tail_floor` so a teacher whose top-k holds (numerically) all its mass gives a bounded term.
This one is a differentiable loss on the student's full distribution, not an advantage.

Shapes: `B` completions by `T` completion tokens; `mask` true (or 1) for the tokens that count. Masked positions
may hold anything (padding, -inf): they give 0 and no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _masked(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), values, torch.zeros_like(values))


def _check_same(name: str, a: Tensor, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name}: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")


def reverse_kl_per_token(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """`log p_student - log p_teacher` on the sampled tokens, 0 at masked positions. Shapes: all [B, T]."""
    _check_same("student/teacher log-probs", student_logp, teacher_logp)
    _check_same("log-probs/mask", student_logp, mask)
    mask = mask.bool()
    # Padding may hold -inf in either: keep it out of the subtraction (inf - inf is NaN).
    s = torch.where(mask, student_logp, torch.zeros_like(student_logp))
    t = torch.where(mask, teacher_logp, torch.zeros_like(teacher_logp))
    return s - t


def distill_advantages(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor, coef: float,
                       outcome: Tensor | None = None) -> Tensor:
    """The per-token advantage of on-policy distillation, `-coef * (log p_student - log p_teacher)`, detached,
    plus the outcome advantage `outcome` ([B], one per completion, e.g. GRPO's group-normalised reward) broadcast
    over the completion's tokens when given (distillation beside verifiable rewards); `outcome=None` is
    distillation only. Returns [B, T], 0 at masked positions.
    """
    if coef < 0:
        raise ValueError(f"--distill-coef must be >= 0, got {coef}")
    kl = reverse_kl_per_token(student_logp.detach(), teacher_logp.detach(), mask)
    adv = -coef * kl
    if outcome is not None:
        outcome = outcome.detach()
        if outcome.dim() == 2 and outcome.shape == kl.shape:
            adv = adv + outcome.to(adv.dtype)
        elif outcome.dim() == 1 and outcome.shape[0] == kl.shape[0]:
            adv = adv + outcome.to(adv.dtype).unsqueeze(-1)
        else:
            raise ValueError(f"outcome advantages must be [B] or [B, T] for log-probs {tuple(kl.shape)}, "
                             f"got {tuple(outcome.shape)}")
    return _masked(adv, mask)


def topk_reverse_kl(student_logits: Tensor, teacher_topk_ids: Tensor, teacher_topk_logp: Tensor, mask: Tensor,
                    tail_floor: float = 1e-8, temperature: float = 1.0) -> Tensor:
    """Per-token reverse KL over the teacher's top-k support plus one tail bucket (see the module docstring).

    Shapes: `student_logits` [B, T, V] (the student's logits at the completion positions, divided by
    `temperature` here as the actor divides its own), `teacher_topk_ids` [B, T, K] (long), `teacher_topk_logp`
    [B, T, K] (the teacher's log-probs of those ids, already at the teacher's temperature), `mask` [B, T].
    Returns [B, T], differentiable in `student_logits`, 0 at masked positions.
    """
    if student_logits.dim() != 3:
        raise ValueError(f"student_logits must be [B, T, V], got {tuple(student_logits.shape)}")
    _check_same("teacher top-k ids/log-probs", teacher_topk_ids, teacher_topk_logp)
    if teacher_topk_ids.shape[:2] != student_logits.shape[:2] or mask.shape != student_logits.shape[:2]:
        raise ValueError(f"top-k KL: student logits {tuple(student_logits.shape)}, teacher top-k "
                         f"{tuple(teacher_topk_ids.shape)} and mask {tuple(mask.shape)} must share [B, T]")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logp_s = torch.gather(torch.log_softmax(student_logits / temperature, dim=-1), -1, teacher_topk_ids.long())
    return topk_reverse_kl_from_logprobs(logp_s, teacher_topk_logp, mask, tail_floor)


def topk_reverse_kl_from_logprobs(student_topk_logp: Tensor, teacher_topk_logp: Tensor, mask: Tensor,
                                  tail_floor: float = 1e-8) -> Tensor:
    """`topk_reverse_kl` from the student's log-probs at the teacher's top-k ids (what a vocab-parallel head gives
    without the full distribution: `megarl.mcore.actor.topk_label_logprobs`). Shapes: both [B, T, K], `mask`
    [B, T]; returns [B, T], differentiable in `student_topk_logp`, 0 at masked positions."""
    _check_same("student/teacher top-k log-probs", student_topk_logp, teacher_topk_logp)
    if mask.shape != student_topk_logp.shape[:2]:
        raise ValueError(f"top-k KL: log-probs {tuple(student_topk_logp.shape)} and mask {tuple(mask.shape)} must "
                         "share [B, T]")
    if not 0 < tail_floor < 1:
        raise ValueError(f"tail_floor must be in (0, 1), got {tail_floor}")
    mask = mask.bool()
    keep = mask.unsqueeze(-1)
    # Masked positions may hold anything (-inf, garbage ids' log-probs): kept out of every exp and log.
    logp_s = torch.where(keep, student_topk_logp, torch.zeros_like(student_topk_logp))
    logp_t = torch.where(keep, teacher_topk_logp.to(logp_s.dtype), torch.zeros_like(logp_s))
    p_s = logp_s.exp()
    head = (p_s * (logp_s - logp_t)).sum(dim=-1)
    # The tails: 1 - sum p over the top-k, floored (a top-k holding all the mass leaves a bounded term).
    tail_s = (1 - p_s.sum(dim=-1)).clamp(min=tail_floor)
    tail_t = (1 - logp_t.exp().sum(dim=-1)).clamp(min=tail_floor)
    tail = tail_s * (tail_s.log() - tail_t.log())
    kl = head + tail
    return torch.where(mask, kl, torch.zeros_like(kl))

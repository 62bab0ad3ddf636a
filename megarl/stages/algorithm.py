"""From scored samples to the actor's `TrainBatch`: packing, log-probs, final rewards, advantages.

    packed  = pack(rollout.samples, pad_id)                     padded rows, the per-token loss mask
    logp    = algorithm.logprobs(actor, packed)                 the reference's (a KL term, or the estimator needs
                                                                it) and the actor's own before the update (more
                                                                than one update per rollout)
    batch   = algorithm.train_batch(rollout, packed, logp)      rewards with --kl-in-reward folded in, then the
                                                                registered estimator's advantages -> TrainBatch

The estimator declares what it needs (`megarl.algorithms.Needs`) and `AlgorithmStage` provides exactly that: a frozen
reference, a critic (`megarl.stages.critic_update`, trained here, before the actor), per-token inputs. Nothing here
knows an estimator by name.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import time

import torch

from megarl.algorithms import ADVANTAGES, KL_ESTIMATORS
from megarl.algorithms.distill import distill_advantages, reverse_kl_per_token
from megarl.config import Config
from megarl.mcore.actor import MegatronPolicy
from megarl.mcore.parallel import ParallelInfo, broadcast_from_last_stage
from megarl.stages.critic_update import CriticStage
from megarl.samples import PackedSamples, RolloutBatch, Sample, SampleStatus, TrainBatch


def pack(samples: Sequence[Sample], pad_id: int, mask_truncated: bool = False) -> PackedSamples:
    """Right-padded rows of `prompt + response`; the loss mask is each sample's own (1 = the policy's token), and
    with `mask_truncated` (DAPO) responses cut at the length limit are left out of the loss. Aborted samples (the
    engine stopped them from outside) are always left out: their partial response is nothing the policy chose to
    end. Like DAPO's masked overlong samples, they keep their reward in their group's baseline (a mask of zeros
    adds nothing to the loss's numerator and still counts in per-sequence denominators, as in TRL)."""
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    width = max(len(x) for x in seqs)
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(seqs), width - 1, dtype=torch.float32)
    rollout_logp = torch.zeros(len(seqs), width - 1, dtype=torch.float32)
    for b, (s, seq) in enumerate(zip(samples, seqs)):
        tokens[b, : len(seq)] = torch.tensor(seq)
        lo, hi = len(s.prompt_ids) - 1, len(seq) - 1  # column t predicts token t + 1
        if s.status is not SampleStatus.ABORTED and not (mask_truncated and s.status is SampleStatus.TRUNCATED):
            loss_mask[b, lo:hi] = torch.tensor(s.loss_mask, dtype=torch.float32)
        rollout_logp[b, lo:hi] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    lengths = torch.tensor([len(x) for x in seqs])
    return PackedSamples(tokens, loss_mask, rollout_logp, lengths, _routing(samples, width))


def _routing(samples: Sequence[Sample], width: int) -> torch.Tensor | None:
    """The engine's experts per token as [B, S, sparse layers, k], -1 where it has none; None unless every sample
    has them."""
    if not samples or any(s.routed_experts is None for s in samples):
        return None
    first = samples[0].routed_experts
    routing = torch.full((len(samples), width, *first.shape[1:]), -1, dtype=first.dtype)
    for b, s in enumerate(samples):
        routing[b, : len(s.routed_experts)] = s.routed_experts
    return routing


def frozen_models(reference, teacher) -> list[MegatronPolicy]:
    """The frozen Megatron models that hold weights of their own: the reference (not the LoRA actor's base, which
    is the actor) and the local teachers (not a served one, whose memory is its server's)."""
    teachers = getattr(teacher, "teachers", None) or {}
    return [m for m in (reference, *teachers.values())
            if isinstance(m, MegatronPolicy) and not m.trainable]


class LogProbs(NamedTuple):
    old: torch.Tensor | None  # the actor before this step's updates; None when the ratio's denominator is logp itself
    ref: torch.Tensor | None  # the frozen reference; None without one, and on pipeline stages other than the last
    teacher: torch.Tensor | None = None  # on-policy distillation's teacher, as `ref`
    teacher_s: float = 0.0  # the teacher's time (its forward passes or its server's answers)
    teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None  # --distill-topk: (ids, log-probs) [B, S - 1, K]


class AlgorithmStage:
    """The models the algorithm needs besides the actor, and the batch it trains the actor on: the stage that runs
    the registered algorithm (`megarl.algorithms`: its estimator, its KL)."""

    def __init__(self, cfg: Config, info: ParallelInfo, reference: MegatronPolicy | None, critic: CriticStage | None,
                 teacher=None):
        self.cfg, self.info, self.reference, self.critic = cfg, info, reference, critic
        self.teacher = teacher  # `logprobs(tokens, **kw)`: a frozen MegatronPolicy (--teacher); None without one
        self.estimator = ADVANTAGES.get(cfg.algorithm.advantage_estimator)
        self.options = ADVANTAGES.kwargs_of(cfg, cfg.algorithm.advantage_estimator)  # the estimator's own
        # --offload-frozen: the frozen Megatron models (the reference, local teachers) hold GPU memory only while
        # they compute their log-probs; they leave now, before the first rollout.
        self.frozen = frozen_models(reference, teacher) if cfg.training.offload_frozen else []
        self.frozen_bytes = sum(model.offload(params=True, optimizer=False) for model in self.frozen)

    @staticmethod
    def needs_reference(cfg: Config) -> bool:
        return cfg.algorithm.kl_coef > 0 or ADVANTAGES.get(cfg.algorithm.advantage_estimator).needs.reference

    @staticmethod
    def needs_critic(cfg: Config) -> bool:
        return ADVANTAGES.get(cfg.algorithm.advantage_estimator).needs.critic

    def logprobs(self, actor: MegatronPolicy, packed: PackedSamples, samples: Sequence[Sample] = ()) -> LogProbs:
        """With a single update per rollout the old log-probs equal the current ones (ratio 1, as in TRL), so
        computing them would be a wasted forward pass."""
        t = self.cfg.training
        kw = dict(micro_batch_size=t.micro_batch_size, temperature=self.cfg.rollout.rollout_temperature,
                  lengths=packed.lengths, max_tokens_per_micro_batch=t.max_tokens_per_micro_batch)
        for model in self.frozen:  # --offload-frozen: back for their forward passes, away again after them
            model.onload()
        ref = self.reference.logprobs(packed.tokens, **kw) if self.reference is not None else None
        old = actor.logprobs(packed.tokens, routing=packed.routing, **kw) if t.updates_per_rollout > 1 else None
        teacher, teacher_s, topk = None, 0.0, None
        if self.teacher is not None:  # at the engine's temperature, as the reference and the actor
            start = time.perf_counter()
            rows = [s.prompt_index for s in samples]
            teacher = self.teacher.logprobs(packed.tokens, rows=rows, **kw)
            if (k := self.cfg.algorithm.distill_topk) > 0:  # fixed micro-batches: one forward, K outputs a position
                topk = self.teacher.topk_logprobs(packed.tokens, k, rows=rows, lengths=packed.lengths,
                                                  micro_batch_size=t.micro_batch_size,
                                                  temperature=self.cfg.rollout.rollout_temperature)
            teacher_s = time.perf_counter() - start
        for model in self.frozen:
            model.offload(params=True, optimizer=False)
        return LogProbs(old=old, ref=ref, teacher=teacher, teacher_s=teacher_s, teacher_topk=topk)

    def train_batch(self, rollout: RolloutBatch, packed: PackedSamples,
                    logp: LogProbs) -> tuple[TrainBatch, dict[str, float]]:
        """Collective. The batch and the metrics of what ran for it (the critic's)."""
        rewards = self.final_rewards(rollout.samples, packed, logp.ref)
        advantages, metrics = self.advantages(rewards, packed, logp.ref, rollout.group_size)
        if self.teacher is not None:
            advantages, distill = self.distill(advantages, packed, logp)
            metrics = {**metrics, **distill}
        batch = TrainBatch(tokens=packed.tokens, loss_mask=packed.loss_mask, rollout_logp=packed.rollout_logp,
                           lengths=packed.lengths, rewards=rewards, advantages=advantages, old_logp=logp.old,
                           ref_logp=logp.ref, routing=packed.routing,
                           teacher_topk_ids=None if logp.teacher_topk is None else logp.teacher_topk[0],
                           teacher_topk_logp=None if logp.teacher_topk is None else logp.teacher_topk[1])
        return batch, metrics

    def final_rewards(self, samples: Sequence[Sample], packed: PackedSamples, ref: torch.Tensor | None) -> torch.Tensor:
        """[B] float32. With `--kl-in-reward`: r_i - kl_coef * sum_t kl_t, the KL of each response to the reference
        summed over its tokens (estimator `--kl-estimator`, on the rollout's own log-probs, the policy that sampled
        it). The reference log-probs live on the last pipeline stage; the sums are broadcast to the others."""
        a = self.cfg.algorithm
        rewards = [s.reward for s in samples]
        if a.kl_in_reward and a.kl_coef > 0:
            kl = torch.zeros(len(samples), dtype=torch.float64)
            if ref is not None:
                mask = packed.loss_mask.bool()
                zero = torch.zeros_like(packed.rollout_logp)
                per_token = KL_ESTIMATORS.get(a.kl_estimator)(torch.where(mask, packed.rollout_logp, zero),
                                                      torch.where(mask, ref.to(zero.dtype), zero))
                kl = torch.where(mask, per_token, zero).sum(dim=-1).double()
            if self.info.pp_size > 1:
                kl = broadcast_from_last_stage(kl)
            rewards = [r - a.kl_coef * k for r, k in zip(rewards, kl.tolist())]
        return torch.tensor(rewards, dtype=torch.float32)

    def advantages(self, rewards: torch.Tensor, packed: PackedSamples, ref: torch.Tensor | None,
                   group_size: int) -> tuple[torch.Tensor, dict[str, float]]:
        """[B] float32 (outcome estimators), or [B, S - 1] (token-level ones), from the registered estimator."""
        a, needs = self.cfg.algorithm, self.estimator.needs
        inputs: dict = dict(self.options)
        if needs.token_level:
            inputs["mask"] = packed.loss_mask
        if needs.reference:
            inputs["ref_logp"] = ref
            if ref is None and self.critic is None:  # not the last pipeline stage: its advantages are never read
                shape = packed.loss_mask.shape if needs.token_level else rewards.shape
                return torch.zeros(shape, dtype=torch.float32), {}
        if self.critic is not None:  # the critic's values, like the reference's log-probs, live on the last stage
            return self.critic.advantages_and_update(self.estimator.fn, rewards, packed, inputs)
        if needs.token_level:
            return self.estimator.fn(rewards, a.advantage_eps, **inputs).float(), {}
        advantages = self.estimator.fn(rewards.view(-1, group_size), eps=a.advantage_eps, **inputs)
        return advantages.flatten().to(torch.float32), {}

    def distill(self, advantages: torch.Tensor, packed: PackedSamples,
                logp: LogProbs) -> tuple[torch.Tensor, dict[str, float]]:
        """On-policy distillation (`megarl.algorithms.distill`): the per-token advantage
        -distill_coef * (log p_student - log p_teacher) on the sampled tokens, with the rollout's own log-probs as the
        student's (the policy that sampled them), added to the estimator's advantage, or alone (--distill-only).
        [B, S - 1]; its metrics: the per-token reverse KL to the teacher, the distillation term's share of the
        advantage (mean |distill| / (mean |distill| + mean |outcome|) over the loss tokens), the teacher's time (all
        of it exposed: the teacher runs between the rollout and the update).

        With --distill-topk K > 0 the teacher's signal is the top-K KL, a term of the actor's loss
        (`megarl.stages.update`), not an advantage: the advantage is the estimator's, or 0 with --distill-only;
        the sampled tokens' reverse KL is still reported."""
        a = self.cfg.algorithm
        mask = packed.loss_mask.bool()
        if logp.teacher is None:  # not the last pipeline stage: its advantages are never read
            return torch.zeros(mask.shape, dtype=torch.float32), {}
        student, teacher = packed.rollout_logp.double(), logp.teacher.double()
        if a.distill_topk > 0:
            kl = reverse_kl_per_token(student, teacher, mask)
            adv = torch.zeros(mask.shape, dtype=torch.float32) if a.distill_only else advantages
            return adv, {"distill/reverse_kl": float(kl.sum() / mask.sum().clamp(min=1)),
                         "distill/teacher_s": logp.teacher_s, "distill/teacher_exposed_s": logp.teacher_s}
        outcome = None if a.distill_only else advantages.double()
        adv = distill_advantages(student, teacher, mask, a.distill_coef, outcome=outcome)
        kl = reverse_kl_per_token(student, teacher, mask)
        n = mask.sum().clamp(min=1)
        distill_abs = float((a.distill_coef * kl.abs()).sum() / n)
        outcome_abs = 0.0
        if outcome is not None:
            per_token = outcome if outcome.dim() == 2 else outcome.unsqueeze(-1).expand_as(kl)
            outcome_abs = float(torch.where(mask, per_token.abs(), torch.zeros_like(kl)).sum() / n)
        share = distill_abs / (distill_abs + outcome_abs) if distill_abs + outcome_abs > 0 else 0.0
        metrics = {"distill/reverse_kl": float(kl.sum() / n), "distill/adv_share": share,
                   "distill/teacher_s": logp.teacher_s, "distill/teacher_exposed_s": logp.teacher_s}
        return adv.float(), metrics

    def save(self, root: str, step: int, keep_last: int) -> None:
        """Collective. The algorithm's own models' state (the critic's), saved before the actor's."""
        if self.critic is not None:
            self.critic.save(root, step, keep_last)


Algorithm = AlgorithmStage  # the old name, beside the `megarl.algorithms` package it is not; removed in megarl 0.3

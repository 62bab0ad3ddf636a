"""Typed data between the stages of a step: rollout -> reward -> advantages -> the actor's training batch."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from megarl.data import PromptRecord
from megarl.rollout.base import RolloutEngine, SamplingParams
from megarl.verifiers import get_verifier
from megarl.verifiers.pool import RewardPool, batch_health


@dataclass
class Sample:
    """One completion of one prompt, and what the verifier said of it."""

    group: int  # index of its prompt group in this rank's batch
    prompt_index: int  # row of the dataset
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    response_text: str = ""
    reward: float = 0.0
    outcome: str = ""
    advantage: float = 0.0


@dataclass
class RolloutBatch:
    samples: list[Sample]
    group_size: int
    generate_seconds: float = 0.0
    reward_seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)

    def rewards(self) -> torch.Tensor:
        """[num_groups, group_size]; samples are stored group by group."""
        return torch.tensor([s.reward for s in self.samples], dtype=torch.float32).view(-1, self.group_size)


def generate(engine: RolloutEngine, prompts: Sequence[PromptRecord], params: SamplingParams) -> RolloutBatch:
    start = time.perf_counter()
    groups = engine.generate([p.prompt_ids for p in prompts], params)
    samples = [
        Sample(group=g, prompt_index=p.index, prompt_ids=list(p.prompt_ids), response_ids=list(c.token_ids),
               rollout_logprobs=list(c.logprobs), finish_reason=c.finish_reason)
        for g, (p, completions) in enumerate(zip(prompts, groups))
        for c in completions
    ]
    return RolloutBatch(samples, params.n, generate_seconds=time.perf_counter() - start)


def score(batch: RolloutBatch, prompts: Sequence[PromptRecord], tokenizer, pool: RewardPool | None = None) -> None:
    """Decode each response and let the verifier its data row names set its reward: in `pool`'s worker processes
    when given, else here. The batch's reward-health metrics (`batch_health`) go to `batch.metrics`."""
    start = time.perf_counter()
    requests = []
    for s in batch.samples:
        record = prompts[s.group]
        s.response_text = tokenizer.decode(s.response_ids, skip_special_tokens=True)
        requests.append((record.verifier, s.response_text, record.label))
    if pool is not None:
        results, health = pool.score(requests, group_size=batch.group_size)
    else:
        results = [_local_verifier(name).verify(response, label) for name, response, label in requests]
        health = batch_health(results, batch.group_size)
    for s, result in zip(batch.samples, results):
        s.reward, s.outcome = float(result.score), result.outcome
    batch.metrics.update(health)
    batch.reward_seconds = time.perf_counter() - start


_LOCAL_VERIFIERS: dict = {}


def _local_verifier(name: str):
    # One instance per name for the process: a verifier may hold a helper process (the math verifier's budget).
    if name not in _LOCAL_VERIFIERS:
        _LOCAL_VERIFIERS[name] = get_verifier(name)
    return _LOCAL_VERIFIERS[name]


def to_train_batch(samples: Sequence[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors aligned with the actor's log-probs ([B, S - 1] predicts tokens[:, 1:]).

    `loss_mask[b, t]` is 1 where tokens[b, t + 1] is a response token (a stop token included).
    """
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    width = max(len(x) for x in seqs)
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(seqs), width - 1, dtype=torch.float32)
    rollout_logp = torch.zeros(len(seqs), width - 1, dtype=torch.float32)
    for b, (s, seq) in enumerate(zip(samples, seqs)):
        tokens[b, : len(seq)] = torch.tensor(seq)
        lo, hi = len(s.prompt_ids) - 1, len(seq) - 1
        loss_mask[b, lo:hi] = 1.0
        rollout_logp[b, lo:hi] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return {"tokens": tokens, "loss_mask": loss_mask, "rollout_logp": rollout_logp, "advantages": advantages}

"""The rollout-engine boundary.

A rollout engine turns prompt token ids into sampled completions with per-token log-probs, and accepts new
weights as Hugging Face-named tensors. The built-in engine (`megarl.rollout.builtin`) implements it in plain
PyTorch; SGLang's `Engine` fits behind the same protocol (`release_memory` / `resume_memory` map to its
`release_memory_occupation` / `resume_memory_occupation`, `update_weights` to `update_weights_from_tensor`).
Engines know nothing of Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Protocol, Sequence, runtime_checkable

import torch

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature == 0` means greedy."""

    n: int = 1  # completions per prompt
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus mass kept, 1.0 = off
    top_k: int = -1  # tokens kept, -1 = off
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()  # generation of a sequence ends after emitting one of these
    seed: int | None = None  # same seed, same prompts, same weights -> same samples

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Completion:
    """One sampled continuation of one prompt.

    `logprobs[i]` is log p(token_ids[i] | prompt, token_ids[:i]) under softmax(logits / temperature)
    (raw logits when temperature == 0), before any top-k / top-p truncation: the same quantity the actor
    recomputes, so the two can be compared token by token. A stop token, when hit, is the last element of
    `token_ids`.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int = 0


@runtime_checkable
class RolloutEngine(Protocol):
    """Token ids in; token ids, log-probs and finish reasons out."""

    weight_version: int

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """Sample `params.n` completions for each prompt; result[i] holds prompt i's group, in order."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Load full (unsharded) weights given by Hugging Face parameter names."""
        ...

    def release_memory(self) -> None:
        """Free rollout memory (KV cache, weights) before training. A no-op for the built-in engine."""
        ...

    def resume_memory(self) -> None:
        """Re-acquire what `release_memory` freed. A no-op for the built-in engine."""
        ...

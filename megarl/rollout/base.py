"""The rollout-engine boundary.

A rollout engine turns prompt token ids into sampled completions with per-token log-probs, and takes the actor's
weights after each update, as Hugging Face-named tensors in buckets (`megarl.rollout.weight_sync`). What every
engine must have is the protocol `RolloutEngine`; what only some engines can do (report rows as they finish,
record MoE routing, take weights from several GPUs, score whole distributions) is declared on `EngineCapabilities`,
a base class whose defaults say "cannot": an engine that can sets the field, and the trainer reads the field,
never asks an object whether it happens to have an attribute. An engine that does not derive from it (a plugin's,
written to the protocol alone) is wrapped in `ProtocolEngine` (`as_engine`) and has none of them. Backends are
registered by name in
`megarl.rollout.backends`: the built-in PyTorch engine (`builtin.py`), SGLang colocated or over HTTP
(`sglang_engine.py`), and Megatron's own inference engine over the actor's model (`megarl/mcore/
inference_engine.py`, the one engine that knows Megatron: it shares the actor's parameters instead of receiving
copies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Literal, Protocol, Sequence, runtime_checkable

import torch

from megarl.registry import refuse_bare_capabilities

if TYPE_CHECKING:
    from megarl.rollout.sglang_ipc import IpcGather
    from megarl.rollout.weight_sync import WeightBucket

# "abort": the engine stopped the request from outside before it finished (SGLang's `{"type": "abort"}`); the
# sample becomes `SampleStatus.ABORTED`, which never counts in the loss (`megarl.stages.algorithm.pack`).
FinishReason = Literal["stop", "length", "abort"]


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
    # Generation of a sequence also ends once the text of its new tokens contains one of these (a tool call's
    # closing tag); the token that completed it is the completion's last. Matched on decoded text, so the engine
    # needs the tokenizer (`BuiltinEngine(tokenizer=...)`; SGLang launched with its tokenizer).
    stop: tuple[str, ...] = ()

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
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must be a tuple of non-empty strings, got {self.stop!r}")


@dataclass
class Completion:
    """One sampled continuation of one prompt.

    `logprobs[i]` is log p(token_ids[i] | prompt, token_ids[:i]) under softmax(logits / temperature)
    (raw logits when temperature == 0), before any top-k / top-p truncation: the same quantity the actor
    recomputes, so the two can be compared token by token. A stop token, or the token that completed a stop
    string, is the last element of `token_ids` (finish reason "stop").

    `routed_experts` (mixture-of-experts models, engines that record routing): the experts each token was sent
    to, int16 [prompt + response tokens, sparse layers, top-k], for every token the engine ran through the model
    (the last response token, never fed back, repeats the one before it); the actor can replay them
    (`--routing-replay`). None: not recorded.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int = 0
    routed_experts: torch.Tensor | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """Token ids in; token ids, log-probs and finish reasons out; weights in, stamped with a version."""

    weight_version: int  # the version of the weights it holds; completions carry it
    dtype: torch.dtype | None  # weights are sent in this dtype; None: as the actor holds them
    shares_actor_weights: bool  # generates with the actor's own parameters: a sync moves nothing, only stamps

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """Sample `params.n` completions for each prompt; result[i] holds prompt i's group, in order."""
        ...

    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[list[float]]:
        """log p(sequence[t] | sequence[:t]) under softmax(logits / temperature) for every t >= prompt_len."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Load full (unsharded) weights given by Hugging Face parameter names, all or a subset."""
        ...

    def load_weight_buckets(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Load one sync's buckets (`weight_sync.pack_buckets`), then stamp `version`."""
        ...

    def release_memory(self, keep_weights: bool = False) -> None:
        """Free rollout memory (KV cache, weights) before training; a no-op where there is nothing to free.
        `keep_weights`: no push follows before the next rollout (an evaluation between steps), so the weights stay:
        an engine whose released weights lose their contents would generate from garbage otherwise."""
        ...

    def resume_memory(self) -> None:
        """Re-acquire what `release_memory` freed and forget state computed under older weights."""
        ...

    def shutdown(self) -> None:
        """Stop whatever the engine started (processes, servers it owns)."""
        ...


class EngineCapabilities:
    """The optional abilities of a rollout engine, declared: derive from this class (besides implementing
    `RolloutEngine`) and set what the engine can do; the defaults are what an engine that says nothing gets.

    - `reports_finished_rows`: `generate(prompts, params, on_finish=fn)` calls `fn(row, completion)` as each row
      stops, so a rollout function may score it while the others decode (`--reward-overlap`);
    - `records_routing`: completions carry `routed_experts` (mixture-of-experts models; `--routing-replay`);
    - `ipc_tp_size`: how many trainer ranks make their own payload of every weight bucket (a colocated engine at
      TP > 1, whose GPUs are the trainer's); above 1 the weight sync hands it an `IpcGather` (`use_ipc`);
    - `scores_distributions`: `score_distributions` gives the whole next-token distribution (the mismatch check,
      exact), `scores_topk`: `score_topk` gives its top k (the mismatch check, bounds);
    - `takes_buckets`: `load_weight_buckets` reads the buckets on this rank; False where another rank pushes them
      (a data-parallel leader of `SGLangServers(push=False)`), so an asynchronous sync keeps no copy of them here;
    - `loads_from_host`: `load_weight_buckets` takes buckets in host memory as well as on the GPU (it copies them
      to host memory itself: `EngineProcess`), so an asynchronous sync's copy, staged in host memory, goes to it as
      it is rather than back to the GPU one bucket at a time (`megarl.rollout.pipeline.OrderedEngine`).
    """

    reports_finished_rows: bool = False
    records_routing: bool = False
    ipc_tp_size: int = 1
    scores_distributions: bool = False
    scores_topk: bool = False
    takes_buckets: bool = True
    loads_from_host: bool = False

    def use_ipc(self, ipc: IpcGather) -> None:
        """Take each bucket's payloads from the `ipc_tp_size` trainer ranks on the engine's GPUs."""
        raise NotImplementedError(f"{type(self).__name__} declares ipc_tp_size {self.ipc_tp_size} but no use_ipc")

    def score_distributions(self, sequences: list[list[int]], prompt_lens: list[int],
                            temperature: float = 1.0) -> list[torch.Tensor]:
        """Per sequence [len(seq) - prompt_len, vocab] log-probs of every next token (`scores_distributions`)."""
        raise NotImplementedError(f"{type(self).__name__} does not score whole distributions")

    def score_topk(self, sequences: list[list[int]], prompt_lens: list[int],
                   k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sequence (ids, log-probs) [len(seq) - prompt_len, k] of the k likeliest tokens (`scores_topk`)."""
        raise NotImplementedError(f"{type(self).__name__} does not score top-k distributions")


class ProtocolEngine(EngineCapabilities):
    """A `RolloutEngine` that declares no capability (a plugin's, written to the protocol alone), with the
    defaults of `EngineCapabilities`: every call goes to `inner`."""

    def __init__(self, inner: RolloutEngine):
        self.inner = inner
        self.shares_actor_weights = inner.shares_actor_weights
        self.dtype = inner.dtype

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.inner.weight_version = version

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 on_finish: Callable[[int, Completion], None] | None = None) -> list[list[Completion]]:
        return self.inner.generate(prompts, params)

    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[list[float]]:
        return self.inner.score(sequences, prompt_lens, temperature)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        self.inner.update_weights(named_tensors, version)

    def load_weight_buckets(self, buckets: Iterable[WeightBucket], version: int) -> None:
        self.inner.load_weight_buckets(buckets, version)

    def release_memory(self, keep_weights: bool = False) -> None:
        if keep_weights:  # as the trainer calls an engine: the argument only when it is set
            self.inner.release_memory(keep_weights=True)
        else:
            self.inner.release_memory()

    def resume_memory(self) -> None:
        self.inner.resume_memory()

    def shutdown(self) -> None:
        self.inner.shutdown()


def as_engine(engine: RolloutEngine) -> EngineCapabilities:
    """`engine` with its capabilities declared: itself when it derives from `EngineCapabilities` (every engine of
    megarl's), else wrapped in `ProtocolEngine`."""
    if isinstance(engine, EngineCapabilities):
        return engine
    refuse_bare_capabilities(engine, EngineCapabilities, "rollout engine")
    return ProtocolEngine(engine)

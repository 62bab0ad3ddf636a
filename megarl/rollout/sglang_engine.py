"""SGLang behind the `RolloutEngine` protocol: in-process and colocated, or as HTTP servers on other nodes.

Colocated (`SGLangEngine`): each model-parallel leader of the trainer owns an in-process `sglang.Engine` on its
own GPUs (SGLang's TP x this rank's GPU onward). Actor and engine take turns with the memory; one step is

    generate -> release_memory (kv cache, weights, cuda graphs) -> train -> load_weight_buckets: resume
    weights, push the buckets -> resume_memory: resume cuda graphs and kv cache, flush the prefix cache -> generate

SGLang needs `enable_memory_saver` (torch_memory_saver) for the release, and an idle scheduler, which it is
between steps. In SGLang >= 0.5.23 weight updates run inside `begin_weight_update` / `end_weight_update`;
older versions have neither, and the adapter then calls the update alone. Buckets go over as
`load_format="flattened_bucket"`: one serialized `{flattened_tensor, metadata}` per SGLang TP rank, which for a
CUDA tensor is an IPC handle, not the data (`serialize_bucket`). SGLang's TP rank r opens only entry r, a payload
of its own (CUDA-IPC refcounting is per payload), made on rank r's own GPU: at TP > 1 the weight sync
(`megarl.stages.colocation.WeightSync`) attaches the trainer ranks on the engine's GPUs (`use_ipc`), which each
pack the same buckets from their own export stream and serialise their copy, and the leader gathers the payloads
(`megarl.rollout.sglang_ipc.IpcGather`). Without them (the engine used on its own) the leader serialises once per
TP rank, every TP rank opens a CUDA context on the leader's GPU, and the first load warns. After each bucket the
IPC memory the engine let go of is collected (`torch.cuda.ipc_collect`).

Disaggregated (`SGLangServers`): SGLang servers launched elsewhere (`--rollout-servers host:port,...`), reached
over HTTP. Prompts are split over the servers in contiguous blocks. Weights go either over NCCL (the trainer's
leader joins a process group with every server's TP ranks: `init_weights_update_group`, then per bucket
`update_weights_from_distributed` while the leader broadcasts the flat bucket) or from a checkpoint directory
on a shared file system (`update_weights_from_disk`). A server that refuses a control call answers 400 with
`{"success": false, "message": ...}`: the message is raised, and the trainer never waits in a collective for a
server that refused to join it. The pusher flushes the servers' prefix caches once after its push; SGLang
refuses `/flush_cache` (400) while any request runs or waits, so the flush is retried for a bounded time. Only one
data-parallel leader pushes; all of them then meet at a barrier (`LeaderBarrier`), so no leader generates before
every server holds the new weights. Generation and scoring requests are watched: a server that dies or hangs
(its `/health` unanswered for `--engine-health-timeout`) is named and its request sent to another server, or to it
again once it answers, up to `--engine-max-restarts` failures (`megarl.rollout.server_health`).

LoRA (`--lora-weight-sync adapter`): the engine is launched with SGLang's LoRA support (`enable_lora`,
`max_lora_rank`, `lora_target_modules`); the first sync pushes the base weights in buckets, each sync then loads
the version's adapters, PEFT-named CPU tensors with their adapter_config.json dict, as `megarl-v<version>`
(`load_lora_adapter_from_tensors`, in process; `/load_lora_adapter_from_tensors` over HTTP, the tensors pickled by
value since a server elsewhere cannot open shared memory) and unloads the previous version's; every generate and
score request then names the adapter (`lora_path`). A colocated engine keeps its base weights on the GPU while
the actor trains from then on: SGLang keeps no copy of released weights, and the base is not sent again.

On CPU (`launch(device="cpu")`, what the sglang backend picks without a GPU): SGLang's CPU engine
(`CPU_ENGINE_ARGS`), never colocated (memory release needs torch_memory_saver, hence CUDA: refused up front), with
no reproducible seeded sampling (deterministic inference is refused for its torch attention; greedy decoding
repeats) and no LoRA (its LoRA layers pin memory: refused up front); the run's log says the first two at launch.
The tests run it for real (tests/sglang_cpu, docs/guide.md "SGLang on CPU").

Health, where the engine is not colocated (the CPU engine): its scheduler and detokenizer processes are watched
(`megarl.rollout.sglang_health`: a process gone, or a call unanswered while they use no CPU for
`--engine-health-timeout`); a dead or hung engine is killed, launched again, given the weights of the last sync
(the adapter keeps a CPU copy of its buckets) and its version, and the generate or score call in flight is sent
again, up to `--engine-max-restarts` times (`restarts` and `seconds_lost`: the row's `engine_restarts` and
`engine_seconds_lost`); after that the run stops naming the engine and its last error. An engine that dies or
hangs during a weight sync is restarted the same way and starts with the sync's new weights (`_load_restartable`:
the buckets are copied to the CPU before the push), so a sync is neither lost nor half applied. Colocated on a GPU
nothing is watched yet (the restart would need the trainer's IPC handles again; not built without a GPU to test
it on).

Log-probs: SGLang reports log softmax(logits / temperature) of the sampled token, before top-k / top-p, which is
`Completion.logprobs`' definition (leave SGLANG_RETURN_ORIGINAL_LOGPROB unset). The engine knows nothing of
Megatron; `sglang` itself is imported only when an engine is launched or a bucket serialized.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import sys
import threading
import time
import urllib.error
import warnings
import urllib.request
from typing import Callable, Iterable, Sequence

import torch

from megarl.rollout.base import Completion, EngineCapabilities, SamplingParams
from megarl.rollout.engine_process import EngineDeadError
from megarl.rollout.server_health import ServerHealth, WatchedServers
from megarl.rollout.sglang_health import EngineWatch, RestartingCalls, fresh_event_loop, sigquit_noted
from megarl.rollout.sglang_ipc import IpcGather, release_ipc, serialize_bucket
from megarl.rollout.weight_sync import (DEFAULT_BUCKET_BYTES, WeightBucket, WeightSyncError, adapter_name,
                                        pack_buckets)

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
# Every region torch_memory_saver manages in SGLang 0.5.23; the captured CUDA graphs' memory is one of them.
MEMORY_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)


def sglang_available() -> tuple[bool, str]:
    """(importable, why not) without raising: `sglang` needs CUDA kernels to run a model, not to import. Without a
    GPU, SGLang's CPU path is selected first: SGLang reads `SGLANG_USE_CPU_ENGINE` once, when it is imported."""
    if not torch.cuda.is_available():
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    try:
        import sglang  # noqa: F401 - only to see it imports
    except Exception as e:  # noqa: BLE001 - ImportError, or a kernel wheel that fails to load in any way
        return False, f"sglang is not importable ({type(e).__name__}: {e})"
    return True, ""


def _own_payload(bucket: WeightBucket, tp_size: int) -> list[str]:
    """`tp_size` payloads serialised by this process, one per TP rank: each TP rank opens a handle of its own, as
    SGLang's CUDA-IPC refcounting needs (its own `Engine._serialize_tensors_per_rank` serialises plain tensors so),
    but all of them point to this rank's GPU. `IpcGather.payloads` makes each on the TP rank's own GPU."""
    return [serialize_bucket(bucket) for _ in range(tp_size)]


def _close_quietly(ipc: IpcGather, error: str, rest: Iterable[WeightBucket], cause: BaseException) -> None:
    """`ipc.close(error, rest)` on a failed sync; should that fail too (the gather's collectives broke), the
    original error is still the one raised, with this one as a note."""
    try:
        ipc.close(error, rest)
    except Exception as e:  # noqa: BLE001 - reported on the error being raised, which names the first cause
        cause.add_note(f"telling the other ranks of the engine failed too: {type(e).__name__}: {e}")


def sampling_dict(params: SamplingParams, seed: int | None = None) -> dict:
    """megarl's `SamplingParams` in SGLang's request form (one request = one sample; `n` is handled by the caller)."""
    out = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
           "top_k": params.top_k, "stop_token_ids": list(params.stop_token_ids)}
    if params.stop:  # matched by SGLang on the decoded text; output_ids keep the tokens that spelled it
        out["stop"] = list(params.stop)
    if seed is not None:
        out["sampling_seed"] = seed
    return out


def expand_requests(prompts: Sequence[Sequence[int]], params: SamplingParams) -> tuple[list[list[int]], list[dict]]:
    """Each prompt repeated `n` times, consecutively, with its own seed: explicit order, and SGLang's radix cache
    still prefills the shared prompt once."""
    ids, sampling = [], []
    for i, prompt in enumerate(prompts):
        for j in range(params.n):
            ids.append(list(prompt))
            sampling.append(sampling_dict(params, None if params.seed is None else params.seed + i * params.n + j))
    return ids, sampling


def to_completion(output: dict, version: int) -> Completion:
    """One SGLang output as a `Completion`. A request SGLang aborted (`finish_reason` `{"type": "abort",
    "message": ...}`: aborted from outside, or refused, with whatever it had generated) did not finish: it keeps
    finish reason "abort", which the rollout functions turn into `SampleStatus.ABORTED` (counted in `aborted_frac`,
    always out of the loss), never a finished or a length-truncated answer."""
    meta = output["meta_info"]
    token_ids = list(output["output_ids"])
    logprobs = [float(lp) for lp, _tok, *_ in meta.get("output_token_logprobs") or []]
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"SGLang returned {len(token_ids)} tokens but {len(logprobs)} log-probs")
    return Completion(token_ids=token_ids, logprobs=logprobs,
                      finish_reason=_FINISH.get(_finish_kind(output), "length"), weight_version=version)


# SGLang's finish kinds: "stop" (a stop token or string), "length" (max_new_tokens), "abort"; anything else (no
# reason at all) did not finish by the policy's choice and is treated as cut at the length limit.
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _finish_kind(output: dict) -> str:
    reason = output["meta_info"].get("finish_reason") or {}
    return str(reason.get("type") if isinstance(reason, dict) else reason)


def count_aborted(outputs: Sequence[dict]) -> int:
    """How many of `outputs` SGLang aborted; warns with the first one's message, since the run goes on with them
    as aborted samples, out of the loss (`to_completion`)."""
    aborted = [o for o in outputs if _finish_kind(o) == "abort"]
    if aborted:
        reason = aborted[0]["meta_info"].get("finish_reason")
        message = reason.get("message", "") if isinstance(reason, dict) else ""
        warnings.warn(f"SGLang aborted {len(aborted)} of {len(outputs)} requests ({message or 'no message'}): they "
                      "enter the batch as aborted samples, out of the loss (aborted_frac)",
                      RuntimeWarning, stacklevel=3)
    return len(aborted)


def check_score_temperature(temperature: float) -> None:
    """SGLang's input log-probs (`input_token_logprobs`, what `score` reads) are a plain log_softmax of the logits:
    it scales prompt logits by no temperature (`Req.temp_scaled_logprobs` is never set for them), whatever the
    request's temperature. Scoring at any other temperature would return the T = 1 values under another name."""
    if temperature != 1.0:
        raise ValueError(f"SGLang score(): temperature {temperature:g} is not supported: SGLang scores input tokens "
                         "with a plain log_softmax (temperature 1) whatever the request says; call score with "
                         "temperature=1.0")


def group(completions: list[Completion], n: int) -> list[list[Completion]]:
    return [completions[i : i + n] for i in range(0, len(completions), n)]


def input_logprobs(output: dict, seq_len: int, prompt_len: int) -> list[float]:
    """Log-probs of a scored sequence's tokens after its prompt, from `meta_info.input_token_logprobs` of a
    request sent with `logprob_start_len=0` (entry k: token k given tokens[:k]; entry 0 has none)."""
    entries = output["meta_info"]["input_token_logprobs"]
    if len(entries) != seq_len:
        raise RuntimeError(f"SGLang scored {len(entries)} input tokens of a {seq_len}-token sequence")
    return [float(e[0]) for e in entries[prompt_len:]]


def input_top_logprobs(output: dict, seq_len: int, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's top-k (token ids, log-probs) [seq_len - prompt_len, k] at each token after its prompt, from
    `meta_info.input_top_logprobs` of a request sent with `logprob_start_len=0, top_logprobs_num=k` (entry j: the
    k likeliest tokens given tokens[:j], each as (logprob, token_id, text); entry 0 has none)."""
    entries = output["meta_info"]["input_top_logprobs"]
    if len(entries) != seq_len:
        raise RuntimeError(f"SGLang gave top log-probs for {len(entries)} input tokens of a {seq_len}-token sequence")
    rows = entries[prompt_len:]
    ids = torch.tensor([[int(e[1]) for e in row] for row in rows], dtype=torch.long)
    logp = torch.tensor([[float(e[0]) for e in row] for row in rows], dtype=torch.float64)
    return ids, logp


def _check(result, what: str) -> None:
    """SGLang's control calls answer (success, message), {"success": ..., "message": ...}, or (the LoRA ones) an
    object or dict with `success` and `error_message`."""
    if not isinstance(result, (dict, tuple, list)) and hasattr(result, "success"):
        result = (result.success, getattr(result, "error_message", None) or "")
    if isinstance(result, dict):
        result = (result.get("success", True), result.get("message") or result.get("error_message") or "")
    if isinstance(result, (tuple, list)) and result and result[0] is False:
        raise WeightSyncError(f"SGLang {what} failed: {result[1] if len(result) > 1 else ''}")


@contextlib.contextmanager
def _engine_environment():
    """The trainer's environment as SGLang's processes need it, and as the trainer needs it back afterwards.

    - Without TORCHELASTIC_USE_AGENT_STORE, which torchrun sets and SGLang's spawned schedulers inherit: under it
      torch <= 2.13 makes every rank of SGLang's own process group a client of a TCP store nobody hosts (the
      scheduler waits in `_create_c10d_store` until its timeout; seen on CPU, torch 2.13). torch 2.14.1 applies it
      only at MASTER_ADDR:MASTER_PORT, which SGLang does not use.
    - SGLang writes NCCL settings (NCCL_ALGO and NCCL_MIN/MAX_NCHANNELS at TP > 1 with deterministic inference,
      NCCL_CUMEM_ENABLE, NCCL_NVLS_ENABLE) and CUDA_DEVICE_MAX_CONNECTIONS into the process that launches it,
      which is the trainer: they are put back as they were once its processes are spawned. Only model-parallel
      leaders launch engines and the trainer's communicators start lazily, afterwards: with SGLang's values the
      leaders would run every all-reduce as a tree while their peers may pick a ring (a hang).
    """
    saved = {k: v for k, v in os.environ.items() if _restored(k) or k == "TORCHELASTIC_USE_AGENT_STORE"}
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        yield
    finally:
        for key in [k for k in os.environ if _restored(k)]:
            if key not in saved:
                del os.environ[key]
        os.environ.update(saved)


def _restored(key: str) -> bool:
    """The variables of the trainer's own communicators and CUDA context, whatever SGLang writes to them."""
    return key.startswith("NCCL_") or key == "CUDA_DEVICE_MAX_CONNECTIONS"


def _note(message: str) -> None:
    """A line in the run's log (stderr, as megarl's other warnings) that is not worth a Python warning."""
    print(f"megarl: sglang: {message}", file=sys.stderr, flush=True)


def _refuse_colocated_on_cpu(colocated: bool | None) -> bool:
    """SGLang's CPU engine runs beside the actor, never colocated: releasing its memory needs torch_memory_saver,
    which needs CUDA (without it `release_memory_occupation` releases nothing; with it the scheduler dies on
    libcuda.so.1). Refuses `colocated=True` before anything starts, instead of an engine that holds on to its
    memory or dies at the first release."""
    if colocated:
        raise ValueError("SGLang on CPU cannot run colocated: releasing its memory between rollouts "
                         "(release_memory_occupation) needs torch_memory_saver, which needs a CUDA GPU; launch it "
                         "with colocated=False (it keeps its weights and KV cache while the actor trains)")
    _note("CPU engine, not colocated: it keeps its weights and KV cache while the actor trains (memory release "
          "needs a CUDA GPU)")
    return False


# Tried on CPU: the scheduler dies at start in `sglang/srt/lora/layers.py` (`torch.tensor(..., pin_memory=True)`).
CPU_LORA_REFUSED = ("--lora-weight-sync adapter: SGLang 0.5.23's CPU engine does not take LoRA (its LoRA layers "
                    "allocate pinned memory at start, which needs CUDA); use --lora-weight-sync merged, which sends "
                    "the adapters merged into the weights")

# What SGLang 0.5.23 needs to run on CPU: its CPU path (`SGLANG_USE_CPU_ENGINE=1`, read when sglang is imported),
# torch attention, no CUDA graphs, and a KV pool bounded in tokens (on CPU `mem_fraction_static` is a share of the
# machine's memory).
CPU_ENGINE_ARGS = {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True,
                   "max_total_tokens": 16384}


def cpu_engine_args(server_args: dict, seed: int | None) -> dict:
    """`server_args` with SGLang's CPU settings (`CPU_ENGINE_ARGS`) where not given. Seeded sampling is not
    reproducible there: SGLang honours a request's `sampling_seed` only with deterministic inference, which it
    refuses for the torch attention backend; greedy decoding is reproducible."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    out = {**CPU_ENGINE_ARGS, **server_args}
    if seed is not None and not out.get("enable_deterministic_inference"):
        _note(f"CPU engine: seeded sampling is not reproducible (seed {seed}): SGLang ignores the requests' "
              "sampling_seed without deterministic inference, which it does not offer for its CPU attention "
              "(torch_native); greedy decoding is reproducible")
    out.setdefault("enable_deterministic_inference", False)
    return out


class SGLangEngine(RestartingCalls, EngineCapabilities):
    """A `RolloutEngine` over an in-process `sglang.Engine` colocated with the actor (see the module docstring).

    `engine` is an `sglang.Engine` or anything with its methods (the tests pass a recording fake)."""

    shares_actor_weights = False
    scores_topk = True  # `score_topk` (the mismatch check's bounds)

    def __init__(self, engine, *, tp_size: int = 1, colocated: bool = True, dtype: torch.dtype | None = None,
                 serialize: Callable[[WeightBucket, int], list] | None = None, ipc: IpcGather | None = None,
                 tokenizer: bool = True, watch: EngineWatch | None = None,
                 relaunch: Callable[[], tuple[object, EngineWatch]] | None = None, max_restarts: int = 0,
                 timeout_s: float = 3600.0):
        """`tokenizer`: whether the engine was launched with its tokenizer, which stop strings need.
        `ipc`: the trainer ranks on the engine's GPUs, which make one payload each (at `tp_size` > 1; the weight
        sync attaches them with `use_ipc`); `serialize(bucket, tp_size)`: the per-TP-rank payloads of a bucket,
        instead of `ipc` (tests). `watch`: the engine's processes, whose health every call is checked against;
        `relaunch()`: a fresh engine and its watch, for up to `max_restarts` restarts (module docstring, Health);
        `timeout_s`: the longest a watched call may take."""
        self.engine = engine
        self.watch, self.relaunch, self.max_restarts, self.timeout_s = watch, relaunch, max_restarts, timeout_s
        self.restarts, self.seconds_lost = 0, 0.0  # the row's engine_restarts, engine_seconds_lost
        self._kept: list[WeightBucket] = []  # the last sync's buckets, on the CPU, for a restarted engine
        self._kept_version = 0  # their version (0: none kept, the checkpoint's weights)
        self.tokenizer = tokenizer
        self.dtype = dtype  # weights are sent in this dtype (None: as the actor holds them)
        self.tp_size = tp_size
        self.colocated = colocated
        self.ipc: IpcGather | None = None
        self._serialize = serialize
        self._warned = False  # about payloads all made on this rank's GPU (`_payloads`)
        if ipc is not None:
            self.use_ipc(ipc)
        self.weight_version = 0
        self.aborted = 0  # requests SGLang aborted so far (`count_aborted`)
        self._released: set[str] = set()
        self.adapter: str | None = None  # the LoRA adapter every request names (`load_lora_adapter`)

    @classmethod
    def launch(cls, hf_dir: str, *, tp_size: int = 1, base_gpu_id: int = 0, mem_fraction: float = 0.5,
               dtype: str = "bfloat16", seed: int | None = 0, colocated: bool | None = None, tokenizer: bool = False,
               ipc: IpcGather | None = None, lora_rank: int = 0, lora_targets: Sequence[str] = (),
               device: str = "cuda", health_timeout_s: float = 60.0, max_restarts: int = 0,
               timeout_s: float = 3600.0, **server_args) -> SGLangEngine:
        """`tokenizer`: load SGLang's tokenizer and detokenizer, which matching `SamplingParams.stop` needs.
        `lora_rank` > 0: SGLang's LoRA support on, for adapters of that rank on `lora_targets` (HF projection
        names), loaded at each sync (`load_lora_adapter`, --lora-weight-sync adapter).

        `seed`: SGLang's `random_seed`; a seeded engine is also launched with `enable_deterministic_inference`,
        without which SGLang 0.5.23 ignores the per-request `sampling_seed` megarl sends (same seed, different
        samples). Deterministic inference uses batch-invariant kernels (slower; SGLang picks an attention backend
        that supports it); pass `enable_deterministic_inference=False` to trade the reproducibility for speed.

        `device`: "cuda", or "cpu" (SGLang's CPU engine, `cpu_engine_args`, never colocated).
        `colocated` (None: on a GPU only) launches with SGLang's memory saver, for the release/resume cycle.
        Not colocated, the engine is watched and restarted (`health_timeout_s`, `max_restarts`: the module
        docstring's Health); `timeout_s`: the longest a call on it may take."""
        if device == "cpu":
            if lora_rank:
                raise ValueError(CPU_LORA_REFUSED)
            colocated = _refuse_colocated_on_cpu(colocated)
            server_args = cpu_engine_args(server_args, seed)
        colocated = True if colocated is None else colocated
        ok, why = sglang_available()
        if not ok:
            raise RuntimeError(f"--rollout-backend sglang: {why}; install SGLang on the GPU machine "
                               "(pip install 'megarl[sglang]') or use --rollout-backend builtin")
        import sglang

        server_args.setdefault("enable_deterministic_inference", seed is not None)
        if lora_rank:
            server_args.update(enable_lora=True, max_lora_rank=lora_rank, lora_target_modules=list(lora_targets))
        if not colocated:  # SGLang's watchdog would kill the trainer's process tree when a child dies
            server_args["custom_sigquit_handler"] = sigquit_noted

        def start():
            with _engine_environment():
                return sglang.Engine(model_path=str(hf_dir), tp_size=tp_size, base_gpu_id=base_gpu_id,
                                     mem_fraction_static=mem_fraction, dtype=dtype,
                                     random_seed=0 if seed is None else seed,
                                     enable_memory_saver=colocated, skip_tokenizer_init=not tokenizer,
                                     log_level="error", **server_args)

        health = {}
        if colocated:
            engine = start()
        else:
            engine, watch = EngineWatch.launched(start, health_timeout_s)
            if watch is not None:
                health = dict(watch=watch, relaunch=lambda: EngineWatch.launched(start, health_timeout_s),
                              max_restarts=max_restarts, timeout_s=timeout_s)
        return cls(engine, tp_size=tp_size, colocated=colocated, tokenizer=tokenizer, ipc=ipc,
                   dtype=getattr(torch, dtype) if dtype in ("bfloat16", "float16", "float32") else None, **health)

    @property
    def ipc_tp_size(self) -> int:
        """How many trainer ranks each make their own payload of every bucket (`use_ipc`): the TP ranks of a
        colocated engine, whose GPUs are the trainer's; 1 where the leader's payloads are all it needs."""
        return self.tp_size if self.colocated and self._serialize is None else 1

    def use_ipc(self, ipc: IpcGather) -> None:
        """From now on the payloads of a bucket come from the trainer ranks on the engine's GPUs, one each
        (`IpcGather`); those ranks must take part in every `load_weight_buckets` (`WeightSync` sees to it)."""
        if ipc.tp_size != self.tp_size:
            raise ValueError(f"the IpcGather spans {ipc.tp_size} ranks ({ipc.ranks}) but the engine runs at TP "
                             f"{self.tp_size}: one trainer rank per SGLang TP rank")
        self.ipc = ipc

    def _payloads(self, bucket: WeightBucket) -> list:
        if self._serialize is not None:
            return self._serialize(bucket, self.tp_size)
        if self.ipc is not None:
            return self.ipc.payloads(bucket, self.tp_size)
        if self.tp_size > 1 and not self._warned:
            self._warned = True
            warnings.warn(f"SGLang engine at TP {self.tp_size} without the trainer ranks on its GPUs (no use_ipc): "
                          "each TP rank gets a payload of its own, all serialised on this rank's GPU, so each opens "
                          "a CUDA context there; sync through megarl.stages.colocation.WeightSync, which has each "
                          "made on the TP rank's own GPU (megarl.rollout.sglang_ipc)", RuntimeWarning, stacklevel=4)
        return _own_payload(bucket, self.tp_size)

    # -- rollout ---------------------------------------------------------------------------------------------

    def _lora(self, n: int) -> dict:
        """The `generate` keyword that applies the loaded adapter to each of `n` requests ({} without one)."""
        return {"lora_path": [self.adapter] * n} if self.adapter is not None else {}

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        if not prompts:
            return []
        if params.stop and not self.tokenizer:
            raise ValueError("SamplingParams.stop: this SGLang engine was launched without its tokenizer "
                             "(skip_tokenizer_init), so it cannot match stop strings; launch it with tokenizer=True")
        ids, sampling = expand_requests(prompts, params)
        outputs = self._call("generate", lambda e: e.generate(input_ids=ids, sampling_params=sampling,
                                                              return_logprob=True, **self._lora(len(ids))))
        self.aborted += count_aborted(outputs)
        return group([to_completion(o, self.weight_version) for o in outputs], params.n)

    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[list[float]]:
        """Log-probs of each sequence's tokens after its prompt (one prefill, one throwaway new token); at
        temperature 1 only (`check_score_temperature`)."""
        check_score_temperature(temperature)
        outputs = self._call("score", lambda e: e.generate(
            input_ids=[list(s) for s in sequences], sampling_params={"max_new_tokens": 1, "temperature": temperature},
            return_logprob=True, logprob_start_len=0, **self._lora(len(sequences))))
        return [input_logprobs(o, len(s), p) for o, s, p in zip(outputs, sequences, prompt_lens)]

    def score_topk(self, sequences: list[list[int]], prompt_lens: list[int],
                   k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The engine's k likeliest next tokens and their log-probs at each token after its prompt, at temperature
        1: per sequence (ids, log-probs) [len(seq) - prompt_len, k] (`megarl.rollout.mismatch.topk_mismatch`)."""
        outputs = self._call("score_topk", lambda e: e.generate(
            input_ids=[list(s) for s in sequences], sampling_params={"max_new_tokens": 1, "temperature": 1.0},
            return_logprob=True, logprob_start_len=0, top_logprobs_num=k, **self._lora(len(sequences))))
        return [input_top_logprobs(o, len(s), p) for o, s, p in zip(outputs, sequences, prompt_lens)]

    # -- the colocation cycle --------------------------------------------------------------------------------

    def release_memory(self, keep_weights: bool = False) -> None:
        """Free everything the memory saver holds for training (colocated mode only): the KV cache, the weights
        and the captured CUDA graphs' memory, which would otherwise stay reserved while the actor trains.
        `keep_weights` (no push follows: an evaluation between steps): the weights stay. SGLang keeps no copy of
        released weights unless `enable_weights_cpu_backup` is on, so weights released with no push after them
        come back as uninitialised memory. Once a LoRA adapter is loaded the weights always stay: they are the base
        the adapters apply to, sent once (--lora-weight-sync adapter)."""
        if self.colocated:
            keep_weights = keep_weights or self.adapter is not None
            tags = [t for t in MEMORY_TAGS if not (keep_weights and t == WEIGHTS)]
            _check(self.engine.release_memory_occupation(tags=tags), "release_memory_occupation")
            self._released = set(tags)

    def load_weight_buckets(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Resume the weights' memory if released, then push every bucket without flushing the cache per bucket.
        A watched engine that can be relaunched (the CPU engine beside the actor) is synced by `_load_restartable`."""
        if self.watch is not None and self.relaunch is not None and self.ipc is None:
            self._load_restartable(buckets, version)
            return
        session = hasattr(self.engine, "begin_weight_update")
        buckets = iter(buckets)
        try:
            if WEIGHTS in self._released:
                _check(self.engine.resume_memory_occupation(tags=[WEIGHTS]), "resume_memory_occupation(weights)")
                self._released.discard(WEIGHTS)
            if session:
                _check(self._call("begin_weight_update", lambda e: e.begin_weight_update()), "begin_weight_update")
            try:
                for bucket in buckets:
                    payloads = self._payloads(bucket)
                    if len(payloads) != self.tp_size:
                        raise WeightSyncError(f"{len(payloads)} IPC payloads for an engine at TP {self.tp_size}: "
                                              "SGLang needs one per TP rank")
                    result = self._call("update_weights_from_tensor", lambda e, p=payloads: (
                        e.update_weights_from_tensor(named_tensors=p, load_format="flattened_bucket",
                                                     flush_cache=False)))
                    _check(result, "update_weights_from_tensor")
                    del payloads
                    release_ipc()  # the engine has loaded this bucket and closed its handles (slime: per chunk)
                    if self.ipc is not None:
                        self.ipc.loaded()  # the other ranks drop their copies
            finally:
                if session:
                    _check(self._call("end_weight_update", lambda e: e.end_weight_update()), "end_weight_update")
        except BaseException as e:
            if self.ipc is not None:  # the other ranks on the engine's GPUs learn it where they wait, and raise
                _close_quietly(self.ipc, f"{type(e).__name__}: {e}", buckets, e)
            raise
        if self.ipc is not None:
            self.ipc.close()
        self.weight_version = version

    def _load_restartable(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """The sync of a watched engine that can be relaunched: every bucket copied to the CPU first (what a
        restarted engine loads), then pushed in one watched call. An engine that dies or hangs during it is
        restarted (`_call`, within --engine-max-restarts) and loads these new weights as it starts, so a sync is
        neither lost nor half applied; past the restarts the run stops, naming the sync."""
        kept = [WeightBucket(b.flat.detach().to("cpu", copy=True), list(b.slots)) for b in buckets]
        self._sync_kept(kept, version, self._push)
        self.weight_version = version

    def _push(self, engine, buckets: Sequence[WeightBucket]) -> None:
        """`buckets` into `engine`, in one weight-update session where it has them."""
        session = hasattr(engine, "begin_weight_update")
        if session:
            _check(engine.begin_weight_update(), "begin_weight_update")
        for bucket in buckets:
            payloads = self._payloads(bucket)
            if len(payloads) != self.tp_size:
                raise WeightSyncError(f"{len(payloads)} payloads for an engine at TP {self.tp_size}: SGLang needs "
                                      "one per TP rank")
            _check(engine.update_weights_from_tensor(named_tensors=payloads, load_format="flattened_bucket",
                                                     flush_cache=False), "update_weights_from_tensor")
            del payloads
            release_ipc()
        if session:
            _check(engine.end_weight_update(), "end_weight_update")

    def load_lora_adapter(self, tensors: dict[str, torch.Tensor], config: dict, version: int) -> None:
        """Load the adapters of `version` (PEFT-named, whole: SGLang shards them over its TP ranks itself) as
        `megarl-v<version>`, unload the previous version's, and name the new one in every request from now on.
        The base weights must be in place (the first sync pushes them, and they are never released after)."""
        if WEIGHTS in self._released:
            raise WeightSyncError("SGLang's weights are released: push the base weights (load_weight_buckets) before "
                                  "loading LoRA adapters onto them")
        name = adapter_name(version)
        if self.adapter == name:  # the same version again: SGLang refuses a name already loaded
            _check(self.engine.unload_lora_adapter(lora_name=name), f"unload_lora_adapter({name})")
            self.adapter = None
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        _check(self.engine.load_lora_adapter_from_tensors(lora_name=name, tensors=tensors, config_dict=config),
               f"load_lora_adapter_from_tensors({name})")
        old, self.adapter = self.adapter, name
        if old is not None:
            _check(self.engine.unload_lora_adapter(lora_name=old), f"unload_lora_adapter({old})")
        self.weight_version = version

    def resume_memory(self) -> None:
        """Re-acquire what is still released (the CUDA graphs and the KV cache after a push), then flush the prefix
        cache: cached prefixes were computed with the old weights."""
        tags = [t for t in (WEIGHTS, CUDA_GRAPH, KV_CACHE) if t in self._released]
        if tags:
            _check(self.engine.resume_memory_occupation(tags=tags), f"resume_memory_occupation({','.join(tags)})")
            self._released.clear()
        self._call("flush_cache", lambda e: e.flush_cache())

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        if self.ipc is not None:
            raise WeightSyncError(f"SGLangEngine.update_weights: the engine's TP ranks load each bucket from the "
                                  f"trainer ranks {self.ipc.ranks}, which must all pack it: sync through "
                                  "megarl.stages.colocation.WeightSync")
        self.load_weight_buckets(pack_buckets(named_tensors, DEFAULT_BUCKET_BYTES),
                                 self.weight_version + 1 if version is None else version)

    def shutdown(self) -> None:
        self.engine.shutdown()

    # -- health (not colocated) ------------------------------------------------------------------------------

    def _handle(self):
        return self.engine

    def _restart(self) -> None:
        """A fresh engine holding the weights of the last sync (or the checkpoint's, before any) and its version,
        the dead one's processes killed."""
        self.watch.kill(self.engine)
        fresh_event_loop()
        self.engine, self.watch = self.relaunch()
        if self._kept:
            self.watch.call(lambda: self._push(self.engine, self._kept),
                            f"weight load (version {self._kept_version})", self.timeout_s)

    def kill_for_fault(self, hang: bool = False) -> None:
        """MEGARL_FAULT engine_crash (SIGKILL) or engine_hang (SIGSTOP) of the engine's processes."""
        if self.watch is None:
            raise EngineDeadError("engine_crash / engine_hang: a colocated SGLang engine is not watched (only "
                                  "SGLang's CPU engine, beside the actor, is)")
        self.watch.kill_for_fault(hang)


# ---------------------------------------------------------------------------------------------------------
# Disaggregated: SGLang servers on other nodes.


class ServerRefused(RuntimeError):
    """An SGLang server answered an HTTP error status; `message` is what it said."""

    def __init__(self, where: str, status: int, message: str):
        super().__init__(f"SGLang at {where} answered HTTP {status}: {message}")
        self.where, self.status, self.message = where, status, message


def _error_message(e: urllib.error.HTTPError) -> str:
    """SGLang's own words from an error answer: `{"message": ...}` (control endpoints), `{"error": {"message":
    ...}}` (generation), or the plain text some endpoints send (`/flush_cache`)."""
    text = e.read().decode(errors="replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text or str(e.reason)
    if isinstance(data, dict):
        error = data.get("error")
        message = (data.get("message") or data.get("error_message")
                   or (error.get("message") if isinstance(error, dict) else error))
        return str(message) if message else text
    return text


def _post(url: str, path: str, payload: dict | None = None, timeout: float = 3600.0):
    """POST `payload` as JSON; the answer's JSON (a plain-text answer as `{"message": text}`). An error status
    raises `ServerRefused` with SGLang's message (urllib's HTTPError alone says only "Bad Request")."""
    where = url.rstrip("/") + path
    req = urllib.request.Request(where, data=json.dumps(payload or {}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        raise ServerRefused(where, e.code, _error_message(e)) from None
    try:
        return json.loads(body) if body.strip() else {}
    except ValueError:  # some endpoints answer plain text (`/flush_cache`: "Cache flushed. ...")
        return {"message": body.decode(errors="replace").strip()}


def _get(url: str, path: str, timeout: float = 60.0) -> dict:
    with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


def server_tp_size(url: str) -> int:
    """A server's tensor-parallel size from its `/server_info` (`/get_server_info` before SGLang 0.5.2x)."""
    for path in ("/server_info", "/get_server_info"):
        try:
            return int(_get(url, path).get("tp_size", 1))
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
    raise RuntimeError(f"{url}: neither /server_info nor /get_server_info answers; pass tp_sizes explicitly")


def _in_threads(calls: list[Callable[[], object]]) -> tuple:
    """Start calls concurrently (a server call may block until the trainer joins a collective); `_join` waits
    for them and re-raises the first error."""
    results, errors = [None] * len(calls), []

    def run(i, call):
        try:
            results[i] = call()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    return threads, results, errors


def _join(pending) -> list:
    threads, results, errors = pending
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _until(done: Callable[[], bool], pending, poll_s: float = 0.02) -> None:
    """Wait for `done()` while watching the server calls in `pending`: the first of them to fail is raised at
    once. A server that refuses to join a collective answers within milliseconds; the collective itself would
    wait for it until its timeout (600 s under NCCL)."""
    errors = pending[2]
    while not done():
        if errors:
            raise errors[0]
        time.sleep(poll_s)


def init_weights_update_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                              group_name: str, timeout_s: float = 600.0):
    """The trainer's side of SGLang's weight-update group: a process group of its own, outside the default one,
    rendezvoused the way SGLang's servers join it (`init_custom_process_group`: a TCP store at
    master_address:master_port, under a `group_name` prefix). Uses torch's private `_new_process_group_helper`,
    as SGLang does.

    The trainer (rank 0) hosts the store itself. `c10d.rendezvous("tcp://...")` would not do: under torchrun
    (TORCHELASTIC_USE_AGENT_STORE=True) torch <= 2.13 makes every rank a client of the agent's store, whatever the
    port, so trainer and servers would all wait for a store nobody hosts."""
    import datetime

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                          multi_tenant=True)
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                           group_name=group_name, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _abandon(group) -> None:
    """Abort a weight-update group left mid-collective by a refusing server, so no watchdog waits on it."""
    from torch.distributed import distributed_c10d as c10d

    abort = getattr(c10d, "_abort_process_group", None)
    if abort is not None and isinstance(group, c10d.ProcessGroup):
        try:
            abort(group)
        except Exception:  # noqa: BLE001 - best effort: the sync has already failed with the server's message
            pass


class LeaderBarrier:
    """Where the data-parallel leaders of a disaggregated run meet after each weight sync, so that none of them
    generates before every server holds the new weights. Only one leader pushes (`SGLangServers(push=True)`);
    without this the others would stamp the new version on completions sampled, by the servers, from the old
    weights, for as long as the push takes. A barrier on keys of a `torch.distributed` store (the default
    group's, prefixed), not a collective: it needs no process group of its own (the engines exist on the leaders
    only), it can name the leaders that did not arrive, and a pusher that failed posts its error, so the others
    raise with it at once instead of at the timeout."""

    def __init__(self, store, dp_rank: int, dp_size: int, timeout_s: float = 600.0, poll_s: float = 0.05):
        self.store, self.dp_rank, self.dp_size = store, dp_rank, dp_size
        self.timeout_s, self.poll_s = timeout_s, poll_s

    @classmethod
    def over_default_store(cls, dp_rank: int, dp_size: int, timeout_s: float = 600.0) -> LeaderBarrier:
        from torch.distributed import distributed_c10d as c10d

        return cls(c10d.PrefixStore("megarl_weight_sync", c10d._get_default_store()), dp_rank, dp_size, timeout_s)

    def _key(self, version: int, who) -> str:
        return f"{version}/{who}"

    def fail(self, version: int, message: str) -> None:
        """This leader's sync of `version` failed: the others raise with `message`."""
        self.store.set(self._key(version, "failed"), message)

    def arrive(self, version: int) -> None:
        """This leader holds `version`; returns once every leader does. Raises `WeightSyncError` naming the
        data-parallel ranks still missing after `timeout_s` (--distributed-timeout-seconds), or with the message
        of a leader whose sync failed."""
        self.store.set(self._key(version, self.dp_rank), "1")
        keys = [self._key(version, r) for r in range(self.dp_size)]
        failed = self._key(version, "failed")
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.store.check([failed]):
                raise WeightSyncError(f"weight sync {version} failed on another data-parallel leader: "
                                      f"{self.store.get(failed).decode(errors='replace')}")
            if self.store.check(keys):
                return
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
                raise WeightSyncError(
                    f"weight sync {version}: the data-parallel leader(s) of DP rank {missing} did not finish it "
                    f"within {self.timeout_s:g} s (--distributed-timeout-seconds), so rank {self.dp_rank} cannot "
                    "know the servers hold the new weights; DP rank 0 pushes them (is its push stuck or dead?)")
            time.sleep(self.poll_s)


class SGLangServers(WatchedServers, EngineCapabilities):
    """A `RolloutEngine` over SGLang HTTP servers (disaggregated mode; see the module docstring).

    `tp_sizes[i]` is server i's tensor-parallel size (asked from the server when not given): its TP ranks join
    the weight-update group after the trainer's leader (rank 0). With several data-parallel leaders, one pushes
    (`push=True`) and flushes the prefix caches after its push; the others only generate, and `barrier` keeps
    every leader from generating before the push is over."""

    shares_actor_weights = False
    dtype = None  # weights travel as the actor holds them; each server casts to its own dtype
    flush_retries = 60  # SGLang refuses /flush_cache while requests run or wait; slime retries as long
    flush_interval_s = 1.0

    def __init__(self, urls: Sequence[str], *, tp_sizes: Sequence[int] | None = None, push: bool = True,
                 timeout_s: float = 3600.0, barrier: LeaderBarrier | None = None, health_timeout_s: float = 60.0,
                 max_restarts: int = 0):
        if not urls:
            raise ValueError("SGLangServers needs at least one server URL")
        self.urls = [u if u.startswith("http") else f"http://{u}" for u in urls]
        # generation and scoring are watched (`/health`) and failed over to the other servers (`server_health`)
        self.health = ServerHealth(self.urls, health_timeout_s, max_restarts)
        self.tp_sizes = list(tp_sizes) if tp_sizes else None
        self.timeout_s = timeout_s
        self.push = push
        self.takes_buckets = push  # the other leaders' buckets are drained, never read: none keep a copy
        self.barrier = barrier  # None: this is the only data-parallel leader
        self.weight_version = 0
        self.aborted = 0  # requests the servers aborted so far (`count_aborted`)
        self.group = None
        self.group_name = "megarl_weights"
        self._seed_checked = False
        self.adapter: str | None = None  # the LoRA adapter every request names (`load_lora_adapter`)

    def _lora(self) -> dict:
        """The `/generate` key that applies the loaded adapter to every request of a body ({} without one)."""
        return {"lora_path": self.adapter} if self.adapter is not None else {}

    def _post(self, url: str, path: str, payload: dict | None = None, timeout: float | None = None):
        return _post(url, path, payload, timeout=self.timeout_s if timeout is None else timeout)

    def _watched(self, url: str, path: str, payload: dict):
        """A generation request, sent again to another server (or to this one once it answers again) when `url`
        dies or hangs (`ServerHealth.call`)."""
        return self.health.call(url, lambda u: self._post(u, path, payload),
                                lambda e: e.status if isinstance(e, ServerRefused) else None)

    def _control(self, url: str, path: str, payload: dict | None = None, what: str = "",
                 timeout: float | None = None):
        """A control call whose refusal (HTTP 400 `{"success": false, "message"}`, or success false) raises
        `WeightSyncError` with SGLang's message."""
        what = what or path.lstrip("/")
        try:
            result = self._post(url, path, payload, timeout)
        except ServerRefused as e:
            raise WeightSyncError(f"SGLang {what} refused by {url}: {e.message}") from e
        _check(result, f"{what} at {url}")
        return result

    def _all(self, path: str, payload: dict | None = None, what: str = "", timeout: float | None = None) -> None:
        _join(_in_threads([lambda u=u: self._control(u, path, payload, what, timeout) for u in self.urls]))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        if not prompts:
            return []
        if params.seed is not None:
            self._check_seed_honoured()
        ids, sampling = expand_requests(prompts, params)
        # Contiguous blocks of whole groups per server, so concatenating the answers keeps the order.
        per = -(-len(prompts) // len(self.urls)) * params.n
        blocks = [(u, ids[i : i + per], sampling[i : i + per]) for u, i in zip(self.urls, range(0, len(ids), per))]
        answers = _join(_in_threads([
            lambda u=u, x=x, s=s: self._watched(u, "/generate", {"input_ids": x, "sampling_params": s,
                                                                 "return_logprob": True, **self._lora()})
            for u, x, s in blocks]))
        outputs = [o for answer in answers for o in (answer if isinstance(answer, list) else [answer])]
        self.aborted += count_aborted(outputs)
        return group([to_completion(o, self.weight_version) for o in outputs], params.n)

    def _check_seed_honoured(self) -> None:
        """Warn once when a server was launched without --enable-deterministic-inference: SGLang then ignores the
        `sampling_seed` of every request (`/server_info` carries the server's arguments)."""
        if self._seed_checked:
            return
        self._seed_checked = True
        off = []
        for url in self.urls:
            try:
                info = _get(url, "/server_info")
            except (OSError, ValueError):  # an older server, or no answer: generation will say more
                continue
            if not info.get("enable_deterministic_inference", False):
                off.append(url)
        if off:
            warnings.warn(f"SGLang servers {', '.join(off)} run without --enable-deterministic-inference: they ignore "
                          "the requests' sampling_seed, so a seeded run does not sample reproducibly there; launch "
                          "them with it (launch/slurm/disaggregated.sbatch: SGLANG_ARGS)", RuntimeWarning, stacklevel=3)

    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[list[float]]:
        check_score_temperature(temperature)
        answer = self._watched(self.urls[0], "/generate", {
            "input_ids": [list(s) for s in sequences], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": temperature}, **self._lora()})
        answer = answer if isinstance(answer, list) else [answer]
        return [input_logprobs(o, len(s), p) for o, s, p in zip(answer, sequences, prompt_lens)]

    def release_memory(self, keep_weights: bool = False) -> None:
        """Nothing to release: the servers have GPUs of their own."""

    def resume_memory(self) -> None:
        """Nothing to re-acquire; the prefix caches were flushed by the pusher right after its push
        (`load_weight_buckets`), not here, where other leaders may already be generating."""

    # -- weights ---------------------------------------------------------------------------------------------

    def connect(self, master_address: str, master_port: int, backend: str = "nccl") -> None:
        """Form the weight-update group: the trainer's leader is rank 0, server i's TP ranks follow. A server
        that refuses to join stops this at once with its message (the rendezvous would wait for it)."""
        if self.tp_sizes is None:
            self.tp_sizes = [server_tp_size(u) for u in self.urls]
        world_size = 1 + sum(self.tp_sizes)
        offsets = [1 + sum(self.tp_sizes[:i]) for i in range(len(self.urls))]
        pending = _in_threads([
            lambda u=u, o=o: self._control(u, "/init_weights_update_group", {
                "master_address": master_address, "master_port": master_port, "rank_offset": o,
                "world_size": world_size, "group_name": self.group_name, "backend": backend})
            for u, o in zip(self.urls, offsets)])
        joining = _in_threads([lambda: init_weights_update_group(backend, master_address, master_port, 0,
                                                                 world_size, self.group_name)])
        _until(lambda: not joining[0][0].is_alive(), pending)
        group = _join(joining)[0]
        _join(pending)
        self.group = group

    def load_weight_buckets(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Broadcast each flat bucket over the weight-update group while every server receives it, then flush the
        servers' prefix caches (the pusher only). A server that refuses a bucket raises at once with SGLang's
        message; the group is then aborted (connect again to push once more). Every data-parallel leader then
        waits at `barrier` until the push is over, the pusher included."""
        if not self.push:
            for _ in buckets:  # the pushing rank sends them; keep the bucket iterator's accounting honest
                pass
        self._pushed(version, lambda: self._push(buckets))
        self.weight_version = version

    def load_lora_adapter(self, tensors: dict[str, torch.Tensor], config: dict, version: int) -> None:
        """The pusher loads the adapters of `version` on every server as `megarl-v<version>` and unloads the
        previous version's; every data-parallel leader then waits at `barrier` and names the new adapter in its
        requests from then on. Over HTTP the tensors travel pickled by value (CPU tensors; SGLang's `SafeUnpickler`
        admits them), one copy per server TP rank, as SGLang's route takes them."""
        name = adapter_name(version)
        self._pushed(version, lambda: self._load_adapter(name, tensors, config))
        self.adapter, self.weight_version = name, version

    def _pushed(self, version: int, push: Callable[[], None]) -> None:
        """`push` on the pushing rank (a failure reaches the other leaders through `barrier`), then every
        data-parallel leader waits at `barrier` until the push of `version` is over."""
        if self.push:
            try:
                push()
            except BaseException as e:
                if self.barrier is not None:
                    self.barrier.fail(version, f"{type(e).__name__}: {e}")
                raise
        if self.barrier is not None:
            self.barrier.arrive(version)

    def _load_adapter(self, name: str, tensors: dict[str, torch.Tensor], config: dict) -> None:
        if self.tp_sizes is None:
            self.tp_sizes = [server_tp_size(u) for u in self.urls]
        payload = base64.b64encode(pickle.dumps({k: v.detach().cpu().contiguous() for k, v in tensors.items()}))
        payload = payload.decode()
        if self.adapter == name:  # the same version again: SGLang refuses a name already loaded
            self._all("/unload_lora_adapter", {"lora_name": name}, f"unload_lora_adapter({name})")
            self.adapter = None
        _join(_in_threads([lambda u=u, tp=tp: self._control(
            u, "/load_lora_adapter_from_tensors",
            {"lora_name": name, "config_dict": config, "serialized_named_tensors": [payload] * tp},
            f"load_lora_adapter_from_tensors({name})") for u, tp in zip(self.urls, self.tp_sizes)]))
        if self.adapter is not None:  # no flush: SGLang keys cached prefixes by the adapter too (`Req.extra_key`)
            self._all("/unload_lora_adapter", {"lora_name": self.adapter}, f"unload_lora_adapter({self.adapter})")

    def _push(self, buckets: Iterable[WeightBucket]) -> None:
        if self.group is None:
            raise WeightSyncError("SGLangServers: call connect() before pushing weights over NCCL "
                                  "(or use update_weights_from_disk)")
        import torch.distributed as dist

        self._all("/begin_weight_update", {"selector": "all"}, "begin_weight_update")  # refused: no broadcast
        try:
            for bucket in buckets:
                request = {"names": [s.name for s in bucket.slots],
                           "dtypes": [str(s.dtype).removeprefix("torch.") for s in bucket.slots],
                           "shapes": [list(s.shape) for s in bucket.slots], "group_name": self.group_name,
                           "flush_cache": False, "load_format": "flattened_bucket"}
                pending = _in_threads([lambda u=u, body=request: self._control(
                    u, "/update_weights_from_distributed", body, "update_weights_from_distributed")
                    for u in self.urls])
                work = dist.broadcast(bucket.flat, src=0, group=self.group, async_op=True)
                try:
                    _until(work.is_completed, pending)
                except WeightSyncError:
                    group, self.group = self.group, None
                    _abandon(group)
                    raise
                work.wait()
                _join(pending)
        except BaseException as e:
            try:  # close the session on the servers still answering, briefly: the first error is the one to see
                self._all("/end_weight_update", what="end_weight_update", timeout=10.0)
            except Exception as closing:  # noqa: BLE001 - reported on the error being raised
                e.add_note(f"closing the weight-update session failed too: {closing}")
            raise
        self._all("/end_weight_update", what="end_weight_update")
        self._flush()

    def _flush(self) -> None:
        """Flush every server's prefix cache (prefixes computed under the old weights), retrying while a server
        refuses because requests run or wait (SGLang's /flush_cache answers 400 then, without waiting)."""

        def flush(url: str) -> None:
            last = ""
            for attempt in range(self.flush_retries):
                try:
                    self._post(url, "/flush_cache")
                    return
                except ServerRefused as e:
                    if e.status != 400:
                        raise WeightSyncError(f"SGLang flush_cache at {url}: {e.message}") from e
                    last = e.message
                if attempt + 1 < self.flush_retries:
                    time.sleep(self.flush_interval_s)
            raise WeightSyncError(
                f"SGLang flush_cache refused by {url} {self.flush_retries} times over "
                f"{self.flush_retries * self.flush_interval_s:g} s ({last}): prefixes cached under the old weights "
                "would be reused; something keeps sending it requests during the weight sync")

        _join(_in_threads([lambda u=u: flush(u) for u in self.urls]))

    def shutdown(self) -> None:
        """The servers were launched elsewhere and outlive the trainer: nothing to stop here."""

    def update_weights_from_disk(self, hf_dir: str, version: int) -> None:
        """Load an HF checkpoint directory every server can read (a shared file system), then flush."""
        self._all("/update_weights_from_disk", {"model_path": str(hf_dir)}, "update_weights_from_disk")
        self._flush()
        self.weight_version = version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """The whole model in default-sized buckets over the weight-update group (servers have no IPC gather)."""
        self.load_weight_buckets(pack_buckets(named_tensors, DEFAULT_BUCKET_BYTES),
                                 self.weight_version + 1 if version is None else version)

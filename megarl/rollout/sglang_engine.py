"""SGLang behind the `RolloutEngine` protocol: in-process and colocated, or as HTTP servers on other nodes.

Colocated (`SGLangEngine`): each model-parallel leader of the trainer owns an in-process `sglang.Engine` on its
own GPUs (SGLang's TP x this rank's GPU onward). Actor and engine take turns with the memory; one step is

    generate -> release_memory (kv cache, weights) -> train -> load_weight_buckets: resume weights,
    push the buckets -> resume_memory: resume kv cache, flush the prefix cache -> generate ...

SGLang needs `enable_memory_saver` (torch_memory_saver) for the release, and an idle scheduler, which it is
between steps. In SGLang >= 0.5.23 weight updates run inside `begin_weight_update` / `end_weight_update`;
older versions have neither, and the adapter then calls the update alone. Buckets go over as
`load_format="flattened_bucket"`: one serialized `{flattened_tensor, metadata}` per SGLang TP rank, which for a
CUDA tensor is an IPC handle, not the data (`serialize_bucket`). Every SGLang TP rank opens the same handle of the
leader's GPU buffer and narrows its own shard from it.

Disaggregated (`SGLangServers`): SGLang servers launched elsewhere (`--rollout-servers host:port,...`), reached
over HTTP. Prompts are split over the servers in contiguous blocks. Weights go either over NCCL (the trainer's
leader joins a process group with every server's TP ranks: `init_weights_update_group`, then per bucket
`update_weights_from_distributed` while the leader broadcasts the flat bucket) or from a checkpoint directory
on a shared file system (`update_weights_from_disk`).

Log-probs: SGLang reports log softmax(logits / temperature) of the sampled token, before top-k / top-p, which is
`Completion.logprobs`' definition (leave SGLANG_RETURN_ORIGINAL_LOGPROB unset). The engine knows nothing of
Megatron; `sglang` itself is imported only when an engine is launched or a bucket serialized.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from typing import Callable, Iterable, Sequence

import torch

from megarl.rollout.base import Completion, SamplingParams
from megarl.rollout.weight_sync import DEFAULT_BUCKET_BYTES, WeightBucket, WeightSyncError, pack_buckets

KV_CACHE, WEIGHTS = "kv_cache", "weights"


def sglang_available() -> tuple[bool, str]:
    """(importable, why not) without raising: `sglang` needs CUDA kernels to run a model, not to import."""
    try:
        import sglang  # noqa: F401 - only to see it imports
    except Exception as e:  # noqa: BLE001 - ImportError, or a kernel wheel that fails to load in any way
        return False, f"sglang is not importable ({type(e).__name__}: {e})"
    return True, ""


def serialize_bucket(bucket: WeightBucket, tp_size: int) -> list[str]:
    """One `MultiprocessingSerializer` payload per SGLang TP rank in the form `load_format="flattened_bucket"`
    expects. For a CUDA bucket the payload holds an IPC handle: the bucket must stay alive until the engine has
    loaded it (`update_weights_from_tensor` returns after loading)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    if bucket.flat.is_cuda:  # SGLang's fix for CUDA IPC between processes that number the GPUs differently
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
    metadata = [FlattenedTensorMetadata(name=s.name, shape=torch.Size(s.shape), dtype=s.dtype, start_idx=s.start,
                                        end_idx=s.end, numel=s.end - s.start) for s in bucket.slots]
    payload = MultiprocessingSerializer.serialize({"flattened_tensor": bucket.flat, "metadata": metadata},
                                                  output_str=True)
    return [payload] * tp_size


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
    meta = output["meta_info"]
    token_ids = list(output["output_ids"])
    logprobs = [float(lp) for lp, _tok, *_ in meta["output_token_logprobs"]]
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"SGLang returned {len(token_ids)} tokens but {len(logprobs)} log-probs")
    return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason="length" if kind == "length" else "stop",
                      weight_version=version)


def group(completions: list[Completion], n: int) -> list[list[Completion]]:
    return [completions[i : i + n] for i in range(0, len(completions), n)]


def input_logprobs(output: dict, seq_len: int, prompt_len: int) -> list[float]:
    """Log-probs of a scored sequence's tokens after its prompt, from `meta_info.input_token_logprobs` of a
    request sent with `logprob_start_len=0` (entry k: token k given tokens[:k]; entry 0 has none)."""
    entries = output["meta_info"]["input_token_logprobs"]
    if len(entries) != seq_len:
        raise RuntimeError(f"SGLang scored {len(entries)} input tokens of a {seq_len}-token sequence")
    return [float(e[0]) for e in entries[prompt_len:]]


def _check(result, what: str) -> None:
    """SGLang's control calls answer (success, message) or {"success": ..., "message": ...}."""
    if isinstance(result, dict):
        result = (result.get("success", True), result.get("message", ""))
    if isinstance(result, (tuple, list)) and result and result[0] is False:
        raise WeightSyncError(f"SGLang {what} failed: {result[1] if len(result) > 1 else ''}")


class SGLangEngine:
    """A `RolloutEngine` over an in-process `sglang.Engine` colocated with the actor (see the module docstring).

    `engine` is an `sglang.Engine` or anything with its methods (the tests pass a recording fake)."""

    shares_actor_weights = False

    def __init__(self, engine, *, tp_size: int = 1, colocated: bool = True, dtype: torch.dtype | None = None,
                 serialize: Callable[[WeightBucket, int], list] = serialize_bucket, tokenizer: bool = True):
        """`tokenizer`: whether the engine was launched with its tokenizer, which stop strings need."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.dtype = dtype  # weights are sent in this dtype (None: as the actor holds them)
        self.tp_size = tp_size
        self.colocated = colocated
        self.serialize = serialize
        self.weight_version = 0
        self._released: set[str] = set()

    @classmethod
    def launch(cls, hf_dir: str, *, tp_size: int = 1, base_gpu_id: int = 0, mem_fraction: float = 0.5,
               dtype: str = "bfloat16", seed: int = 0, colocated: bool = True, tokenizer: bool = False,
               **server_args) -> SGLangEngine:
        """`tokenizer`: load SGLang's tokenizer and detokenizer, which matching `SamplingParams.stop` needs."""
        ok, why = sglang_available()
        if not ok:
            raise RuntimeError(f"--rollout-backend sglang: {why}; install SGLang on the GPU machine "
                               "(pip install 'megarl[sglang]') or use --rollout-backend builtin")
        import sglang

        engine = sglang.Engine(model_path=str(hf_dir), tp_size=tp_size, base_gpu_id=base_gpu_id,
                               mem_fraction_static=mem_fraction, dtype=dtype, random_seed=seed,
                               enable_memory_saver=colocated, skip_tokenizer_init=not tokenizer, log_level="error",
                               **server_args)
        return cls(engine, tp_size=tp_size, colocated=colocated, tokenizer=tokenizer,
                   dtype=getattr(torch, dtype) if dtype in ("bfloat16", "float16", "float32") else None)

    # -- rollout ---------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        if not prompts:
            return []
        if params.stop and not self.tokenizer:
            raise ValueError("SamplingParams.stop: this SGLang engine was launched without its tokenizer "
                             "(skip_tokenizer_init), so it cannot match stop strings; launch it with tokenizer=True")
        ids, sampling = expand_requests(prompts, params)
        outputs = self.engine.generate(input_ids=ids, sampling_params=sampling, return_logprob=True)
        return group([to_completion(o, self.weight_version) for o in outputs], params.n)

    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[list[float]]:
        """Log-probs of each sequence's tokens after its prompt (one prefill, one throwaway new token)."""
        outputs = self.engine.generate(input_ids=[list(s) for s in sequences],
                                       sampling_params={"max_new_tokens": 1, "temperature": temperature},
                                       return_logprob=True, logprob_start_len=0)
        return [input_logprobs(o, len(s), p) for o, s, p in zip(outputs, sequences, prompt_lens)]

    # -- the colocation cycle --------------------------------------------------------------------------------

    def release_memory(self) -> None:
        """Free the KV cache and the weights for training (colocated mode only)."""
        if self.colocated:
            _check(self.engine.release_memory_occupation(tags=[KV_CACHE, WEIGHTS]), "release_memory_occupation")
            self._released = {KV_CACHE, WEIGHTS}

    def load_weight_buckets(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Resume the weights' memory if released, then push every bucket without flushing the cache per bucket."""
        if WEIGHTS in self._released:
            _check(self.engine.resume_memory_occupation(tags=[WEIGHTS]), "resume_memory_occupation(weights)")
            self._released.discard(WEIGHTS)
        session = hasattr(self.engine, "begin_weight_update")
        if session:
            _check(self.engine.begin_weight_update(), "begin_weight_update")
        try:
            for bucket in buckets:
                result = self.engine.update_weights_from_tensor(
                    named_tensors=self.serialize(bucket, self.tp_size), load_format="flattened_bucket",
                    flush_cache=False)
                _check(result, "update_weights_from_tensor")
        finally:
            if session:
                _check(self.engine.end_weight_update(), "end_weight_update")
        self.weight_version = version

    def resume_memory(self) -> None:
        """Re-acquire what is still released (the KV cache after a push), then flush the prefix cache: cached
        prefixes were computed with the old weights."""
        tags = [t for t in (WEIGHTS, KV_CACHE) if t in self._released]
        if tags:
            _check(self.engine.resume_memory_occupation(tags=tags), f"resume_memory_occupation({','.join(tags)})")
            self._released.clear()
        self.engine.flush_cache()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        self.load_weight_buckets(pack_buckets(named_tensors, DEFAULT_BUCKET_BYTES),
                                 self.weight_version + 1 if version is None else version)

    def shutdown(self) -> None:
        self.engine.shutdown()


# ---------------------------------------------------------------------------------------------------------
# Disaggregated: SGLang servers on other nodes.


def _post(url: str, path: str, payload: dict | None = None, timeout: float = 3600.0):
    req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(payload or {}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
    return json.loads(body) if body.strip() else {}


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


def init_weights_update_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                              group_name: str, timeout_s: float = 600.0):
    """The trainer's side of SGLang's weight-update group: a process group of its own, outside the default one,
    rendezvoused the way SGLang's servers join it (a TCP store under a `group_name` prefix). Uses torch's
    private `_new_process_group_helper`, as SGLang does."""
    import datetime

    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                           group_name=group_name, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class SGLangServers:
    """A `RolloutEngine` over SGLang HTTP servers (disaggregated mode; see the module docstring).

    `tp_sizes[i]` is server i's tensor-parallel size (asked from the server when not given): its TP ranks join
    the weight-update group after the trainer's leader (rank 0)."""

    shares_actor_weights = False
    dtype = None  # weights travel as the actor holds them; each server casts to its own dtype

    def __init__(self, urls: Sequence[str], *, tp_sizes: Sequence[int] | None = None, push: bool = True,
                 timeout_s: float = 3600.0):
        if not urls:
            raise ValueError("SGLangServers needs at least one server URL")
        self.urls = [u if u.startswith("http") else f"http://{u}" for u in urls]
        self.tp_sizes = list(tp_sizes) if tp_sizes else None
        self.timeout_s = timeout_s
        self.push = push  # with several data-parallel leaders, one pushes the weights and the others only generate
        self.weight_version = 0
        self.group = None
        self.group_name = "megarl_weights"

    def _post(self, url: str, path: str, payload: dict | None = None):
        return _post(url, path, payload, timeout=self.timeout_s)

    def _all(self, path: str, payload: dict | None = None, what: str = "") -> None:
        for result in _join(_in_threads([lambda u=u: self._post(u, path, payload) for u in self.urls])):
            _check(result, what or path)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        if not prompts:
            return []
        ids, sampling = expand_requests(prompts, params)
        # Contiguous blocks of whole groups per server, so concatenating the answers keeps the order.
        per = -(-len(prompts) // len(self.urls)) * params.n
        blocks = [(u, ids[i : i + per], sampling[i : i + per]) for u, i in zip(self.urls, range(0, len(ids), per))]
        answers = _join(_in_threads([
            lambda u=u, x=x, s=s: self._post(u, "/generate", {"input_ids": x, "sampling_params": s,
                                                              "return_logprob": True})
            for u, x, s in blocks]))
        outputs = [o for answer in answers for o in (answer if isinstance(answer, list) else [answer])]
        return group([to_completion(o, self.weight_version) for o in outputs], params.n)

    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[list[float]]:
        answer = self._post(self.urls[0], "/generate", {
            "input_ids": [list(s) for s in sequences], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": temperature}})
        answer = answer if isinstance(answer, list) else [answer]
        return [input_logprobs(o, len(s), p) for o, s, p in zip(answer, sequences, prompt_lens)]

    def release_memory(self) -> None:
        """Nothing to release: the servers have GPUs of their own."""

    def resume_memory(self) -> None:
        self._all("/flush_cache", what="flush_cache")

    # -- weights ---------------------------------------------------------------------------------------------

    def connect(self, master_address: str, master_port: int, backend: str = "nccl") -> None:
        """Form the weight-update group: the trainer's leader is rank 0, server i's TP ranks follow."""
        if self.tp_sizes is None:
            self.tp_sizes = [server_tp_size(u) for u in self.urls]
        world_size = 1 + sum(self.tp_sizes)
        offsets = [1 + sum(self.tp_sizes[:i]) for i in range(len(self.urls))]
        pending = _in_threads([
            lambda u=u, o=o: self._post(u, "/init_weights_update_group", {
                "master_address": master_address, "master_port": master_port, "rank_offset": o,
                "world_size": world_size, "group_name": self.group_name, "backend": backend})
            for u, o in zip(self.urls, offsets)])
        self.group = init_weights_update_group(backend, master_address, master_port, 0, world_size, self.group_name)
        for result in _join(pending):
            _check(result, "init_weights_update_group")

    def load_weight_buckets(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Broadcast each flat bucket over the weight-update group while every server receives it."""
        if not self.push:
            for _ in buckets:  # the pushing rank sends them; keep the bucket iterator's accounting honest
                pass
            self.weight_version = version
            return
        if self.group is None:
            raise WeightSyncError("SGLangServers: call connect() before pushing weights over NCCL "
                                  "(or use update_weights_from_disk)")
        import torch.distributed as dist

        self._all("/begin_weight_update", {"selector": "all"}, "begin_weight_update")
        try:
            for bucket in buckets:
                request = {"names": [s.name for s in bucket.slots],
                           "dtypes": [str(s.dtype).removeprefix("torch.") for s in bucket.slots],
                           "shapes": [list(s.shape) for s in bucket.slots], "group_name": self.group_name,
                           "flush_cache": False, "load_format": "flattened_bucket"}
                pending = _in_threads([lambda u=u, body=request: self._post(u, "/update_weights_from_distributed", body)
                                       for u in self.urls])
                dist.broadcast(bucket.flat, src=0, group=self.group)
                for result in _join(pending):
                    _check(result, "update_weights_from_distributed")
        finally:
            self._all("/end_weight_update", what="end_weight_update")
        self.weight_version = version

    def shutdown(self) -> None:
        """The servers were launched elsewhere and outlive the trainer: nothing to stop here."""

    def update_weights_from_disk(self, hf_dir: str, version: int) -> None:
        """Load an HF checkpoint directory every server can read (a shared file system)."""
        self._all("/update_weights_from_disk", {"model_path": str(hf_dir)}, "update_weights_from_disk")
        self.weight_version = version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        self.load_weight_buckets(pack_buckets(named_tensors, DEFAULT_BUCKET_BYTES),
                                 self.weight_version + 1 if version is None else version)

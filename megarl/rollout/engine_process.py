"""The built-in engine in a process of its own, for asynchronous training (`--async-staleness K >= 1`).

    engine = EngineProcess(hf_config, checkpoint, dtype=torch.float32, threads=1)   # spawns the process
    engine.load_weight_buckets(buckets, version=3)   # through shared memory; returns once the engine holds them
    engine.generate(prompts, params)                  # runs there, on its own `threads` cores

`EngineProcess` is a `RolloutEngine`: the trainer talks to it as to the in-process `BuiltinEngine`, and the child
runs exactly that engine. Requests are answered in the order they are sent, one at a time, so the engine swaps
weights only between generate calls. Weights travel as the weight sync's buckets: the first sync allocates one
shared-memory buffer per bucket and hands it to the child once; every later sync copies its bucket into the same
buffer and sends only the bucket's layout and the version. A buffer is rewritten only after the child has answered
the load that read it, so it never reads a half-written bucket.

The child never outlives the trainer (it watches its parent), and the trainer never waits on a dead child: every
reply is awaited with a timeout, and a child that died is reported with its exit code.

Health: the child beats a shared heartbeat every 0.2 s from a thread of its own; a child that died is found within a
second, one whose heartbeat stopped for `health_timeout_s` (stopped, deadlocked, swapped out) counts as hung. Either
is killed and replaced (`max_restarts` times): the new child gets every weight bucket from the shared buffers and
the weight version, then the request in flight is sent again. Requests are pure functions of the weights and the
request (a generate's `SamplingParams.seed`), so the answer is the one the old child would have given: no sample is
lost or counted twice. `restarts` and `seconds_lost` count them; past `max_restarts` an `EngineProcessError` names
the engine and its last error.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from typing import Callable, Iterable, Sequence, TypeVar

import torch
import torch.multiprocessing as mp

from megarl.rollout.base import Completion, EngineCapabilities, SamplingParams
from megarl.rollout.weight_sync import TensorSlot, WeightBucket

T = TypeVar("T")


class EngineProcessError(RuntimeError):
    """The engine process failed, died or did not answer in time."""


class EngineDeadError(EngineProcessError):
    """The engine process died or hung (a restart may help, unlike an error the engine reported)."""


def call_restarting(owner, attempt: Callable[[], T], label: str, restarting: Callable[[EngineDeadError], str],
                    restarted: Callable[[], str], can_restart: bool = True) -> T:
    """`attempt()` answered, on an engine `owner` restarts (`owner._restart()`) when it dies or hangs
    (`EngineDeadError`), at most `owner.max_restarts` times in the run (`owner.restarts`), `attempt` made again on
    the new one; `owner.seconds_lost` adds the time from the first failure to the answer. Each restart's line is
    `restarting(error)`, the answer's after one `restarted()`; past the restarts (or without `can_restart`) the run
    stops: `label` (the engine) stopped the run, with its last error. The loop of the built-in engine's process and
    of the in-process SGLang and vLLM engines (`sglang_health.RestartingCalls`)."""
    failed_at = None
    while True:
        try:
            if failed_at is not None:
                owner._restart()
            value = attempt()
            if failed_at is not None:
                owner.seconds_lost += time.monotonic() - failed_at
                print(restarted(), file=sys.stderr, flush=True)
            return value
        except EngineDeadError as e:
            if not can_restart or owner.restarts >= owner.max_restarts:
                raise EngineDeadError(f"{label} stopped the run after {owner.restarts} restart(s) "
                                      f"(--engine-max-restarts {owner.max_restarts}); its last error: {e}") from None
            owner.restarts += 1
            failed_at = time.monotonic() if failed_at is None else failed_at
            print(restarting(e), file=sys.stderr, flush=True)


class EngineProcess(EngineCapabilities):
    """A `RolloutEngine` whose `BuiltinEngine` runs in a spawned process (see the module docstring)."""

    shares_actor_weights = False
    loads_from_host = True  # each bucket is copied into a shared-memory buffer (`load_weight_buckets`)

    def __init__(self, hf_config: dict, checkpoint: str | None = None, *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, threads: int = 1, timeout_s: float = 600.0,
                 health_timeout_s: float = 60.0, max_restarts: int = 0):
        """`checkpoint`: the HF directory whose tokenizer decodes stop strings (None: no stop strings).
        `threads`: torch intra-op threads in the engine process. `timeout_s`: the longest a request may take.
        `health_timeout_s`, `max_restarts`: see the module docstring (Health)."""
        self.dtype, self.timeout_s, self.weight_version = dtype, timeout_s, 0
        self.health_timeout_s, self.max_restarts = health_timeout_s, max_restarts
        self.restarts, self.seconds_lost = 0, 0.0
        self._spawn_args = (hf_config, checkpoint, device, dtype, threads)
        self._buffers: list[torch.Tensor] = []  # shared-memory bucket buffers, by bucket index
        self._slots: list[list] = []  # each buffer's layout, as last loaded
        self.busy_seconds = 0.0  # the child's time inside requests, as it reports it
        self._spawn()
        self._call("ready")

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        self._requests, self._replies = ctx.Queue(), ctx.Queue()
        self._heartbeat = ctx.Value("d", 0.0, lock=False)  # 0 until the child's first beat (start-up: timeout_s)
        self._proc = ctx.Process(target=_serve, name="megarl-engine", daemon=True,
                                 args=(*self._spawn_args, os.getpid(), self._requests, self._replies,
                                       self._heartbeat))
        self._proc.start()

    # ---- RolloutEngine -------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        return self._call("generate", [list(p) for p in prompts], params)

    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[list[float]]:
        return self._call("score", sequences, prompt_lens, temperature)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        from megarl.rollout.weight_sync import pack_buckets

        self.load_weight_buckets(pack_buckets(named_tensors, dtype=self.dtype),
                                 self.weight_version + 1 if version is None else version)

    def load_weight_buckets(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Copy each bucket into its shared buffer and have the child load it; returns once all are loaded."""
        for index, bucket in enumerate(buckets):
            fresh = index >= len(self._buffers) or self._buffers[index].numel() != bucket.nbytes
            if fresh:
                buffer = torch.empty(bucket.nbytes, dtype=torch.uint8).share_memory_()
                if index < len(self._buffers):
                    self._buffers[index] = buffer
                else:
                    self._buffers.append(buffer)
            self._buffers[index].copy_(bucket.flat.reshape(-1).to("cpu", non_blocking=False))
            self._call("load", index, self._buffers[index] if fresh else None, bucket.slots, version)
            if index < len(self._slots):  # what a restarted child loads again
                self._slots[index] = list(bucket.slots)
            else:
                self._slots.append(list(bucket.slots))
        self._call("stamp", version)
        self.weight_version = version

    def release_memory(self, keep_weights: bool = False) -> None:
        """Nothing to free: the engine holds no GPU the actor needs."""

    def resume_memory(self) -> None:
        """Nothing to re-acquire (see `release_memory`)."""

    def shutdown(self) -> None:
        if self._proc.is_alive():
            try:
                self._requests.put(("stop",))
                self._proc.join(timeout=10)
            except (OSError, ValueError):
                pass
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)

    # ---- transport -----------------------------------------------------------------------------------------

    def _call(self, op: str, *args):
        """`op` answered, restarting a dead or hung child (at most `max_restarts` times in the run) and sending
        `op` again; a child's own error is raised at once."""
        return call_restarting(
            self, lambda: self._call_once(op, *args), "the built-in rollout engine process",
            lambda e: (f"megarl: {e}: restarting the engine process (restart {self.restarts} of {self.max_restarts}), "
                       f"with weights version {self.weight_version}; the {op!r} request is sent again"),
            lambda: (f"megarl: engine process restarted (pid {self._proc.pid}); engine_restarts {self.restarts}, "
                     f"{self.seconds_lost:.1f} s lost in all"))

    def _restart(self) -> None:
        """A new child holding the weights the old one held (every buffer, loaded again) and their version."""
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(timeout=30)
        self._spawn()
        self._call_once("ready")
        for index, (buffer, slots) in enumerate(zip(self._buffers, self._slots)):
            self._call_once("load", index, buffer, slots, self.weight_version)
        if self._buffers:
            self._call_once("stamp", self.weight_version)

    def kill_for_fault(self, hang: bool = False) -> None:
        """MEGARL_FAULT engine_crash (SIGKILL) or engine_hang (SIGSTOP) of the child."""
        os.kill(self._proc.pid, signal.SIGSTOP if hang else signal.SIGKILL)

    def _call_once(self, op: str, *args):
        name = f"the built-in rollout engine process (pid {self._proc.pid})"
        if not self._proc.is_alive():
            raise EngineDeadError(f"{name} is gone, exit code {self._proc.exitcode}, before the {op!r} request")
        self._requests.put((op, *args))
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                status, value, busy = self._replies.get(timeout=1.0)
                break
            except Exception:  # noqa: BLE001 - queue.Empty, or a half-written reply of a dying child (EOFError,
                # an unpickling error): check the child is alive, then wait on
                if not self._proc.is_alive():
                    raise EngineDeadError(f"{name} died during the {op!r} request, exit code "
                                          f"{self._proc.exitcode}") from None
                beat = self._heartbeat.value
                silent = time.time() - beat
                if beat and silent > self.health_timeout_s:
                    raise EngineDeadError(f"{name} is hung: no heartbeat for {silent:.0f} s during the {op!r} "
                                          f"request (--engine-health-timeout {self.health_timeout_s:g})") from None
                if time.monotonic() > deadline:
                    raise EngineProcessError(f"{name} did not answer the {op!r} request within {self.timeout_s:g} "
                                             "s") from None
        self.busy_seconds += busy
        if status == "error":
            raise EngineProcessError(f"the engine process failed in {op!r}:\n{value}")
        return value


def _serve(hf_config: dict, checkpoint: str | None, device: str, dtype: torch.dtype, threads: int, parent: int,
           requests, replies, heartbeat) -> None:
    """The child: a `BuiltinEngine` answering requests in order until told to stop or orphaned."""
    import threading

    from megarl.rollout.builtin import BuiltinEngine, CheckpointTokenizer

    torch.set_num_threads(threads)
    if torch.device(device).type == "cuda":  # a spawned process starts on GPU 0: take the leader's own
        torch.cuda.set_device(torch.device(device))

    def watch_parent():  # a trainer killed with SIGKILL cannot stop us: go when it is gone; beat meanwhile
        while os.getppid() == parent:
            heartbeat.value = time.time()
            time.sleep(0.2)
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    tokenizer = None
    if checkpoint:
        tokenizer = CheckpointTokenizer(checkpoint)
    engine = BuiltinEngine(hf_config, device=device, dtype=dtype, tokenizer=tokenizer)
    buffers: dict[int, torch.Tensor] = {}
    while True:
        request = requests.get()
        op, args = request[0], request[1:]
        if op == "stop":
            return
        start = time.perf_counter()
        try:
            if op == "ready":
                value = None
            elif op == "generate":
                value = engine.generate(*args)
            elif op == "score":
                value = engine.score(*args)
            elif op == "load":
                index, buffer, slots, version = args
                if buffer is not None:
                    buffers[index] = buffer
                engine.load_weight_buckets([WeightBucket(buffers[index], list(slots))], version)
                value = None
            elif op == "stamp":
                engine.weight_version = args[0]
                value = None
            else:
                raise ValueError(f"unknown request {op!r}")
            replies.put(("ok", value, time.perf_counter() - start))
        except Exception:  # noqa: BLE001 - the engine's error, whatever it is, goes to the parent; this loop serves on
            replies.put(("error", traceback.format_exc(), time.perf_counter() - start))


__all__ = ["EngineDeadError", "EngineProcess", "EngineProcessError", "TensorSlot"]

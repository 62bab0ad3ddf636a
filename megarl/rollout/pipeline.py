"""The engine's side of asynchronous training (`--async-staleness K`, `megarl.stages.asynchronous`): one worker
thread that runs the engine's work in the order it was queued, and the engine wrapper whose calls queue on it.

    pipeline = Pipeline()                                   # one worker thread: the engine's work, in order
    engine = OrderedEngine(EngineProcess(...), pipeline)    # what the loop, the sync and evaluation call

Since the engine's work runs in one thread in the order it was queued (a weight load, a rollout, the next load,
...), what each batch holds depends only on the weights and seeds, never on timing.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from megarl.rollout.base import EngineCapabilities, RolloutEngine, as_engine

from megarl.rollout.weight_sync import WeightBucket

if TYPE_CHECKING:
    from megarl.rollout.base import Completion, SamplingParams


class Pipeline:
    """One worker thread running the engine's work in the order it was queued; it reports how long it was busy."""

    def __init__(self):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megarl-rollout")
        self._lock = threading.Lock()
        self._busy = 0.0
        self._mark = time.perf_counter()
        self._unchecked: list[Future] = []  # queued work nobody waits on (weight loads): failures surface later

    def submit(self, fn, *args, watch: bool = False) -> Future:
        """Queue `fn(*args)`; `watch`: nobody will wait on it, so `check` raises its failure."""
        self.check()

        def timed():
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                with self._lock:
                    self._busy += time.perf_counter() - start

        future = self._executor.submit(timed)
        if watch:
            self._unchecked.append(future)
        return future

    def run(self, fn, *args):
        """`fn(*args)` in the worker, after everything queued before it; waits for the result."""
        return self.submit(fn, *args).result()

    def check(self) -> None:
        """Raise the failure of queued work nobody waits on (a weight load), once it has run."""
        still = []
        for future in self._unchecked:
            if not future.done():
                still.append(future)
            elif future.exception() is not None:
                raise future.exception()
        self._unchecked = still

    def busy_fraction(self) -> tuple[float, float]:
        """(seconds busy, seconds elapsed) since the last call."""
        now = time.perf_counter()
        with self._lock:
            busy, self._busy = self._busy, 0.0
        elapsed, self._mark = now - self._mark, now
        return busy, elapsed

    def close(self) -> None:
        """Drop queued work that has not started; wait for the running one."""
        self._executor.shutdown(wait=True, cancel_futures=True)


class OrderedEngine(EngineCapabilities):
    """A `RolloutEngine` whose calls queue on the pipeline behind the work before them (see the module
    docstring). Weight loads do not wait: the buckets are a copy of the actor's weights, loaded in turn."""

    def __init__(self, inner: RolloutEngine, pipeline: Pipeline):
        """An `inner` engine that shares the actor's parameters (`shares_actor_weights`) would see them change
        during a batch: megarl's own (--rollout-backend megatron) is refused with --async-staleness; a plugin's that
        ignores weights (a scripted policy) only gets its versions, in order."""
        self.inner, self.pipeline = inner, pipeline
        self.shares_actor_weights = inner.shares_actor_weights
        self.dtype = inner.dtype
        self.weight_version = inner.weight_version
        self.records_routing = as_engine(inner).records_routing
        self.takes_buckets = as_engine(inner).takes_buckets
        self.loads_from_host = as_engine(inner).loads_from_host

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        return self.pipeline.run(self.inner.generate, prompts, params)

    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[list[float]]:
        return self.pipeline.run(self.inner.score, sequences, prompt_lens, temperature)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        from megarl.rollout.weight_sync import pack_buckets

        if self.shares_actor_weights:  # nothing moves (`weight_sync.stamp`): the version, in turn
            version = self.weight_version + 1 if version is None else version
            self.pipeline.submit(self.inner.update_weights, (), version, watch=True)
            self.weight_version = version
            return
        self.load_weight_buckets(pack_buckets(named_tensors, dtype=self.dtype),
                                 self.weight_version + 1 if version is None else version)

    def load_weight_buckets(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Keep a copy of this version's buckets, in host memory, for the worker to load in turn: the actor trains
        on meanwhile. Only a rank whose engine reads them keeps one (`takes_buckets`; the other data-parallel
        leaders of shared servers drain theirs). The copy is the whole model, so it never stays on the GPU:
        each bucket goes to (pinned) host memory as it is packed, and the worker brings it back to its GPU one
        bucket at a time for an engine that needs it there (`loads_from_host`)."""
        if self.takes_buckets:
            owned = host_copies(buckets)  # built now, from the actor's weights of this version
        else:
            owned = []
            for _ in buckets:  # the export still runs to its end, one bucket at a time
                pass
        self.pipeline.submit(self._load, owned, version, watch=True)
        self.weight_version = version

    def _load(self, owned: list[tuple[WeightBucket, torch.device]], version: int) -> None:
        if self.loads_from_host:
            buckets = (bucket for bucket, _ in owned)
        else:
            buckets = (bucket if home.type == "cpu" else WeightBucket(bucket.flat.to(home), bucket.slots)
                       for bucket, home in owned)
        self.inner.load_weight_buckets(buckets, version)

    def release_memory(self, keep_weights: bool = False) -> None:
        """The engine runs beside the actor, never in its memory: nothing to hand over."""

    def resume_memory(self) -> None:
        """See `release_memory`."""

    def shutdown(self) -> None:
        self.pipeline.close()
        self.inner.shutdown()


def host_copies(buckets: Iterable[WeightBucket]) -> list[tuple[WeightBucket, torch.device]]:
    """Each bucket with the device it was packed on, held in host memory: a bucket on the GPU is copied into
    pinned (page-locked) host memory as soon as it is packed and its GPU memory goes back at once, so the GPU holds
    one bucket at a time, never the model; a bucket already in host memory is kept as it is (`pack_buckets` made
    it: it is a copy already). Pinned memory needs CUDA, and only a GPU bucket asks for it."""
    owned, gpus = [], set()
    for bucket in buckets:
        home = bucket.flat.device
        if home.type != "cpu":
            host = torch.empty(bucket.nbytes, dtype=torch.uint8, pin_memory=True)
            host.copy_(bucket.flat, non_blocking=True)  # ordered before any reuse of the bucket's GPU memory
            bucket = WeightBucket(host, bucket.slots)
            gpus.add(home)
        owned.append((bucket, home))
    for gpu in gpus:
        torch.cuda.synchronize(gpu)  # the copies are complete before the worker reads them
    return owned

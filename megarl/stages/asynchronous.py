"""Asynchronous training (`--async-staleness K`, K >= 1): the engine generates the next batches while the actor
trains on this one, with a staleness bound that makes every run reproducible.

    pipeline = Pipeline()                                   # one worker thread: the engine's work, in order
    engine = OrderedEngine(EngineProcess(...), pipeline)    # what the loop, the sync and evaluation call
    collect = AsyncCollect(collector, pipeline, engine, K)  # the rollout stage: batch s was made with v(s - K)

`Pipeline` and `OrderedEngine`, the engine's side, live in `megarl.rollout.pipeline`; here is the rollout stage and
the checks a step makes on what it consumed.

The rule. The batch the actor trains on at step s was generated with exactly the weights of step max(0, s - K):
when step s takes its batch it first queues the rollout of batch s + K, which the engine runs with the weights
it holds then, version s (the sync after step s - 1 queued them). Batches 0 .. K - 1 use the starting weights.
Since the engine's work runs in one worker thread in the order it was queued (a weight load, a rollout, the next
load, ...), what each batch holds depends only on the weights and seeds, never on timing: a run is reproducible
and a resumed run repeats the uninterrupted one bitwise. Every sample carries the version that generated it and
`check_staleness` enforces s - version <= K on every batch the trainer consumes.

What runs where. The rollout function (generation and reward) runs in the worker thread, talking to the engine
directly; the engine itself is a process of its own on CPU (`megarl.rollout.engine_process`) or the SGLang
servers of the disaggregated mode (`--rollout-servers`). Collectives stay in the main thread: every rank draws the
prompts of each batch when it is queued (the prompt sampler stays in step), and a model replica's other ranks
receive the leader's batch when it is consumed. A weight sync packs the actor's weights into buckets (a copy: the
actor goes on training) and queues their load; evaluation's generate calls queue behind everything before them.

In flight at a checkpoint: the K queued batches (finished first, then saved with this rank's rollout state) and
the number of batches made so far (their seeds).

Engines shared by several data-parallel leaders (SGLang servers, `--rollout-servers`, at DP > 1): one rank's weight
load changes the weights under the others' queued batches, so before each sync every rank waits for its queued
batches (`AsyncCollect.settle`); rollout still overlaps training, up to the sync.

With dynamic sampling, each round takes the next queued batch (and queues one more), so a batch taken at step s
was queued at most K rounds, hence at most K steps, earlier; groups that wait in its buffer for a later step are
dropped once they are older than the bound.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

from megarl.rollout.pipeline import OrderedEngine, Pipeline
from megarl.samples import RolloutBatch, Sample

if TYPE_CHECKING:
    from megarl.stages.collect import Collector

# `Pipeline` and `OrderedEngine` are re-exported for imports from here (megarl.rollout.pipeline; until megarl 0.3)
__all__ = ["AsyncCollect", "OrderedEngine", "Pipeline", "StalenessError", "check_staleness", "overlap_metrics"]


class StalenessError(RuntimeError):
    """A batch generated with weights older than --async-staleness allows."""


@dataclass
class _Queued:
    index: int  # how many batches were queued before it: its seed
    version: int  # the weights it is generated with
    future: Future | None  # the leader's rollout; None on a replica's other ranks (or once restored: `done`)
    done: RolloutBatch | None = None  # restored from a checkpoint


class AsyncCollect:
    """The rollout stage of asynchronous training: `K` batches queued ahead of the one consumed (see the module
    docstring). Has the collector's `share` and `rollout`, so dynamic sampling can wrap it."""

    def __init__(self, collector: Collector, pipeline: Pipeline, engine: OrderedEngine, staleness: int):
        if staleness < 1:
            raise ValueError(f"AsyncCollect needs a staleness bound >= 1, got {staleness}")
        self.collector, self.pipeline, self.engine, self.staleness = collector, pipeline, engine, staleness
        self.share, self.rollout, self.info = collector.share, collector.rollout, collector.info
        self.queue: deque[_Queued] = deque()
        self.queued = 0  # batches queued so far, over the whole run
        self.wait_seconds = 0.0  # the trainer's wait for batches since the last `take_metrics`
        self.generate_seconds = 0.0

    def start(self) -> None:
        """Queue the first K batches, with the starting weights (a resumed run restored them instead)."""
        while len(self.queue) < self.staleness:
            self._queue_next()

    def _queue_next(self) -> None:
        prompts = self.collector.draw()  # every rank: the sampler stays in step
        index, version = self.queued, self.engine.weight_version
        future = (self.pipeline.submit(self.collector.produce, prompts, index)
                  if self.info.is_mp_leader else None)
        self.queue.append(_Queued(index, version, future))
        self.queued += 1

    def __call__(self, step: int) -> RolloutBatch:
        """The next batch (queued K batches ago); the batch K ahead is queued first, with today's weights."""
        self._queue_next()
        item = self.queue.popleft()
        start = time.perf_counter()
        rollout = self._result(item)
        waited = time.perf_counter() - start
        self.wait_seconds += waited
        rollout = self.collector.share_batch(rollout)
        self.generate_seconds += rollout.generate_seconds + rollout.reward_exposed_seconds  # the worker's time
        # The worker's reward wait came last in its work, so the trainer waited on at most that much of it: the
        # step's exposed reward is the part of the worker's that overlapped no training (t_reward_exposed is what
        # the step waited on, as in the synchronous loop; t_reward stays the scoring's own time).
        return replace(rollout, reward_exposed_seconds=min(rollout.reward_exposed_seconds, waited))

    def _result(self, item: _Queued) -> RolloutBatch | None:
        if item.done is not None:
            return item.done
        return item.future.result() if item.future is not None else None

    def take_metrics(self) -> dict[str, float]:
        """Seconds the trainer waited for batches, and the seconds of generation and reward those batches took
        (in the worker, overlapped with training), since the last call."""
        busy, elapsed = self.pipeline.busy_fraction()
        out = {"t_wait_rollout": self.wait_seconds, "t_rollout_async": self.generate_seconds,
               "rollout_idle_frac": max(0.0, 1.0 - busy / max(elapsed, 1e-9))}
        self.wait_seconds = self.generate_seconds = 0.0
        return out

    def rank_state(self) -> dict:
        """What is in flight: the queued batches (finished first) and how many were queued in all."""
        items = [(q.index, q.version, self._result(q)) for q in self.queue]
        return {"async_queued": self.queued, "async_queue": items}

    def load_rank_state(self, state: dict) -> None:
        """Restore the queue; a checkpoint of a synchronous run has none, and `start` queues afresh."""
        items = state.get("async_queue", [])
        if len(items) > self.staleness:
            raise ValueError(f"this checkpoint holds {len(items)} queued batches, saved by a run with "
                             f"--async-staleness {len(items)}: resuming with --async-staleness {self.staleness} would "
                             f"train on batches older than the bound; use --async-staleness >= {len(items)}")
        self.queued = state.get("async_queued", 0)
        self.queue = deque(_Queued(i, v, None, done) for i, v, done in items)

    def round(self, step: int, index: int, need: bool) -> RolloutBatch | None:
        """Dynamic sampling's round: every rank takes the next queued batch (keeping the queues in step); a rank
        that does not `need` it drops it."""
        rollout = self(step)
        return rollout if need else None

    def settle(self) -> None:
        """Collective. Every batch queued so far finishes, on every rank, before the next weights move: for engines
        that several data-parallel leaders share (--rollout-servers), where one rank's load would otherwise change
        the weights under another rank's queued batch."""
        from megarl.mcore.parallel import agree_any

        for item in self.queue:
            self._result(item)
        agree_any(False)  # a barrier over the main threads

    def cancel(self) -> None:
        """Training is over: drop the queued batches (those not started yet cost nothing more)."""
        for item in self.queue:
            if item.future is not None:
                item.future.cancel()
        self.queue.clear()

    def stop(self) -> None:
        """The run is over: stop the worker (it finishes what it is running)."""
        self.cancel()
        self.pipeline.close()


def check_staleness(samples: Sequence[Sample], step: int, bound: int) -> dict[str, float]:
    """Every sample trained on at step `step` (0-based) was generated with weights at most `bound` versions old;
    returns the batch's staleness (mean and max) as metrics. Raises `StalenessError` otherwise."""
    if not samples:
        return {}
    ages = [step - s.weight_version for s in samples]
    worst = max(ages)
    if worst > bound or min(ages) < 0:
        bad = next(s for s, a in zip(samples, ages) if a > bound or a < 0)
        raise StalenessError(f"step {step} got a sample of prompt {bad.prompt_index} generated with weight version "
                             f"{bad.weight_version}: {step - bad.weight_version} versions old, outside the bound 0 .. "
                             f"{bound} (--async-staleness)")
    return {"staleness_mean": sum(ages) / len(ages), "staleness_max": float(worst)}


def overlap_metrics(phases: dict[str, float], step_seconds: float) -> dict[str, float]:
    """How much of a step the overlap saved: `overlap` = (rollout + training) / step time, against its bound
    (rollout + training) / max(rollout, training), both 1.0 for a synchronous step. Rollout: the seconds the
    consumed batch took in the worker (generation and reward); training: the step's own seconds but the wait."""
    rollout = phases.get("t_rollout_async", 0.0)
    training = max(step_seconds - phases.get("t_wait_rollout", 0.0), 0.0)
    both = rollout + training
    return {"overlap": both / max(step_seconds, 1e-9), "overlap_bound": both / max(rollout, training, 1e-9)}

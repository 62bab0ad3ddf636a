"""The reward stage of a step: the reward function one rollout scores with, metered (`RewardMeter`), and the wait
for rewards still being scored when the step needs them (`wait_for_rewards`).

`RewardMeter` wraps the run's reward function (`megarl.reward.functions`: in a worker pool or in process, routed to
rule verifiers and reward models) for one rollout, adding up the seconds spent in it and the results' health
(`batch_health`); with `--reward-overlap` it scores in a thread of its own, so rows are scored as they finish while
the rest still decode (`submit`). This module imports neither torch nor megatron.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

from megarl.data import PromptRecord
from megarl.reward.functions import RewardFn, Scores, StreamingReward, as_reward_function
from megarl.reward.hacking import rm_length_sums
from megarl.reward.pool import batch_health
from megarl.samples import RolloutBatch, Sample
from megarl.verifiers import VerifyResult
from megarl.verifiers.signals import switched


class _Scored:
    """Scores already in (scored in the caller's thread)."""

    def __init__(self, results: list[VerifyResult]):
        self._results = results

    def result(self) -> list[VerifyResult]:
        return self._results


class _Queued:
    """Scores the meter's thread is computing; waiting on them counts as exposed reward time."""

    def __init__(self, meter: RewardMeter):
        self.meter, self.done = meter, threading.Event()
        self.results: list[VerifyResult] | None = None
        self.error: BaseException | None = None

    def result(self) -> list[VerifyResult]:
        if not self.done.is_set():
            start = time.perf_counter()
            self.done.wait()
            self.meter.waited += time.perf_counter() - start
        if self.error is not None:
            raise self.error
        return self.results


class RewardMeter(StreamingReward):
    """The reward function one rollout scores with: it counts the scoring's seconds and every result, for the
    step's metrics, and with `overlap` scores in a thread of its own, so that a rollout function can hand it
    samples as they finish (`submit`) and go on generating.

    - `seconds` (the step's `t_reward`): the wall time spent inside `inner`, in whichever thread;
    - `exposed` (`t_reward_exposed`): the part of it a caller waited on: all of a blocking call, and the waits in
      `Scores.result()` (`waited`, which also holds the thread's hand-over, at most `seconds`). Without overlap
      the two are equal.

    The thread calls `inner` once for everything queued since its last call, in the order submitted, so `inner`
    sees one caller at a time, as without overlap. Only rows `inner` says it can score off the trainer's thread
    (`scores_off_thread(records)`: rule verifiers in workers or in process, not reward models, which batch on the
    trainer's device) are queued; the rest are scored in the caller, exactly as without overlap. Verdicts do not
    depend on what else is in a call, so the results are the same numbers either way, only the order of the work
    changes.

    `signals` False scores with the verifiers' reward-hacking signals off (`megarl.verifiers.signals.switched`):
    the bench switch's off steps (`MEGARL_BENCH_SIGNALS=alternate`); the verdicts are the same.
    """

    def __init__(self, inner: RewardFn, overlap: bool = False, signals: bool = True):
        self.inner, self.overlap, self.signals = as_reward_function(inner), overlap, signals
        self.seconds = self.waited = 0.0  # in `inner`; callers blocked on scores
        self.scored: list[tuple[int, VerifyResult]] = []  # (sample.group, result), in the order scored
        self.rm_lengths: list[tuple[float, float]] = []  # (a reward model's score, the response's length)
        self._restarts_before = inner.restarts
        self._model_seconds_before = self.inner.model_seconds
        self._lock = threading.Condition()
        self._queue: list[tuple[list[Sample], list[PromptRecord], _Queued]] = []
        self._thread: threading.Thread | None = None
        self.defer = False  # set by the trainer's rollout stage: `finish` leaves the waiting to it
        self.deferred: Callable[[], list[Sample]] | None = None

    @property
    def restarts(self) -> int:
        return self.inner.restarts

    @property
    def exposed(self) -> float:
        return min(self.waited, self.seconds)

    def __call__(self, samples: Sequence[Sample], records: Sequence[PromptRecord]) -> list[VerifyResult]:
        return self.submit(samples, records).result()

    def overlaps(self, records: Sequence[PromptRecord]) -> bool:
        """Whether `submit` scores these rows in the meter's thread (else in the caller, before it returns)."""
        return self.overlap and self.inner.scores_off_thread(records)

    def submit(self, samples: Sequence[Sample], records: Sequence[PromptRecord]) -> Scores:
        """Start scoring `samples`; returns at once when they go to the meter's thread (see the class docstring)."""
        if not self.overlaps(records):
            start = time.perf_counter()
            results = self._score(list(samples), list(records))
            self.waited += time.perf_counter() - start
            return _Scored(results)
        handle = _Queued(self)
        with self._lock:
            self._queue.append((list(samples), list(records), handle))
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name="megarl-reward", daemon=True)
                self._thread.start()
        return handle

    def finish(self, samples: list[Sample], scored: Callable[[], list[Sample]]) -> list[Sample]:
        """What a rollout function returns for samples it `submit`ted: `scored()` (they, scored; it waits), or,
        when the caller takes care of it (`defer`: the trainer's rollout stage, which waits only once the step
        needs the rewards, `megarl.stages.collect`), `samples` as they are, `scored` kept in `deferred`."""
        if not self.defer:
            return scored()
        self.deferred = scored
        return samples

    def _drain(self) -> None:
        """The meter's thread: score what is queued, one `inner` call at a time, until the queue is empty."""
        while True:
            with self._lock:
                batch, self._queue = self._queue, []
                if not batch:
                    self._thread = None
                    return
            try:
                results = self._score([s for b in batch for s in b[0]], [r for b in batch for r in b[1]])
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on these scores
                for _, _, handle in batch:
                    handle.error = e
                    handle.done.set()
                continue
            at = 0
            for samples, _, handle in batch:
                handle.results, at = results[at : at + len(samples)], at + len(samples)
                handle.done.set()

    def _score(self, samples: list[Sample], records: list[PromptRecord]) -> list[VerifyResult]:
        start = time.perf_counter()
        with switched(self.signals):
            results = self.inner(samples, records)
        self.seconds += time.perf_counter() - start
        self.scored.extend((s.group, r) for s, r in zip(samples, results))
        self.rm_lengths.extend((r.model_score, len(s.response_ids)) for s, r in zip(samples, results)
                               if r.model_score is not None)
        return results

    def health(self, group_size: int) -> dict[str, float]:
        """`batch_health` of every result so far, group by group (samples may finish in any order), and the
        workers replaced meanwhile."""
        ordered = [r for _, r in sorted(self.scored, key=lambda gr: gr[0])]  # stable: a group's own order kept
        out = batch_health(ordered, group_size)
        out["reward_worker_restarts"] = self.inner.restarts - self._restarts_before
        out["reward_signals_on"] = float(self.signals)
        if "rm_n" in out:
            out["rm_seconds"] = self.inner.model_seconds - self._model_seconds_before
        out.update(rm_length_sums(self.rm_lengths))  # `hack/rm_length_corr` (`megarl.reward.hacking`)
        return out


def wait_for_rewards(rollout: RolloutBatch) -> RolloutBatch:
    """`rollout` with every reward in: waits for those still being scored (`RolloutBatch.pending`)."""
    return rollout.pending() if rollout.pending is not None else rollout

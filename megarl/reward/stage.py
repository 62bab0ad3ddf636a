"""Reward as a stage: samples and their data rows in, one `VerifyResult` per sample out.

A rollout function calls the reward function it is given on the trajectories it finished; each row's `verifier`
field chooses the verifier (through the registry, never by dataset name). Two implementations:

- `PoolReward`: worker processes (`megarl.reward.pool.RewardPool`), each sample under a wall-clock limit; the
  workers import `--plugins` and build verifiers with the run's verifier options;
- `InProcessReward`: the verifiers in this process, each under its own budget (`--reward-workers 0`).

`RoutedReward` wraps either: rows whose `verifier` is one rule verifier go to it exactly as before; rows that name
a reward model (`hf_rm`, `remote_rm`, `llm_judge`: `megarl.reward.models`) or a composition ("math >
hf_rm": `megarl.reward.compose`) are split into parts, the rule parts scored by the wrapped function, each
model's rows by that model in one batch in this process, and put back together in order. Anything else with the
`RewardFn` shape plugs in the same way. `RewardMeter` wraps one for a rollout, adding up the seconds spent in it
and the results' health (`batch_health`); with `--reward-overlap` it scores in a thread of its own, so rows are
scored as they finish while the rest still decode (`submit`). This module imports neither torch nor megatron.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from megarl.data import PromptRecord
from megarl.reward import compose
from megarl.reward.models import REWARD_MODELS
from megarl.reward.pool import RewardPool, batch_health, shared_pool
from megarl.samples import Sample
from megarl.verifiers import VERIFIERS, VerifyResult

if TYPE_CHECKING:
    from megarl.config import Config, RewardConfig


class RewardFn(Protocol):
    """`reward(samples, records)`: one result per sample, in order; `records[i]` is sample i's data row. It reads
    `sample.response_text` (and anything else of the sample) and changes nothing."""

    restarts: int  # reward workers replaced so far (hung or died); 0 where there are none

    def __call__(self, samples: Sequence[Sample], records: Sequence[PromptRecord]) -> list[VerifyResult]: ...


def _requests(samples: Sequence[Sample], records: Sequence[PromptRecord]) -> list[tuple[str, str, Any]]:
    if len(samples) != len(records):
        raise ValueError(f"reward: {len(samples)} samples but {len(records)} data rows")
    return [(r.verifier, s.response_text, r.label) for s, r in zip(samples, records)]


class PoolReward:
    """Scores in a `RewardPool`'s worker processes (see the module docstring)."""

    def __init__(self, pool: RewardPool):
        self.pool = pool

    @property
    def restarts(self) -> int:
        return self.pool.restarts

    def scores_off_thread(self, records: Sequence[PromptRecord]) -> bool:
        """The workers score; this process only waits (`RewardMeter`)."""
        return True

    def __call__(self, samples: Sequence[Sample], records: Sequence[PromptRecord]) -> list[VerifyResult]:
        return self.score(_requests(samples, records))

    def score(self, requests: Sequence[tuple[str, str, Any]]) -> list[VerifyResult]:
        """One result per (verifier name, response, ground truth), in order."""
        results, _ = self.pool.score(requests)
        return results


class InProcessReward:
    """Scores in this process: one verifier instance per name, built with `options[name]` and kept for the
    process (a verifier may hold a helper process, such as the math verifier's budget)."""

    restarts = 0

    def __init__(self, options: dict[str, dict] | None = None):
        self.options = options or {}
        self._verifiers: dict[str, Any] = {}

    def scores_off_thread(self, records: Sequence[PromptRecord]) -> bool:
        """Rule verifiers are plain Python (a sandbox's or a budget's helper process at most): any one thread at a
        time may run them (`RewardMeter`)."""
        return True

    def __call__(self, samples: Sequence[Sample], records: Sequence[PromptRecord]) -> list[VerifyResult]:
        return self.score(_requests(samples, records))

    def score(self, requests: Sequence[tuple[str, str, Any]]) -> list[VerifyResult]:
        """One result per (verifier name, response, ground truth), in order."""
        return [self._verifier(name).verify(response, label) for name, response, label in requests]

    def _verifier(self, name: str):
        if name not in self._verifiers:
            self._verifiers[name] = VERIFIERS.build(name, **self.options.get(name, {}))
        return self._verifiers[name]

    def close(self) -> None:
        for verifier in self._verifiers.values():
            getattr(verifier, "close", lambda: None)()


class RoutedReward:
    """Rule rows to `rules`, reward-model and composed rows through their parts (see the module docstring).
    `options[name]`: the keyword arguments reward model `name` is built with (once, on first use)."""

    def __init__(self, rules, options: dict[str, dict] | None = None):
        self.rules, self.options = rules, options or {}
        self.models: dict[str, Any] = {}
        self.model_seconds = 0.0  # wall time spent in reward models so far

    @property
    def restarts(self) -> int:
        return self.rules.restarts + sum(m.restarts for m in self.models.values())

    def scores_off_thread(self, records: Sequence[PromptRecord]) -> bool:
        """Rule rows, when `rules` can score off the trainer's thread; never rows of a reward model, which scores
        in batches on the trainer's device."""
        return (all(compose.is_plain_rule(r.verifier) for r in records)
                and bool(getattr(self.rules, "scores_off_thread", lambda _: False)(records)))

    def __call__(self, samples: Sequence[Sample], records: Sequence[PromptRecord]) -> list[VerifyResult]:
        requests = _requests(samples, records)
        if all(compose.is_plain_rule(name) for name, _, _ in requests):
            return self.rules(samples, records)  # the rule-only path, untouched
        prompts = [r.raw_prompt if r.raw_prompt is not None else r.prompt for r in records]
        return self.score([(name, p, resp, label) for (name, resp, label), p in zip(requests, prompts)])

    def score(self, requests: Sequence[tuple[str, Any, str, Any]]) -> list[VerifyResult]:
        """One result per (spec, prompt, response, ground truth), in order."""
        specs = [compose.parse(name) for name, _, _, _ in requests]
        rule_jobs: list[tuple[int, int]] = []  # (row, part) of each rule part, in the order sent to `rules`
        model_jobs: dict[str, list[tuple[int, int]]] = {}
        for i, spec in enumerate(specs):
            for j, part in enumerate(spec.parts):
                if part.name in REWARD_MODELS:
                    model_jobs.setdefault(part.name, []).append((i, j))
                else:
                    rule_jobs.append((i, j))
        got: dict[tuple[int, int], VerifyResult] = {}
        if rule_jobs:
            rule_requests = [(specs[i].parts[j].name, requests[i][2], requests[i][3]) for i, j in rule_jobs]
            got.update(zip(rule_jobs, self.rules.score(rule_requests)))
        start = time.perf_counter()
        for name, jobs in model_jobs.items():
            rows = [(requests[i][1], requests[i][2], requests[i][3]) for i, _ in jobs]
            got.update(zip(jobs, self._model(name).score(rows)))
        self.model_seconds += time.perf_counter() - start
        models = set(model_jobs)
        return [compose.combine(spec, [got[(i, j)] for j in range(len(spec.parts))], models)
                for i, spec in enumerate(specs)]

    def _model(self, name: str):
        if name not in self.models:
            self.models[name] = REWARD_MODELS.build(name, **self.options.get(name, {}))
        return self.models[name]

    def close(self) -> None:
        for model in self.models.values():
            model.close()
        getattr(self.rules, "close", lambda: None)()


class Scores(Protocol):
    """The results of one `RewardMeter.submit`, in its order: `result()` blocks until they are in."""

    def result(self) -> list[VerifyResult]: ...


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


class RewardMeter:
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
    """

    def __init__(self, inner: RewardFn, overlap: bool = False):
        self.inner, self.overlap = inner, overlap
        self.seconds = self.waited = 0.0  # in `inner`; callers blocked on scores
        self.scored: list[tuple[int, VerifyResult]] = []  # (sample.group, result), in the order scored
        self._restarts_before = inner.restarts
        self._model_seconds_before = getattr(inner, "model_seconds", 0.0)
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
        return self.overlap and bool(getattr(self.inner, "scores_off_thread", lambda _: False)(records))

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
        results = self.inner(samples, records)
        self.seconds += time.perf_counter() - start
        self.scored.extend((s.group, r) for s, r in zip(samples, results))
        return results

    def health(self, group_size: int) -> dict[str, float]:
        """`batch_health` of every result so far, group by group (samples may finish in any order), and the
        workers replaced meanwhile."""
        ordered = [r for _, r in sorted(self.scored, key=lambda gr: gr[0])]  # stable: a group's own order kept
        out = batch_health(ordered, group_size)
        out["reward_worker_restarts"] = self.inner.restarts - self._restarts_before
        if "rm_n" in out:
            out["rm_seconds"] = getattr(self.inner, "model_seconds", 0.0) - self._model_seconds_before
        return out


def reward_options(cfg: Config) -> dict[str, dict]:
    """The keyword arguments each verifier and reward model is built with, by name, from the run's config (their
    declared options, `megarl.registry`): what the trainer, every reward worker and `megarl-verify` use."""
    return {**VERIFIERS.kwargs(cfg), **REWARD_MODELS.kwargs(cfg)}


def build_reward(r: RewardConfig, options: dict[str, dict], plugins: tuple[str, ...] = ()) -> RewardFn:
    """The run's reward function: a pool of `--reward-workers` processes (-1: one per CPU) that import `plugins`,
    or, with 0 workers, this process, for the rule verifiers, routed (`RoutedReward`) so that rows may name reward
    models; verifiers and reward models are built with `options[name]`."""
    if r.reward_workers == 0:
        return RoutedReward(InProcessReward(options), options)
    return RoutedReward(PoolReward(shared_pool(r.reward_workers, r.reward_timeout, preload=plugins,
                                               options=options)), options)

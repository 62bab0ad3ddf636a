"""Reward pool: score a batch of samples in worker processes, each sample under a wall-clock limit.

    with RewardPool(workers=8, timeout_s=10) as pool:
        results, health = pool.score([("math", response, gold), ...], group_size=8)

- Each sample names its verifier (the data row's `verifier` field, looked up in the registry), so one batch can
  mix math, code and anything registered.
- Workers are helper processes (`megarl.verifiers.budget.Guard`); one feeder thread per worker sends it one
  sample at a time. A sample that overruns `timeout_s` gets outcome `timeout`; its worker is killed and
  replaced. A worker that dies (a crash, `os._exit`, the OOM killer, a kill from outside) is replaced and its
  sample scored again on the replacement, once (`RESCORES`): a death the sample did not cause costs it nothing,
  and the result is the one a worker that never died gives (verifiers are deterministic). A sample whose worker
  dies again gets `parse_error` with the reason in `normalized`: it kills workers itself. Either way every sample
  gets exactly one result, in input order, and `restarts` counts every worker replaced.
- Inside a worker a verifier's own budget hop is skipped (`verify_unguarded` when it has one): the pool's kill
  already bounds it, at the smaller of `timeout_s` and the verifier's own budget (`budget_s`, e.g. the math
  verifier's 5 s), so a sample gets the same limit in a worker as in the trainer's process.
- Workers import `preload` (the run's `--plugins`) when they start, so verifiers registered there exist in them,
  and build each verifier with `options[name]` (the run's verifier and sandbox flags, `megarl.reward.reward_options`).
  A batch scored inside `megarl.verifiers.signals.switched(False)` is scored with `signals=False` in the options
  of the verifiers that declare it (a second instance in each worker): the bench switch's off steps.

`batch_health` turns a batch of results into the per-step metrics train.py logs: outcome counts, timeout rate,
extraction-failure (no answer) rate, share of groups whose rewards are all equal, p50/p99 latency; when a reward
model scored rows, the sums its score mean/std and its agreement with the rule verifier come from; when rows ran
in a sandbox, the programs, tests and sandbox CPU seconds the step's throughput comes from.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Sequence

from megarl import faults
from megarl.verifiers import signals as hack_signals
from megarl.verifiers.budget import BudgetExceeded, Guard, HelperFailed
from megarl.verifiers.base import OUTCOMES, VERIFIERS, VerifierCapabilities, VerifyResult

Request = tuple[str, str, Any]  # (verifier name, response, ground truth)
RESCORES = 1  # times a sample whose worker died is scored again on the replacement before it gets parse_error


def default_workers() -> int:
    """This process's share of the CPUs it may use (torchrun's ranks on the node split them), at most 16: rewards
    are rarely the bottleneck beyond that."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(16, cpus // ranks_here))


class RewardPool:
    def __init__(self, workers: int = 0, timeout_s: float = 10.0, preload: tuple[str, ...] = (),
                 memory_mib: int = 4096, options: dict[str, dict] | None = None):
        """`workers` 0 = `default_workers()`. `preload`: modules each worker imports at start (e.g. ones that
        register extra verifiers). `options[name]`: keyword arguments of verifier `name` in the workers."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.size = workers or default_workers()
        self.timeout_s = timeout_s
        self.options = options or {}
        modules = ("megarl.reward.pool",) + tuple(preload)
        self._guards = [Guard(preload=modules, memory_mib=memory_mib) for _ in range(self.size)]
        self.restarts = 0  # workers replaced so far (hung or died)
        self._lock = threading.Lock()
        self._limits: dict[str, float] = {}  # seconds a sample of each verifier may take

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        for g in self._guards:
            g.close()

    def score(self, requests: Sequence[Request], group_size: int | None = None) -> tuple[list[VerifyResult], dict]:
        """One result per request, in order, and the batch's health metrics."""
        start = time.perf_counter()
        results: list[VerifyResult | None] = [None] * len(requests)
        restarts_before = self.restarts
        cursor = iter(range(len(requests)))
        signals_on = hack_signals.enabled()  # the caller's context: the feeder threads do not inherit it

        def feed(guard: Guard) -> None:
            while True:
                with self._lock:
                    i = next(cursor, None)
                if i is None:
                    return
                results[i] = self._score_one(guard, requests[i], signals_on)

        threads = [threading.Thread(target=feed, args=(g,), daemon=True)
                   for g in self._guards[: max(1, min(self.size, len(requests)))]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        health = batch_health(results, group_size)
        health["reward_worker_restarts"] = self.restarts - restarts_before
        health["reward_pool_seconds"] = time.perf_counter() - start
        return results, health

    def _limit(self, name: str) -> float:
        """`timeout_s`, or the verifier's own budget when smaller (its option, else its class's `budget_s`)."""
        if name not in self._limits:
            try:
                builder = VERIFIERS.get(name)  # a class, or a builder (which declares nothing)
                declared = isinstance(builder, type) and issubclass(builder, VerifierCapabilities)
                budget = self.options.get(name, {}).get("budget_s", builder.budget_s if declared else None)
            except ValueError:  # not registered in this process: the worker says so
                budget = None
            self._limits[name] = min(self.timeout_s, budget) if budget else self.timeout_s
        return self._limits[name]

    def _score_one(self, guard: Guard, request: Request, signals_on: bool = True) -> VerifyResult:
        name = request[0]
        options = self.options.get(name, {})
        if not signals_on and "signals" in options:
            options = {**options, "signals": False}
        call = (*request, options)
        target = "megarl.reward.pool:_verify_here"
        if faults.take("reward_worker_crash"):  # MEGARL_FAULT: this worker dies with the verdict in hand
            target = "megarl.reward.pool:_verify_then_die"
        elif name == "code" and faults.take("sandbox_kill"):  # MEGARL_FAULT: this worker's sandbox is killed
            target = "megarl.reward.pool:_verify_killing_sandbox"
        for attempt in range(RESCORES + 1):
            guard.last_seconds = 0.0
            try:
                score, outcome, extracted, normalized, seconds, tests_run, cpu, reruns, signals, signals_s = \
                    guard.call(target, call, self._limit(name))
                result = VerifyResult(score, outcome, extracted, normalized, seconds, tests_run=tests_run,
                                      sandbox_cpu_seconds=cpu, sandbox_reruns=reruns, signals=signals,
                                      signals_seconds=signals_s)
            except BudgetExceeded:
                self._count_restart()
                result = VerifyResult(0.0, "timeout")
            except HelperFailed as e:
                self._count_restart()
                if attempt < RESCORES:
                    print(f"megarl: reward worker died scoring a {name!r} sample ({e}): replaced, the sample is "
                          "scored again", file=sys.stderr, flush=True)
                    target = "megarl.reward.pool:_verify_here"
                    continue
                result = VerifyResult(0.0, "parse_error", normalized=f"reward worker died: {e} (and again when "
                                                                     "the sample was scored again)")
            except Exception as e:  # noqa: BLE001 - the verifier raised: this sample scores 0, the batch goes on
                result = VerifyResult(0.0, "parse_error", normalized=f"verifier raised {type(e).__name__}: {e}")
            result.seconds = guard.last_seconds  # the sample's own time, not a replacement worker's start-up
            return result

    def _count_restart(self) -> None:
        with self._lock:
            self.restarts += 1


_SHARED: dict = {}


def shared_pool(workers: int, timeout_s: float, preload: tuple[str, ...] = (),
                options: dict[str, dict] | None = None) -> RewardPool:
    """The process's pool for these settings (`workers` -1 = `default_workers()`), made on first use and closed
    at exit. The trainer scores every step, so its workers live as long as it does."""
    key = (workers, timeout_s, preload, repr(sorted((options or {}).items())))
    if key not in _SHARED:
        import atexit

        pool = _SHARED[key] = RewardPool(workers=0 if workers < 0 else workers, timeout_s=timeout_s,
                                         preload=preload, options=options)
        atexit.register(pool.close)
    return _SHARED[key]


_INSTANCES: dict = {}


def _verify_here(name: str, response: str, ground_truth: Any, options: dict | None = None) -> tuple:
    """Runs inside a worker: one verifier instance per name and options, reused."""
    from megarl.verifiers import VERIFIERS

    key = (name, repr(sorted((options or {}).items())))
    verifier = _INSTANCES.get(key)
    if verifier is None:
        verifier = _INSTANCES[key] = VERIFIERS.build(name, **(options or {}))
    verify = verifier.verify_unguarded if isinstance(verifier, VerifierCapabilities) else verifier.verify
    r = verify(response, ground_truth)
    return (float(r.score), r.outcome, r.extracted, r.normalized, r.seconds, r.tests_run, r.sandbox_cpu_seconds,
            int(getattr(r, "sandbox_reruns", 0) or 0), dict(getattr(r, "signals", None) or {}),
            float(getattr(r, "signals_seconds", 0.0) or 0.0))


def _verify_then_die(*args) -> None:
    """Runs inside a worker, for MEGARL_FAULT=reward_worker_crash: the work done, the worker dies before it answers."""
    import signal

    _verify_here(*args)
    os.kill(os.getpid(), signal.SIGKILL)


def _verify_killing_sandbox(*args) -> tuple:
    """Runs inside a worker, for MEGARL_FAULT=sandbox_kill: the sample's code verifier has its sandbox killed from
    outside mid-case (`faults.kill_sandbox`)."""
    faults.arm("sandbox_kill")
    return _verify_here(*args)


def batch_health(results: Sequence[VerifyResult], group_size: int | None = None) -> dict:
    """Outcome counts and rates, p50/p99 latency, and (given the group size) the share of groups whose rewards
    are all equal - groups that give GRPO no signal."""
    n = len(results)
    out: dict = {f"reward_n_{o}": sum(r.outcome == o for r in results) for o in OUTCOMES}
    out["reward_n"] = n
    out["reward_timeout_rate"] = out["reward_n_timeout"] / n if n else 0.0
    out["reward_no_answer_rate"] = out["reward_n_no_answer"] / n if n else 0.0
    out["reward_parse_error_rate"] = out["reward_n_parse_error"] / n if n else 0.0
    out["reward_sandbox_reruns"] = sum(getattr(r, "sandbox_reruns", 0) or 0 for r in results)
    seconds = sorted(r.seconds for r in results)
    out["reward_latency_p50"] = _quantile(seconds, 0.50)
    out["reward_latency_p99"] = _quantile(seconds, 0.99)
    scores = [r.model_score for r in results if r.model_score is not None]
    if scores:  # a reward model scored rows: rm_n, rm_score_sum and rm_score_sqsum give its mean and std
        out.update(rm_n=len(scores), rm_score_sum=sum(scores), rm_score_sqsum=sum(x * x for x in scores))
        agrees = [r.agrees for r in results if r.agrees is not None]
        out.update(rm_agree_n=len(agrees), rm_agree_sum=sum(agrees))
    out.update(sandbox_throughput(results))
    out["reward_signals_seconds"] = sum(getattr(r, "signals_seconds", 0.0) or 0.0 for r in results)
    if group_size and n and n % group_size == 0:
        groups = [results[i : i + group_size] for i in range(0, n, group_size)]
        out["reward_uniform_group_frac"] = sum(len({r.score for r in g}) == 1 for g in groups) / len(groups)
    return out


SANDBOX_KEYS = ("reward_programs", "reward_tests", "reward_sandbox_cpu_seconds")


def sandbox_throughput(results: Sequence[VerifyResult]) -> dict:
    """What the sandboxed rows cost (`VerifyResult.tests_run`, `.sandbox_cpu_seconds`; None: no program ran in a
    sandbox): `reward_programs`, `reward_tests` and `reward_sandbox_cpu_seconds`, sums that add up over ranks
    into the step's tests/s and CPU per program (`megarl.stages.report`). Empty when no row ran in a sandbox."""
    ran = [r for r in results if r.tests_run is not None or r.sandbox_cpu_seconds is not None]
    if not ran:
        return {}
    totals = (len(ran), sum(r.tests_run or 0 for r in ran), sum(r.sandbox_cpu_seconds or 0.0 for r in ran))
    return dict(zip(SANDBOX_KEYS, totals))


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return float(sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))])

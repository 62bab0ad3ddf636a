"""The reward function a rollout calls: samples and their data rows in, one `VerifyResult` per sample out.

A rollout function calls the reward function it is given on the trajectories it finished; each row's `verifier`
field chooses the verifier (through the registry, never by dataset name). Two implementations:

- `PoolReward`: worker processes (`megarl.reward.pool.RewardPool`), each sample under a wall-clock limit; the
  workers import `--plugins` and build verifiers with the run's verifier options;
- `InProcessReward`: the verifiers in this process, each under its own budget (`--reward-workers 0`).

`RoutedReward` wraps either: rows whose `verifier` is one rule verifier go to it exactly as before; rows that name
a reward model (`hf_rm`, `remote_rm`, `llm_judge`: `megarl.reward.models`) or a composition ("math >
hf_rm": `megarl.reward.compose`) are split into parts, the rule parts scored by the wrapped function, each
model's rows by that model in one batch in this process, and put back together in order. Anything else with the
`RewardFn` shape plugs in the same way.

What the reward stage (`megarl.stages.reward.RewardMeter`) asks of a reward function besides the call is declared
on `RewardFunction`, with defaults: `scores_off_thread(records)`, `model_seconds`, `close()`; a bare `RewardFn` is
wrapped in `PlainReward` (`as_reward_function`). What a rollout function may ask of the reward it is given, to hand
it rows as they finish, is `StreamingReward` (the stage's meter is one). This module imports neither torch nor
megatron.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from megarl.reward import compose
from megarl.reward.models import REWARD_MODELS
from megarl.reward.pool import RewardPool, shared_pool
from megarl.registry import refuse_bare_capabilities
from megarl.samples import Sample
from megarl.verifiers import VERIFIERS, VerifierCapabilities, VerifyResult

if TYPE_CHECKING:  # annotations only: reward and data do not import each other
    from megarl.config import Config, RewardConfig
    from megarl.data import PromptRecord


class RewardFn(Protocol):
    """`reward(samples, records)`: one result per sample, in order; `records[i]` is sample i's data row. It reads
    `sample.response_text` (and anything else of the sample) and changes nothing."""

    restarts: int  # reward workers replaced so far (hung or died); 0 where there are none

    def __call__(self, samples: Sequence[Sample], records: Sequence[PromptRecord]) -> list[VerifyResult]: ...


class RewardFunction:
    """A reward function with its optional abilities declared (see the module docstring); derive from it and
    override what applies. The defaults are those of a function that says nothing."""

    restarts: int = 0  # reward workers replaced so far (hung or died); 0 where there are none
    model_seconds: float = 0.0  # wall time spent in reward models so far

    def __call__(self, samples: Sequence[Sample], records: Sequence[PromptRecord]) -> list[VerifyResult]:
        raise NotImplementedError

    def scores_off_thread(self, records: Sequence[PromptRecord]) -> bool:
        """Whether these rows may be scored in a thread other than the trainer's (`megarl.stages.reward`)."""
        return False

    def close(self) -> None:
        """Release what it holds (worker processes are the pool's; verifiers' helpers, reward models)."""


class PlainReward(RewardFunction):
    """A bare `RewardFn` (the call and `restarts`) as a `RewardFunction`, with the defaults."""

    def __init__(self, inner: RewardFn):
        self.inner = inner

    @property
    def restarts(self) -> int:
        return self.inner.restarts

    def __call__(self, samples: Sequence[Sample], records: Sequence[PromptRecord]) -> list[VerifyResult]:
        return self.inner(samples, records)


def as_reward_function(reward: RewardFn) -> RewardFunction:
    """`reward` itself when it is a `RewardFunction` (megarl's are), else wrapped in `PlainReward`."""
    if isinstance(reward, RewardFunction):
        return reward
    refuse_bare_capabilities(reward, RewardFunction, "reward function", forwarded=("restarts",))
    return PlainReward(reward)


def _requests(samples: Sequence[Sample], records: Sequence[PromptRecord]) -> list[tuple[str, str, Any]]:
    if len(samples) != len(records):
        raise ValueError(f"reward: {len(samples)} samples but {len(records)} data rows")
    return [(r.verifier, s.response_text, r.label) for s, r in zip(samples, records)]


class PoolReward(RewardFunction):
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

    def close(self) -> None:
        """Stop the pool's workers (each starts again if the pool scores again: it is the process's, `shared_pool`)."""
        self.pool.close()


class InProcessReward(RewardFunction):
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
            if isinstance(verifier, VerifierCapabilities):  # a verifier that declares nothing holds nothing to close
                verifier.close()


class RoutedReward(RewardFunction):
    """Rule rows to `rules`, reward-model and composed rows through their parts (see the module docstring).
    `options[name]`: the keyword arguments reward model `name` is built with (once, on first use)."""

    def __init__(self, rules, options: dict[str, dict] | None = None):
        self.rules, self.options = as_reward_function(rules), options or {}
        self.models: dict[str, Any] = {}
        self.model_seconds = 0.0  # wall time spent in reward models so far

    @property
    def restarts(self) -> int:
        return self.rules.restarts + sum(m.restarts for m in self.models.values())

    def scores_off_thread(self, records: Sequence[PromptRecord]) -> bool:
        """Rule rows, when `rules` can score off the trainer's thread; never rows of a reward model, which scores
        in batches on the trainer's device."""
        return (all(compose.is_plain_rule(r.verifier) for r in records)
                and self.rules.scores_off_thread(records))

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
        self.rules.close()


class Scores(Protocol):
    """The results of one `RewardMeter.submit`, in its order: `result()` blocks until they are in."""

    def result(self) -> list[VerifyResult]: ...

class StreamingReward(RewardFunction):
    """What a rollout function may ask of the reward it is given, to hand it rows as they finish (the trainer's
    `megarl.stages.reward.RewardMeter`): `overlaps(records)` says whether `submit` scores them in a thread of its own
    (else in the caller, before it returns), `finish` what the rollout function returns."""

    def overlaps(self, records: Sequence[PromptRecord]) -> bool:
        raise NotImplementedError

    def submit(self, samples: Sequence[Sample], records: Sequence[PromptRecord]) -> Scores:
        raise NotImplementedError

    def finish(self, samples: list[Sample], scored: Callable[[], list[Sample]]) -> list[Sample]:
        raise NotImplementedError


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

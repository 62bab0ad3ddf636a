"""Reward as a stage: samples and their data rows in, one `VerifyResult` per sample out.

A rollout function calls the reward function it is given on the trajectories it finished; each row's `verifier`
field chooses the verifier (through the registry, never by dataset name). Two implementations:

- `PoolReward`: worker processes (`megarl.verifiers.pool.RewardPool`), each sample under a wall-clock limit; the
  workers import `--plugins` and build verifiers with the run's verifier options;
- `InProcessReward`: the verifiers in this process, each under its own budget (`--reward-workers 0`).

Anything else with the `RewardFn` shape (a reward model, a remote judge) plugs in the same way. `RewardMeter`
wraps one for a rollout, adding up the seconds spent in it and the results' health (`batch_health`).
This module imports neither torch nor megatron.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from megarl.data import PromptRecord
from megarl.types import Sample
from megarl.verifiers import VerifyResult, get_verifier
from megarl.verifiers.pool import RewardPool, batch_health, shared_pool

if TYPE_CHECKING:
    from megarl.config import RewardConfig


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

    def __call__(self, samples: Sequence[Sample], records: Sequence[PromptRecord]) -> list[VerifyResult]:
        results, _ = self.pool.score(_requests(samples, records))
        return results


class InProcessReward:
    """Scores in this process: one verifier instance per name, built with `options[name]` and kept for the
    process (a verifier may hold a helper process, such as the math verifier's budget)."""

    restarts = 0

    def __init__(self, options: dict[str, dict] | None = None):
        self.options = options or {}
        self._verifiers: dict[str, Any] = {}

    def __call__(self, samples: Sequence[Sample], records: Sequence[PromptRecord]) -> list[VerifyResult]:
        return self.score(_requests(samples, records))

    def score(self, requests: Sequence[tuple[str, str, Any]]) -> list[VerifyResult]:
        """One result per (verifier name, response, ground truth), in order."""
        return [self._verifier(name).verify(response, label) for name, response, label in requests]

    def _verifier(self, name: str):
        if name not in self._verifiers:
            self._verifiers[name] = get_verifier(name, **self.options.get(name, {}))
        return self._verifiers[name]

    def close(self) -> None:
        for verifier in self._verifiers.values():
            getattr(verifier, "close", lambda: None)()


class RewardMeter:
    """A `RewardFn` that counts: the seconds spent in `inner` and every result, for one rollout's metrics."""

    def __init__(self, inner: RewardFn):
        self.inner, self.seconds, self.results = inner, 0.0, []
        self._restarts_before = inner.restarts

    @property
    def restarts(self) -> int:
        return self.inner.restarts

    def __call__(self, samples: Sequence[Sample], records: Sequence[PromptRecord]) -> list[VerifyResult]:
        start = time.perf_counter()
        results = self.inner(samples, records)
        self.seconds += time.perf_counter() - start
        self.results.extend(results)
        return results

    def health(self, group_size: int) -> dict[str, float]:
        """`batch_health` of every result so far, and the workers replaced meanwhile."""
        out = batch_health(self.results, group_size)
        out["reward_worker_restarts"] = self.inner.restarts - self._restarts_before
        return out


def build_reward(r: RewardConfig, options: dict[str, dict], plugins: tuple[str, ...] = ()) -> RewardFn:
    """The run's reward function: a pool of `--reward-workers` processes (-1: one per CPU) that import `plugins`,
    or, with 0 workers, this process; verifiers are built with `options[name]`."""
    if r.reward_workers == 0:
        return InProcessReward(options)
    return PoolReward(shared_pool(r.reward_workers, r.reward_timeout, preload=plugins, options=options))

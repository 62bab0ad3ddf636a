"""A reward worker that dies mid-scoring (`MEGARL_FAULT=reward_worker_crash@S`, `megarl/faults.py`): the pool
replaces it and scores the lost sample again, so every sample gets one result, the one an unharmed pool gives,
and the row counts the restart. Checked here on the pool itself; a real run with the fault, whose metrics match the
uninterrupted run's bitwise, is in test_run_faults.py (it shares that module's uninterrupted run)."""

from __future__ import annotations

import time

import pytest

from megarl import faults
from megarl.reward.pool import RewardPool

pytestmark = [pytest.mark.faults, pytest.mark.distributed]


def _verdicts(results):
    return [(r.score, r.outcome, r.extracted, r.normalized) for r in results]


def test_a_worker_killed_mid_scoring_is_replaced_and_its_sample_scored_again(monkeypatch):
    requests = [("arithmetic", str(a), 7) for a in range(8)] + [("math", r"$\boxed{\frac12}$", "0.5")]
    with RewardPool(workers=2, timeout_s=30) as pool:
        expected, health = pool.score(requests, group_size=3)
        assert health["reward_worker_restarts"] == 0

        monkeypatch.setenv(faults.ENV, "reward_worker_crash@2")
        assert not faults.fire("reward_worker_crash", 1) and faults.fire("reward_worker_crash", 2)
        t0 = time.monotonic()
        got, health = pool.score(requests, group_size=3)
        print(f"reward worker killed mid-scoring: batch of {len(requests)} scored in {time.monotonic() - t0:.1f} s")
    assert _verdicts(got) == _verdicts(expected), "no sample lost, changed or counted twice"
    assert health["reward_worker_restarts"] == 1 and health["reward_n"] == len(requests)
    assert health["reward_n_parse_error"] == 0 and not faults.take("reward_worker_crash")

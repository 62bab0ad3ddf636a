"""The reward pool: every sample gets exactly one result, in input order, even when the verifier hangs, raises, or
kills its worker; the batch's health metrics; scoring a rollout batch through the pool or in process."""

from __future__ import annotations

import pytest

from megarl.verifiers.base import VerifyResult
from megarl.reward.pool import RewardPool, batch_health, default_workers, shared_pool

N = 10_000
TIMEOUT_S = 3.0  # a correct sample's wall time under load: 0.5 s, then 1 s, timed one out in clean-clone CI runs
# on 2 cores shared with other jobs (2026-12-04); fewer hangs keep the waits short (5 x 3 s over 2 workers)


def action(i: int) -> str:
    if i % 2000 == 999:
        return "hang"
    if i % 1500 == 7:
        return "exit"
    if i % 2500 == 11:
        return "kill"
    if i % 97 == 5:
        return "crash"
    return "ok"


@pytest.mark.distributed
@pytest.mark.slow
def test_ten_thousand_samples_with_hangs_crashes_and_dying_workers():
    requests = [("flaky", f"{action(i)}:{i}", i if i % 3 else -1) for i in range(N)]
    with RewardPool(workers=2, timeout_s=TIMEOUT_S, preload=("pool_flaky_verifier",)) as pool:
        results, health = pool.score(requests, group_size=4)
        again, _ = pool.score([("flaky", "ok:5", 5), ("flaky", "ok:6", 7)])  # replaced workers still serve

    assert len(results) == N and all(isinstance(r, VerifyResult) for r in results)
    expected = {"hang": 0, "exit": 0, "kill": 0, "crash": 0, "ok": 0}
    for i, r in enumerate(results):
        a = action(i)
        expected[a] += 1
        if a == "ok":  # the extracted value is the sample's own index: results are in input order
            want = ("correct", 1.0) if i % 3 else ("incorrect", 0.0)
            assert (r.outcome, r.score, r.extracted) == (*want, str(i))
        elif a == "hang":
            assert r.outcome == "timeout" and r.score == 0.0 and TIMEOUT_S <= r.seconds < TIMEOUT_S + 5
        elif a == "crash":
            assert r.outcome == "parse_error" and "RuntimeError" in r.normalized
        else:
            assert r.outcome == "parse_error" and "worker died" in r.normalized
    assert min(expected.values()) > 0, expected
    assert health["reward_n"] == N
    assert health["reward_n_timeout"] == expected["hang"]
    assert health["reward_n_parse_error"] == expected["crash"] + expected["exit"] + expected["kill"]
    # a sample whose worker died is scored once more on the replacement: these kill that one too
    assert health["reward_worker_restarts"] == expected["hang"] + 2 * (expected["exit"] + expected["kill"])
    assert health["reward_timeout_rate"] == pytest.approx(expected["hang"] / N)
    assert [r.outcome for r in again] == ["correct", "incorrect"]


def test_batch_health_by_hand():
    def r(score, outcome, seconds):
        return VerifyResult(score, outcome, seconds=seconds)

    results = [r(1.0, "correct", 0.1), r(0.0, "incorrect", 0.2),  # group 0: mixed
               r(0.0, "no_answer", 0.3), r(0.0, "timeout", 5.0),  # group 1: all 0
               r(1.0, "correct", 0.4), r(1.0, "correct", 0.5)]  # group 2: all 1
    h = batch_health(results, group_size=2)
    assert h["reward_n"] == 6 and h["reward_n_correct"] == 3 and h["reward_n_timeout"] == 1
    assert h["reward_timeout_rate"] == pytest.approx(1 / 6)
    assert h["reward_no_answer_rate"] == pytest.approx(1 / 6)
    assert h["reward_uniform_group_frac"] == pytest.approx(2 / 3)
    assert h["reward_latency_p50"] == pytest.approx(0.4)  # sorted: .1 .2 .3 .4 .5 5.0 -> index 3
    assert h["reward_latency_p99"] == pytest.approx(5.0)
    assert batch_health([], group_size=2)["reward_n"] == 0


@pytest.mark.distributed
def test_mixed_verifiers_in_one_batch_and_errors_from_the_verifier():
    requests = [("arithmetic", "19", 19), ("math", "so $\\boxed{\\frac12}$", "0.5"), ("arithmetic", "x", 3),
                ("nope", "1", 1)]
    with RewardPool(workers=2, timeout_s=30) as pool:
        results, _ = pool.score(requests)
    assert [r.outcome for r in results] == ["correct", "correct", "no_answer", "parse_error"]
    assert "unknown verifier 'nope'" in results[3].normalized


def test_pool_settings():
    assert shared_pool(1, 10.0) is shared_pool(1, 10.0), "one pool per process and settings"
    assert shared_pool(1, 10.0, options={"code": {"reward": "fraction"}}) is not shared_pool(1, 10.0)
    assert 1 <= default_workers() <= 16
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool(workers=1, timeout_s=0)


@pytest.mark.distributed
@pytest.mark.slow
def test_reward_functions_score_samples_by_their_rows_verifier_with_the_runs_options():
    from megarl.data import PromptRecord
    from megarl.reward import InProcessReward, PoolReward, RewardMeter
    from megarl.samples import Sample, SampleStatus

    rows = [PromptRecord(0, "1+1=", [1], "2", "arithmetic"), PromptRecord(1, "half?", [2], "1/2", "math")]
    answers = [["2", "3"], ["$\\boxed{0.5}$", "The answer is 0.5"]]
    samples = [Sample(group=g, prompt_index=g, prompt_ids=[1], response_ids=[7], loss_mask=[1], rollout_logprobs=[0.0],
                      weight_version=0, status=SampleStatus.COMPLETED, response_text=text)
               for g, group in enumerate(answers) for text in group]
    records = [rows[s.group] for s in samples]
    lenient = [("correct", 1.0), ("incorrect", 0.0), ("correct", 1.0), ("correct", 1.0)]
    strict = lenient[:3] + [("no_answer", 0.0)]  # `--math-strategy strict` takes only a \boxed{} answer
    with RewardPool(workers=2, timeout_s=30, options={"math": {"strategy": "strict"}}) as pool:
        for reward, want in ((InProcessReward(), lenient), (InProcessReward({"math": {"strategy": "strict"}}), strict),
                             (PoolReward(pool), strict)):
            meter = RewardMeter(reward)
            assert [(r.outcome, r.score) for r in meter(samples, records)] == want
            health = meter.health(group_size=2)
            assert health["reward_n"] == 4 and health["reward_worker_restarts"] == 0 and meter.seconds > 0
    assert samples[3].reward == 0.0 and samples[3].outcome == "", "a reward function changes no sample"
    with pytest.raises(ValueError, match="4 samples but 2 data rows"):
        InProcessReward()(samples, rows)


def test_a_sample_in_a_worker_keeps_its_verifiers_own_budget():
    """The pool's limit is the smaller of its timeout and the verifier's budget (the math verifier's 5 s, or the
    run's option): a pathological answer ends as a timeout at the budget, not at the pool's timeout."""
    with RewardPool(workers=1, timeout_s=30) as pool:
        assert pool._limit("math") == 5.0 and pool._limit("arithmetic") == 30
    with RewardPool(workers=1, timeout_s=2) as pool:
        assert pool._limit("math") == 2
    with RewardPool(workers=1, timeout_s=30, options={"math": {"budget_s": 1.0}}) as pool:
        (result,), _ = pool.score([("math", r"The answer is $\boxed{10^{10^{10^{10}}}}$.", "1")])
    assert result.outcome == "timeout" and 1.0 <= result.seconds < 4.0, result

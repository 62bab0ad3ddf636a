"""Rewards off the critical path (`--reward-overlap`): the meter's scoring thread gives the same results as scoring
in the caller, one call at a time and in order; `single_turn` scores rows as the engine reports them finished and
may leave the last scores to the trainer; the builtin engine's finished rows are the ones it returns; the step's
sandbox throughput from hand-computed numbers."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from megarl.data import PromptRecord
from megarl.reward import RewardFunction
from megarl.reward.pool import batch_health, sandbox_throughput
from megarl.rollout import Completion, SamplingParams, single_turn
from megarl.rollout.base import EngineCapabilities
from megarl.samples import Sample, SampleStatus
from megarl.stages.reward import RewardMeter
from megarl.verifiers import VerifyResult


def _sample(group: int, text: str) -> Sample:
    return Sample(group=group, prompt_index=group, prompt_ids=[1], response_ids=[2], loss_mask=[1],
                  rollout_logprobs=[0.0], weight_version=0, status=SampleStatus.COMPLETED, response_text=text)


def _record(i: int) -> PromptRecord:
    return PromptRecord(i, str(i), [1], str(i), "v")


class _Reward(RewardFunction):
    """Scores 1 when the response's first word is even; records each call's texts and thread. With `gate`, the
    first call waits for it."""

    restarts = 0

    def __init__(self, off_thread: bool = True, gate: threading.Event | None = None, fail: bool = False):
        self.off_thread, self.gate, self.fail = off_thread, gate, fail
        self.calls: list[tuple[list[str], str]] = []
        self.entered = threading.Event()

    def scores_off_thread(self, records) -> bool:
        return self.off_thread

    def __call__(self, samples, records):
        self.entered.set()
        if self.gate is not None and not self.calls:
            self.gate.wait(10)
        self.calls.append(([s.response_text for s in samples], threading.current_thread().name))
        if self.fail:
            raise RuntimeError("verifier bug")
        time.sleep(0.01)
        return [VerifyResult(float(int(s.response_text.split()[0]) % 2 == 0), "correct", seconds=0.01)
                for s in samples]


def test_the_thread_scores_one_call_at_a_time_in_order_with_the_callers_results():
    gate = threading.Event()
    overlapped, serial = RewardMeter(_Reward(gate=gate), overlap=True), RewardMeter(_Reward(), overlap=False)
    batches = [[_sample(0, "2"), _sample(0, "3")], [_sample(1, "4")], [_sample(2, "7"), _sample(2, "8")]]
    handles = [overlapped.submit(batches[0], [_record(0)] * 2)]
    assert overlapped.inner.entered.wait(10)  # the first call has begun, and waits on the gate
    handles += [overlapped.submit(b, [_record(s.group) for s in b]) for b in batches[1:]]
    gate.set()
    got = [[(r.score, r.outcome) for r in h.result()] for h in handles]
    want = [[(r.score, r.outcome) for r in serial(b, [_record(s.group) for s in b])] for b in batches]
    assert got == want == [[(1.0, "correct"), (0.0, "correct")], [(1.0, "correct")],
                           [(0.0, "correct"), (1.0, "correct")]]
    calls = overlapped.inner.calls
    # What was queued while the first call ran went in one call, in the order submitted, all in the meter's thread.
    assert [texts for texts, _ in calls] == [["2", "3"], ["4", "7", "8"]]
    assert {thread for _, thread in calls} == {"megarl-reward"}
    assert {thread for _, thread in serial.inner.calls} == {threading.current_thread().name}
    assert 0.0 <= overlapped.exposed <= overlapped.seconds and overlapped.seconds >= 0.02
    assert serial.exposed == serial.seconds >= 0.03  # the caller waited on all of it
    health = batch_health([r for h in handles for r in h.result()], group_size=None)
    assert overlapped.health(1)["reward_n"] == serial.health(1)["reward_n"] == health["reward_n"] == 5


def test_rows_the_reward_cannot_score_off_thread_are_scored_in_the_caller():
    meter = RewardMeter(_Reward(off_thread=False), overlap=True)
    results = meter.submit([_sample(0, "2")], [_record(0)]).result()
    assert [r.score for r in results] == [1.0] and meter.inner.calls[0][1] == threading.current_thread().name
    assert not meter.overlaps([_record(0)])


def test_a_failure_in_the_thread_reaches_whoever_waits():
    meter = RewardMeter(_Reward(fail=True), overlap=True)
    handle = meter.submit([_sample(0, "2")], [_record(0)])
    with pytest.raises(RuntimeError, match="verifier bug"):
        handle.result()


def test_health_is_group_by_group_whatever_order_rows_finished_in():
    meter = RewardMeter(_Reward(), overlap=True)
    for group, text in [(1, "3"), (0, "2"), (1, "5"), (0, "4")]:  # group 0 all 1.0, group 1 all 0.0
        meter.submit([_sample(group, text)], [_record(group)]).result()
    assert meter.health(2)["reward_uniform_group_frac"] == 1.0


class _StreamingEngine(EngineCapabilities):
    """Prompt p, sample i: [p0 + i, 0] (stops, reported early for odd i) or [p0 + i] * max (the length limit)."""

    weight_version = 3
    reports_finished_rows = True

    def __init__(self, report: bool = True):
        self.reported: list[int] = []
        self.reports_finished_rows = report

    def generate(self, prompts, params, on_finish=None):
        groups = [[Completion([p[0] + i, 0] if i % 2 else [p[0] + i] * params.max_new_tokens,
                              [-0.5] * (2 if i % 2 else params.max_new_tokens), "stop" if i % 2 else "length",
                              self.weight_version) for i in range(params.n)] for p in prompts]
        for row in reversed(range(len(prompts) * params.n)):  # finishing out of order
            c = groups[row // params.n][row % params.n]
            if on_finish is not None and c.finish_reason == "stop":
                self.reported.append(row)
                on_finish(row, c)
        return groups


class _Tok:
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == 0))


PROMPTS = [PromptRecord(10, "a", [4, 5], "x", "v"), PromptRecord(11, "b", [7], "y", "v")]
PARAMS = SamplingParams(n=2, max_new_tokens=3, stop_token_ids=(0,))


@pytest.mark.parametrize("report", [True, False])
def test_single_turn_overlapped_gives_the_serial_samples(report):
    serial = single_turn(_StreamingEngine(), PROMPTS, PARAMS, _Reward(), _Tok())
    assert [s.reward for s in serial] == [1.0, 0.0, 0.0, 1.0]
    engine, meter = _StreamingEngine(report), RewardMeter(_Reward(), overlap=True)
    assert single_turn(engine, PROMPTS, PARAMS, meter, _Tok()) == serial
    texts = [t for texts, _ in meter.inner.calls for t in texts]
    if report:  # the stopped rows one by one as reported (rows 3, 1), then the rest (rows 0, 2) in one call
        assert engine.reported == [3, 1] and texts == ["8", "5", "4 4 4", "7 7 7"]
    else:
        assert texts == ["4 4 4", "5", "7 7 7", "8"]


def test_single_turn_can_leave_the_scores_to_its_caller():
    serial = single_turn(_StreamingEngine(), PROMPTS, PARAMS, _Reward(), _Tok())
    meter = RewardMeter(_Reward(), overlap=True)
    meter.defer = True
    unscored = single_turn(_StreamingEngine(), PROMPTS, PARAMS, meter, _Tok())
    assert [(s.reward, s.outcome) for s in unscored] == [(0.0, "")] * 4
    assert [replace(s, reward=0.0, outcome="") for s in serial] == unscored
    assert meter.deferred() == serial


def test_the_collector_returns_pending_rewards_and_waits_for_them_on_request():
    from megarl.config import RolloutConfig
    from megarl.data import PromptSampler
    from megarl.mcore.parallel import ParallelInfo
    from megarl.stages.collect import Collector, wait_for_rewards

    info = ParallelInfo(rank=0, world_size=1, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1)
    prompts = [PromptRecord(i, str(i), [i + 1], "", "v") for i in range(4)]

    def collector(overlap: bool) -> Collector:
        return Collector(_StreamingEngine(), single_turn, _Reward(), _Tok(), prompts, PromptSampler(4, seed=0),
                         RolloutConfig(n_samples_per_prompt=2, max_response_len=3), global_batch=2, seed=0, info=info,
                         reward_overlap=overlap)

    serial, overlapped = collector(False)(step=0), collector(True)(step=0)
    assert serial.pending is None and overlapped.pending is not None
    scored = wait_for_rewards(overlapped)
    assert scored.pending is None and scored.samples == serial.samples
    assert scored.metrics["reward_n"] == serial.metrics["reward_n"] == 4
    assert 0.0 <= scored.reward_exposed_seconds <= scored.reward_seconds
    assert serial.reward_exposed_seconds == serial.reward_seconds > 0
    # Dynamic sampling reads outcomes: its rounds wait inside.
    assert collector(True).round(step=0, index=0, need=True).pending is None


def test_the_builtin_engine_reports_each_stopped_row_as_it_returns_it(tiny_qwen2):
    import torch

    from megarl.rollout.builtin import BuiltinEngine

    torch.set_num_threads(1)
    engine = BuiltinEngine.from_pretrained(tiny_qwen2)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=5, stop_token_ids=tuple(range(0, 96, 5)))
    prompts = [[5, 17, 33], [12, 7]]
    reported: dict[int, Completion] = {}
    groups = engine.generate(prompts, params, on_finish=lambda row, c: reported.setdefault(row, c))
    assert groups == engine.generate(prompts, params)  # the callback changes nothing
    rows = [c for g in groups for c in g]
    stopped = {i for i, c in enumerate(rows) if c.finish_reason == "stop"}
    assert stopped and set(reported) == stopped and len(stopped) < len(rows)
    assert all(reported[i] == rows[i] for i in stopped)


def test_sandbox_throughput_by_hand():
    from megarl.metrics import format_step, reward_throughput

    results = [VerifyResult(1.0, "correct", tests_run=4, sandbox_cpu_seconds=0.030),
               VerifyResult(0.0, "incorrect", tests_run=2, sandbox_cpu_seconds=0.010),
               VerifyResult(0.0, "parse_error", tests_run=0, sandbox_cpu_seconds=None),  # never started: 0 CPU
               VerifyResult(1.0, "correct")]  # not a sandboxed row
    assert sandbox_throughput(results) == {"reward_programs": 3, "reward_tests": 6,
                                           "reward_sandbox_cpu_seconds": pytest.approx(0.040)}
    assert sandbox_throughput(results[3:]) == {} and "reward_programs" not in batch_health(results[3:])
    # Two ranks: 3 + 5 programs, 6 + 10 tests, 0.04 + 0.12 CPU seconds; the slower rank scored for 2 s.
    assert reward_throughput(8, 16, 0.16, 2.0) == {"reward_programs_per_s": 4.0, "reward_tests_per_s": 8.0,
                                                   "sandbox_cpu_ms_per_program": pytest.approx(20.0)}
    assert reward_throughput(0, 0, 0.0, 2.0) == {}
    line = format_step({"step": 3, "step_seconds": 2.0, "t_generate": 1.5, "t_reward": 1.2, "t_reward_exposed": 0.05},
                       10)
    assert "(rollout 1.50 reward 1.20 (0.05 exposed))" in line


def test_sandbox_costs_cross_the_reward_workers_boundary():
    from megarl.reward.pool import RewardPool

    with RewardPool(workers=1, timeout_s=30, preload=("pool_sandboxed_verifier",)) as pool:
        results, health = pool.score([("fake_sandboxed", "4 0.25", None), ("fake_sandboxed", "none", None),
                                      ("fake_sandboxed", "2 0.5", None)])
    assert [(r.tests_run, r.sandbox_cpu_seconds) for r in results] == [(4, 0.25), (None, None), (2, 0.5)]
    assert (health["reward_programs"], health["reward_tests"], health["reward_sandbox_cpu_seconds"]) == (2, 6, 0.75)

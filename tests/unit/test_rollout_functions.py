"""Rollout functions: the registered default (`single_turn`) and the rules every rollout function's result must
follow, with a scripted engine and reward function."""

from __future__ import annotations

import pytest

from megarl.data import PromptRecord
from megarl.rollout import Completion, SamplingParams, ROLLOUTS, register_rollout
from megarl.samples import SampleStatus
from megarl.verifiers import VerifyResult


class _Engine:
    """Prompt p: completions ending in the stop token 0 (odd sample index) or cut at the length limit (even)."""

    weight_version = 7

    def generate(self, prompts, params):
        return [[Completion([p[0] + i, 0] if i % 2 else [p[0] + i] * params.max_new_tokens,
                            [-0.5] * (2 if i % 2 else params.max_new_tokens), "stop" if i % 2 else "length",
                            self.weight_version) for i in range(params.n)] for p in prompts]


class _Tok:
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == 0))


class _Reward:
    """Scores 1 when the response's first token is even; records what it was given."""

    restarts = 0

    def __init__(self):
        self.calls = []

    def __call__(self, samples, records):
        self.calls.append((list(samples), list(records)))
        return [VerifyResult(float(int(s.response_text.split()[0]) % 2 == 0), "correct") for s in samples]


def test_single_turn_makes_scored_policy_samples():
    prompts = [PromptRecord(10, "a", [4, 5], "x", "v"), PromptRecord(11, "b", [7], "y", "v")]
    params = SamplingParams(n=2, max_new_tokens=3, stop_token_ids=(0,))
    reward = _Reward()
    samples = ROLLOUTS.get("single_turn")(_Engine(), prompts, params, reward, _Tok())
    assert [(s.group, s.prompt_index, s.prompt_ids) for s in samples] == [
        (0, 10, [4, 5]), (0, 10, [4, 5]), (1, 11, [7]), (1, 11, [7])]
    assert [s.response_ids for s in samples] == [[4, 4, 4], [5, 0], [7, 7, 7], [8, 0]]
    assert all(s.loss_mask == [1] * len(s.response_ids) and s.weight_version == 7 for s in samples)
    assert [s.status for s in samples] == [SampleStatus.TRUNCATED, SampleStatus.COMPLETED] * 2
    assert [s.response_text for s in samples] == ["4 4 4", "5", "7 7 7", "8"]
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 1.0]
    (scored, records), = reward.calls  # one call, each sample with its own data row
    assert [r.index for r in records] == [10, 10, 11, 11] and scored[0].reward == 0.0


def test_a_registered_rollout_function_is_found_by_name_and_names_are_unique(monkeypatch):
    monkeypatch.setattr(ROLLOUTS, "_items", dict(ROLLOUTS._items))  # undone after the test
    register_rollout("mine")(lambda *a: [])
    # the built-ins and this one (a plugin another test of this process imported may be registered too)
    names = ROLLOUTS.names()
    assert {"mine", "single_turn", "tool_use", "verifiers"} <= set(names) and len(names) == len(set(names))
    assert ROLLOUTS.get("mine")() == []
    with pytest.raises(ValueError, match="rollout function 'mine' is already registered"):
        register_rollout("mine")(lambda *a: [])
    with pytest.raises(ValueError, match="unknown rollout function 'other'; valid names: mine, single_turn, tool_use"):
        ROLLOUTS.get("other")


def test_a_rollout_function_must_return_n_samples_per_prompt_in_order():
    from megarl.config import RolloutConfig
    from megarl.data import PromptSampler
    from megarl.mcore.parallel import ParallelInfo
    from megarl.stages.collect import Collector

    def one_per_prompt(engine, prompts, params, reward, tokenizer):
        return ROLLOUTS.get("single_turn")(engine, prompts, SamplingParams(n=1, max_new_tokens=2), reward, tokenizer)

    info = ParallelInfo(rank=0, world_size=1, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1)
    prompts = [PromptRecord(i, str(i), [i + 1], "", "v") for i in range(4)]
    r = RolloutConfig(n_samples_per_prompt=2, rollout_function="one_per_prompt")
    collector = Collector(_Engine(), one_per_prompt, _Reward(), _Tok(), prompts, PromptSampler(4, seed=0), r,
                          global_batch=2, seed=0, info=info)
    with pytest.raises(RuntimeError, match="rollout function 'one_per_prompt' returned 2 samples for 2 prompts x 2"):
        collector(step=0)
    good = Collector(_Engine(), ROLLOUTS.get("single_turn"), _Reward(), _Tok(), prompts, PromptSampler(4, seed=0),
                     RolloutConfig(n_samples_per_prompt=2, max_response_len=3), global_batch=2, seed=0, info=info)
    rollout = good(step=0)
    assert len(rollout.samples) == 4 and rollout.group_size == 2 and rollout.metrics["reward_n"] == 4
    assert rollout.generate_seconds >= 0 and rollout.reward_seconds > 0


def test_a_plain_function_and_a_configured_one_become_rollouts_with_the_protocols_defaults(monkeypatch):
    """What the trainer asks of a rollout function besides the call is declared on `Rollout`: a plain registered
    function gets the defaults (no settings, no metrics, nothing to close); `register_rollout(configure=)` gives a
    plain function the run's settings; a `Rollout` subclass is used as it is."""
    from types import SimpleNamespace

    from megarl.rollout.functions import FunctionRollout, Rollout, as_rollout, build_rollout

    monkeypatch.setattr(ROLLOUTS, "_items", dict(ROLLOUTS._items))  # undone after the test
    cfg = lambda name: SimpleNamespace(rollout=SimpleNamespace(rollout_function=name))

    def plain(engine, prompts, params, reward, tokenizer):
        return ["plain"]

    class Counting(Rollout):
        def __init__(self, calls=0):
            self.calls = calls

        def __call__(self, engine, prompts, params, reward, tokenizer):
            self.calls += 1
            return []

        def step_metrics(self):
            return {"calls": float(self.calls)}

    register_rollout("plain")(plain)
    register_rollout("configured", configure=lambda c: Counting(calls=10))(plain)
    register_rollout("object")(Counting())
    built = build_rollout(cfg("plain"))
    assert isinstance(built, FunctionRollout) and built(None, [], None, None, None) == ["plain"]
    assert built.step_metrics() == {} and built.close() is None and not built.defers_rewards
    assert ROLLOUTS.get("plain") is plain  # the registry keeps what was registered: callable as before
    configured = build_rollout(cfg("configured"))
    assert isinstance(configured, Counting) and configured.calls == 10
    assert build_rollout(cfg("object")) is ROLLOUTS.get("object") and as_rollout(configured) is configured
    assert ROLLOUTS.get("single_turn").defers_rewards  # the one whose batch may come back with rewards pending


def test_an_engine_written_to_the_protocol_alone_gets_the_declared_defaults():
    from megarl.rollout.base import EngineCapabilities, ProtocolEngine, as_engine

    class Plain:
        weight_version, dtype, shares_actor_weights = 0, None, False

        def generate(self, prompts, params):
            return [["ok"] for _ in prompts]

    engine = as_engine(Plain())
    assert isinstance(engine, ProtocolEngine) and engine.generate([[1]], None, on_finish=print) == [["ok"]]
    assert not (engine.reports_finished_rows or engine.records_routing or engine.scores_distributions
                or engine.scores_topk) and engine.ipc_tp_size == 1
    engine.weight_version = 3
    assert engine.inner.weight_version == 3

    class Declared(Plain, EngineCapabilities):
        records_routing = True

    declared = Declared()
    assert as_engine(declared) is declared and declared.records_routing


def test_old_import_paths_still_work_until_they_go():
    from megarl.reward import RewardMeter
    from megarl.reward.stage import RewardMeter as StageRewardMeter
    from megarl.rollout.mismatch import full_mismatch
    from megarl.stages import report, setup
    from megarl.stages.algorithm import Algorithm, AlgorithmStage
    from megarl.stages.asynchronous import OrderedEngine, Pipeline
    from megarl.stages.collect import wait_for_rewards
    from megarl.stages.critic_update import Critic, CriticStage

    import megarl.algorithms.mismatch as algorithms_mismatch
    import megarl.rollout.pipeline as pipeline
    import megarl.stages.reward as stage
    import megarl.trainer.build as build
    import megarl.trainer.evaluate as evaluate
    import megarl.trainer.export as export
    import megarl.trainer.log as log

    assert RewardMeter is StageRewardMeter is stage.RewardMeter and wait_for_rewards is stage.wait_for_rewards
    assert full_mismatch is algorithms_mismatch.full_mismatch
    assert Algorithm is AlgorithmStage and Critic is CriticStage
    assert (OrderedEngine, Pipeline) == (pipeline.OrderedEngine, pipeline.Pipeline)
    assert setup.start is build.start and setup.check_before_start is build.check_before_start
    assert report.evaluate is evaluate.evaluate and report.save_hf is export.save_hf and report.finish is log.finish

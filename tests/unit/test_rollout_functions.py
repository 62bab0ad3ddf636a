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
    assert ROLLOUTS.names() == ["mine", "single_turn", "tool_use"] and ROLLOUTS.get("mine")() == []
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

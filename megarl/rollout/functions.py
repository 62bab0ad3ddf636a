"""Rollout functions: how a group of prompts becomes finished, scored trajectories.

    @register_rollout("my_rollout")
    def my_rollout(engine, prompts, params, reward, tokenizer) -> list[Sample]: ...

`engine` is the `RolloutEngine`, `prompts` this rank's prompt records (`megarl.data.PromptRecord`), `params` the
step's `SamplingParams` (`params.n` trajectories per prompt), `reward` the `megarl.reward.RewardFn` to score
them with and `tokenizer` the run's tokenizer (to decode what the verifier reads, or to encode a tool's output).
It returns `params.n` samples per prompt, group by group in prompt order, each with `group` = its prompt's index
in `prompts`, scored by `reward`. `--rollout-function NAME` picks one; `ROLLOUTS.get(name)` returns a registered
one, so a user's function can call the default and change what it returns.

A rollout function with settings of its own (`tool_use`: its turns, tools and limits) has a `configure(cfg) ->
RolloutFn` attribute, which the trainer calls once (`build_rollout`) with the run's `Config`; what it returns may
have `step_metrics() -> dict` (numbers of its latest call, added to the step's metrics) and `close()`.

What wraps a rollout function, not what is inside one: the trainer broadcasts its result within a model-parallel
group, and dynamic sampling and overlong shaping (`megarl.stages.collect`) apply to any rollout function.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol, Sequence

from megarl.data import PromptRecord
from megarl.registry import Registry
from megarl.rollout import slots
from megarl.reward import RewardFn, RewardMeter, Scores
from megarl.rollout.base import Completion, RolloutEngine, SamplingParams
from megarl.samples import Sample, SampleStatus
from megarl.verifiers import VerifyResult


class RolloutFn(Protocol):
    def __call__(self, engine: RolloutEngine, prompts: Sequence[PromptRecord], params: SamplingParams,
                 reward: RewardFn, tokenizer) -> list[Sample]: ...


# `single_turn` is defined below; `tool_use` (multi-turn with tool calls) in its own module, imported on first lookup.
# The registry, and the built-ins' options (`tool_use`'s), live in `megarl.rollout.slots` (pure Python).
ROLLOUTS: Registry[RolloutFn] = slots.ROLLOUTS

# Register a rollout function under `name` (a second registration of a name is an error).
register_rollout = ROLLOUTS.register


def build_rollout(cfg) -> RolloutFn:
    """The run's rollout function (`--rollout-function`), configured with the run's settings when it takes any."""
    fn = ROLLOUTS.get(cfg.rollout.rollout_function)
    configure = getattr(fn, "configure", None)
    return configure(cfg) if callable(configure) else fn


# How an engine's finish reason ends a trajectory: an aborted request is neither finished nor cut at the limit.
FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


def policy_sample(group: int, record: PromptRecord, completion: Completion, tokenizer) -> Sample:
    """A sample whose every response token is the policy's (loss mask 1), unscored."""
    ids = list(completion.token_ids)
    return Sample(group=group, prompt_index=record.index, prompt_ids=list(record.prompt_ids), response_ids=ids,
                  loss_mask=[1] * len(ids), rollout_logprobs=list(completion.logprobs),
                  weight_version=completion.weight_version, routed_experts=completion.routed_experts,
                  status=FINISH_STATUS[completion.finish_reason],
                  response_text=tokenizer.decode(ids, skip_special_tokens=True))


@register_rollout("single_turn")
def single_turn(engine: RolloutEngine, prompts: Sequence[PromptRecord], params: SamplingParams, reward: RewardFn,
                tokenizer) -> list[Sample]:
    """One completion per trajectory: the engine samples `params.n` per prompt, the reward function scores them.
    Given the trainer's reward with --reward-overlap (`RewardMeter.overlaps`), each row is handed to it as it
    stops while the others decode (engines that report rows finishing: `reports_finished_rows`), the rest once the
    batch ends, and `RewardMeter.finish` says whether to wait for the scores here or let the trainer."""
    records = [p for p in prompts for _ in range(params.n)]
    if not (isinstance(reward, RewardMeter) and reward.overlaps(records)):
        groups = engine.generate([p.prompt_ids for p in prompts], params)
        samples = [policy_sample(g, record, c, tokenizer)
                   for g, (record, completions) in enumerate(zip(prompts, groups)) for c in completions]
        return [_scored(s, r) for s, r in zip(samples, reward(samples, records))]
    early: dict[int, Scores] = {}

    def finished(row: int, completion: Completion) -> None:
        early[row] = reward.submit([policy_sample(row // params.n, records[row], completion, tokenizer)],
                                   [records[row]])

    streams = getattr(engine, "reports_finished_rows", False)
    groups = engine.generate([p.prompt_ids for p in prompts], params, **({"on_finish": finished} if streams else {}))
    samples = [policy_sample(g, record, c, tokenizer)
               for g, (record, completions) in enumerate(zip(prompts, groups)) for c in completions]
    rest = [i for i in range(len(samples)) if i not in early]
    late = reward.submit([samples[i] for i in rest], [records[i] for i in rest])

    def scored() -> list[Sample]:
        results = dict(zip(rest, late.result()))
        results.update((i, scores.result()[0]) for i, scores in early.items())
        return [_scored(s, results[i]) for i, s in enumerate(samples)]

    return reward.finish(samples, scored)


def _scored(sample: Sample, result: VerifyResult) -> Sample:
    return replace(sample, reward=float(result.score), outcome=result.outcome)

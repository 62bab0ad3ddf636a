"""Rollout functions: how a group of prompts becomes finished, scored trajectories.

    @register_rollout("my_rollout")
    def my_rollout(engine, prompts, params, reward, tokenizer) -> list[Sample]: ...

`engine` is the `RolloutEngine`, `prompts` this rank's prompt records (`megarl.data.PromptRecord`), `params` the
step's `SamplingParams` (`params.n` trajectories per prompt), `reward` the `megarl.reward.RewardFn` to score
them with and `tokenizer` the run's tokenizer (to decode what the verifier reads, or to encode a tool's output).
It returns `params.n` samples per prompt, group by group in prompt order, each with `group` = its prompt's index
in `prompts`, scored by `reward`. `--rollout-function NAME` picks one; `ROLLOUTS.get(name)` returns a registered
one, so a user's function can call the default and change what it returns.

What the trainer calls besides the function itself is declared on `Rollout`, the base class of a rollout
function as an object: `configure(cfg) -> Rollout` (called once, `build_rollout`, with the run's `Config`: a
function with settings of its own, `tool_use`, returns itself built from them), `step_metrics() -> dict` (numbers
of its latest call, added to the step's metrics), `close()` and `defers_rewards`. A plain function registered as
above is wrapped in `FunctionRollout` (`as_rollout`), whose defaults are: no settings, no metrics, nothing to
close. `register_rollout(name, configure=...)` registers a plain function with a `configure` of its own.

What wraps a rollout function, not what is inside one: the trainer broadcasts its result within a model-parallel
group, and dynamic sampling and overlong shaping (`megarl.stages.collect`) apply to any rollout function.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Protocol, Sequence

from megarl.data import PromptRecord
from megarl.registry import Registry, refuse_bare_capabilities
from megarl.rollout import slots
from megarl.reward import RewardFn, Scores, StreamingReward
from megarl.rollout.base import Completion, RolloutEngine, SamplingParams, as_engine
from megarl.samples import Sample, SampleStatus
from megarl.verifiers import VerifyResult


class RolloutFn(Protocol):
    def __call__(self, engine: RolloutEngine, prompts: Sequence[PromptRecord], params: SamplingParams,
                 reward: RewardFn, tokenizer) -> list[Sample]: ...


class Rollout:
    """A rollout function as an object: the call, and what the trainer asks of it besides (see the module
    docstring). Derive from it for a rollout function with settings, metrics or resources of its own."""

    # The samples it returns are the ones it submitted to the reward (`RewardMeter.submit`), unchanged and in order,
    # so the trainer may take the batch before their last rewards are in (`megarl.stages.collect`).
    defers_rewards: bool = False

    def __call__(self, engine: RolloutEngine, prompts: Sequence[PromptRecord], params: SamplingParams,
                 reward: RewardFn, tokenizer) -> list[Sample]:
        raise NotImplementedError

    def configure(self, cfg: Any) -> Rollout:
        """The rollout function with the run's settings (`megarl.config.Config`); called once, by `build_rollout`."""
        return self

    def step_metrics(self) -> dict[str, float]:
        """Numbers of its latest call, added to the step's metrics."""
        return {}

    def close(self) -> None:
        """Release what it holds (a tool's sandbox); the run is over."""


class FunctionRollout(Rollout):
    """A plain rollout function as a `Rollout`: its call, and `configure` when it is given one."""

    def __init__(self, fn: RolloutFn, configure: Callable[[Any], RolloutFn] | None = None):
        self.fn, self._configure = fn, configure
        self.__doc__ = fn.__doc__

    def __call__(self, engine: RolloutEngine, prompts: Sequence[PromptRecord], params: SamplingParams,
                 reward: RewardFn, tokenizer) -> list[Sample]:
        return self.fn(engine, prompts, params, reward, tokenizer)

    def configure(self, cfg: Any) -> Rollout:
        return self if self._configure is None else as_rollout(self._configure(cfg))


_HINT = " (a plain function: register it with register_rollout(name, configure=...))"


def as_rollout(fn: RolloutFn) -> Rollout:
    """`fn` as a `Rollout`: itself when it is one, else a plain function wrapped in `FunctionRollout`."""
    if isinstance(fn, Rollout):
        return fn
    refuse_bare_capabilities(fn, Rollout, "rollout function", hint=_HINT)
    return FunctionRollout(fn)


# `single_turn` is defined below; `tool_use` (multi-turn with tool calls) in its own module, imported on first lookup.
# The registry, and the built-ins' options (`tool_use`'s), live in `megarl.rollout.slots` (pure Python).
ROLLOUTS: Registry[RolloutFn] = slots.ROLLOUTS


def register_rollout(name: str, *, options: type | None = None,
                     configure: Callable[[Any], RolloutFn] | None = None) -> Callable[[RolloutFn], RolloutFn]:
    """Decorator: register a rollout function (a plain function or a `Rollout`) under `name`; a second registration
    of a name is an error. `options`: its options dataclass (`megarl.registry`); `configure(cfg)`: for a plain
    function, what the trainer runs instead, built from the run's settings (`Rollout.configure`)."""

    def decorate(fn: RolloutFn) -> RolloutFn:
        refuse_bare_capabilities(fn, Rollout, f"rollout function {name!r}:", hint=_HINT)
        ROLLOUTS.add(name, fn if configure is None else FunctionRollout(fn, configure), options=options)
        return fn

    return decorate


def build_rollout(cfg) -> Rollout:
    """The run's rollout function (`--rollout-function`), configured with the run's settings."""
    return as_rollout(ROLLOUTS.get(cfg.rollout.rollout_function)).configure(cfg)


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


def _single_turn(engine: RolloutEngine, prompts: Sequence[PromptRecord], params: SamplingParams, reward: RewardFn,
                 tokenizer) -> list[Sample]:
    """One completion per trajectory: the engine samples `params.n` per prompt, the reward function scores them.
    Given the trainer's reward with --reward-overlap (`RewardMeter.overlaps`), each row is handed to it as it
    stops while the others decode (engines that report rows finishing: `reports_finished_rows`), the rest once the
    batch ends, and `RewardMeter.finish` says whether to wait for the scores here or let the trainer."""
    records = [p for p in prompts for _ in range(params.n)]
    if not (isinstance(reward, StreamingReward) and reward.overlaps(records)):
        groups = engine.generate([p.prompt_ids for p in prompts], params)
        samples = [policy_sample(g, record, c, tokenizer)
                   for g, (record, completions) in enumerate(zip(prompts, groups)) for c in completions]
        return [_scored(s, r) for s, r in zip(samples, reward(samples, records))]
    early: dict[int, Scores] = {}

    def finished(row: int, completion: Completion) -> None:
        early[row] = reward.submit([policy_sample(row // params.n, records[row], completion, tokenizer)],
                                   [records[row]])

    streams = as_engine(engine).reports_finished_rows
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


class SingleTurn(FunctionRollout):
    """`single_turn` (`_single_turn`): it returns the samples it submitted, so the trainer may defer their rewards."""

    defers_rewards = True


single_turn = SingleTurn(_single_turn)
register_rollout("single_turn")(single_turn)


def _scored(sample: Sample, result: VerifyResult) -> Sample:
    return replace(sample, reward=float(result.score), outcome=result.outcome, extracted=result.extracted,
                   signals=dict(result.signals))

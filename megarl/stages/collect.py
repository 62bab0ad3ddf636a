"""The rollout stage on every rank: this step's prompts, the rollout function, and what wraps it.

    collect = OverlongShaping(DynamicSampling(Collector(...)))      # as the flags ask; each `(step) -> RolloutBatch`

`Collector` draws the step's global batch of prompts (every rank draws, so the prompt sampler stays in step) and
keeps this data-parallel rank's share; the first rank of each model replica runs the registered rollout function
(`--rollout-function`) with the engine and the reward function, and the replica's other ranks receive its samples.
Dynamic sampling and overlong shaping wrap a collector, whichever rollout function it runs.

Rewards off the critical path (`--reward-overlap`, on by default): the rollout function hands rows to the reward
function as they finish (`RewardMeter.submit`), scored in a thread while the rest decode. With the default rollout
function and nothing around the collector that reads rewards, the batch even comes back before its last scores are
in (`RolloutBatch.pending`): the step computes log-probs meanwhile and waits (`wait_for_rewards`) only before the
advantages. Dynamic sampling (outcomes decide what is kept), overlong shaping (it changes rewards), asynchronous
training (the worker finishes its batch) and model-parallel replicas (the batch is broadcast) wait inside.
Verdicts are the same either way; only the order of the work changes.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Protocol, Sequence

from megarl.config import RolloutConfig
from megarl.data import PromptRecord, PromptSampler
from megarl.mcore.parallel import ParallelInfo, agree_any, broadcast_in_mp_group
from megarl.reward import RewardFn
from megarl.reward.pool import SANDBOX_KEYS
from megarl.rollout import RolloutEngine, RolloutFn, SamplingParams
from megarl.rollout.functions import as_rollout
from megarl.samples import RolloutBatch, Sample
from megarl.stages.reward import RewardMeter, wait_for_rewards
from megarl.verifiers.signals import bench_on

# `wait_for_rewards` moved to megarl.stages.reward; importable from here until megarl 0.3
__all__ = ["Collect", "Collector", "DynamicSampling", "OverlongShaping", "wait_for_rewards"]


class Collect(Protocol):
    def __call__(self, step: int) -> RolloutBatch: ...  # its rewards may be pending: `wait_for_rewards`

    def rank_state(self) -> dict: ...  # this rank's state to checkpoint

    def load_rank_state(self, state: dict) -> None: ...


def sampling_params(r: RolloutConfig, tokenizer, *, seed: int, n: int | None = None,
                    greedy: bool = False) -> SamplingParams:
    eos = tokenizer.eos_token_id
    return SamplingParams(
        n=n or r.n_samples_per_prompt, temperature=0.0 if greedy else r.rollout_temperature, top_p=r.rollout_top_p,
        top_k=r.rollout_top_k, max_new_tokens=r.max_response_len,
        stop_token_ids=tuple([eos] if isinstance(eos, int) else (eos or ())), seed=seed,
    )


def check_groups(samples: Sequence[Sample], num_prompts: int, n: int, who: str) -> None:
    """A rollout function's result must hold `n` samples per prompt, group by group in prompt order."""
    groups = [s.group for s in samples]
    if groups != [g for g in range(num_prompts) for _ in range(n)]:
        raise RuntimeError(f"rollout function {who!r} returned {len(samples)} samples for {num_prompts} prompts x "
                           f"{n}: it must return {n} per prompt, group by group, each with `group` = its prompt's "
                           "index")


def check_lengths(samples: Sequence[Sample], context: int, who: str) -> None:
    """Prompt + response within the model's positions: prompts are filtered at load and responses capped by
    --max-response-len, so only a rollout function that adds tokens of its own (a tool's output) can overrun."""
    over = [s for s in samples if context and len(s.prompt_ids) + len(s.response_ids) > context]
    if over:
        s = over[0]
        raise RuntimeError(f"rollout function {who!r} returned {len(over)} trajectories longer than the model's "
                           f"{context} positions (the first: {len(s.prompt_ids)} prompt + {len(s.response_ids)} "
                           "response tokens); keep prompt + response within max_position_embeddings")


class Collector:
    """The step's prompts through the rollout function (see the module docstring)."""

    staleness = 0  # synchronous: every batch is made with the current weights (`AsyncCollect.staleness`: K)

    def __init__(self, engine: RolloutEngine | None, rollout_fn: RolloutFn, reward: RewardFn, tokenizer,
                 prompts: list[PromptRecord], sampler: PromptSampler, rollout: RolloutConfig, global_batch: int,
                 seed: int, info: ParallelInfo, context: int = 0, reward_overlap: bool = False):
        """`context`: the model's positions; a trajectory longer than that stops the run (0 = unchecked).
        `reward_overlap`: score rows as they finish (see the module docstring)."""
        self.engine, self.rollout_fn, self.reward, self.tokenizer = engine, as_rollout(rollout_fn), reward, tokenizer
        self.prompts, self.sampler, self.rollout, self.seed, self.info = prompts, sampler, rollout, seed, info
        self.global_batch, self.context, self.reward_overlap = global_batch, context, reward_overlap
        self.share = global_batch // info.dp_size  # prompts per data-parallel rank
        # The batch may come back with rewards pending only from a rollout function whose samples are the ones it
        # submitted, in order (`Rollout.defers_rewards`: the default one; a function of one's own may change them),
        # and only where it is not broadcast.
        self.defer = reward_overlap and self.rollout_fn.defers_rewards and info.replica_size == 1

    def draw(self) -> list[PromptRecord]:
        """Every rank draws the same global batch (keeping the sampler in step); each DP rank takes its slice."""
        indices = self.sampler.next_indices(self.global_batch)
        mine = indices[self.info.dp_rank * self.share : (self.info.dp_rank + 1) * self.share]
        return [self.prompts[i] for i in mine]

    def run(self, prompts: list[PromptRecord], step: int, defer: bool = False) -> RolloutBatch:
        """The model replica's leader runs the rollout function; the replica's other ranks receive the result.
        `defer`: the rewards may still be pending (only where `self.defer` allows)."""
        return self.share_batch(self.produce(prompts, step, defer) if self.info.is_mp_leader else None)

    def produce(self, prompts: list[PromptRecord], step: int, defer: bool = False) -> RolloutBatch:
        """The leader's part of `run`, with no collective: the rollout function on `prompts`, seeded by `step`
        (asynchronous training runs it in a worker thread). `defer`: see `run`."""
        seed = (self.seed * 1_000_003 + step * 1_009 + self.info.dp_rank) % (2**31)
        params = sampling_params(self.rollout, self.tokenizer, seed=seed)
        meter = RewardMeter(self.reward, overlap=self.reward_overlap, signals=bench_on(step + 1))
        meter.defer = defer and self.defer
        start = time.perf_counter()
        samples = self.rollout_fn(self.engine, prompts, params, meter, self.tokenizer)
        seconds = time.perf_counter() - start
        check_groups(samples, len(prompts), params.n, self.rollout.rollout_function)
        check_lengths(samples, self.context, self.rollout.rollout_function)
        own = self.rollout_fn.step_metrics()  # a configured function's own metrics
        rollout = RolloutBatch(samples, params.n, generate_seconds=seconds - meter.exposed)
        if meter.deferred is None:
            return _scored(rollout, meter, own)
        scored = meter.deferred
        return replace(rollout, pending=lambda: _scored(replace(rollout, samples=scored()), meter, own))

    def share_batch(self, rollout: RolloutBatch | None) -> RolloutBatch:
        """The leader's batch to the model replica's other ranks (collective within the replica)."""
        if self.info.replica_size > 1:
            rollout = broadcast_in_mp_group(rollout)
        return rollout

    def __call__(self, step: int) -> RolloutBatch:
        return self.run(self.draw(), step, defer=True)

    def round(self, step: int, index: int, need: bool) -> RolloutBatch | None:
        """Dynamic sampling's round `index` (0-based) of `step`: every rank draws; only a rank that `need`s more
        groups rolls out."""
        prompts = self.draw()
        return self.run(prompts, step + 7_919_000 * index) if need else None

    def rank_state(self) -> dict:
        return {}

    def load_rank_state(self, state: dict) -> None:
        pass


def _scored(rollout: RolloutBatch, meter: RewardMeter, own: dict[str, float]) -> RolloutBatch:
    """`rollout` with its samples scored: the reward's seconds and health, then the rollout function's `own`
    metrics."""
    metrics = {**meter.health(rollout.group_size), **own}
    return replace(rollout, reward_seconds=meter.seconds, reward_exposed_seconds=meter.exposed, metrics=metrics,
                   pending=None)


def _groups(rollout: RolloutBatch) -> list[list[Sample]]:
    n = rollout.group_size
    return [rollout.samples[i : i + n] for i in range(0, len(rollout.samples), n)]


class DynamicSampling:
    """DAPO's dynamic sampling around a `Collector`.

    Groups whose verifier *outcomes* are all equal (all correct, all wrong) carry no signal and are dropped; more
    prompts are drawn and rolled out until every rank has its share, for up to `max_rounds` rounds. Shaped rewards
    never decide what is dropped: only outcomes do. If the rounds run out, dropped groups fill the gap (their
    advantages are 0) so every rank trains on the same number of samples. Groups beyond the share wait in a
    buffer (this rank's; checkpointed) for the next step. All ranks draw every round, so the prompt sampler stays
    in step across ranks. Reports `ds_*` metrics: prompts drawn, groups dropped, rounds, groups filled from the
    dropped ones.
    """

    def __init__(self, collector: Collector, max_rounds: int):
        self.collector, self.max_rounds = collector, max_rounds
        self.buffer: list[list[Sample]] = []

    def __call__(self, step: int) -> RolloutBatch:
        c, share = self.collector, self.collector.share
        bound = c.staleness  # asynchronous: buffered groups past the bound are dropped
        if bound:
            self.buffer = drop_stale_groups(self.buffer, step, bound)
        kept = [self.buffer.pop(0) for _ in range(min(share, len(self.buffer)))]
        dropped: list[list[Sample]] = []
        first: RolloutBatch | None = None
        throughput: dict[str, float] = {}
        gen_s = reward_s = exposed_s = 0.0
        drawn = rounds = 0
        while rounds < self.max_rounds and agree_any(len(kept) < share):
            need = len(kept) < share  # a full rank still takes part, keeping the sampler in step with the others
            rb = c.round(step, rounds, need)
            rounds += 1
            if not need:
                continue
            drawn += share
            first = first or rb
            gen_s, reward_s = gen_s + rb.generate_seconds, reward_s + rb.reward_seconds
            exposed_s += rb.reward_exposed_seconds
            for k in SANDBOX_KEYS:
                if k in rb.metrics:
                    throughput[k] = throughput.get(k, 0.0) + rb.metrics[k]
            for group in _groups(rb):
                (dropped if len({smp.outcome for smp in group}) == 1 else kept).append(group)
        filled = max(0, share - len(kept))
        kept += dropped[:filled]
        self.buffer.extend(kept[share:])
        del self.buffer[: max(0, len(self.buffer) - share)]  # keep the freshest groups, at most one step's worth
        samples = [replace(smp, group=g) for g, group in enumerate(kept[:share]) for smp in group]
        metrics = {**(first.metrics if first is not None else {}), **throughput}  # every round's sandbox work
        metrics.update(ds_prompts_drawn=float(drawn), ds_groups_dropped=float(len(dropped)), ds_rounds=float(rounds),
                       ds_groups_filled=float(filled))
        return RolloutBatch(samples, c.rollout.n_samples_per_prompt, generate_seconds=gen_s, reward_seconds=reward_s,
                            metrics=metrics, reward_exposed_seconds=exposed_s)

    def rank_state(self) -> dict:
        return {"ds_buffer": self.buffer, **self.collector.rank_state()}

    def load_rank_state(self, state: dict) -> None:
        self.buffer = list(state.get("ds_buffer", []))
        self.collector.load_rank_state({k: v for k, v in state.items() if k != "ds_buffer"})


class OverlongShaping:
    """DAPO's overlong reward shaping (soft punishment) around any collect stage: with L the response length, Lmax
    the maximum and B the buffer, the reward gets 0 for L <= Lmax - B, -penalty * (L - (Lmax - B)) / B for
    Lmax - B < L <= Lmax. Applied to what the inner stage returns, after dynamic sampling, so shaping never decides
    which groups are dropped; the samples it changes are new ones."""

    def __init__(self, inner: Collect, max_len: int, buffer_len: int, penalty: float):
        self.inner, self.start, self.buffer_len, self.penalty = inner, max_len - buffer_len, buffer_len, penalty

    def shaped(self, smp: Sample) -> Sample:
        over = len(smp.response_ids) - self.start
        if over <= 0:
            return smp
        return replace(smp, reward=smp.reward - self.penalty * min(over, self.buffer_len) / self.buffer_len)

    def __call__(self, step: int) -> RolloutBatch:
        rollout = wait_for_rewards(self.inner(step))
        return replace(rollout, samples=[self.shaped(s) for s in rollout.samples])

    def rank_state(self) -> dict:
        return self.inner.rank_state()

    def load_rank_state(self, state: dict) -> None:
        self.inner.load_rank_state(state)


def drop_stale_groups(groups: list[list[Sample]], step: int, bound: int) -> list[list[Sample]]:
    """Dynamic sampling's buffer under a staleness bound: the groups step `step` may still train on."""
    return [g for g in groups if all(step - s.weight_version <= bound for s in g)]

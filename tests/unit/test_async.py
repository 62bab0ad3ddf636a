"""Asynchronous training's parts: the engine in its own process gives what the in-process engine gives (weights
through shared memory, every version), the pipeline keeps the engine's work in order, the queue makes batch s
with the weights of step s - K and survives a checkpoint, the staleness bound is enforced, and the overlap
figures are the formulas the docs give."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass, field, replace

import pytest
import torch
from helpers import make_tiny_hf_model
from safetensors.torch import load_file

from megarl.arguments import parse_args
from megarl.config import ConfigError
from megarl.rollout.base import Completion, SamplingParams
from megarl.rollout.builtin import BuiltinEngine
from megarl.rollout.engine_process import EngineProcess, EngineProcessError
from megarl.rollout.weight_sync import push
from megarl.stages.asynchronous import (AsyncCollect, OrderedEngine, Pipeline, StalenessError, check_staleness,
                                        overlap_metrics)
from megarl.stages.collect import DynamicSampling, drop_stale_groups
from megarl.samples import RolloutBatch, Sample, SampleStatus

PROMPTS = [[1, 5, 9, 3], [2, 7], [4, 4, 4, 8, 1]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = make_tiny_hf_model(tmp_path_factory.mktemp("hf"), "qwen2")
    return json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))


def _perturbed(weights: dict, scale: float) -> dict:
    g = torch.Generator().manual_seed(int(scale * 1000))
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in weights.items()}


def _same(a: list[list[Completion]], b: list[list[Completion]]):
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    for ga, gb in zip(a, b):
        for ca, cb in zip(ga, gb):
            assert ca.weight_version == cb.weight_version
            torch.testing.assert_close(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs), rtol=0, atol=1e-5)


@pytest.mark.distributed
def test_engine_process_matches_the_in_process_engine_across_weight_versions(tiny):
    config, weights = tiny
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=7)
    local = BuiltinEngine(config)
    remote = EngineProcess(config, threads=1, timeout_s=120)
    try:
        for version, w in ((1, weights), (2, _perturbed(weights, 0.05)), (3, _perturbed(weights, 0.1))):
            for engine in (local, remote):
                stats = push(engine, w.items(), version, bucket_bytes=50_000)  # several buckets, buffers reused
                assert engine.weight_version == version and stats.buckets > 1
            _same(remote.generate(PROMPTS, params), local.generate(PROMPTS, params))
            seqs = [p + [3, 3, 2] for p in PROMPTS]
            torch.testing.assert_close(torch.tensor(sum(remote.score(seqs, [len(p) for p in PROMPTS]), [])),
                                       torch.tensor(sum(local.score(seqs, [len(p) for p in PROMPTS]), [])),
                                       rtol=0, atol=1e-5)
        assert remote.busy_seconds > 0
    finally:
        remote.shutdown()
    assert not remote._proc.is_alive()


@pytest.mark.distributed
def test_engine_process_reports_its_failures_and_its_death(tiny):
    config, weights = tiny
    remote = EngineProcess(config, threads=1, timeout_s=60)
    try:
        with pytest.raises(EngineProcessError, match="unknown parameter 'nope'"):
            remote.update_weights([("nope", torch.zeros(2))], version=1)
        remote.update_weights(weights.items(), version=1)  # still serving after a failed request
        assert len(remote.generate([[1, 2]], SamplingParams(n=1, max_new_tokens=2, seed=0))[0]) == 1
        os.kill(remote._proc.pid, signal.SIGKILL)
        remote._proc.join(timeout=10)
        with pytest.raises(EngineProcessError, match=r"engine process .* (gone|died).*exit code -9"):
            remote.generate([[1, 2]], SamplingParams(n=1, max_new_tokens=2, seed=0))
    finally:
        remote.shutdown()


@dataclass
class _Recorder:
    """An engine that records the order of the calls it gets."""

    calls: list = field(default_factory=list)
    weight_version: int = 0
    dtype: torch.dtype | None = None
    shares_actor_weights: bool = False
    fail_load: bool = False

    def load_weight_buckets(self, buckets, version):
        if self.fail_load:
            raise RuntimeError("load failed on purpose")
        self.calls.append(("load", version, [n for b in buckets for n, _ in b.tensors()]))
        self.weight_version = version

    def generate(self, prompts, params):
        self.calls.append(("generate", self.weight_version))
        return [[Completion([1], [0.0], "stop", self.weight_version)] for _ in prompts]

    def shutdown(self):
        pass


def test_ordered_engine_loads_a_copy_in_order_and_surfaces_a_failed_load():
    inner, pipeline = _Recorder(), Pipeline()
    engine = OrderedEngine(inner, pipeline)
    w = torch.ones(3)
    engine.update_weights([("w", w)], version=1)
    w.add_(1)  # the actor trains on: the engine must load the weights of version 1
    assert engine.generate([[1]], SamplingParams())[0][0].weight_version == 1
    assert [c[0] for c in inner.calls] == ["load", "generate"]
    inner.fail_load = True
    engine.update_weights([("w", w)], version=2)
    pipeline.run(lambda: None)  # the load has run (and failed)
    with pytest.raises(RuntimeError, match="load failed on purpose"):
        engine.generate([[1]], SamplingParams())
    pipeline.close()


class _Info:
    is_mp_leader, replica_size, dp_rank, dp_size = True, 1, 0, 1


class _FakeCollector:
    """The collector's interface: `draw` takes the next prompts in order, `produce` stamps what the engine holds."""

    def __init__(self, engine, groups: int = 2, n: int = 2):
        self.engine, self.share, self.info, self.drawn = engine, groups, _Info(), 0
        self.rollout = type("R", (), {"n_samples_per_prompt": n})()

    def draw(self):
        self.drawn += 1
        return [self.drawn * 100 + i for i in range(self.share)]

    def produce(self, prompts, index):
        n = self.rollout.n_samples_per_prompt
        v = self.engine.weight_version
        # every third prompt's group is all correct (dynamic sampling drops it), the others mixed
        samples = [Sample(g, p, [1], [2], [1], [0.0], v, SampleStatus.COMPLETED,
                          outcome="correct" if p % 3 == 0 or j % 2 else "incorrect")
                   for g, p in enumerate(prompts) for j in range(n)]
        return RolloutBatch(samples, n, metrics={"index": index})

    def share_batch(self, rollout):
        return rollout


def _steps(k: int, steps: range, state: dict | None = None):
    """Run the queue like train.py (take the batch, train, sync version step + 1); the batches' (prompt of its first
    sample, version, seed index) and the rank state after each step."""
    inner, pipeline = _Recorder(), Pipeline()
    engine = OrderedEngine(inner, pipeline)
    engine.update_weights([("w", torch.zeros(1))], version=steps.start)
    collect = AsyncCollect(_FakeCollector(inner), pipeline, engine, k)
    if state:
        collect.load_rank_state(state["collect"])
        collect.collector.drawn = state["drawn"]
    collect.start()
    seen, states = [], []
    for step in steps:
        batch = collect(step)
        check_staleness(batch.samples, step, k)
        seen.append((batch.samples[0].prompt_index, batch.samples[0].weight_version, batch.metrics["index"]))
        engine.update_weights([("w", torch.full((1,), float(step + 1)))], version=step + 1)
        states.append({"collect": collect.rank_state(), "drawn": collect.collector.drawn})
    collect.stop()
    return seen, states


@pytest.mark.parametrize("k", [1, 2])
def test_batch_s_is_made_with_the_weights_of_step_s_minus_k_and_resumes_exactly(k):
    seen, states = _steps(k, range(8))
    assert [v for _, v, _ in seen] == [max(0, s - k) for s in range(8)]
    assert [i for _, _, i in seen] == list(range(8)), "seeds follow the batch's place in the queue"
    assert [p for p, _, _ in seen] == [100 * (s + 1) for s in range(8)], "prompts in draw order"
    resumed, _ = _steps(k, range(4, 8), states[3])  # a run resumed after step 3's checkpoint
    assert resumed == seen[4:]


def test_a_checkpoint_with_more_queued_batches_than_the_bound_is_refused():
    _, states = _steps(2, range(3))
    inner = _Recorder()
    collect = AsyncCollect(_FakeCollector(inner), Pipeline(), OrderedEngine(inner, Pipeline()), 1)
    with pytest.raises(ValueError, match="--async-staleness 2"):
        collect.load_rank_state(states[-1]["collect"])


def test_dynamic_sampling_over_the_queue_keeps_the_bound(monkeypatch):
    """Each round takes one queued batch; buffered groups older than the bound are dropped."""
    k = 1
    inner, pipeline = _Recorder(), Pipeline()
    engine = OrderedEngine(inner, pipeline)
    queue = AsyncCollect(_FakeCollector(inner, groups=2, n=2), pipeline, engine, k)
    ds = DynamicSampling(queue, max_rounds=3)
    queue.start()
    monkeypatch.setattr("megarl.stages.collect.agree_any", lambda flag: flag)  # one rank: no process group
    rounds = dropped = 0
    for step in range(12):
        batch = ds(step)
        assert len(batch.samples) == 4
        check_staleness(batch.samples, step, k)
        rounds += batch.metrics["ds_rounds"]
        dropped += batch.metrics["ds_groups_dropped"]
        engine.update_weights([("w", torch.zeros(1))], version=step + 1)
    assert dropped > 0 and rounds > 12, "the test must exercise extra rounds"
    pipeline.close()


def test_check_staleness():
    def sample(v):
        return Sample(0, 0, [1], [2], [1], [0.0], v, SampleStatus.COMPLETED)

    assert check_staleness([sample(3), sample(5)], 5, 2) == {"staleness_mean": 1.0, "staleness_max": 2.0}
    with pytest.raises(StalenessError, match="3 versions old, outside the bound 0 .. 2"):
        check_staleness([sample(5), sample(2)], 5, 2)
    with pytest.raises(StalenessError):
        check_staleness([sample(6)], 5, 2)  # from the future: a sync went wrong
    groups = [[sample(1), sample(1)], [sample(3), sample(2)], [sample(4)]]
    assert drop_stale_groups(groups, 4, 2) == groups[1:]


def test_overlap_metrics_are_the_documented_ratios():
    # rollout 3 s in the worker, step 5 s of which 1 s waiting: training 4 s
    m = overlap_metrics({"t_rollout_async": 3.0, "t_wait_rollout": 1.0}, 5.0)
    assert m == {"overlap": pytest.approx(7 / 5), "overlap_bound": pytest.approx(7 / 4)}


@pytest.mark.parametrize("extra,message", [
    (["--rollout-backend", "megatron"], "--rollout-backend builtin"),
    (["--rollout-backend", "sglang"], "without --rollout-servers"),
    (["--offload-optimizer"], "nothing to offload"),
])
def test_async_flag_rules(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(["--hf-checkpoint", "x", "--async-staleness", "1", *extra])
    with pytest.raises(ConfigError, match="--async-staleness must be >= 0"):
        parse_args(["--hf-checkpoint", "x", "--async-staleness", "-1"])
    with pytest.raises(ConfigError, match="--rollout-threads"):
        parse_args(["--hf-checkpoint", "x", "--rollout-threads", "0"])


def test_settle_waits_for_every_queued_batch(monkeypatch):
    """Before a sync to shared servers every queued batch is finished (then a barrier over the ranks)."""
    calls = []
    monkeypatch.setattr("megarl.mcore.parallel.agree_any", lambda flag: calls.append(flag) or flag)
    inner, pipeline = _Recorder(), Pipeline()
    engine = OrderedEngine(inner, pipeline)
    collect = AsyncCollect(_FakeCollector(inner), pipeline, engine, 2)
    pipeline.submit(__import__("time").sleep, 0.3)  # the worker is busy: the queued batches are not done yet
    collect.start()
    assert not any(q.future.done() for q in collect.queue)
    collect.settle()
    assert all(q.future.done() for q in collect.queue) and calls == [False]
    pipeline.close()


def test_exposed_reward_is_what_the_trainer_waited_on():
    """The worker scored a batch for 0.3 s (all of it exposed inside the worker); the trainer, busy meanwhile, took
    it after the worker had finished: it waited on none of the reward. One taken before the worker finished waited
    on at most its wait, never more than the worker's own exposed reward."""
    import time as _time

    class _Scored(_FakeCollector):
        def produce(self, prompts, index):
            _time.sleep(0.3)
            return replace(super().produce(prompts, index), reward_seconds=0.3, reward_exposed_seconds=0.3)

    inner, pipeline = _Recorder(), Pipeline()
    engine = OrderedEngine(inner, pipeline)
    collect = AsyncCollect(_Scored(inner), pipeline, engine, 1)
    collect.start()
    first = collect(0)  # taken at once: the trainer waits ~0.3 s, all of it on the worker's scoring
    assert 0.2 < first.reward_exposed_seconds <= 0.3 and first.reward_seconds == 0.3
    _time.sleep(0.5)  # the trainer trains while the worker makes the next batch
    second = collect(1)
    assert second.reward_exposed_seconds < 0.05 and second.reward_seconds == 0.3
    collect.stop()


@pytest.mark.parametrize("choice,cuda,expected", [("auto", True, "cuda:3"), ("cuda", True, "cuda:3"),
                                                  ("auto", False, "cpu"), ("cpu", True, "cpu")])
def test_the_engine_process_gets_the_leaders_own_gpu(monkeypatch, tmp_path, choice, cuda, expected):
    """The built-in engine of --async-staleness runs in a spawned process, which starts on GPU 0: handed a bare
    "cuda", every data-parallel leader of a node would put its engine there. It gets the leader's own GPU (here
    LOCAL_RANK 3, the device `init_distributed` made current), with CUDA reported present."""
    from megarl.rollout import backends, engine_process

    made = {}

    class Spawned:
        def __init__(self, config, checkpoint, *, device, **kw):
            made["device"] = device

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(engine_process, "EngineProcess", Spawned)
    cfg = parse_args(["--hf-checkpoint", str(tmp_path), "--async-staleness", "1", "--rollout-device", choice],
                     check_registries=False)
    assert isinstance(backends.build_builtin(cfg), Spawned) and made["device"] == expected


def _held_after_sync(inner) -> tuple[list[bool], list]:
    """An asynchronous sync into `inner` while the worker is busy: whether each packed bucket's memory is still
    held once `load_weight_buckets` has returned (before the worker loads it), and what the worker then hands the
    engine (`(device, pinned, names)` per bucket)."""
    import threading
    import weakref

    from megarl.rollout.weight_sync import pack_buckets

    pipeline, gate, packed = Pipeline(), threading.Event(), []
    engine = OrderedEngine(inner, pipeline)
    pipeline.submit(gate.wait)  # the worker is generating: the load queues behind it

    def tracked():
        for bucket in pack_buckets([(f"w{i}", torch.full((64,), float(i))) for i in range(4)], 256):
            packed.append(weakref.ref(bucket.flat))
            yield bucket

    engine.load_weight_buckets(tracked(), version=1)
    held = [ref() is not None for ref in packed]
    gate.set()
    pipeline.run(lambda: None)  # the load has run
    pipeline.close()
    assert len(packed) == 4 and engine.weight_version == 1
    return held, getattr(inner, "calls", None)


class _Seen(_Recorder):
    """A `_Recorder` that notes where each bucket it loads lives."""

    def load_weight_buckets(self, buckets, version):
        self.calls += [(b.flat.device.type, b.flat.is_pinned(), [n for n, _ in b.tensors()]) for b in buckets]
        self.weight_version = version


def test_only_the_pushing_rank_keeps_the_async_copy_and_keeps_it_in_host_memory():
    """With --async-staleness the sync's buckets wait for the worker while the actor trains on: the pushing rank
    keeps them (in host memory: on a GPU, pinned; tests/gpu/test_colocated_path.py checks that part), a
    data-parallel leader whose servers another rank pushes to (`SGLangServers(push=False)`) keeps none. Kept as
    GPU buckets on every leader, they were a whole model of GPU memory on each (about 15 GiB for a 7B model)."""
    from megarl.rollout.sglang_engine import SGLangServers

    held, calls = _held_after_sync(_Seen())
    assert held == [True] * 4
    assert calls == [("cpu", False, [f"w{i}"]) for i in range(4)]
    bystander = SGLangServers(["127.0.0.1:1"], push=False)
    assert not bystander.takes_buckets and SGLangServers(["127.0.0.1:1"]).takes_buckets
    held, _ = _held_after_sync(bystander)
    assert held == [False] * 4, "a leader that does not push kept the buckets"
    assert bystander.weight_version == 1

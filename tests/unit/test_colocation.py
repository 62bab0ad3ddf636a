"""The colocated engine's memory, on CPU with stand-ins for the actor and SGLang (`test_sglang_engine`'s recording
fakes): the leader's extra memory during a weight sync, and the order in which actor, reference and engine take
the GPU. On a GPU these fail as an OOM or as SGLang's "Not enough memory" at the first sync, and only on a model
big enough; here they fail every time.
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
from pathlib import Path

import pytest
import torch
from test_sglang_engine import FakeActor, RecordingEngine, RecordingSessionEngine

from megarl.config import build_config
from megarl.mcore.parallel import ParallelInfo
from megarl.rollout.sglang_engine import SGLangEngine
from megarl.trainer.engine_launch import LaunchWait

ONE_RANK = ParallelInfo(rank=0, world_size=1, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1)
STATUS = Path("/proc/self/status")


# -- the leader's extra memory during a sync ---------------------------------------------------------------------


class GatheringActor:
    """A leader whose export makes a fresh full tensor per parameter, as the TP gathers of `iter_hf` do; its
    `export_hf` is the real one's definition (`list(iter_hf())`)."""

    def __init__(self, tensors: int, rows: int, cols: int):
        self.tensors, self.rows, self.cols = tensors, rows, cols

    def iter_hf(self):
        for i in range(self.tensors):
            yield f"model.layers.{i}.mlp.down_proj.weight", torch.full((self.rows, self.cols), float(i))

    def export_hf(self):
        return list(self.iter_hf())

    @property
    def model_bytes(self) -> int:
        return self.tensors * self.rows * self.cols * 4


def _rss_field(name: str) -> int:
    return int(re.search(rf"{name}:\s+(\d+) kB", STATUS.read_text()).group(1)) * 1024


M_MMAP_THRESHOLD, DYNAMIC_MAX = -3, 32 << 20  # glibc's mallopt parameter; the most its dynamic threshold reaches


def _peak_extra_bytes(fn) -> tuple[int, object]:
    """Peak resident memory of this process while `fn` runs, above what it held before (Linux: VmHWM, reset
    through /proc/self/clear_refs). glibc serves blocks of 1 MiB and more with mmap meanwhile, so each tensor's
    memory comes from the system and goes back to it when freed, and the peak follows the bytes alive at once
    (otherwise a block freed earlier in this process can hide an allocation). Then the threshold is left at the
    most glibc's dynamic threshold reaches in a process that frees large blocks."""
    libc = ctypes.CDLL(None)
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) := the current resident size
        before = _rss_field("VmRSS")
        out = fn()
        return _rss_field("VmHWM") - before, out
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, DYNAMIC_MAX)


def _can_measure() -> bool:
    if not hasattr(ctypes.CDLL(None), "mallopt"):  # not glibc
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "VmHWM" in STATUS.read_text()
    except OSError:
        return False


@pytest.mark.skipif(not _can_measure(), reason="needs Linux's /proc/self/clear_refs and VmHWM to measure peak memory")
def test_streamed_sync_holds_about_a_bucket_not_the_model():
    from megarl.stages.colocation import WeightSync

    actor = GatheringActor(tensors=64, rows=256, cols=1024)  # 64 MiB in 1 MiB tensors
    bucket_mb = 4
    log = []
    engine = SGLangEngine(RecordingSessionEngine(log), tp_size=1, serialize=lambda bucket, tp: [None] * tp)
    cfg = build_config({"sync_bucket_mb": bucket_mb})
    sync = WeightSync(actor, engine, cfg.rollout, ONE_RANK)
    peak, metrics = _peak_extra_bytes(lambda: sync(version=1))
    assert metrics["sync_bytes"] == actor.model_bytes and engine.weight_version == 1, "the whole model moved"
    print(f"peak extra {peak / 2**20:.1f} MiB during a sync of {actor.model_bytes / 2**20:.0f} MiB in "
          f"{metrics['sync_buckets']} buckets of {bucket_mb} MiB")
    # Streamed: the tensors of the bucket being filled, the bucket, and the previous one still referenced by the
    # consumer's loop variable: 3 to 4 buckets, whatever the model's size. A list export holds the whole model
    # first.
    assert peak < 6 * (bucket_mb << 20) < actor.model_bytes / 2, f"peak extra {peak / 2**20:.1f} MiB"


def test_a_push_that_fails_part_way_still_runs_the_export_to_its_end():
    """The export runs collectives (TP gathers, PP broadcasts): a leader that stops pulling would leave the other
    ranks of its replica waiting in a gather; it drains the export, then raises the engine's error."""
    from megarl.rollout.weight_sync import WeightSyncError
    from megarl.stages.colocation import WeightSync

    pulled = []

    class Actor(GatheringActor):
        def iter_hf(self):
            for name, tensor in super().iter_hf():
                pulled.append(name)
                yield name, tensor

    actor = Actor(tensors=5, rows=256, cols=256)  # 256 KiB each
    engine = SGLangEngine(RecordingSessionEngine([], fail_update=True), serialize=lambda b, tp: [None] * tp)
    sync = WeightSync(actor, engine, build_config({"sync_bucket_mb": 1}).rollout, ONE_RANK)
    with pytest.raises(WeightSyncError, match="boom"):
        sync(version=1)
    assert len(pulled) == 5


# -- who holds the GPU when ---------------------------------------------------------------------------------------


class ProbingActor(FakeActor):
    """`FakeActor` with the log-probs --verify-weight-sync asks for."""

    class shape:  # noqa: N801 - stands for the ModelShape attribute
        vocab_size = 50

    def logprobs(self, tokens, *, micro_batch_size, temperature=1.0):
        self.log.append("actor_logprobs")
        return torch.full((1, tokens.shape[1] - 1), -1.5)


class ScoringEngine(RecordingSessionEngine):
    """Scores every input token at -1.5, as the actor does: the check passes, only the order is under test."""

    def generate(self, input_ids, sampling_params, return_logprob=False, logprob_start_len=None):
        if logprob_start_len != 0:
            return super().generate(input_ids, sampling_params, return_logprob, logprob_start_len)
        self.log.append("score")
        return [{"output_ids": [0], "meta_info": {"finish_reason": {"type": "length"},
                                                  "input_token_logprobs": [(None, ids[0], None)] +
                                                  [(-1.5, t, None) for t in ids[1:]]}} for ids in input_ids]


def test_the_engine_scores_the_probe_after_the_optimizer_left_the_gpu(monkeypatch):
    import torch.distributed as dist

    from megarl.mcore import parallel
    from megarl.stages import colocation

    # The one-rank collectives of the old verify_sync, so that it runs here and fails on the order, not on a
    # missing process group.
    monkeypatch.setattr(parallel, "mp_group", lambda: None)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(0, obj))
    log = []
    engine = SGLangEngine(ScoringEngine(log), serialize=lambda bucket, tp: [bucket] * tp)
    actor = ProbingActor(log)
    cfg = build_config({"offload_optimizer": True, "offload_params": True, "verify_weight_sync": True,
                        "verify_sync_tolerance": 1e-6})
    sync = colocation.WeightSync(actor, engine, cfg.rollout, ONE_RANK)
    colocation.enter_training(actor, engine)
    log.clear()
    sync(version=1)
    probe = colocation.enter_rollout(actor, engine, cfg.training, sync)
    kv = next(i for i, e in enumerate(log) if e[0] == "resume" and "kv_cache" in e[1])
    assert log.index(("offload", True, True)) < kv < log.index("score"), log
    assert log.index("actor_logprobs") < log.index(("offload", True, True)), "the actor's forward needs its weights"
    assert probe["sync_probe_absdiff_max"] == 0.0 and probe["sync_probe_version"] == 1
    assert colocation.enter_rollout(actor, engine, cfg.training, sync) == {}, "each probe is scored once"


def test_colocated_sglang_launches_before_the_actor_and_hands_its_memory_back(monkeypatch):
    assert _construction_order(monkeypatch, "sglang") == [
        "launch", ("release", ("kv_cache", "weights", "cuda_graph")), "launch wait", "actor", "reference",
        "reference.load_hf", "resume"]


def test_other_engines_are_built_after_the_actor_as_before(monkeypatch):
    """The order every golden loss curve was recorded with (the actor's initialisation draws random numbers)."""
    assert _construction_order(monkeypatch, "builtin") == ["actor", "reference", "reference.load_hf", "resume",
                                                           "launch"]


def _construction_order(monkeypatch, backend: str) -> list:
    import torch.distributed as dist

    from megarl.rollout import backends
    from megarl.trainer import build as trainer_build

    log = []

    class Policy:
        def __init__(self, shape, *, trainable, **kwargs):
            self.name, self.lora = ("actor" if trainable else "reference"), None  # LoRA off, as by default
            log.append(self.name)

        def load_hf(self, path):
            log.append(f"{self.name}.load_hf")

    def build(cfg, actor=None):
        log.append("launch")
        return SGLangEngine(RecordingEngine(log))

    for name in ("sglang", "builtin"):
        b = backends.BACKENDS.get(name)
        monkeypatch.setitem(backends.BACKENDS._items, name, dataclasses.replace(b, build=build))
    monkeypatch.setattr(trainer_build, "MegatronPolicy", Policy)
    monkeypatch.setattr(trainer_build, "resume", lambda *a: (log.append("resume"), (0, {}))[1])
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: log.append("barrier"))

    class Wait(LaunchWait):  # every rank meets here once the engines have launched (on store keys, not a barrier)
        def wait(self, rank, what):
            log.append("launch wait")
            super().wait(rank, what)

    monkeypatch.setattr(trainer_build, "LaunchWait", type("W", (), {
        "over_default_store": staticmethod(lambda name, dp_size, timeout_s: Wait(dist.HashStore(), dp_size, 5))}))
    cfg = build_config({"rollout_backend": backend, "kl_coef": 0.1})
    checked = trainer_build.Checked(layout=None, shape=None, resume_from=None)
    models = trainer_build.build_models(cfg, checked, ONE_RANK, {"padded_vocab_size": 64}, sampler=None,
                                        say=lambda *a: None)
    assert isinstance(models.engine, SGLangEngine) and models.reference is not None
    return log


# -- an evaluation between steps ---------------------------------------------------------------------------------


class ForgetfulEngine(RecordingSessionEngine):
    """SGLang's memory saver without `enable_weights_cpu_backup` (0.5.23): released weights come back as
    uninitialised memory, and only a push makes them valid again; generating from them is what the test catches."""

    def __init__(self, log):
        super().__init__(log)
        self.weights_valid = True

    def release_memory_occupation(self, tags=None):
        super().release_memory_occupation(tags)
        if "weights" in tags:
            self.weights_valid = False

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.weights_valid = True
        return super().update_weights_from_tensor(named_tensors, load_format, flush_cache)

    def generate(self, input_ids, sampling_params, return_logprob=False, logprob_start_len=None):
        assert self.weights_valid, f"generated from released weights; calls so far: {self.log}"
        return super().generate(input_ids, sampling_params, return_logprob, logprob_start_len)


def test_an_evaluation_between_steps_leaves_the_engine_its_weights(monkeypatch):
    """train.py's order with --eval-interval: step (release, train, push), the evaluation between steps (the
    engine takes the GPU, generates, hands it back), the next step's rollout. No push follows the evaluation, so
    the engine must keep its weights through it; its KV cache and CUDA graphs still go."""
    from types import SimpleNamespace

    from megarl.stages import colocation
    from megarl.trainer import evaluate as ev

    log = []
    fake = ForgetfulEngine(log)
    engine, actor = SGLangEngine(fake, serialize=lambda bucket, tp: [bucket] * tp), FakeActor(log)
    cfg = build_config({"offload_optimizer": True, "offload_params": True})
    sync = colocation.WeightSync(actor, engine, cfg.rollout, ONE_RANK)

    def rollout():
        fake.generate([[1, 2]], {"max_new_tokens": 1})

    monkeypatch.setattr(ev, "evaluate", lambda run, quiet=False: (rollout(), {"sampled": 0.5, "greedy": 0.5})[1])
    run = SimpleNamespace(actor=actor, engine=engine, cfg=cfg, sync=sync, say=lambda *a, **k: None)
    for step in (1, 2):
        colocation.enter_rollout(actor, engine, cfg.training, sync)
        rollout()
        colocation.enter_training(actor, engine)
        sync(version=step)
        assert ev.evaluate_between_steps(run, step)["eval_sampled"] == 0.5
    released = [e[1] for e in log if e[0] == "release"]
    assert released[1] == ("kv_cache", "cuda_graph"), released  # after the first evaluation: the weights stay


class OldPluginEngine:
    """A plugin engine written before `keep_weights`: its release_memory takes no argument."""

    def __init__(self):
        self.released = 0

    def release_memory(self):
        self.released += 1


def test_a_plugin_engines_one_argument_release_memory_still_works():
    from megarl.stages import colocation

    engine, actor = OldPluginEngine(), FakeActor([])
    colocation.enter_training(actor, engine, keep_weights=True)
    colocation.enter_training(actor, engine)
    assert engine.released == 2


# -- the push's peak ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("offload_optimizer", [True, False])
def test_the_actor_lets_go_of_its_gradients_and_optimizer_before_the_engines_weights_come_back(offload_optimizer):
    """SGLang takes its weights' memory back before the first bucket (`load_weight_buckets`): the push must not
    find the actor's fp32 gradients (zeroed by the next step anyway) and, with --offload-optimizer, its optimizer
    state still on the GPU beside them. Every rank of the replica lets go (an SGLang TP rank sits on each GPU),
    and the next update gets them back at `enter_training`."""
    from megarl.stages import colocation

    log = []
    engine, actor = SGLangEngine(RecordingSessionEngine(log), serialize=lambda b, tp: [b] * tp), FakeActor(log)
    cfg = build_config({"offload_optimizer": offload_optimizer, "sync_bucket_mb": 1})
    sync = colocation.WeightSync(actor, engine, cfg.rollout, ONE_RANK, training=cfg.training)
    colocation.enter_training(actor, engine)
    log.clear()
    sync(version=1)
    assert log[:3] == [("offload", False, offload_optimizer), ("resume", ("weights",)), "begin_weight_update"], log
    colocation.enter_training(actor, engine)
    assert log[-1] == "onload"
    bystander = colocation.WeightSync(actor, None, cfg.rollout, ONE_RANK, training=cfg.training)
    log.clear()
    bystander(version=2)  # a rank without the engine: its GPU holds an SGLang TP rank too
    assert log[0] == ("offload", False, offload_optimizer), log
    elsewhere = build_config({"rollout_servers": "127.0.0.1:1", "rollout_backend": "sglang"})
    log.clear()  # servers on GPUs of their own: nothing comes back beside the actor, which keeps its state
    colocation.WeightSync(actor, None, elsewhere.rollout, ONE_RANK, training=elsewhere.training)(version=3)
    assert not [e for e in log if e[0] == "offload"], log


def test_a_checkpoint_after_the_sync_brings_the_optimizer_back_first(monkeypatch):
    """Since `free_for_push` the optimizer state may be on the host when train.py saves (after the sync): the save
    brings it back before anything is written."""
    from types import SimpleNamespace

    from megarl.trainer import checkpoints

    log = []
    monkeypatch.setattr(checkpoints.checkpoint, "save", lambda *a, **k: log.append("actor.save"))
    run = SimpleNamespace(cfg=build_config({"save": "/nowhere"}), actor=FakeActor(log),
                          algorithm=SimpleNamespace(save=lambda *a: log.append("algorithm.save")),
                          sampler=SimpleNamespace(state_dict=dict), collect=SimpleNamespace(rank_state=dict),
                          record={})
    checkpoints.save(run, 3)
    assert log == ["onload", "algorithm.save", "actor.save"]

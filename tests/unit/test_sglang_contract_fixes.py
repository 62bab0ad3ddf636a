"""The SGLang adapter held to what SGLang 0.5.23 actually does (docs/notes: the GPU path read against the pinned
sources), with fakes and stub HTTP servers that answer as SGLang does: aborted requests, input log-probs that
ignore the temperature, `sampling_seed` honoured only under deterministic inference, every memory tag, control
endpoints that answer 400 with `{"success": false, "message": ...}`, and `/flush_cache` refusing while requests run.
No GPU and no sglang needed.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from megarl.rollout import sglang_engine
from megarl.rollout.base import SamplingParams
from megarl.rollout.sglang_engine import SGLangEngine, SGLangServers, to_completion
from megarl.rollout.weight_sync import WeightSyncError, pack_buckets
from megarl.samples import SampleStatus


def _output(n_new: int, finish: dict) -> dict:
    ids = list(range(5, 5 + n_new))
    return {"output_ids": ids, "meta_info": {
        "finish_reason": finish, "output_token_logprobs": [(-0.25, t, None) for t in ids]}}


class _Recorder:
    """The slice of `sglang.Engine` the colocated adapter calls, recording each call."""

    def __init__(self, outputs=None):
        self.log, self.outputs = [], outputs

    def generate(self, input_ids, sampling_params, return_logprob=False, logprob_start_len=None):
        self.log.append(("generate", sampling_params))
        return self.outputs

    def release_memory_occupation(self, tags=None):
        self.log.append(("release", tuple(tags)))

    def resume_memory_occupation(self, tags=None):
        self.log.append(("resume", tuple(tags)))

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.log.append("update")
        return True, "Success"

    def flush_cache(self):
        self.log.append("flush_cache")


# -- finding 8: an aborted request is not a finished sample ------------------------------------------------------


def test_aborted_request_is_its_own_status_and_stays_out_of_the_loss(one_rank_group):
    """SGLang ends a request it aborts with finish_reason {"type": "abort", "message": ...}: the partial response
    must reach GRPO neither as a finished answer nor as one cut at the length limit. It becomes
    `SampleStatus.ABORTED`, its tokens are out of the loss whatever --mask-truncated says, and the step counts it
    in `aborted_frac`. Followed through the real to_completion, rollout sample, packing, GRPO advantages, the
    token loss and the step's metrics."""
    from megarl.algorithms.advantages import compute_grpo_advantages
    from megarl.algorithms.losses import aggregate, grpo_token_loss
    from megarl.data import PromptRecord
    from megarl.mcore.parallel import ParallelInfo
    from megarl.rollout.functions import policy_sample
    from megarl.samples import RolloutBatch, TrainBatch
    from megarl.stages import report
    from megarl.stages.algorithm import pack

    aborted = _output(2, {"type": "abort", "message": "Abort in waiting queue"})
    assert to_completion(aborted, 0).finish_reason == "abort"
    assert to_completion(_output(2, {"type": "stop", "matched": 7}), 0).finish_reason == "stop"
    assert to_completion(_output(2, {"type": "length", "length": 2}), 0).finish_reason == "length"

    engine = SGLangEngine(_Recorder([_output(3, {"type": "stop", "matched": 7}), _output(3, {"type": "stop"}),
                                     aborted]))
    with pytest.warns(RuntimeWarning, match=r"aborted 1 of 3 requests.*Abort in waiting queue"):
        group = engine.generate([[1, 2]], SamplingParams(n=3, max_new_tokens=3))[0]
    assert engine.aborted == 1
    record = PromptRecord(index=0, prompt="", prompt_ids=[1, 2], label="", verifier="math")
    tokenizer = types.SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "")
    samples = [policy_sample(0, record, c, tokenizer) for c in group]
    assert [s.status for s in samples] == [SampleStatus.COMPLETED, SampleStatus.COMPLETED, SampleStatus.ABORTED]
    for s, reward in zip(samples, [1.0, 0.0, 0.0]):
        s.reward = reward

    packed = pack(samples, pad_id=0, mask_truncated=False)  # out of the loss without --mask-truncated too
    assert packed.loss_mask.sum(dim=1).tolist() == [3.0, 3.0, 0.0]
    rewards = torch.tensor([[1.0, 0.0, 0.0]])
    advantages = compute_grpo_advantages(rewards).flatten()  # the aborted row stays in its group's baseline
    mean, std = 1 / 3, (((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2) ** 0.5
    assert torch.allclose(advantages, torch.tensor([(1 - mean) / std, -mean / std, -mean / std]), atol=1e-5)
    logp = packed.rollout_logp.clone().requires_grad_(True)
    per_token, _ = grpo_token_loss(logp, packed.rollout_logp, None, advantages, packed.loss_mask)
    num, den = aggregate(per_token, packed.loss_mask)
    (num / den).backward()
    assert logp.grad[2].abs().sum() == 0, "no gradient from the aborted row"
    # ratio 1: the loss is -mean over the 6 finished tokens of their advantages
    assert torch.allclose(num / den, -(3 * advantages[0] + 3 * advantages[1]) / 6, atol=1e-6)

    batch = TrainBatch(tokens=packed.tokens, loss_mask=packed.loss_mask, rollout_logp=packed.rollout_logp,
                       lengths=packed.lengths, rewards=rewards.flatten(), advantages=advantages)
    one = ParallelInfo(rank=0, world_size=1, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1)
    metrics = report.step_metrics(1, RolloutBatch(samples, group_size=3), batch, {"grad_norm": 0.0, "lr": 0.0}, {},
                                  1.0, one)
    assert metrics["aborted_frac"] == pytest.approx(1 / 3) and metrics["truncated_frac"] == 0.0


# -- finding 7: SGLang's input log-probs ignore the temperature -------------------------------------------------


def test_score_refuses_a_temperature_sglang_would_ignore():
    fake = _Recorder()
    engine = SGLangEngine(fake)
    with pytest.raises(ValueError, match=r"temperature 0.7.*log_softmax.*temperature=1.0"):
        engine.score([[1, 2, 3]], [1], temperature=0.7)
    with pytest.raises(ValueError, match="temperature 0.5"):
        SGLangServers(["127.0.0.1:1"]).score([[1, 2, 3]], [1], temperature=0.5)  # refused before any request
    assert fake.log == [], "nothing was sent to the engine"


# -- finding 6: sampling_seed needs deterministic inference ------------------------------------------------------


@pytest.fixture
def fake_sglang(monkeypatch):
    """`import sglang` gives a module whose `Engine` records its ServerArgs keywords."""
    launched = []
    module = types.ModuleType("sglang")
    module.Engine = lambda **kw: launched.append(kw) or _Recorder()
    monkeypatch.setitem(sys.modules, "sglang", module)
    return launched


def test_seeded_launch_turns_on_deterministic_inference(fake_sglang):
    """SGLang 0.5.23 reads `sampling_seed` only when launched with `enable_deterministic_inference`; megarl sends a
    seed with every request of a seeded run, so the seeded engine is launched deterministic."""
    SGLangEngine.launch("/ckpt", seed=1234)
    SGLangEngine.launch("/ckpt", seed=None)
    SGLangEngine.launch("/ckpt", seed=3, enable_deterministic_inference=False)  # an explicit choice wins
    assert [kw["enable_deterministic_inference"] for kw in fake_sglang] == [True, False, False]
    assert fake_sglang[0]["random_seed"] == 1234


# -- finding 11: every memory tag is released and resumed ---------------------------------------------------------


def test_release_and_resume_cover_every_memory_tag():
    fake = _Recorder()
    engine = SGLangEngine(fake, serialize=lambda bucket, tp: [bucket])
    engine.release_memory()
    engine.load_weight_buckets(pack_buckets([("w", torch.ones(2))]), version=1)
    engine.resume_memory()
    released = fake.log[0][1]
    resumed = [t for entry in fake.log if entry[0] == "resume" for t in entry[1]]
    assert set(released) == {"kv_cache", "weights", "cuda_graph"}
    assert sorted(resumed) == sorted(released), "each released tag is resumed once"
    assert fake.log[1] == ("resume", ("weights",)) and fake.log[-1] == "flush_cache"


# -- finding 9: one IPC payload per TP rank, and IPC memory collected per bucket -----------------------------------


def test_each_tp_rank_gets_a_payload_of_its_own(monkeypatch):
    """SGLang's TP rank r opens only payload r (`deserialize_own_rank`): CUDA-IPC refcounting is per payload, so
    one payload opened by every TP rank is released early or never. Without the trainer ranks on the engine's GPUs
    (`IpcGather`, which `WeightSync` attaches: tests/distributed/test_ipc_gather.py) the leader serialises the
    bucket once per TP rank, as SGLang's own `_serialize_tensors_per_rank` does, and warns at the first load that
    all of them live on its GPU."""
    serialized = []

    def serialize(obj, output_str=False):
        serialized.append(obj["flattened_tensor"])
        return f"payload {len(serialized)}"

    names = ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.weight_sync",
             "sglang.srt.weight_sync.tensor_bucket")
    modules = {name: types.ModuleType(name) for name in names}
    modules["sglang.srt.utils"].MultiprocessingSerializer = types.SimpleNamespace(serialize=serialize)
    modules["sglang.srt.weight_sync.tensor_bucket"].FlattenedTensorMetadata = lambda **kw: kw
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    fake = _Recorder()
    fake.update_weights_from_tensor = lambda named_tensors, **kw: fake.log.append(list(named_tensors)) or (True, "")
    engine = SGLangEngine(fake, tp_size=2)
    with pytest.warns(RuntimeWarning, match=r"TP 2 without the trainer ranks on its GPUs.*WeightSync"):
        engine.load_weight_buckets(pack_buckets([(f"w{i}", torch.ones(4)) for i in range(3)], 32), version=1)
    assert fake.log == [["payload 1", "payload 2"], ["payload 3", "payload 4"]], "one serialisation per TP rank"
    engine = SGLangEngine(_Recorder(), tp_size=2, serialize=lambda bucket, tp: [bucket])
    with pytest.raises(WeightSyncError, match="1 IPC payloads for an engine at TP 2"):
        engine.load_weight_buckets(pack_buckets([("w", torch.ones(2))]), version=1)


def test_ipc_memory_is_collected_after_each_bucket(monkeypatch):
    """CUDA-IPC memory an engine has loaded from is given back per bucket (`torch.cuda.ipc_collect`, as slime
    does per chunk), not once the whole sync is over."""
    collected, fake = [], _Recorder()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: collected.append(len(fake.log)))
    engine = SGLangEngine(fake, serialize=lambda bucket, tp: [bucket])
    engine.load_weight_buckets(pack_buckets([(f"w{i}", torch.ones(4)) for i in range(3)], 16), version=1)
    assert fake.log == ["update"] * 3 and collected == [1, 2, 3], "one collect right after each bucket's update"


def test_a_stalled_ipc_gather_names_the_rank_the_leader_and_the_bucket(monkeypatch):
    """A rank of a colocated engine waits for the leader per bucket (`IpcGather`): when a collective of the gather
    times out (gloo raises a RuntimeError after --distributed-timeout-seconds), the error says which rank waited,
    on whose engine, for what, and at which bucket, not only gloo's words."""
    from megarl.rollout import sglang_ipc

    me = {"rank": 1}
    timed_out = RuntimeError("[gloo] Timed out waiting 60000ms for recv operation to complete")

    def stall(*args, **kwargs):
        raise timed_out

    monkeypatch.setattr(sglang_ipc.dist, "get_rank", lambda group=None: me["rank"])
    monkeypatch.setattr(sglang_ipc.dist, "gather_object", lambda *a, **k: None)
    monkeypatch.setattr(sglang_ipc.dist, "broadcast_object_list", stall)
    gather = sglang_ipc.IpcGather(None, [0, 1], serialize=lambda bucket: "payload")
    with pytest.raises(WeightSyncError) as info:
        gather.serve(pack_buckets([("w", torch.ones(4))]))
    assert str(info.value).startswith(
        "rank 1 (on the GPU of TP rank 1 of the colocated SGLang engine on ranks [0, 1]): waiting for leader 0 to "
        "load bucket 0 into the engine failed: RuntimeError: [gloo] Timed out waiting 60000ms"), info.value
    assert info.value.__cause__ is timed_out
    me["rank"] = 0
    monkeypatch.setattr(sglang_ipc.dist, "gather_object", stall)
    with pytest.raises(WeightSyncError, match=r"^rank 0 \(the leader of the colocated SGLang engine on ranks "
                                              r"\[0, 1\]\): gathering the payloads of ranks \[1\] for bucket 0 failed"):
        gather.payloads(next(pack_buckets([("w", torch.ones(4))])), tp_size=2)


def test_an_engine_off_its_leaders_first_stage_tp_ranks_is_refused(monkeypatch):
    """The ranks on a colocated engine's GPUs read the leader's export stream, so they must be its first stage's
    TP ranks: an engine at TP 2 over a trainer at TP 1 x PP 2 would put rank 1, a later stage, on TP rank 1's
    GPU. Checked on every rank alike when the gather is built, and, for the flags, when they are parsed."""
    from megarl.rollout import sglang_ipc

    places = [(0, 0, 0), (0, 1, 0)]  # (TP, PP, CP) of ranks 0 and 1: TP 1 x PP 2
    monkeypatch.setattr(sglang_ipc.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(sglang_ipc.dist, "all_gather_object",
                        lambda out, obj, group=None: out.__setitem__(slice(None), [(i == 0, p) for i, p in
                                                                                    enumerate(places)]))
    with pytest.raises(ValueError, match=r"rank 1, on the GPU of TP rank 1 of leader 0's engine, is \(TP, PP, CP\) "
                                         r"rank \(0, 1, 0\), not \(1, 0, 0\)"):
        sglang_ipc.build_ipc_gather(2, is_leader=True, place=places[0])
    from megarl.arguments import parse_args
    from megarl.config import ConfigError

    with pytest.raises(ConfigError, match="--sglang-tp-size 2: a colocated SGLang engine .* at most "
                                          "--tensor-model-parallel-size 1"):
        parse_args(["--rollout-backend", "sglang", "--sglang-tp-size", "2"])
    assert parse_args(["--rollout-backend", "sglang", "--sglang-tp-size", "2",
                       "--tensor-model-parallel-size", "2"]).components["rollout_backend.sglang"].sglang_tp_size == 2


# -- finding 13: Megatron's fused softmax only where its kernel imports --------------------------------------------


def test_masked_softmax_fusion_needs_the_kernel(monkeypatch):
    """megatron-core's wheels do not ship `scaled_masked_softmax_cuda`; with the fusion on and the kernel absent,
    `FusedScaleMaskSoftmax.is_kernel_available` dies on the import. On a 'GPU' without the kernel the fusion is
    off; with the kernel importable it is on."""
    from megarl.mcore.model import transformer_config
    from megarl.model_shape import ModelShape

    tiny = ModelShape(family="qwen2", num_layers=2, hidden_size=8, num_attention_heads=2, num_kv_heads=2, head_dim=4,
                      ffn_hidden_size=16, vocab_size=32, max_position_embeddings=32, rope_theta=10000.0,
                      norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for kernel in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda"):
        monkeypatch.setitem(sys.modules, kernel, None)  # `import kernel` raises ImportError
    assert transformer_config(tiny, tp=1, pp=1).masked_softmax_fusion is False
    for kernel in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda"):
        monkeypatch.setitem(sys.modules, kernel, types.ModuleType(kernel))
    assert transformer_config(tiny, tp=1, pp=1).masked_softmax_fusion is True


# -- findings 4 and 5: SGLang servers that refuse --------------------------------------------------------------


class _StubServer:
    """An SGLang HTTP server as 0.5.23 answers: control endpoints 200 `{"success": true}`, or 400 with
    `{"success": false, "message": ...}` for the paths in `refuse`; `/flush_cache` answers 400 (plain text, as
    SGLang does) while `busy` requests are still running, each refusal finishing one of them."""

    FLUSH_REFUSED = ("Cache not flushed. Please check backend logs for more details. (When there are running or "
                     "waiting requests, the operation will not be performed.)")

    def __init__(self, refuse: dict[str, str] | None = None, busy: int = 0):
        self.calls, self.refuse, self.busy = [], refuse or {}, busy
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                outer.calls.append(self.path)
                if self.path in outer.refuse:
                    self._answer(400, json.dumps({"success": False, "message": outer.refuse[self.path]}))
                elif self.path == "/flush_cache" and outer.busy:
                    outer.busy -= 1
                    self._answer(400, outer.FLUSH_REFUSED)
                elif self.path == "/flush_cache":
                    self._answer(200, "Cache flushed.")
                else:
                    assert isinstance(body, dict)
                    self._answer(200, json.dumps({"success": True, "message": "ok"}))

            def _answer(self, code, text):
                data = text.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stubs():
    made = []

    def make(**kw):
        made.append(_StubServer(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


class _NeverJoined:
    """What a broadcast to a server that never joins looks like from the trainer: `dist.broadcast` blocks until
    the collective timeout (600 s under NCCL; `block_s` here), an async one never completes."""

    def __init__(self, block_s: float = 3.0):
        self.block_s, self.calls = block_s, 0

    def __call__(self, tensor, src, group=None, async_op=False):
        self.calls += 1
        if async_op:
            return types.SimpleNamespace(is_completed=lambda: False, wait=lambda *a: time.sleep(self.block_s))
        time.sleep(self.block_s)
        raise RuntimeError("collective timed out")


def test_refused_weight_update_surfaces_sglang_message_without_waiting(stubs, monkeypatch):
    """A server that refuses `/update_weights_from_distributed` (400 + message) never joins the broadcast: the
    trainer raises with SGLang's message at once instead of waiting the collective timeout."""
    import torch.distributed as dist

    refusing = stubs(refuse={"/update_weights_from_distributed": "Weight update session not started"})
    client = SGLangServers([stubs().url, refusing.url], tp_sizes=[1, 1])
    client.group = object()  # connected (the broadcast is faked)
    broadcast = _NeverJoined()
    monkeypatch.setattr(dist, "broadcast", broadcast)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="Weight update session not started"):
        client.load_weight_buckets(pack_buckets([("w", torch.ones(4))]), version=1)
    assert time.monotonic() - start < broadcast.block_s / 2, "the trainer did not wait for the collective"
    assert client.weight_version == 0 and "/end_weight_update" in refusing.calls


def test_refused_session_never_enters_the_broadcast(stubs, monkeypatch):
    import torch.distributed as dist

    refusing = stubs(refuse={"/begin_weight_update": "Another weight update is in progress"})
    client = SGLangServers([refusing.url], tp_sizes=[1])
    client.group = object()
    broadcast = _NeverJoined()
    monkeypatch.setattr(dist, "broadcast", broadcast)
    with pytest.raises(WeightSyncError, match="begin_weight_update.*Another weight update is in progress"):
        client.load_weight_buckets(pack_buckets([("w", torch.ones(4))]), version=1)
    assert broadcast.calls == 0 and "/update_weights_from_distributed" not in refusing.calls


def test_refused_group_join_raises_at_once(stubs, monkeypatch):
    """`/init_weights_update_group` refused: the trainer's side of the rendezvous would wait for a server that
    never comes (the store's timeout, 600 s); it stops with SGLang's message instead."""
    refusing = stubs(refuse={"/init_weights_update_group": "Group megarl_weights already exists"})

    def rendezvous_never_met(*args, **kwargs):
        time.sleep(3.0)
        raise TimeoutError("rendezvous timed out")

    monkeypatch.setattr(sglang_engine, "init_weights_update_group", rendezvous_never_met)
    client = SGLangServers([refusing.url], tp_sizes=[1])
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="Group megarl_weights already exists"):
        client.connect("127.0.0.1", 1, backend="gloo")
    assert time.monotonic() - start < 1.5 and client.group is None


def test_pusher_flushes_after_the_push_retrying_while_busy(stubs, monkeypatch):
    """SGLang's `/flush_cache` answers 400 while any request runs or waits. The pusher flushes once after its push
    and retries; the other data-parallel leaders, which may be generating, never flush."""
    import torch.distributed as dist

    busy = stubs(busy=2)
    monkeypatch.setattr(dist, "broadcast", lambda t, src, group=None, async_op=False: types.SimpleNamespace(
        is_completed=lambda: True, wait=lambda *a: True))
    pusher = SGLangServers([busy.url], tp_sizes=[1])
    pusher.group, pusher.flush_interval_s = object(), 0.01
    pusher.load_weight_buckets(pack_buckets([("w", torch.ones(4))]), version=1)
    assert busy.calls == ["/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update",
                          "/flush_cache", "/flush_cache", "/flush_cache"]
    assert pusher.weight_version == 1
    other = SGLangServers([busy.url], push=False)
    other.load_weight_buckets(pack_buckets([("w", torch.ones(4))]), version=1)
    other.resume_memory()
    pusher.resume_memory()
    assert busy.calls.count("/flush_cache") == 3, "only the pusher flushes, once per push"


def test_flush_gives_up_with_a_message(stubs):
    always_busy = stubs(busy=100)
    client = SGLangServers([always_busy.url], tp_sizes=[1])
    client.flush_retries, client.flush_interval_s = 3, 0.01
    with pytest.raises(WeightSyncError, match=r"flush_cache.*3 times.*running or waiting requests"):
        client.update_weights_from_disk("/shared/ckpt", version=2)
    assert always_busy.calls.count("/flush_cache") == 3 and client.weight_version == 0


# -- finding 2: Transformer Engine's grouped experts mark fc2 partition_dim=0 -------------------------------------


def test_expert_fc2_splits_on_columns_whatever_partition_dim_says(monkeypatch):
    """TE 2.20's `GroupedLinear` (megatron-core's TEGroupedLinear with expert-TP or EP > 1) sets `partition_dim=0`
    on every expert weight, fc2 included; megatron splits fc2 (row-parallel) on dim 1. Loading (`shard_for_tp`)
    and exporting (`gather_tp`) follow the layer's role, not the attribute."""
    from megarl.mcore import convert
    from megarl.model_shape import ModelShape

    moe = ModelShape(family="qwen3_moe", num_layers=2, hidden_size=4, num_attention_heads=2, num_kv_heads=2,
                     head_dim=2, ffn_hidden_size=8, vocab_size=16, max_position_embeddings=32, rope_theta=1e4,
                     norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=False, qk_norm=True, num_experts=4,
                     moe_top_k=2, moe_ffn_hidden_size=6, moe_layers=(0, 1))
    rules = convert.rules_for(moe)
    fc2, _, _ = convert._match_expert("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight", rules)
    fc1, _, _ = convert._match_expert("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", rules)
    te_marked = types.SimpleNamespace(tensor_model_parallel=True, partition_dim=0)  # what TE leaves on both
    down = torch.arange(24.0).view(4, 6)  # HF down_proj: [hidden, moe_ffn]
    shards = [convert.shard_for_tp(fc2, down, te_marked, r, 2) for r in range(2)]
    assert [tuple(t.shape) for t in shards] == [(4, 3), (4, 3)] and torch.equal(shards[1], down[:, 3:])

    monkeypatch.setattr(convert.dist, "all_gather", lambda parts, local, group=None: [
        p.copy_(s) for p, s in zip(parts, shards)])
    assert torch.equal(convert.gather_tp(fc2, shards[0], te_marked, None, 2), down)
    gate_up = torch.arange(48.0).view(12, 4)  # fc1 stays on rows: [gate shard ; up shard] per rank
    assert convert.shard_for_tp(fc1, gate_up, te_marked, 1, 2).shape == (6, 4)

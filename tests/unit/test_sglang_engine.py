"""The SGLang adapters against recording fakes of SGLang's API (no GPU, no sglang needed), and SGLang's own
serializer / bucket classes on CPU tensors when `sglang` is importable.

The colocation cycle's order is the point: release (kv cache, weights, cuda graphs) -> train -> resume weights ->
push buckets -> resume cuda graphs and kv cache -> flush cache -> generate. Pushing into released weights, or
generating with a released or stale KV cache, fails on a GPU only, and only sometimes; here it fails every time.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from megarl.config import build_config
from megarl.rollout.base import SamplingParams
from megarl.rollout.sglang_engine import SGLangEngine, SGLangServers, serialize_bucket, sglang_available
from megarl.rollout.weight_sync import WeightSyncError, pack_buckets


def _output(prompt, n_new, finish="length", seed=0):
    ids = [(sum(prompt) + seed + k) % 50 for k in range(n_new)]
    return {"output_ids": ids, "meta_info": {
        "finish_reason": {"type": finish}, "weight_version": "default",
        "output_token_logprobs": [(-0.5 - 0.01 * k, t, None) for k, t in enumerate(ids)],
        "input_token_logprobs": [(None, prompt[0], None)] + [(-1.0 - k, t, None) for k, t in enumerate(prompt[1:])]}}


class RecordingEngine:
    """The slice of `sglang.Engine` megarl calls, recording each call."""

    def __init__(self, log, fail_update=False):
        self.log, self.fail_update = log, fail_update
        self.requests = []

    def generate(self, input_ids, sampling_params, return_logprob=False, logprob_start_len=None):
        self.log.append("generate")
        self.requests.append((input_ids, sampling_params, logprob_start_len))
        sp = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
        return [_output(p, s["max_new_tokens"], seed=s.get("sampling_seed") or 0) for p, s in zip(input_ids, sp)]

    def release_memory_occupation(self, tags=None):
        self.log.append(("release", tuple(tags)))

    def resume_memory_occupation(self, tags=None):
        self.log.append(("resume", tuple(tags)))

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.log.append(("update", load_format, flush_cache, len(named_tensors)))
        return (False, "boom") if self.fail_update else (True, "Success")

    def flush_cache(self):
        self.log.append("flush_cache")


class RecordingSessionEngine(RecordingEngine):
    """SGLang >= 0.5.23: weight updates run inside a session."""

    def begin_weight_update(self, selector="all"):
        self.log.append("begin_weight_update")
        return True, "ok"

    def end_weight_update(self):
        self.log.append("end_weight_update")
        return True, "ok"


class FakeActor:
    """What the cycle needs of `MegatronPolicy`: the streamed export and offload."""

    def __init__(self, log):
        self.log = log
        self.weights = [(f"model.layers.{i}.mlp.down_proj.weight", torch.full((8, 8), float(i))) for i in range(3)]

    def iter_hf(self):
        self.log.append("export")  # a generator, like the real one: nothing runs until the push pulls a tensor
        yield from self.weights

    def offload(self, *, params, optimizer):
        self.log.append(("offload", params, optimizer))

    def onload(self):
        self.log.append("onload")


def _engine(log, sessions=True, **kw):
    fake = (RecordingSessionEngine if sessions else RecordingEngine)(log, **kw)
    return SGLangEngine(fake, tp_size=2, serialize=lambda bucket, tp: [bucket] * tp)


def test_colocation_cycle_order():
    from megarl.mcore.parallel import ParallelInfo
    from megarl.stages.colocation import WeightSync, enter_rollout, enter_training

    log = []
    engine, actor = _engine(log), FakeActor(log)
    cfg = build_config({"offload_optimizer": True, "offload_params": True, "sync_bucket_mb": 1})
    one_rank = ParallelInfo(rank=0, world_size=1, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1)
    sync = WeightSync(actor, engine, cfg.rollout, one_rank)
    params = SamplingParams(n=2, max_new_tokens=3)
    for step in range(2):
        enter_rollout(actor, engine, cfg.training)
        engine.generate([[1, 2, 3]], params)
        enter_training(actor, engine)
        log.append("train")
        metrics = sync(version=step + 1)
        assert metrics["weight_version"] == step + 1 and metrics["sync_bytes"] == 3 * 8 * 8 * 4
    enter_rollout(actor, engine, cfg.training)
    one_step = [("offload", True, True), ("resume", ("cuda_graph", "kv_cache")), "flush_cache", "generate",
                ("release", ("kv_cache", "weights", "cuda_graph")), "onload", "train",
                ("resume", ("weights",)), "begin_weight_update", "export", ("update", "flattened_bucket", False, 2),
                "end_weight_update"]
    first = [("offload", True, True), "flush_cache"] + one_step[3:]  # nothing released before the first rollout
    assert log == first + one_step + [("offload", True, True), ("resume", ("cuda_graph", "kv_cache")), "flush_cache"]
    assert engine.weight_version == 2
    assert engine.generate([[4, 5]], params)[0][0].weight_version == 2


def test_buckets_are_pushed_one_call_each_without_flushing():
    log = []
    engine = _engine(log)
    named = [(f"w{i}", torch.ones(1024)) for i in range(5)]  # 4 KiB each
    engine.load_weight_buckets(pack_buckets(named, 8 << 10), version=3)
    updates = [e for e in log if e[0] == "update"]
    assert len(updates) == 3 and all(u[1:3] == ("flattened_bucket", False) for u in updates)
    assert log[0] == "begin_weight_update" and log[-1] == "end_weight_update" and "flush_cache" not in log


def test_failed_update_raises_and_closes_the_session():
    log = []
    engine = _engine(log, fail_update=True)
    with pytest.raises(WeightSyncError, match="boom"):
        engine.load_weight_buckets(pack_buckets([("w", torch.ones(4))]), version=1)
    assert log[-1] == "end_weight_update" and engine.weight_version == 0


def test_older_sglang_without_sessions():
    log = []
    engine = _engine(log, sessions=False)
    engine.load_weight_buckets(pack_buckets([("w", torch.ones(4))]), version=1)
    assert log == [("update", "flattened_bucket", False, 2)]


def test_not_colocated_releases_nothing():
    log = []
    engine = SGLangEngine(RecordingEngine(log), colocated=False, serialize=lambda b, tp: [b])
    engine.release_memory()
    engine.resume_memory()
    assert log == ["flush_cache"]


def test_generate_groups_seeds_and_maps_outputs():
    log = []
    engine = _engine(log)
    params = SamplingParams(n=3, max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=(7,), seed=10)
    groups = engine.generate([[1, 2], [3, 4, 5]], params)
    ids, sampling, _ = engine.engine.requests[0]
    assert ids == [[1, 2]] * 3 + [[3, 4, 5]] * 3, "each prompt's samples are consecutive"
    assert [s["sampling_seed"] for s in sampling] == list(range(10, 16))
    assert sampling[0] == {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "stop_token_ids": [7],
                           "sampling_seed": 10}
    assert [len(g) for g in groups] == [3, 3]
    c = groups[1][2]
    assert c.token_ids == _output([3, 4, 5], 4, seed=15)["output_ids"]
    assert c.logprobs == pytest.approx([-0.5, -0.51, -0.52, -0.53]) and c.finish_reason == "length"


def test_score_reads_input_logprobs_after_the_prompt():
    log = []
    engine = _engine(log)
    assert engine.score([[9, 8, 7, 6]], [2]) == [[-2.0, -3.0]]
    assert engine.engine.requests[0][2] == 0, "logprob_start_len=0: every input token is scored"


# -- disaggregated: a fake SGLang HTTP server --------------------------------------------------------------------


class _FakeServer:
    def __init__(self):
        self.calls = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                outer.calls.append((self.path, body))
                if self.path == "/generate":
                    sp = body["sampling_params"]
                    sp = sp if isinstance(sp, list) else [sp] * len(body["input_ids"])
                    answer = [_output(p, s["max_new_tokens"], finish="stop", seed=s.get("sampling_seed") or 0)
                              for p, s in zip(body["input_ids"], sp)]
                else:
                    answer = {"success": True, "message": "ok"}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path != "/server_info":
                    self.send_error(404)
                    return
                data = json.dumps({"tp_size": 2, "model_path": "m"}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def servers():
    fakes = [_FakeServer(), _FakeServer()]
    yield fakes
    for f in fakes:
        f.httpd.shutdown()


def test_servers_split_prompts_and_keep_order(servers):
    client = SGLangServers([s.url for s in servers])
    prompts = [[1, 2], [3], [4, 5, 6]]
    groups = client.generate(prompts, SamplingParams(n=2, max_new_tokens=2, seed=0))
    assert [len(g) for g in groups] == [2, 2, 2]
    sent = [body["input_ids"] for s in servers for path, body in s.calls if path == "/generate"]
    assert sent == [[[1, 2]] * 2 + [[3]] * 2, [[4, 5, 6]] * 2], "whole groups, contiguous blocks, in order"
    assert groups[2][1].token_ids == _output([4, 5, 6], 2, seed=5)["output_ids"]
    assert groups[0][0].finish_reason == "stop"


def test_servers_weight_calls(servers):
    client = SGLangServers([s.url for s in servers])
    client.update_weights_from_disk("/shared/ckpt/step5", version=5)
    client.resume_memory()
    assert client.weight_version == 5
    for s in servers:
        assert s.calls == [("/update_weights_from_disk", {"model_path": "/shared/ckpt/step5"}), ("/flush_cache", {})]
    with pytest.raises(WeightSyncError, match="connect"):
        client.load_weight_buckets(pack_buckets([("w", torch.ones(2))]), version=6)
    from megarl.rollout.sglang_engine import server_tp_size

    assert server_tp_size(f"http://{servers[0].url}") == 2, "weight-update group sizes come from /server_info"
    passive = SGLangServers([s.url for s in servers], push=False)
    passive.load_weight_buckets(pack_buckets([("w", torch.ones(2))]), version=6)
    assert passive.weight_version == 6


def test_servers_load_each_adapter_unload_the_last_and_name_it_in_requests(servers):
    """--lora-weight-sync adapter over HTTP: one payload per server TP rank, the tensors by value (a server elsewhere
    cannot open shared memory); the previous version unloaded after the new one loads; every request names it."""
    import base64
    import pickle

    client = SGLangServers([s.url for s in servers], tp_sizes=[2, 1])
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    adapters = {v: {name: torch.randn(4, 6)} for v in (1, 2)}
    for version, tensors in adapters.items():
        client.load_lora_adapter(tensors, config, version=version)
    client.generate([[1, 2], [3]], SamplingParams(max_new_tokens=1))
    client.score([[1, 2, 3]], [1])
    assert client.weight_version == 2 and client.adapter == "megarl-v2"
    for server, tp in zip(servers, (2, 1)):
        calls = [(p, b) for p, b in server.calls]
        assert [p for p, _ in calls[:3]] == ["/load_lora_adapter_from_tensors"] * 2 + ["/unload_lora_adapter"]
        assert calls[2][1] == {"lora_name": "megarl-v1"}
        for (_, body), version in zip(calls[:2], (1, 2)):
            assert body["lora_name"] == f"megarl-v{version}" and body["config_dict"] == config
            assert len(body["serialized_named_tensors"]) == tp
            sent = pickle.loads(base64.b64decode(body["serialized_named_tensors"][-1]))
            assert torch.equal(sent[name], adapters[version][name])
        assert all(b["lora_path"] == "megarl-v2" for p, b in calls if p == "/generate")
    assert sum(p == "/generate" for p, _ in servers[0].calls) == 2, "a generate block and the score"
    passive = SGLangServers([s.url for s in servers], push=False)  # another data-parallel leader: posts nothing
    before = [len(s.calls) for s in servers]
    passive.load_lora_adapter(adapters[2], config, version=2)
    assert [len(s.calls) for s in servers] == before and passive.adapter == "megarl-v2"


# -- SGLang's own classes -----------------------------------------------------------------------------------------

_SGLANG, _WHY = sglang_available()


@pytest.mark.skipif(not _SGLANG, reason=f"{_WHY}; the adapter's contract is tested above with fakes")
def test_sglang_serializer_and_flattened_bucket_round_trip():
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    named = [("a", torch.randn(3, 4)), ("b", torch.randn(5)), ("c", torch.randn(2, 2, dtype=torch.float64)),
             ("d", torch.arange(7, dtype=torch.bfloat16))]
    for bucket in pack_buckets(named, 1 << 20):
        payload = serialize_bucket(bucket)
        assert isinstance(payload, str)
        data = MultiprocessingSerializer.deserialize(payload)
        rebuilt = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
        for (name, got), (want_name, want) in zip(rebuilt.reconstruct_tensors(), bucket.tensors()):
            assert name == want_name and got.dtype == want.dtype and torch.equal(got, want)
        # SGLang's receiver allocates from (names, dtypes, shapes) alone: our offsets must be the ones it computes
        empty = FlattenedTensorBucket.empty([s.name for s in bucket.slots], [s.dtype for s in bucket.slots],
                                            [s.shape for s in bucket.slots], "cpu")
        assert [(m.start_idx, m.end_idx) for m in empty.get_metadata()] == [(s.start, s.end) for s in bucket.slots]


def _sglang_receiver(port, queue, buckets):
    """SGLang's side of the weight-update group, with SGLang's own rendezvous and receive bucket."""
    import torch.distributed as dist
    from sglang.srt.utils import init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1,
                                   group_name="megarl_weights")
    for _ in range(buckets):
        names, dtypes, shapes = queue.get()
        bucket = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
        dist.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
        queue.put([(n, t.clone()) for n, t in bucket.reconstruct_tensors()])


@pytest.mark.distributed
@pytest.mark.skipif(not _SGLANG, reason=f"{_WHY}; the adapter's contract is tested above with fakes")
def test_weight_update_group_joins_sglang_and_broadcasts_a_bucket():
    """Disaggregated push over gloo: our group rendezvous meets SGLang's `init_custom_process_group`, and the
    broadcast flat bucket is what SGLang's receiver rebuilds from (names, dtypes, shapes) alone."""
    import multiprocessing as mp
    import socket

    import torch.distributed as dist

    from megarl.rollout.sglang_engine import init_weights_update_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    named = [("a", torch.randn(3, 4)), ("b", torch.randn(5)), ("c", torch.randn(2, 3).to(torch.bfloat16))]
    buckets = list(pack_buckets(named, 1 << 20))  # fp32 and bf16
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_sglang_receiver, args=(port, queue, len(buckets)))
    child.start()
    try:
        pg = init_weights_update_group("gloo", "127.0.0.1", port, 0, 2, "megarl_weights", timeout_s=60)
        for bucket in buckets:
            queue.put(([s.name for s in bucket.slots], [str(s.dtype).removeprefix("torch.") for s in bucket.slots],
                       [list(s.shape) for s in bucket.slots]))
            dist.broadcast(bucket.flat, src=0, group=pg)
            got = dict(queue.get(timeout=60))
            assert all(torch.equal(got[n], t) for n, t in bucket.tensors())
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()


def test_stop_strings_pass_through_and_need_the_tokenizer():
    from megarl.rollout.sglang_engine import sampling_dict

    params = SamplingParams(max_new_tokens=4, stop_token_ids=(7,), stop=("</tool_call>", "```\n"))
    assert sampling_dict(params)["stop"] == ["</tool_call>", "```\n"]
    assert "stop" not in sampling_dict(SamplingParams(max_new_tokens=4))  # as before when there are none
    engine = _engine([])
    engine.generate([[1, 2]], params)
    assert engine.engine.requests[0][1][0]["stop"] == ["</tool_call>", "```\n"]
    no_tokenizer = SGLangEngine(RecordingSessionEngine([]), tokenizer=False)
    with pytest.raises(ValueError, match="launched without its tokenizer.*tokenizer=True"):
        no_tokenizer.generate([[1, 2]], params)

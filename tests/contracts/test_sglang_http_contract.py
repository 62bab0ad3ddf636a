"""megarl's disaggregated SGLang client (`SGLangServers`) against SGLang 0.5.23's own HTTP contract, on CPU.

megarl talks to a stub server that records the bytes it is sent; every body is then judged by SGLang's own code,
taken from the 0.5.23 wheel (`sglang_upstream` says how):
- `/generate`: by `GenerateRequest.from_json_value`, the generated decoder SGLang's server runs on every body
  (`api_contract.generate_contract_error`; unknown keys in `sampling_params` are refused there);
- control routes: the route must exist in `http_server.py`, and the body must validate against the route's
  own body type (io_struct's Struct, through the pydantic schema FastAPI builds from it);
- both, more strictly than SGLang: every key megarl sends must be a field of the type, because SGLang ignores
  unknown top-level keys, so a misspelt key would be dropped in silence.
The bucket megarl broadcasts for `/update_weights_from_distributed` is received by SGLang's own
`_receive_bucketed_weights_from_distributed` (its `FlattenedTensorBucket.empty` from the body's names, dtypes and
shapes) and must come back as the tensors megarl packed.
--lora-weight-sync adapter: `/load_lora_adapter_from_tensors` and `/unload_lora_adapter` are judged the same way,
`/generate` with its `lora_path`, and the adapter payloads are read back by SGLang's own normaliser and
`deserialize_own_rank` (its `SafeUnpickler`), one per server TP rank.

Not checked here: the NCCL group itself (tests/distributed/test_weights_update_group.py rendezvous over gloo), and
the server's behaviour beyond parsing (tests/unit/test_sglang_contract_fixes.py's stub servers).
"""

from __future__ import annotations

import inspect
import json
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pydantic
import pytest
import sglang_upstream as upstream
import torch

from megarl.mcore import lora
from megarl.rollout import sglang_engine
from megarl.rollout.base import SamplingParams
from megarl.rollout.sglang_engine import SGLangServers
from megarl.rollout.weight_sync import pack_buckets

TP = 2  # the stub server's tensor-parallel size, as /server_info reports it


class _Stub(ThreadingHTTPServer):
    """Answers as an SGLang server would, and records (path, parsed JSON body) of every POST."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.posts: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def _outputs(body: dict) -> list[dict]:
    """One SGLang-shaped output per request of a `/generate` body (checked against GenerateResponse below)."""
    out = []
    for ids, sp in zip(body["input_ids"], body["sampling_params"] if isinstance(body["sampling_params"], list)
                       else [body["sampling_params"]] * len(body["input_ids"])):
        new = list(range(7, 7 + sp.get("max_new_tokens", 128)))  # SGLang's default; the judges check the keys
        meta = {"finish_reason": {"type": "length", "length": len(new)},
                "output_token_logprobs": [[-0.5, t, None] for t in new], "prompt_tokens": len(ids)}
        if body.get("logprob_start_len") == 0:
            meta["input_token_logprobs"] = [[None if i == 0 else -0.25, t, None] for i, t in enumerate(ids)]
        out.append({"text": "", "output_ids": new, "meta_info": meta})
    return out


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self, payload, content_type="application/json"):
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer({"tp_size": TP, "enable_deterministic_inference": True})

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.loads(raw) if raw else None
        with self.server.lock:
            self.server.posts.append((self.path, body))
        if self.path == "/generate":
            self._answer(_outputs(body))
        elif self.path == "/flush_cache":
            self._answer("Cache flushed.\n", "text/plain")
        else:
            self._answer({"success": True, "message": "ok"})


@pytest.fixture(scope="module")
def stub():
    server = _Stub()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


# -- the judges: SGLang's own parsers, plus the unknown-key rule -------------------------------------------------


def check_generate(body) -> None:
    """Raises unless SGLang 0.5.23's /generate gate admits `body` and knows every key megarl sent."""
    api = upstream.api_types()
    api.GenerateRequest.from_json_value(body)  # JsonContractError: the server's 400
    _known(body, api.GenerateRequest, "/generate")


def check_control(path: str, body) -> None:
    """Raises unless `path` is a POST route of SGLang 0.5.23 and `body` validates against its body type."""
    routes = upstream.routes()
    if path not in routes:
        raise LookupError(f"SGLang {upstream.SGLANG_VERSION} has no POST route {path}")
    if routes[path] is None:  # e.g. /flush_cache: query parameters only, the body is not read
        if body not in (None, {}):
            raise ValueError(f"{path} takes no body, and megarl sent {body!r}")
        return
    cls = upstream.body_type(routes[path])
    pydantic.TypeAdapter(cls).validate_python(body)  # ValidationError: FastAPI's 422
    _known(body, cls, path)


def _known(body: dict, cls, where: str) -> None:
    fields = {f.name for f in msgspec.structs.fields(cls)}
    unknown = sorted(set(body) - fields)
    if unknown:
        raise KeyError(f"{where}: SGLang {upstream.SGLANG_VERSION} ignores unknown keys {unknown} of "
                       f"{cls.__name__} (fields: {sorted(fields)})")


def check(path: str, body) -> None:
    (check_generate if path == "/generate" else lambda b: check_control(path, b))(body)


# -- megarl's client, driven through its public methods -----------------------------------------------------------


def _weights():
    g = torch.Generator().manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(11, 6, generator=g)),
            ("model.layers.0.self_attn.q_proj.weight", torch.randn(6, 6, generator=g)),
            ("model.layers.0.input_layernorm.weight", torch.randn(6, generator=g)),
            ("model.layers.0.mlp.gate_up_proj.weight", torch.randn(3, 5, 7, generator=g)),
            ("model.rotary_emb.step", torch.arange(5, dtype=torch.int64))]


@pytest.fixture(scope="module")
def driven(stub):
    """Everything megarl's `SGLangServers` posts in one life: connect, a seeded generate, score, a bucketed weight
    push, a push from disk. The weight-update group is replaced by a recorder of what is broadcast on it (the group
    itself is another test's subject)."""
    update_group = object()
    sent: list[torch.Tensor] = []

    class _Done:
        def is_completed(self):
            return True

        def wait(self):
            return True

    def broadcast(tensor, src=0, group=None, async_op=False):
        assert group is update_group, "megarl broadcast on another group than the weight-update group"
        sent.append(tensor.clone())
        return _Done() if async_op else None

    joined = []  # the trainer's own join: (args, kwargs) of init_weights_update_group
    weights = _weights()
    buckets = list(pack_buckets(weights, bucket_bytes=200, dtype=torch.bfloat16))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sglang_engine, "init_weights_update_group", lambda *a, **k: joined.append((a, k)) or update_group)
        patch.setattr(torch.distributed, "broadcast", broadcast)
        servers = SGLangServers([stub.url])
        servers.connect("127.0.0.1", 29517, backend="nccl")
        params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=3, stop_token_ids=(2,),
                                seed=11, stop=("</tool>",))
        groups = servers.generate([[1, 5, 6], [1, 9]], params)
        scores = servers.score([[1, 5, 6, 7, 8]], [3])
        servers.load_weight_buckets(iter(buckets), version=1)
        servers.update_weights_from_disk("/shared/ckpt/step_1", version=2)
    return types.SimpleNamespace(posts=list(stub.posts), sent=sent, buckets=buckets, weights=weights,
                                 groups=groups, scores=scores, joined=joined)


def test_every_body_megarl_posts_is_admitted_by_sglang(driven):
    paths = [p for p, _ in driven.posts]
    # What the client is expected to have sent, so that a path it stops sending does not pass unnoticed.
    for path in ("/init_weights_update_group", "/generate", "/begin_weight_update",
                 "/update_weights_from_distributed", "/end_weight_update", "/flush_cache", "/update_weights_from_disk"):
        assert path in paths, f"megarl's SGLangServers no longer posts {path} (posted: {paths})"
    for path, body in driven.posts:
        check(path, body)
    # And megarl read back what the stub answered in SGLang's response shape.
    assert [len(g) for g in driven.groups] == [2, 2] and driven.scores == [[-0.25, -0.25]]


def test_stub_answers_are_sglang_shaped(driven):
    """The answers megarl parsed above are valid SGLang 0.5.23 responses (or the test above proves nothing)."""
    api = upstream.api_types()
    for path, body in driven.posts:
        if path == "/generate":
            for out in _outputs(body):
                api.GenerateResponse.from_json_value(out)


def test_weight_update_group_body_offsets_the_server_ranks_after_the_trainer(driven):
    """SGLang computes each rank as rank_offset + tp_rank in a group of world_size, and the trainer is rank 0."""
    body = next(b for p, b in driven.posts if p == "/init_weights_update_group")
    assert (body["rank_offset"], body["world_size"]) == (1, 1 + TP)
    # and the trainer's own side joins the same group: rank 0 of world_size, under the same group name
    (args, kwargs), = driven.joined
    trainer = inspect.signature(sglang_engine.init_weights_update_group).bind(*args, **kwargs).arguments
    assert (trainer["rank"], trainer["world_size"], trainer["group_name"]) == (0, 1 + TP, body["group_name"])
    assert (trainer["master_address"], trainer["master_port"]) == (body["master_address"], body["master_port"])


def test_the_broadcast_bucket_is_what_sglang_receives(driven, monkeypatch):
    """SGLang's receiver allocates `FlattenedTensorBucket.empty(names, dtypes, shapes)` from the body and
    broadcasts into it; megarl's flat bucket must have exactly that size and layout, tensor by tensor."""
    ws = upstream.weight_sync(monkeypatch)
    bodies = [b for p, b in driven.posts if p == "/update_weights_from_distributed"]
    assert len(bodies) == len(driven.sent) == len(driven.buckets) >= 2
    received = {}
    for body, flat in zip(bodies, driven.sent):
        assert body["load_format"] == "flattened_bucket"

        def broadcast(tensor, src=0, group=None, flat=flat, names=body["names"]):  # the server's side of it
            assert tensor.dtype == flat.dtype and tensor.numel() == flat.numel(), (
                f"SGLang allocates {tensor.numel()} bytes for {names}, megarl broadcasts {flat.numel()}")
            tensor.copy_(flat)

        monkeypatch.setattr(torch.distributed, "broadcast", broadcast)
        server = types.SimpleNamespace(device="cpu", _model_update_group={body["group_name"]: "group"})
        received.update(ws.receive_bucket(server, names=body["names"], dtypes=body["dtypes"],
                                          shapes=body["shapes"], group_name=body["group_name"]))
    assert received.keys() == {name for name, _ in driven.weights}
    for name, tensor in driven.weights:
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert received[name].dtype == want.dtype and torch.equal(received[name], want), name


def test_lora_adapter_bodies_are_admitted_and_sglang_reads_the_tensors_back(stub, monkeypatch):
    ws = upstream.weight_sync(monkeypatch)
    start = len(stub.posts)
    g = torch.Generator().manual_seed(3)
    prefix = "base_model.model.model.layers.0.self_attn"
    tensors = {f"{prefix}.q_proj.lora_A.weight": torch.randn(4, 6, generator=g),
               f"{prefix}.v_proj.lora_B.weight": torch.randn(2, 4, generator=g).to(torch.bfloat16)}
    config = lora.peft_config(lora.LoRAOptions(rank=4, alpha=8.0, targets=("q_proj", "v_proj")), base="")
    servers = SGLangServers([stub.url])  # its TP size from /server_info
    for version in (1, 2):
        servers.load_lora_adapter(tensors, config, version=version)
    servers.generate([[1, 5, 6]], SamplingParams(max_new_tokens=2))
    servers.score([[1, 5, 6, 7]], [2])
    posts = stub.posts[start:]
    assert [p for p, _ in posts] == ["/load_lora_adapter_from_tensors"] * 2 + ["/unload_lora_adapter"] + \
        ["/generate"] * 2
    for path, body in posts:
        check(path, body)
    assert posts[2][1] == {"lora_name": "megarl-v1"}
    assert all(body["lora_path"] == "megarl-v2" for path, body in posts if path == "/generate")
    body = posts[1][1]
    payloads = ws.utils.normalize_serialized_named_tensor_payloads(body["serialized_named_tensors"])
    assert body["lora_name"] == "megarl-v2" and len(payloads) == TP
    for rank in range(TP):
        ws.tp_rank = rank
        data = ws.deserialize_own_rank(None, payloads)
        assert data.keys() == tensors.keys()
        assert all(data[n].dtype == t.dtype and torch.equal(data[n], t) for n, t in tensors.items())


@pytest.mark.parametrize("path, mutate, error", [
    ("/generate", lambda b: b.update(return_logprobs=b.pop("return_logprob")), KeyError),
    ("/generate", lambda b: b["sampling_params"][0].update(max_tokens=3), Exception),
    ("/generate", lambda b: b["sampling_params"][0].update(top_k=20.5), Exception),
    ("/init_weights_update_group", lambda b: b.pop("rank_offset"), pydantic.ValidationError),
    ("/init_weights_update_group", lambda b: b.update(master_port="http"), pydantic.ValidationError),
    ("/update_weights_from_distributed", lambda b: b.update(shapes=[[1.5]]), pydantic.ValidationError),
    ("/update_weights_from_distributed", lambda b: b.update(group=b.pop("group_name")), KeyError),
    ("/begin_weight_update", lambda b: b.update(selector="everything"), pydantic.ValidationError),
    ("/update_weights_from_disk", lambda b: b.update(path=b.pop("model_path")), pydantic.ValidationError),
    ("/update_weights_from_tensors", lambda b: None, LookupError),
])
def test_the_judges_refuse_a_wrong_body(driven, path, mutate, error):
    """Each check above fails on a body that SGLang would refuse or misread: megarl's own body, mutated."""
    source = "/update_weights_from_disk" if path == "/update_weights_from_tensors" else path
    body = json.loads(json.dumps(next(b for p, b in driven.posts if p == source)))
    mutate(body)
    with pytest.raises(error):
        check(path, body)

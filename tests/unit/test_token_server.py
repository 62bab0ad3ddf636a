"""The token endpoint (`megarl.rollout.token_server`) over the built-in engine and a tiny model: the answer's
shape as the `renderers` client of verifiers 0.4.0 reads it, its ids and log-probs against the engine's own
`generate` with the same seed, batching, aborts, timeouts and bad bodies."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

from megarl.rollout import SamplingParams
from megarl.rollout.builtin import BuiltinEngine
from megarl.rollout.token_server import GENERATE_PATH, TokenServer
from helpers import make_tiny_hf_model

VOCAB = 96


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", vocab=VOCAB, seed=3)
    e = BuiltinEngine.from_pretrained(path)
    e.weight_version = 7
    return e


def post(url: str, path: str, body, headers: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def get(url: str, path: str) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def body(ids, **sp):
    return {"model": "megarl", "token_ids": ids,
            "sampling_params": {"temperature": 1.0, "max_tokens": 8, "logprobs": 1, "skip_special_tokens": False,
                                **sp}}


def test_answer_has_the_shape_the_renderers_client_reads_and_the_engines_tokens(engine):
    prompt = [5, 9, 13, 2, 40]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=(3,), seed=11)
    [[direct]] = engine.generate([prompt], params)
    with TokenServer(engine, vocab_size=VOCAB, max_tokens_cap=32, max_model_len=64) as server:
        status, out = post(server.url, GENERATE_PATH, body(prompt, stop_token_ids=[3], seed=11),
                           {"X-Session-ID": "s1"})
        assert status == 200, out
        assert set(out) == {"request_id", "model", "prompt_token_ids", "weight_version", "choices"}
        assert out["prompt_token_ids"] == prompt and out["weight_version"] == 7 and out["request_id"]
        [choice] = out["choices"]
        assert choice["token_ids"] == direct.token_ids
        assert choice["finish_reason"] == direct.finish_reason
        content = choice["logprobs"]["content"]
        assert [c["token"] for c in content] == [f"token_id:{t}" for t in direct.token_ids]
        assert [c["logprob"] for c in content] == pytest.approx(direct.logprobs, abs=0)
        status, models = get(server.url, "/v1/models")
        assert status == 200 and models["data"][0]["id"] == "megarl" and models["data"][0]["max_model_len"] == 64


def test_n_samples_are_the_engines_group(engine):
    prompt = [7, 8, 9]
    [group] = engine.generate([prompt], SamplingParams(n=3, max_new_tokens=5, seed=4))
    with TokenServer(engine, vocab_size=VOCAB, max_tokens_cap=32) as server:
        status, out = post(server.url, GENERATE_PATH, body(prompt, n=3, max_tokens=5, seed=4))
    assert status == 200
    assert [c["token_ids"] for c in out["choices"]] == [c.token_ids for c in group]


def test_concurrent_requests_are_batched_into_one_engine_call(engine):
    prompts = [[5, 6, 7], [10, 11], [20, 21, 22, 23]]
    with TokenServer(engine, vocab_size=VOCAB, max_tokens_cap=32, batch_window=1.0) as server:
        results: dict[int, dict] = {}

        def one(i: int) -> None:
            results[i] = post(server.url, GENERATE_PATH, body(prompts[i], seed=5))[1]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.05)  # arrival order = batch order, well within the window
        for t in threads:
            t.join(60)
        assert server.engine_calls == 1 and server.batches == [3]
        # another parameter set is another call
        post(server.url, GENERATE_PATH, body(prompts[0], seed=5, temperature=0.5))
        assert server.engine_calls == 2
    direct = engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=5))
    for i, [c] in enumerate(direct):
        assert results[i]["choices"][0]["token_ids"] == c.token_ids


class SlowEngine:
    """A `RolloutEngine` whose generate blocks until released, recording the prompts it was given."""

    weight_version, dtype, shares_actor_weights = 2, None, False

    def __init__(self):
        self.release, self.calls = threading.Event(), []

    def generate(self, prompts, params):
        self.calls.append([list(p) for p in prompts])
        self.release.wait(30)
        from megarl.rollout import Completion
        return [[Completion([1, 2], [-0.5, -0.25], "length", self.weight_version)] for _ in prompts]


def test_abort_call_answers_abort_and_an_aborted_waiting_request_never_reaches_the_engine():
    slow = SlowEngine()
    with TokenServer(slow, vocab_size=VOCAB, max_tokens_cap=8, batch_window=0) as server:
        out: dict[str, tuple] = {}
        first = threading.Thread(target=lambda: out.__setitem__("a", post(
            server.url, GENERATE_PATH, body([4, 5]), {"X-Request-ID": "a"})))
        first.start()
        for _ in range(200):  # the first is inside the engine
            if slow.calls:
                break
            time.sleep(0.01)
        second = threading.Thread(target=lambda: out.__setitem__("b", post(
            server.url, GENERATE_PATH, body([6, 7], temperature=0.3), {"X-Session-ID": "sess-b"})))
        second.start()
        time.sleep(0.2)
        assert post(server.url, "/inference/v1/abort", {"session_id": "sess-b"}) == (200, {"aborted": 1})
        assert post(server.url, "/inference/v1/abort", {"request_id": "a"}) == (200, {"aborted": 1})
        first.join(10)
        second.join(10)
        slow.release.set()
        for key in "ab":
            status, answer = out[key]
            assert status == 200 and answer["choices"][0]["finish_reason"] == "abort"
            assert answer["choices"][0]["token_ids"] == [] and answer["choices"][0]["logprobs"]["content"] == []
        time.sleep(0.2)
        assert slow.calls == [[[4, 5]]]  # b was aborted while waiting: the engine never saw it


def test_a_client_that_disconnects_aborts_its_request():
    slow = SlowEngine()
    with TokenServer(slow, vocab_size=VOCAB, max_tokens_cap=8, batch_window=0) as server:
        host, port = server.url.removeprefix("http://").split(":")
        data = json.dumps(body([4, 5], max_tokens=2)).encode()
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(f"POST {GENERATE_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"X-Request-ID: gone\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
            for _ in range(200):
                if slow.calls:
                    break
                time.sleep(0.01)
        for _ in range(100):
            if "gone" not in server._live:
                break
            time.sleep(0.02)
        assert "gone" not in server._live  # the handler saw the close and aborted it
        slow.release.set()


def test_timeout_is_a_504():
    slow = SlowEngine()
    with TokenServer(slow, vocab_size=VOCAB, max_tokens_cap=8, batch_window=0, request_timeout=0.3) as server:
        status, out = post(server.url, GENERATE_PATH, body([4, 5], max_tokens=2))
        slow.release.set()
    assert status == 504 and "0.3 s" in out["error"]["message"]


@pytest.mark.parametrize("bad, field", [
    (b"{not json", "not JSON"),
    ([1, 2], "JSON object"),
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": [1, 500]}, "token_ids[1]"),
    ({"token_ids": [1, "a"]}, "token_ids[1]"),
    ({"token_ids": [1], "prompt": "x"}, "'prompt'"),
    ({"token_ids": [1], "model": "gpt-4"}, "gpt-4"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, "max_tokens"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 99}}, "max_tokens"),
    ({"token_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"token_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"token_ids": [1], "sampling_params": {"logprobs": 5}}, "logprobs"),
    ({"token_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"token_ids": [1], "sampling_params": {"repetition_penalty": 1.3}}, "repetition_penalty"),
    ({"token_ids": [1], "sampling_params": {"beam_width": 2}}, "beam_width"),
    ({"token_ids": [1], "sampling_params": {"stop_token_ids": [1000]}}, "stop_token_ids"),
    ({"token_ids": [1], "sampling_params": {"seed": 1.5}}, "seed"),
])
def test_bad_bodies_are_400s_naming_the_field(engine, bad, field):
    with TokenServer(engine, vocab_size=VOCAB, max_tokens_cap=32) as server:
        status, out = post(server.url, GENERATE_PATH, bad)
        assert status == 400 and field in out["error"]["message"], out
        assert server.engine_calls == 0


def test_unknown_paths_are_404s(engine):
    with TokenServer(engine, vocab_size=VOCAB, max_tokens_cap=32) as server:
        assert post(server.url, "/v1/chat/completions", {})[0] == 404
        assert get(server.url, "/nothing")[0] == 404
        status, out = post(server.url, "/inference/v1/abort", {"x": 1})
        assert status == 400 and "request_id" in out["error"]["message"]


def test_the_command_serves_a_checkpoint_and_stops_on_sigterm(engine, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from helpers import env

    path = make_tiny_hf_model(tmp_path / "m", vocab=VOCAB, seed=3)
    proc = subprocess.Popen([sys.executable, "-m", "megarl.cli.serve_tokens", "--hf-checkpoint", str(path),
                             "--port", "0", "--max-tokens", "8"], stdout=subprocess.PIPE, text=True, env=env())
    try:
        line = proc.stdout.readline()
        assert line.startswith("megarl.cli.serve_tokens: listening on http://127.0.0.1:"), line
        url = line.split()[-1].rstrip("/")
        [[direct]] = BuiltinEngine.from_pretrained(path).generate([[3, 4]], SamplingParams(max_new_tokens=4, seed=2))
        status, out = post(url, GENERATE_PATH, body([3, 4], max_tokens=4, seed=2))
        assert status == 200 and out["choices"][0]["token_ids"] == direct.token_ids
        assert post(url, GENERATE_PATH, body([3, 4], max_tokens=9))[0] == 400  # over --max-tokens
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

"""SGLang servers (`--rollout-servers`) that die or hang mid-request (`megarl.rollout.server_health`), against fake
servers in this process (stdlib http.server answering the endpoints megarl calls: /generate, /health,
/server_info): the request goes to another server, or to the same one once it answers /health again, and the
answers are those of servers that never failed (their samples depend on the prompt and the request's seed only,
as seeded SGLang's do); past --engine-max-restarts the error names the server and its last error."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megarl.rollout.base import SamplingParams
from megarl.rollout.server_health import ServerDeadError
from megarl.rollout.sglang_engine import SGLangServers

pytestmark = pytest.mark.faults
PROMPTS = [[1, 2], [3], [4, 5, 6], [7, 7]]
PARAMS = SamplingParams(n=2, max_new_tokens=3, seed=11)


def _output(prompt: list[int], sampling: dict) -> dict:
    seed = sampling.get("sampling_seed") or 0
    ids = [(sum(prompt) + seed + k) % 50 for k in range(sampling["max_new_tokens"])]
    return {"output_ids": ids, "meta_info": {"output_token_logprobs": [[-0.1 * k, t] for k, t in enumerate(ids)],
                                             "finish_reason": {"type": "length"}}}


class FakeSGLang:
    """A fake SGLang server: `crash` (its next /generate drops the connection unanswered, then the server is gone:
    connection refused) and `hang` (its /generate and /health wait until `resume`)."""

    def __init__(self):
        self.generated = 0  # /generate requests answered
        self.crash_next = False
        self.awake = threading.Event()
        self.awake.set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, payload) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path != "/generate":
                    return self._answer({"success": True, "message": "ok"})
                if outer.crash_next:  # the process dies mid-request: the connection closes, nothing answered
                    outer.crash_next = False
                    self.close_connection = True
                    threading.Thread(target=outer.stop, daemon=True).start()
                    return
                outer.awake.wait()
                outer.generated += 1
                self._answer([_output(p, s) for p, s in zip(body["input_ids"], body["sampling_params"])])

            def do_GET(self):
                outer.awake.wait()
                if self.path == "/health":
                    return self._answer({})
                if self.path == "/server_info":
                    return self._answer({"tp_size": 1, "enable_deterministic_inference": True})
                self.send_error(404)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.handle_error = lambda *a: None  # a client that gave up on a hung answer: a broken pipe here
        self.url = f"127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def hang(self) -> None:
        self.awake.clear()

    def resume(self) -> None:
        self.awake.set()


@pytest.fixture
def fakes():
    made = []

    def make(n: int) -> list[FakeSGLang]:
        made.extend(FakeSGLang() for _ in range(n))
        return made[-n:]

    yield make
    for f in made:
        f.resume()
        try:
            f.stop()
        except OSError:
            pass


def _tokens(groups):
    return [[c.token_ids for c in g] for g in groups]


def _expected(make) -> list:
    (healthy,) = make(1)
    return _tokens(SGLangServers([healthy.url]).generate(PROMPTS, PARAMS))


def test_a_server_that_dies_mid_request_is_named_and_its_requests_go_to_the_other(fakes, capfd):
    expected = _expected(fakes)
    a, b = fakes(2)
    client = SGLangServers([a.url, b.url], health_timeout_s=2.0, max_restarts=1)
    a.crash_next = True
    t0 = time.monotonic()
    assert _tokens(client.generate(PROMPTS, PARAMS)) == expected, "no sample lost or changed"
    recovered_s = time.monotonic() - t0
    assert client.restarts == 1 and a.generated == 0 and b.generated == 2
    err = capfd.readouterr().err
    assert f"megarl: SGLang server http://{a.url} is down (" in err and f"its request goes to http://{b.url}" in err
    assert _tokens(client.generate(PROMPTS, PARAMS)) == expected  # the dead one takes no more requests
    assert client.restarts == 1 and b.generated == 4
    with capfd.disabled():
        print(f"SGLang server died mid-request: answered by the other in {recovered_s:.2f} s")


def test_a_hung_server_is_found_by_its_health_probe_and_retried_once_it_answers(fakes, capfd):
    expected = _expected(fakes)
    (a,) = fakes(1)
    client = SGLangServers([a.url], health_timeout_s=1.0, max_restarts=1)
    assert _tokens(client.generate(PROMPTS, PARAMS)) == expected  # (its /server_info is read once, here)
    a.hang()
    threading.Timer(2.5, a.resume).start()  # a pause (SIGSTOP, a network partition) that ends
    t0 = time.monotonic()
    assert _tokens(client.generate(PROMPTS, PARAMS)) == expected
    hang_s = time.monotonic() - t0
    assert client.restarts == 1 and 0 < client.seconds_lost < hang_s and 2.5 <= hang_s < 30, hang_s
    err = capfd.readouterr().err
    assert "no answer to /health within 1 s (--engine-health-timeout)" in err
    assert f"megarl: SGLang server http://{a.url} answers /health again" in err
    with capfd.disabled():
        print(f"SGLang server hung 2.5 s (health timeout 1 s): answered after {hang_s:.1f} s")


def test_past_its_restarts_the_run_stops_naming_the_server_and_its_last_error(fakes):
    a, b = fakes(2)
    client = SGLangServers([a.url, b.url], health_timeout_s=1.0, max_restarts=0)
    client.generate(PROMPTS, PARAMS)
    b.hang()
    t0 = time.monotonic()
    with pytest.raises(ServerDeadError, match=rf"SGLang server http://{b.url} stopped the run after 0 server "
                                              r"failure\(s\) \(--engine-max-restarts 0\); its last error: no answer "
                                              r"to /health within 1 s"):
        client.generate(PROMPTS, PARAMS)
    assert time.monotonic() - t0 < 20

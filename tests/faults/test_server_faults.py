"""Rollout servers (`--rollout-servers`, SGLang's and vLLM's) that die or hang mid-request
(`megarl.rollout.server_health`), against fake servers in this process (`fake_servers.py`): the request goes to
another server, or to the same one once it answers /health again, and the answers are those of servers that never
failed (their samples depend on the prompt and the request's seed only, as seeded servers' do); past
--engine-max-restarts the error names the server and its last error. Each test runs against both kinds."""

from __future__ import annotations

import threading
import time

import pytest
from fake_servers import FakeSGLang, FakeVLLM

from megarl.rollout.base import SamplingParams
from megarl.rollout.server_health import ServerDeadError
from megarl.rollout.sglang_engine import SGLangServers
from megarl.rollout.vllm_servers import VLLMServers

pytestmark = pytest.mark.faults
PROMPTS = [[1, 2], [3], [4, 5, 6], [7, 7]]
PARAMS = SamplingParams(n=2, max_new_tokens=3, seed=11)
SAMPLES = len(PROMPTS) * PARAMS.n
KINDS = {"SGLang": (FakeSGLang, SGLangServers), "vLLM": (FakeVLLM, VLLMServers)}


@pytest.fixture(params=list(KINDS))
def kind(request) -> str:
    return request.param


@pytest.fixture
def fakes(kind):
    made = []

    def make(n: int) -> list:
        made.extend(KINDS[kind][0]() for _ in range(n))
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


def _client(kind: str, fakes: list, **health):
    return KINDS[kind][1]([f.url for f in fakes], **health)


def _expected(make, kind) -> list:
    return _tokens(_client(kind, make(1)).generate(PROMPTS, PARAMS))


def test_a_server_that_dies_mid_request_is_named_and_its_requests_go_to_the_other(kind, fakes, capfd):
    expected = _expected(fakes, kind)
    a, b = fakes(2)
    client = _client(kind, [a, b], health_timeout_s=2.0, max_restarts=1)
    a.crash_next = True
    t0 = time.monotonic()
    assert _tokens(client.generate(PROMPTS, PARAMS)) == expected, "no sample lost or changed"
    recovered_s = time.monotonic() - t0
    # each sample answered once: by the dead server before it died (vLLM: a request per sample, several in flight
    # on it when the first one's connection dropped), else by the other
    assert client.restarts == 1 and a.generated + b.generated == SAMPLES and b.generated >= SAMPLES // 2
    answered_by_b = b.generated
    err = capfd.readouterr().err
    assert f"megarl: {kind} server http://{a.url} is down (" in err and f"its request goes to http://{b.url}" in err
    assert _tokens(client.generate(PROMPTS, PARAMS)) == expected  # the dead one takes no more requests
    assert client.restarts == 1 and b.generated == answered_by_b + SAMPLES
    with capfd.disabled():
        print(f"{kind} server died mid-request: answered by the other in {recovered_s:.2f} s")


def test_a_hung_server_is_found_by_its_health_probe_and_retried_once_it_answers(kind, fakes, capfd):
    expected = _expected(fakes, kind)
    (a,) = fakes(1)
    client = _client(kind, [a], health_timeout_s=1.0, max_restarts=1)
    assert _tokens(client.generate(PROMPTS, PARAMS)) == expected  # (its /server_info is read once, here)
    a.hang()
    threading.Timer(2.5, a.resume).start()  # a pause (SIGSTOP, a network partition) that ends
    t0 = time.monotonic()
    assert _tokens(client.generate(PROMPTS, PARAMS)) == expected
    hang_s = time.monotonic() - t0
    assert client.restarts == 1 and 0 < client.seconds_lost < hang_s and 2.5 <= hang_s < 30, hang_s
    err = capfd.readouterr().err
    assert "no answer to /health within 1 s (--engine-health-timeout)" in err
    assert f"megarl: {kind} server http://{a.url} answers /health again" in err
    with capfd.disabled():
        print(f"{kind} server hung 2.5 s (health timeout 1 s): answered after {hang_s:.1f} s, "
              f"engine_seconds_lost {client.seconds_lost:.1f}")


def test_past_its_restarts_the_run_stops_naming_the_server_and_its_last_error(kind, fakes):
    a, b = fakes(2)
    client = _client(kind, [a, b], health_timeout_s=1.0, max_restarts=0)
    client.generate(PROMPTS, PARAMS)
    b.hang()
    t0 = time.monotonic()
    with pytest.raises(ServerDeadError, match=rf"{kind} server http://{b.url} stopped the run after 0 server "
                                              r"failure\(s\) \(--engine-max-restarts 0\); its last error: no answer "
                                              r"to /health within 1 s"):
        client.generate(PROMPTS, PARAMS)
    assert time.monotonic() - t0 < 20

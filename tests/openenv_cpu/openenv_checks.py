"""Checks run inside the OpenEnv environment (`test_openenv_cpu.py` runs this file with that environment's pytest):
megarl's sessions against openenv-core's own client and server, per-trajectory isolation, `tool_use` with an
environment token by token, and the errors for a class that cannot be imported or a server that cannot be reached.

The environment is `openenv_guess_env.GuessEnv`; its server is OpenEnv's `create_app` under uvicorn on 127.0.0.1,
started here (not through megarl)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from openenv.core.generic_client import GenericEnvClient
from openenv_guess_env import GuessEnv

from megarl.data import PromptRecord
from megarl.errors import ConfigError
from megarl.reward import InProcessReward
from megarl.rollout import Completion, SamplingParams
from megarl.rollout.slots import ToolUseOptions
from megarl.rollout.tool_use import ToolUse
from megarl.samples import SampleStatus
from megarl.tasks.arithmetic import TOKENIZER_CHARS, build_tokenizer
from megarl.tool_calls.openenv import EnvSessions, Step, load_environment

SERVE = """
import sys, uvicorn
from openenv.core.env_server import create_app
from openenv_guess_env import GuessAction, GuessEnv, GuessObservation
app = create_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=int(sys.argv[2]))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(max_sessions: int):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(port), str(max_sessions)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError("the OpenEnv test server did not start") from None
            time.sleep(0.2)


@pytest.fixture(scope="module")
def server():
    proc, url = serve(max_sessions=16)
    yield url
    proc.terminate()
    proc.wait(timeout=20)


def sessions(kind: str, url: str, count: int) -> EnvSessions:
    return EnvSessions(GuessEnv if kind == "in_process" else None, "" if kind == "in_process" else url, 20.0, count)


# (action fields, whether the environment accepts it): a refused action and an environment error leave the episode
ACTIONS = [({"guess": 10}, True), ({"guess": "ten"}, False), ({"guess": 50}, True), ({"guess": -3}, False),
           ({"guess": 42}, True)]


@pytest.mark.parametrize("kind", ["in_process", "websocket"])
def test_reset_and_steps_equal_the_package_client(server, kind):
    """The reference: OpenEnv's own GenericEnvClient against OpenEnv's own server."""
    reference = GenericEnvClient(base_url=server, connect_timeout_s=20, message_timeout_s=20).sync()
    with reference:
        first = reference.reset(target=42, max_tries=5)
        want = [(first.observation, first.reward, first.done)]
        for action, accepted in ACTIONS:
            if accepted:
                r = reference.step(action)
                want.append((r.observation, r.reward, r.done))
            else:
                with pytest.raises(RuntimeError):
                    reference.step(action)
                want.append(None)
    with sessions(kind, server, 1) as s:
        got = [s.reset([{"target": 42, "max_tries": 5}])[0]]
        for action, _ in ACTIONS:
            got.extend(s.step([(0, action)]))
    assert want[0] == ({"hint": "guess 0"}, None, False)
    assert want[-1] == ({"hint": "correct 3"}, 1.0, True)
    for w, g in zip(want, got):
        assert isinstance(g, Step)
        if w is None:
            assert g.error and g.text.startswith("error: ")
        else:
            assert (g.observation, g.reward, g.done, g.error) == (*w, "")
    assert [g.text for g in got if not g.error] == ["guess 0", "higher 1", "lower 2", "correct 3"]


@pytest.mark.parametrize("kind", ["in_process", "websocket"])
def test_each_trajectory_has_its_own_environment(server, kind):
    """Six sessions with their own targets, stepped together and unevenly: each counts only its own guesses and
    answers for its own target; a new call's sessions start afresh."""
    targets = [3, 30, 300, 3, 30, 300]
    with sessions(kind, server, 6) as s:
        s.reset([{"target": t, "max_tries": 9} for t in targets])
        for rnd in range(3):
            live = [i for i in range(6) if i % 3 >= rnd]  # session i takes i % 3 + 1 steps
            steps = s.step([(i, {"guess": 30}) for i in live])
            for i, step in zip(live, steps):
                want = {3: "lower", 30: "correct", 300: "higher"}[targets[i]]
                assert step.text == f"{want} {rnd + 1}", (i, rnd)
    with sessions(kind, server, 2) as s:
        s.reset([{"target": 7}, {"target": 7}])
        assert [x.text for x in s.step([(0, {"guess": 1}), (1, {"guess": 7})])] == ["higher 1", "correct 1"]


def test_a_full_server_refuses_with_its_url(server):
    proc, url = serve(max_sessions=2)
    try:
        with pytest.raises(RuntimeError, match=f"--openenv-url {url}: reset failed .*session limit"):
            with sessions("websocket", url, 3) as s:
                s.reset([{}] * 3)
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_unimportable_classes_and_unreachable_servers_say_what_and_where():
    with pytest.raises(ConfigError, match="--openenv 'no_such_module_xyz:Env': cannot import 'no_such_module_xyz'"):
        load_environment("no_such_module_xyz:Env")
    with pytest.raises(ConfigError, match="has no attribute 'Missing'"):
        load_environment("openenv_guess_env:Missing")
    with pytest.raises(ConfigError, match="NotAnEnvironment is not a subclass of openenv's Environment"):
        load_environment("openenv_guess_env:NotAnEnvironment")
    with pytest.raises(ConfigError, match="no_such_module_xyz"):
        ToolUse(ToolUseOptions(tool_parser="hermes", openenv="no_such_module_xyz:Env"), None, tools={})
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ConfigError, match=f"--openenv-url {url}: the OpenEnv server is unreachable within "
                                          r"--openenv-timeout 1.5 s"):
        ToolUse(ToolUseOptions(tool_parser="hermes", openenv_url=url, openenv_timeout=1.5), None, tools={})
    with pytest.raises(ConnectionError, match=f"--openenv-url {url}: the OpenEnv server is unreachable within "
                                              r"--openenv-timeout 1.5 s"):
        with EnvSessions(None, url, 1.5, 2) as s:
            s.reset([{}, {}])


# --- tool_use with an environment, token by token --------------------------------------------------------------

EOS = 0


def call(guess) -> str:
    return f'<tool_call>{{"name": "env", "arguments": {{"guess": {guess}}}}}</tool_call>'


class ScriptedEngine:
    """Sample j of the prompt guesses `GUESSES[j][k]` in its turn k (k = tool outputs seen so far); a follow-up
    prompt (prompt + response so far) is known by its first guess. Every completion's ids are recorded."""

    weight_version = 2
    GUESSES = [[5, 42], [99, 7, 1], [42]]  # target 42: right at the 2nd guess; three wrong (max_tries); right at once
    FIRST = {5: 0, 99: 1, 42: 2}

    def __init__(self, tok):
        self.tok, self.sampled = tok, []  # sampled: (sample, ids) in the order produced

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text, group = self.tok.decode(p), []
            for j in range(params.n):
                if '"guess": ' in text:
                    j = self.FIRST[int(text.split('"guess": ', 1)[1].split("}", 1)[0])]
                ids = self.tok.encode(call(self.GUESSES[j][text.count("<tool_response>")]), add_special_tokens=False)
                group.append(Completion(ids, [-0.01 * (i + 1) for i in range(len(ids))], "stop", self.weight_version))
                self.sampled.append((j, ids))
            out.append(group)
        return out


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(chars=TOKENIZER_CHARS + "`<>_[]{}\"'#")


def rows(tok):
    return [PromptRecord(0, "guess#", tok.encode("guess#", add_special_tokens=False), {"target": 42},
                         "env_reward")]


@pytest.mark.parametrize("kind", ["in_process", "websocket"])
def test_tool_use_keeps_the_engine_tokens_and_the_environment_reward(server, tok, kind):
    opts = ToolUseOptions(tool_parser="hermes", tool_response_format="text", max_turns=4, max_tool_calls=4,
                          max_tool_output_tokens=32, **({"openenv": "openenv_guess_env:GuessEnv"}
                                                        if kind == "in_process" else {"openenv_url": server}))
    rollout = ToolUse(opts, None, tools={})
    engine = ScriptedEngine(tok)
    params = SamplingParams(max_new_tokens=400, temperature=1.0, n=3)
    samples = rollout(engine, rows(tok), params, InProcessReward(), tok)
    wrap = rollout.parser.wrap
    hints = [["higher 1", "correct 2"], ["lower 1", "higher 2", "higher 3"], ["correct 1"]]
    by_turn: dict[int, list] = {}  # sample -> its turns' sampled ids
    for j, ids in engine.sampled:
        by_turn.setdefault(j, []).append(ids)
    assert [j for j, _ in engine.sampled] == [0, 1, 2, 0, 1, 1]  # the live trajectories of each engine call
    for j, s in enumerate(samples):
        assert len(by_turn[j]) == len(hints[j])
        ids, mask, logp = [], [], []
        for k, hint in enumerate(hints[j]):
            turn = by_turn[j][k]
            ids += turn
            mask += [1] * len(turn)
            logp += [-0.01 * (i + 1) for i in range(len(turn))]
            out = tok.encode(wrap(hint), add_special_tokens=False)
            ids += out
            mask += [0] * len(out)
            logp += [0.0] * len(out)
        assert s.response_ids == ids and s.loss_mask == mask and s.rollout_logprobs == logp, j
        assert s.status == SampleStatus.COMPLETED
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0]
    assert [s.outcome for s in samples] == ["correct", "incorrect", "correct"]
    assert [(s.metadata["env_reward"], s.metadata["env_steps"], s.metadata["env_done"]) for s in samples] == [
        (1.0, 2.0, 1.0), (0.0, 3.0, 1.0), (1.0, 1.0, 1.0)]

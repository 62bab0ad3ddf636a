"""megarl's OpenEnv integration against openenv-core 0.3.0, in the environment tools/openenv/build_env.sh builds
(built once, when absent, by `openenv_cpu_env.ensure_env_python`).

- `openenv_checks.py`, run with that environment's pytest: sessions in-process and over the WebSocket against the
  package's own client and server, per-trajectory isolation, `tool_use` token by token, the errors.
- A 2-step training run (torchrun, 2 ranks, the tiny test starter, the built-in engine) with the environment served
  on loopback by `python -m megarl.tool_calls.openenv`: every sample's policy tokens are the engine's sampled
  tokens, its tool tokens the environment's observations, and its reward the environment's, replayed through
  OpenEnv's own client."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest
from helpers import build_test_starter, free_port
from openenv_cpu_env import HERE, REPO, env_vars

CHECK_TIMEOUT_S = 900


@pytest.mark.slow
def test_checks_in_the_openenv_environment(openenv_python):
    proc = subprocess.run([str(openenv_python), "-m", "pytest", str(HERE / "openenv_checks.py"), "-q", "--noconftest",
                           "-p", "no:cacheprovider", "-o", "addopts=", "--timeout", "300"],
                          cwd=REPO, env=env_vars(), capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-3000:]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the OpenEnv server at {url} did not start ({proc.poll()})") from None
            time.sleep(0.3)


REPLAY = """
import json, sys
from openenv.core.generic_client import GenericEnvClient
out = []
for label, guesses in json.load(open(sys.argv[2])):
    with GenericEnvClient(base_url=sys.argv[1], connect_timeout_s=20, message_timeout_s=20).sync() as env:
        env.reset(**label)
        steps = [env.step({"guess": g}) for g in guesses]
    out.append([[s.observation["hint"], s.reward, s.done] for s in steps])
print(json.dumps(out))
"""


def spans(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    out: list[tuple[int, list[int]]] = []
    for t, m in zip(ids, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_two_training_steps_with_an_environment_on_loopback(openenv_python, tmp_path):
    import re

    from transformers import AutoTokenizer

    starter = build_test_starter()
    data = tmp_path / "guess.jsonl"
    problems = [(a, b) for a in range(11, 19) for b in (3, 25)]
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": {"target": a + b, "max_tries": 2},
                                        "verifier": "env_reward"}) + "\n" for a, b in problems))
    url, record = f"http://127.0.0.1:{free_port()}", tmp_path / "record"
    server = subprocess.Popen([str(openenv_python), "-m", "megarl.tool_calls.openenv", "openenv_guess_env:GuessEnv",
                               "--port", url.rsplit(":", 1)[1], "--max-sessions", "32"], cwd=REPO, env=env_vars())
    try:
        wait_healthy(url, server)
        out = tmp_path / "run"
        cmd = [str(openenv_python), "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               "PORT", "megarl/train.py", "recipes/tiny_cpu.sh", "--hf-checkpoint", str(starter),
               "--prompt-data", str(data), "--eval-data", "", "--max-train-minutes", "0", "--num-steps", "2",
               "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--micro-batch-size", "16",
               "--max-response-len", "24", "--plugins", "tests/openenv_cpu/openenv_record_plugin.py",
               "--rollout-function", "recorded_tool_use", "--tool-parser", "guess", "--tool-response-format", "text",
               "--max-turns", "3", "--max-tool-calls", "3", "--openenv-url", url, "--output-dir", str(out),
               "--log-interval", "1"]
        for _ in range(3):  # a free port can be taken by another job before torchrun binds it: try another
            port = str(free_port())
            proc = subprocess.run([port if a == "PORT" else a for a in cmd], cwd=REPO,
                                  env={**env_vars(), "MEGARL_OPENENV_RECORD": str(record)},
                                  capture_output=True, text=True, timeout=500)
            if not (proc.returncode and f"port: {port}" in proc.stderr and "EADDRINUSE" in proc.stderr):
                break
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]

        tok = AutoTokenizer.from_pretrained(starter)
        episodes, checks = [], []  # (label, guesses) to replay; (sample, its tool spans) to compare with the replay
        for rank in (0, 1):
            calls = [json.loads(line) for line in open(f"{record}.rank{rank}")]
            assert len(calls) == 2  # one rollout call per step
            for c in calls:
                samples = c["samples"]
                assert len(samples) == len(c["labels"]) * c["n"] == 8
                turns = [[ids for m, ids in spans(s["response_ids"], s["loss_mask"]) if m == 1] for s in samples]
                # engine call k returned the k-th turn of every trajectory still live, in order
                queue = [[i for i, t in enumerate(turns) if len(t) > k] for k in range(len(c["sampled"]))]
                for k, group in enumerate(c["sampled"]):
                    got = [ids for grp in group for ids in grp]  # n per prompt at first, then one each
                    assert len(got) == len(queue[k])
                    for i, sampled in zip(queue[k], got):
                        mine = turns[i][k]
                        last = k == len(turns[i]) - 1
                        assert mine == sampled or (last and sampled[: len(mine)] == mine), (rank, i, k)
                for s, t in zip(samples, turns):
                    steps = int(s["metadata"]["env_steps"])
                    guesses = [int(re.match(r"\s*(\d+)", tok.decode(ids, skip_special_tokens=False)).group(1))
                               for ids in t[:steps]]
                    episodes.append((c["labels"][s["group"]], guesses))
                    checks.append((s, [ids for m, ids in spans(s["response_ids"], s["loss_mask"]) if m == 0]))
        # not vacuous: the environment was stepped, some guesses were right, some trajectories took a second turn
        assert sum(len(g) for _, g in episodes) > 0 and any(s["reward"] > 0 for s, _ in checks)
        assert any(sum(m for m, _ in spans(s["response_ids"], s["loss_mask"])) > 1 for s, _ in checks)
        (tmp_path / "episodes.json").write_text(json.dumps(episodes))
        replay = subprocess.run([str(openenv_python), "-c", REPLAY, url, str(tmp_path / "episodes.json")], cwd=REPO,
                                env=env_vars(), capture_output=True, text=True, timeout=300)
        assert replay.returncode == 0, replay.stderr[-3000:]
        for (s, tool_spans), steps in zip(checks, json.loads(replay.stdout)):
            want = sum(r or 0.0 for _, r, _ in steps)
            assert s["reward"] == s["metadata"]["env_reward"] == want
            assert s["metadata"]["env_done"] == float(any(d for _, _, d in steps))
            assert len(tool_spans) == len(steps)
            for ids, (hint, _, _) in zip(tool_spans, steps):
                full = tok.encode(f" {hint} ", add_special_tokens=False)
                assert ids == full or (ids is tool_spans[-1] and s["status"] == "truncated" and full[: len(ids)] == ids)
    finally:
        server.terminate()
        server.wait(timeout=30)

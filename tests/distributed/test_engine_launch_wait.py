"""The ranks without an engine wait for the leaders launching one before the actor: on store keys, under a limit
of their own (--engine-launch-timeout-seconds), not in a collective under --distributed-timeout-seconds. A slow
leader is waited for, a failed one stops its peers at once with its error, a stuck one is named at the limit; and
whatever the engine wrote into the environment is gone (engine_launch_worker.py)."""

from __future__ import annotations

import re

import pytest
from helpers import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _seconds(out: str, pattern: str) -> int:
    """The seconds in the line of `out` that matches `pattern` (its `(\\d+)` group)."""
    found = re.search(pattern, out)
    assert found, f"no line matches {pattern!r}:\n{out}"
    return int(found.group(1))


def test_peers_wait_for_a_slow_leader_and_stop_on_a_failed_or_stuck_one():
    out = torchrun(2, "tests/distributed/engine_launch_worker.py", timeout=180).stdout
    # 5 s of launch against a 3 s collective timeout: both go on, and SGLang's NCCL settings did not stay
    same = r"after (\d+) s, environment identical across ranks: True"
    assert _seconds(out, f"rank 0 slow: an engine {same}") >= 5
    assert _seconds(out, f"rank 1 slow: no engine {same}") >= 5
    # the leader's own error, on the leader and at once on its peer
    assert "rank 0 fails: after 1 s: RuntimeError: not enough memory for the KV cache" in out, out
    assert _seconds(out, r"rank 1 fails: after (\d+) s: EngineLaunchError: rank 1: the standin engine on rank 0 "
                         r"\(the model-parallel leader of DP rank 0\) failed to launch: RuntimeError: not enough "
                         "memory for the KV cache") < 10
    # the launch timeout, with the leader named and how long it has been launching
    assert _seconds(out, r"rank 1 stuck: after (\d+) s: EngineLaunchError: rank 1: the standin engine did not "
                         r"finish launching within 1 s \(--engine-launch-timeout-seconds\): rank 0 \(the leader of "
                         "DP rank 0\\) has been launching for \\d+ s") < 4
    assert "rank 0 stuck: an engine after 4 s" in out, out

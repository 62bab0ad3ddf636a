"""A dead container must not poison the rows after it (one worker, `--sandbox docker`).

A container can die under a row (its engine kills it, its harness breaks). The pool notices, starts a fresh
container, and reruns the rows that were queued behind it; a row that kills a second container gets a memory-limit
failure (the container's memory cgroup is the only limit that kills one). Before the fix the rows after it ended as
`sandbox_error` failures (queued into the dead container) or the whole batch raised (`docker update` on the dead
container exited 1), which the reward pool scores as `parse_error`: correct samples scored 0.

A program that fills memfds far beyond its row's `memory_mb` used to be one way to kill its container, some of the
time: the OOM killer took the spawner (whose score tied with the program's, the memfds being in no process's RSS)
or the program. The spawner now keeps a lower score than its programs, so the program is the one killed, every
time, and its verdict says out of memory (the container's own cgroup counts the kill). The dead-container test
kills the container from outside instead, while its first row runs.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

import redteam_cases as rc
from megarl.sandbox.docker import DEFAULT_IMAGE
from megarl.verifiers import VERIFIERS

IMAGE = os.environ.get("MEGARL_SANDBOX_IMAGE", DEFAULT_IMAGE)
ADD = {"test": "def check(candidate):\n    assert candidate(2, 3) == 5\n", "entry_point": "add"}
GOOD = "def add(a, b):\n    return a + b\n"
SLOW = "import time\n\n\ndef add(a, b):\n    time.sleep(2.0)\n    return a + b\n"  # the row its container dies under
BOMB = (rc.MEMORY_ATTACKS["memfds"], rc.MEMORY_GOLD)  # ~1 GB of memfds under a row limit of 128 MB


def test_a_memory_bomb_kills_its_program_not_its_container():
    verifier = VERIFIERS.build("code", backend="docker", image=IMAGE, workers=1, memory_mb=rc.MEMORY_LIMIT_MB,
                               time_s=3.0)
    sb = verifier.sandbox
    before = sb.started  # the verifiers' pools are shared per process (and restart after close)
    try:
        results = verifier.verify_many([BOMB, (GOOD, ADD), (GOOD, ADD), BOMB, (GOOD, ADD)])
        assert [r.outcome for r in results] == ["incorrect", "correct", "correct", "incorrect", "correct"], \
            [(r.outcome, r.normalized) for r in results]
        for bomb in (results[0], results[3]):
            assert bomb.score == 0.0 and "out of memory" in bomb.normalized, bomb.normalized
        # the runner and harness pools' first containers, and no other: the programs died, not their container
        assert sb.started - before == 2, sb.started - before
    finally:
        sb.close()
    assert sb.containers() == [], "the pool left containers behind"


@pytest.mark.parametrize("memory_mb", [256, rc.MEMORY_LIMIT_MB],
                         ids=["other-memory-docker-update", "same-memory-queued-behind"])
def test_a_dead_container_does_not_poison_the_rows_after_it(memory_mb):
    """256: the rows after the first need `docker update` on the dead container (the first row asks for 128 MB);
    128: they were already queued in its stdin behind the first row."""
    verifier = VERIFIERS.build("code", backend="docker", image=IMAGE, workers=1, memory_mb=memory_mb, time_s=3.0)
    sb = verifier.sandbox
    try:
        assert verifier.verify(GOOD, ADD).outcome == "correct"  # both pools' containers are up
        up, before = sb.containers(), sb.started
        assert up, "no container to kill"
        killed = []

        def kill_soon():
            time.sleep(0.5)  # the first row sleeps 2 s in its program (load may delay it: dead before it is
            # sent is a dead container too)
            killed.extend(subprocess.run([sb.docker, "kill", *up], capture_output=True, text=True,
                                         timeout=60).stdout.split())

        killer = threading.Thread(target=kill_soon)
        killer.start()
        slow = {**ADD, "memory_mb": rc.MEMORY_LIMIT_MB}
        results = verifier.verify_many([(SLOW, slow), (GOOD, ADD), (GOOD, ADD), (GOOD, ADD)])
        killer.join()
        assert killed, "the container was not killed: the test did not test what it is for"
        assert [r.outcome for r in results] == ["correct"] * 4, [(r.outcome, r.normalized) for r in results]
        assert 1 <= sb.started - before <= 2, sb.started - before  # the harness container, and the runner's if used
        assert verifier.verify(GOOD, ADD).outcome == "correct"
    finally:
        sb.close()
    assert sb.containers() == [], "the pool left containers behind"


def test_a_hung_case_does_not_time_out_the_rows_queued_behind_it():
    """A case past its wall-clock limit leaves its container's harness stuck in it: the rows already queued in
    that container's stdin never run there, and go to the fresh one."""
    verifier = VERIFIERS.build("code", backend="docker", image=IMAGE, workers=1, time_s=1.0)
    hang = {**ADD, "test": "def check(candidate):\n    while True:\n        pass\n", "time_s": 0.5}
    try:
        results = verifier.verify_many([(GOOD, hang), (GOOD, ADD), (GOOD, ADD)])
        assert [r.outcome for r in results] == ["timeout", "correct", "correct"], [r.normalized for r in results]
    finally:
        verifier.sandbox.close()

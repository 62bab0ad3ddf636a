"""A dead container must not poison the rows after it (one worker, `--sandbox docker`).

A program that fills memfds far beyond its row's `memory_mb` gets its container killed (its memory cgroup's OOM
killer takes the harness or its spawner). The pool notices, starts a fresh container, reruns the rows that were
queued behind it, and gives the offending row a memory-limit failure. Before the fix the rows after it ended as
`sandbox_error` failures (queued into the dead container) or the whole batch raised (`docker update` on the dead
container exited 1), which the reward pool scores as `parse_error`: correct samples scored 0.
"""

from __future__ import annotations

import os

import pytest

import redteam_cases as rc
from megarl.sandbox.docker import DEFAULT_IMAGE
from megarl.verifiers import VERIFIERS

IMAGE = os.environ.get("MEGARL_SANDBOX_IMAGE", DEFAULT_IMAGE)
ADD = {"test": "def check(candidate):\n    assert candidate(2, 3) == 5\n", "entry_point": "add"}
GOOD = "def add(a, b):\n    return a + b\n"
BOMB = (rc.MEMORY_ATTACKS["memfds"], rc.MEMORY_GOLD)  # ~1 GB of memfds under a row limit of 128 MB


@pytest.mark.parametrize("memory_mb", [256, rc.MEMORY_LIMIT_MB],
                         ids=["other-memory-docker-update", "same-memory-queued-behind"])
def test_a_dead_container_does_not_poison_the_rows_after_it(memory_mb):
    """256: the good rows need `docker update` on the container the bomb killed; 128: they were already queued
    in its stdin behind the bomb."""
    verifier = VERIFIERS.build("code", backend="docker", image=IMAGE, workers=1, memory_mb=memory_mb, time_s=3.0)
    sb = verifier.sandbox
    before = sb.started  # the verifiers' pools are shared per process (and restart after close)
    try:
        results = verifier.verify_many([BOMB, (GOOD, ADD), (GOOD, ADD), BOMB, (GOOD, ADD)])
        assert [r.outcome for r in results] == ["incorrect", "correct", "correct", "incorrect", "correct"], \
            [(r.outcome, r.normalized) for r in results]
        for bomb in (results[0], results[3]):  # its container killed (or, where the OOM killer took only the
            # program, the program: the harness sees a SIGKILL, as there is no per-case cgroup to ask in a container)
            assert bomb.score == 0.0, bomb.normalized
            assert "memory_limit" in bomb.normalized or "killed by signal 9" in bomb.normalized, bomb.normalized
        started = sb.started - before - 2  # less the runner and harness pools' first containers
        assert started > 0, "no container died: the test did not test what it is for"
        assert started <= 2 * 2, started  # bounded: each bomb kills its container and, rerun once, a fresh one
        # One row at a time (`verify`, the pool's `run`) too.
        assert verifier.verify(*BOMB).outcome == "incorrect"
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

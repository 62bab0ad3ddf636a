"""Disaggregated sync with several data-parallel leaders: one pushes, and no leader may generate before the
servers hold the new weights (`LeaderBarrier`). Two DP leaders under torchrun over gloo share a stub server that
is slow to confirm the push."""

from __future__ import annotations

import pytest
from helpers import free_port, torchrun

pytestmark = [pytest.mark.distributed]


def test_no_leader_generates_before_the_push_is_over():
    proc = torchrun(2, "tests/distributed/leader_barrier_worker.py", "--port", free_port(), timeout=150)
    out = proc.stdout
    # without the barrier rank 1 returns at once and the stub, still confirming rank 0's push, serves v0
    assert "rank 1: sync 1 returned, the server generated with weights v1" in out, out
    assert "rank 0: sync 1 returned, the server generated with weights v1" in out, out
    assert ("rank 1: weight sync 99: the data-parallel leader(s) of DP rank [0] did not finish it within 1 s "
            "(--distributed-timeout-seconds)") in out, out
    assert "rank 0 sync 2: SGLangServers: call connect() before pushing" in out, out
    assert ("rank 1 sync 2: weight sync 2 failed on another data-parallel leader: WeightSyncError: SGLangServers: "
            "call connect() before pushing") in out, out

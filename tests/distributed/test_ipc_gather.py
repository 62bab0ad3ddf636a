"""Colocated SGLang at TP > 1 (finding 9 of the GPU-path reading): SGLang's TP rank r opens only payload r
(`deserialize_own_rank`), which must be made on rank r's own GPU. The trainer ranks on the engine's GPUs each
serialise their own copy and the leader gathers them in TP order (`megarl.rollout.sglang_ipc`)."""

from __future__ import annotations

import pytest
from helpers import torchrun

pytestmark = [pytest.mark.distributed]


def test_each_tp_rank_gets_a_payload_serialised_by_its_own_rank():
    proc = torchrun(2, "tests/distributed/ipc_gather_worker.py", timeout=150)
    # 5 tensors of 16 bytes in 40-byte buckets: 3 buckets (2 + 2 + 1 tensors)
    assert "rank 0: 3 buckets, payloads from ranks [[0, 1], [0, 1], [0, 1]]" in proc.stdout, proc.stdout
    # rank 1 drops its copy of each bucket, and collects, once the engine has loaded it
    assert "rank 1: served 3 buckets, 3 ipc_collect" in proc.stdout, proc.stdout
    assert "rank 0: refused: SGLang update_weights_from_tensor failed: bucket refused by the test engine" in proc.stdout
    assert ("rank 1: raised: the weight sync on rank 0 failed: WeightSyncError: SGLang update_weights_from_tensor "
            "failed: bucket refused by the test engine") in proc.stdout, proc.stdout

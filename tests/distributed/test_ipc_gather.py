"""Colocated SGLang at TP > 1 (finding 9 of the GPU-path reading, item 5 of issue 28): SGLang's TP rank r opens
only payload r (`deserialize_own_rank`), which must be made on rank r's own GPU. Through `WeightSync`, as training
runs it: every trainer rank on the engine's GPUs reads the streamed export, packs the same buckets and serialises
its own copy; the leader gathers the payloads in TP order (`megarl.rollout.sglang_ipc`)."""

from __future__ import annotations

import pytest
from helpers import make_tiny_hf_model, torchrun

pytestmark = [pytest.mark.distributed]


def test_each_tp_rank_gets_its_own_payload_of_every_bucket_through_the_weight_sync(tmp_path):
    # 3 layers, hidden 128, MLP 1024: 2.7 MB in bf16, so 3 buckets of at most 1 MB (--sync-bucket-mb 1)
    hf = make_tiny_hf_model(tmp_path / "qwen2", "qwen2", layers=3, hidden_size=128, intermediate_size=1024)
    proc = torchrun(2, "tests/distributed/ipc_gather_worker.py", "--hf", hf, timeout=240)
    out = proc.stdout
    # the worker asserts each bucket's payloads, layouts and bytes, and each TP rank's tensors against export_hf
    every = "3 buckets, payloads from ranks [[0, 1], [0, 1], [0, 1]], 39 tensors == export_hf on each TP rank"
    assert f"rank 0: sync 1: {every}" in out, out
    assert "rank 1: sync 1: 3 ipc_collect" in out, out  # rank 1 drops each copy once the engine has loaded it
    refused = "SGLang update_weights_from_tensor failed: bucket 1 refused by the test engine"
    assert f"rank 0: sync 2 raised: {refused}" in out, out
    assert f"rank 1: sync 2 raised: the weight sync on rank 0 failed: WeightSyncError: {refused}" in out, out
    session = "SGLang begin_weight_update failed: the test engine refuses the session"
    assert f"rank 0: sync 3 raised: {session}" in out, out  # before any bucket: rank 1 is told at the first one
    assert f"rank 1: sync 3 raised: the weight sync on rank 0 failed: WeightSyncError: {session}" in out, out
    assert f"rank 0: sync 4: {every}; weight version 4" in out, out  # nobody was left waiting

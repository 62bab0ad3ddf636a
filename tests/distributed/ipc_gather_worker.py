"""Under torchrun, 2 CPU processes over gloo: a colocated SGLang engine at TP 2 whose TP ranks run on the GPUs of
trainer ranks 0 and 1. Rank 0 (the leader) holds the engine, a recording fake; rank 1 serves it (`IpcGather.follow`).
Each rank serialises its own copy of every bucket (the serializer records the process and the bytes it saw) and
the engine must get one payload per TP rank, in rank order. Then a sync the engine refuses: rank 1 must raise with
the leader's message instead of waiting."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from megarl.rollout.sglang_engine import SGLangEngine
from megarl.rollout.sglang_ipc import build_ipc_gather
from megarl.rollout.weight_sync import WeightSyncError, pack_buckets


def serialize(bucket) -> str:
    """What SGLang's serializer would capture, made visible: who serialised which bytes."""
    return json.dumps({"rank": dist.get_rank(), "pid": os.getpid(), "names": [s.name for s in bucket.slots],
                       "values": [t.tolist() for _, t in bucket.tensors()]})


class Engine:
    def __init__(self, refuse_at: int | None = None):
        self.updates, self.refuse_at = [], refuse_at

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.updates.append([json.loads(p) for p in named_tensors])
        if self.refuse_at is not None and len(self.updates) > self.refuse_at:
            return False, "bucket refused by the test engine"
        return True, "Success"


def named(step: int):
    return [(f"w{i}", torch.full((4,), float(10 * step + i))) for i in range(5)]  # 16 bytes each


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ipc = build_ipc_gather(tp_size=2, is_leader=rank == 0, timeout_s=60)
    ipc._serialize = serialize
    assert ipc.ranks == [0, 1], ipc.ranks
    if rank == 0:
        fake = Engine()
        engine = SGLangEngine(fake, tp_size=2, ipc=ipc)
        engine.load_weight_buckets(pack_buckets(named(1), 40), version=1)
        for per_rank in fake.updates:
            assert [p["rank"] for p in per_rank] == [0, 1], "payload r must be made by the rank on TP rank r's GPU"
            assert per_rank[0]["pid"] != per_rank[1]["pid"]
            assert per_rank[0]["values"] == per_rank[1]["values"], "both copies hold the leader's bucket"
        got = {n: v for per_rank in fake.updates for n, v in zip(per_rank[1]["names"], per_rank[1]["values"])}
        assert got == {n: t.tolist() for n, t in named(1)}, got
        print(f"rank 0: {len(fake.updates)} buckets, payloads from ranks "
              f"{[[p['rank'] for p in u] for u in fake.updates]}", flush=True)
        try:
            SGLangEngine(Engine(refuse_at=1), tp_size=2, ipc=ipc).load_weight_buckets(pack_buckets(named(2), 40), 2)
        except WeightSyncError as e:
            print(f"rank 0: refused: {e}", flush=True)
    else:  # CUDA as far as the IPC bookkeeping goes: count the collects of this rank's copies
        collects = []
        torch.cuda.is_available, torch.cuda.ipc_collect = (lambda: True), (lambda: collects.append(1))
        print(f"rank 1: served {ipc.follow()} buckets, {len(collects)} ipc_collect", flush=True)
        try:
            ipc.follow()
        except WeightSyncError as e:
            print(f"rank 1: raised: {e}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

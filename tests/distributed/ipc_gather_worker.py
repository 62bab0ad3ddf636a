"""Under torchrun, 2 CPU processes over gloo: the actor at TP 2 and a colocated SGLang engine at TP 2 whose TP ranks
run on the GPUs of trainer ranks 0 and 1, synced through `WeightSync` as `megarl.stages.setup` does. Rank 0 (the
leader) holds the engine, a recording fake; rank 1 has none. SGLang's serializer is replaced by one that records
who serialised which bytes (a CPU process has no CUDA-IPC handles to give); the fake engine decodes payload r as
SGLang's TP rank r would (`deserialize_own_rank`). Checked on rank 0, per sync:

- every bucket comes with one payload per TP rank, payload r serialised by trainer rank r (its own process),
  from the same bucket layout and bytes;
- what each TP rank receives over the whole sync is `export_hf()`, cast to the engine's dtype, bit for bit;
- an engine that refuses a bucket, or the update session, fails the sync on both ranks with the leader's message,
  and the next sync goes through: no rank is left waiting.

Run against a tree without the wiring (the leader serialises every payload itself) this fails: payload 1 comes
from rank 0."""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys

import torch
import torch.distributed as dist

DTYPE = torch.bfloat16  # the engine's: rank 1 must pack in it too (it learns it from the leader)


def record_serialize(bucket) -> str:
    """What SGLang's serializer would capture, made visible: who serialised which bucket, its layout and bytes."""
    return json.dumps({"rank": dist.get_rank(), "pid": os.getpid(),
                       "slots": [(s.name, list(s.shape), str(s.dtype), s.start, s.end) for s in bucket.slots],
                       "bytes": base64.b64encode(bucket.flat.numpy().tobytes()).decode()})


def decode(payload: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """SGLang's TP worker's view of its payload: the record, and the tensors it loads."""
    record = json.loads(payload)
    flat = torch.frombuffer(bytearray(base64.b64decode(record["bytes"])), dtype=torch.uint8)
    tensors = {name: flat[start:end].view(getattr(torch, dtype.removeprefix("torch."))).view(shape)
               for name, shape, dtype, start, end in record["slots"]}
    return record, tensors


class FakeColocatedEngine:
    """`sglang.Engine`'s weight-update calls; each TP rank's tensors kept apart, as each TP worker loads its own."""

    def __init__(self, tp_size: int):
        self.tp_size = tp_size
        self.refuse_begin, self.refuse_update_at = False, None
        self.reset()

    def reset(self):
        self.updates: list[list[dict]] = []  # per bucket, the records of the payloads, in TP order
        self.loaded: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp_size)]

    def begin_weight_update(self):
        return (False, "the test engine refuses the session") if self.refuse_begin else (True, "")

    def end_weight_update(self):
        return True, ""

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        assert load_format == "flattened_bucket" and len(named_tensors) == self.tp_size
        if self.refuse_update_at is not None and len(self.updates) == self.refuse_update_at:
            return False, f"bucket {self.refuse_update_at} refused by the test engine"
        records = []
        for tp_rank, payload in enumerate(named_tensors):
            record, tensors = decode(payload)
            records.append(record)
            self.loaded[tp_rank].update(tensors)
        self.updates.append(records)
        return True, "Success"

    def shutdown(self):
        pass


def check_sync(fake: FakeColocatedEngine, reference: list[tuple[str, torch.Tensor]], stats: dict) -> str:
    assert fake.updates and stats["sync_buckets"] == len(fake.updates), (stats, len(fake.updates))
    for i, records in enumerate(fake.updates):
        ranks = [r["rank"] for r in records]
        assert ranks == list(range(fake.tp_size)), f"bucket {i}: payloads made by ranks {ranks}, one per TP rank's GPU"
        assert len({r["pid"] for r in records}) == fake.tp_size, f"bucket {i}: payloads made in one process"
        assert all(r["slots"] == records[0]["slots"] for r in records), f"bucket {i}: the ranks' layouts differ"
        assert all(r["bytes"] == records[0]["bytes"] for r in records), f"bucket {i}: the ranks' bytes differ"
    want = {name: t.to(DTYPE) for name, t in reference}
    for tp_rank, got in enumerate(fake.loaded):
        assert got.keys() == want.keys(), (tp_rank, sorted(got.keys() ^ want.keys())[:5])
        bad = [n for n in want if not (got[n].dtype == DTYPE and torch.equal(got[n], want[n]))]
        assert not bad, f"TP rank {tp_rank}: {bad[:5]} differ from export_hf"
    return (f"{len(fake.updates)} buckets, payloads from ranks {[[r['rank'] for r in u] for u in fake.updates]}, "
            f"{len(want)} tensors == export_hf on each TP rank")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (4 ranks at 2: the later stage's tensors "
                   "reach both TP ranks of the first; run by hand, the test runs PP 1)")
    args = p.parse_args()
    torch.set_num_threads(1)
    from megarl.config import RolloutConfig
    from megarl.mcore import parallel
    from megarl.mcore.actor import MegatronPolicy
    from megarl.model_shape import ModelShape
    from megarl.rollout import sglang_engine, sglang_ipc
    from megarl.rollout.sglang_engine import SGLangEngine
    from megarl.rollout.weight_sync import WeightSyncError
    from megarl.stages.colocation import WeightSync

    sglang_ipc.serialize_bucket = sglang_engine.serialize_bucket = record_serialize
    info = parallel.init_distributed(2, args.pp, timeout_s=120, seed=0)
    rank = info.rank
    shape = ModelShape.from_pretrained(args.hf)
    actor = MegatronPolicy(shape, tp=2, pp=args.pp, trainable=False)
    actor.load_hf(args.hf)
    reference = actor.export_hf()  # the leader's full tensors, [] on rank 1
    fake = FakeColocatedEngine(2) if info.is_mp_leader else None
    engine = SGLangEngine(fake, tp_size=2, dtype=DTYPE) if fake is not None else None
    sync = WeightSync(actor, engine, RolloutConfig(sync_bucket_mb=1), info, timeout_s=120)
    collects = []
    if rank == 1:  # CUDA as far as the IPC bookkeeping goes: rank 1 collects once the engine has loaded a bucket
        torch.cuda.is_available, torch.cuda.ipc_collect = (lambda: True), (lambda: collects.append(1))
    stats = sync(version=1)
    if fake is not None:
        print(f"rank 0: sync 1: {check_sync(fake, reference, stats)}", flush=True)
    else:
        print(f"rank {rank}: sync 1: {len(collects)} ipc_collect", flush=True)
    for version, what in ((2, "refuse_update_at"), (3, "refuse_begin")):
        if fake is not None:
            fake.reset()
            fake.refuse_update_at, fake.refuse_begin = (1, False) if what == "refuse_update_at" else (None, True)
        try:
            sync(version=version)
            print(f"rank {rank}: sync {version} went through", flush=True)
        except WeightSyncError as e:
            print(f"rank {rank}: sync {version} raised: {e}", flush=True)
    if fake is not None:
        fake.reset()
        fake.refuse_update_at, fake.refuse_begin = None, False
    stats = sync(version=4)
    if fake is not None:
        print(f"rank 0: sync 4: {check_sync(fake, reference, stats)}; weight version {engine.weight_version}",
              flush=True)
    dist.barrier()
    parallel.destroy()


if __name__ == "__main__":
    sys.exit(main())

"""Under torchrun, 2 processes: rank 0 plays the trainer's leader forming SGLang's weight-update group
(`init_weights_update_group`, rank 0 of that group), rank 1 one SGLang server TP rank joining it the way SGLang's
`init_custom_process_group` does (a c10d rendezvous on tcp://, a PrefixStore under the group name, torch's
private helper). Both then meet in one broadcast. Each has its default process group first, as in a real run."""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megarl.rollout.sglang_engine import init_weights_update_group

GROUP = "megarl_weights"


def sglang_side(port: int, timeout_s: float):
    """SGLang 0.5.23's `init_custom_process_group(backend, init_method, world_size, rank, group_name)`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(GROUP, store)
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend("gloo"), store, group_name=GROUP,
                                           timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True)
    args = p.parse_args()
    assert os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True", "the point is torchrun's agent store"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        pg = init_weights_update_group("gloo", "127.0.0.1", args.port, 0, 2, GROUP, timeout_s=args.timeout)
    else:
        pg = sglang_side(args.port, args.timeout)
    flat = torch.arange(6, dtype=torch.float32) if rank == 0 else torch.zeros(6)
    dist.broadcast(flat, src=0, group=pg)
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], flat
    print(f"rank {rank}: joined {GROUP} and received the bucket", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

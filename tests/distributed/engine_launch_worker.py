"""Under torchrun, 2 CPU processes over gloo: one model replica at TP 2, whose leader (rank 0) launches a rollout
engine before the actor (`megarl.trainer.build.launch_engine_first`) while rank 1 waits. The engine comes from a
stand-in backend: an in-process `SGLangEngine` over a stand-in `sglang.Engine` that writes into the environment
what SGLang 0.5.23 writes at TP 2 when seeded. The process group's collective timeout is 3 s; the scenarios:

- slow: the leader takes 5 s, longer than any collective waits; every rank goes on, with the same environment.
- fails: the leader's launch raises after 1 s; rank 1 stops at once with the leader's error, naming rank 0.
- stuck: the leader takes 4 s against a 1 s launch timeout; rank 1 stops at 1 s, naming rank 0.

Each line printed starts with the rank and the scenario."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import types

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megarl.mcore.parallel import ParallelInfo
from megarl.rollout import sglang_engine
from megarl.rollout.backends import register_backend
from megarl.rollout.sglang_engine import SGLangEngine
from megarl.trainer.build import launch_engine_first

SGLANG_WRITES = {"NCCL_ALGO": "allreduce:tree", "NCCL_MIN_NCHANNELS": "1", "NCCL_MAX_NCHANNELS": "1",
                 "NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "8"}


class WritingEngine:
    def __init__(self, **kwargs):
        os.environ.update(SGLANG_WRITES)

    def release_memory_occupation(self, tags=None):
        return True, ""


sys.modules["sglang"] = types.SimpleNamespace(Engine=WritingEngine)
sglang_engine.sglang_available = lambda: (True, "")


@register_backend("standin", launch_first=lambda cfg: True)
def build(cfg, actor):
    time.sleep(cfg.launch_s)
    if cfg.error:
        raise RuntimeError(cfg.error)
    return SGLangEngine.launch("/model", tp_size=2, seed=1234, device="cuda")


def config(launch_s: float, timeout_s: float = 60.0, error: str = ""):
    return types.SimpleNamespace(rollout=types.SimpleNamespace(rollout_backend="standin"),
                                 training=types.SimpleNamespace(engine_launch_timeout_seconds=timeout_s),
                                 launch_s=launch_s, error=error)


def environment() -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith("NCCL_") or k == "CUDA_DEVICE_MAX_CONNECTIONS"}


def store_barrier(store, name: str, rank: int) -> None:
    """Between scenarios, outside the process group (whose 3 s limit a scenario may outlast on one rank)."""
    store.set(f"{name}/{rank}", "1")
    store.wait([f"{name}/{r}" for r in range(2)], datetime.timedelta(seconds=60))


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    rank = dist.get_rank()
    store = c10d.PrefixStore("engine_launch_test", c10d._get_default_store())
    info = ParallelInfo(rank=rank, world_size=2, tp_rank=rank, tp_size=2, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1)
    say = print if rank == 0 else (lambda *a, **k: None)
    scenarios = {"slow": config(5.0), "fails": config(1.0, error="not enough memory for the KV cache"),
                 "stuck": config(4.0, timeout_s=1.0)}
    for name, cfg in scenarios.items():
        start = time.monotonic()
        try:
            engine = launch_engine_first(cfg, info, say)
            took = time.monotonic() - start
            line = f"rank {rank} {name}: {'an engine' if engine else 'no engine'} after {took:.0f} s"
            if name == "slow":  # both ranks get here
                store.set(f"env/{rank}", json.dumps(environment()))
                store.wait([f"env/{r}" for r in range(2)], datetime.timedelta(seconds=60))
                line += f", environment identical across ranks: {store.get('env/0') == store.get('env/1')}"
            print(line, flush=True)
        except Exception as e:  # noqa: BLE001 - what each rank gets is the point
            print(f"rank {rank} {name}: after {time.monotonic() - start:.0f} s: {type(e).__name__}: {e}", flush=True)
        store_barrier(store, f"end/{name}", rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

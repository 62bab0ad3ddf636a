"""A torchrun worker that reports what it sees (tests/distributed/test_forkrun.py): its arguments, names, path,
torchrun's environment, signal handlers, threads, a gloo all-reduce; then ends as `mode` says."""

import atexit
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

out, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
        "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
        "OMP_NUM_THREADS", "PROBE_VAR")
seen = {"argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0],
        "on_path": os.environ["PROBE_PATH"] in sys.path, "cwd": os.getcwd(),
        "env": {k: os.environ.get(k) for k in keys}, "threads": torch.get_num_threads(),
        "sigterm": str(signal.getsignal(signal.SIGTERM)), "sigint": str(signal.getsignal(signal.SIGINT)),
        "sigpipe": str(signal.getsignal(signal.SIGPIPE)), "sigusr1": str(signal.getsignal(signal.SIGUSR1)),
        "all_reduce": total.item(),
        "main_module": sys.modules["__main__"].__dict__.get("__file__"),
        "forked": "megatron.core" in sys.modules}  # imported by the fork server, never by this script
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(seen, f)
with open(f"{out}/rank{rank}.pid", "w") as f:
    f.write(str(os.getpid()))
atexit.register(lambda: open(f"{out}/rank{rank}.atexit", "w").close())
sys.stdout.write(f"rank {rank} says hello\n")  # one write: print's text and newline are two, which may interleave
if mode == "exit3" and rank == 1:
    sys.exit(3)
if mode == "raise" and rank == 0:
    raise ValueError("boom from the probe")
if mode != "ok":  # the other rank waits to be stopped by torchrun (or the launch's timeout): one root cause
    time.sleep(600)
dist.barrier()
dist.destroy_process_group()

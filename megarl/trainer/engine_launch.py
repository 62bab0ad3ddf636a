"""Every rank waits for the rollout engines launched before the actor (`megarl.trainer.build.launch_engine_first`).

Only model-parallel leaders launch them, and a cold start (loading a large model from a slow file system,
capturing CUDA graphs) may take longer than any collective should wait. So the wait is on keys of the default
group's `torch.distributed` store, not a barrier under `--distributed-timeout-seconds`: it has a limit of its own
(`--engine-launch-timeout-seconds`), a leader whose launch failed posts its error so that every other rank stops
at once with it, and a leader that did not finish in time is named, with how far it got.
"""

from __future__ import annotations

import json
import time


class EngineLaunchError(RuntimeError):
    """A leader's engine did not launch (it failed, or did not finish within the launch timeout)."""


class LaunchWait:
    """The leaders of DP ranks 0..dp_size-1 post `started`, then `launched` or `failed`, under keys of `store`;
    `wait` returns once each has launched. Each run of `launch_engine_first` takes a store of its own (a prefix).
    Every rank polls two keys' worth of the store each `poll_s`, however many leaders there are."""

    FLAG = "--engine-launch-timeout-seconds"

    def __init__(self, store, dp_size: int, timeout_s: float, poll_s: float = 0.2):
        self.store, self.dp_size, self.timeout_s, self.poll_s = store, dp_size, timeout_s, poll_s

    @classmethod
    def over_default_store(cls, name: str, dp_size: int, timeout_s: float) -> LaunchWait:
        from torch.distributed import distributed_c10d as c10d

        return cls(c10d.PrefixStore(name, c10d._get_default_store()), dp_size, timeout_s)

    def started(self, dp_rank: int, rank: int) -> None:
        self.store.set(f"started/{dp_rank}", json.dumps({"rank": rank, "time": time.time()}))

    def launched(self, dp_rank: int) -> None:
        self.store.set(f"launched/{dp_rank}", "1")

    def failed(self, dp_rank: int, rank: int, error: BaseException) -> None:
        """This leader's launch raised `error`: every rank waiting raises with it (the last to fail, if several do)."""
        self.store.set("failed", json.dumps({"rank": rank, "dp_rank": dp_rank,
                                             "error": f"{type(error).__name__}: {error}"}))

    def wait(self, rank: int, what: str) -> None:
        """Until every leader has launched `what`; raises `EngineLaunchError` with a leader's error as soon as one
        fails, or naming those not done within the timeout."""
        launched = [f"launched/{d}" for d in range(self.dp_size)]
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.store.check(["failed"]):
                post = json.loads(self.store.get("failed"))
                raise EngineLaunchError(f"rank {rank}: the {what} on rank {post['rank']} (the model-parallel leader "
                                        f"of DP rank {post['dp_rank']}) failed to launch: {post['error']}")
            if self.store.check(launched):
                return
            if time.monotonic() > deadline:
                late = "; ".join(self._where(d) for d, key in enumerate(launched) if not self.store.check([key]))
                raise EngineLaunchError(f"rank {rank}: the {what} did not finish launching within "
                                        f"{self.timeout_s:g} s ({self.FLAG}): {late}. A large model on a slow file "
                                        "system or CUDA-graph capture can take that long (raise the flag); "
                                        "otherwise that rank's log says where it stopped")
            time.sleep(self.poll_s)

    def _where(self, dp_rank: int) -> str:
        key = f"started/{dp_rank}"
        if not self.store.check([key]):
            return f"the leader of DP rank {dp_rank} never started launching"
        post = json.loads(self.store.get(key))
        return (f"rank {post['rank']} (the leader of DP rank {dp_rank}) has been launching for "
                f"{time.time() - post['time']:.0f} s")

"""The suite's torchrun (tests/forkrun.py: workers forked from a process that imported torch, megatron-core and
transformers once) against the real `python -m torch.distributed.run`: what a worker sees (its argv, `__main__`,
sys.path, torchrun's environment, signal handlers, thread count, a gloo all-reduce), its output, its exit handlers,
and how a failed or hung launch ends. Every other launch in the suite relies on these being the same."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from helpers import REPO, torchrun

from megarl.procs import running

pytestmark = [pytest.mark.distributed]

PROBE = "tests/distributed/forkrun_probe.py"


def _launch(tmp_path, name: str, mode: str, fork: bool, env: dict | None = None,
            **kw) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / name
    out.mkdir()
    extra = {"PROBE_VAR": "from-the-launch", "PROBE_PATH": str(tmp_path), "OMP_NUM_THREADS": "2",
             "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), **(env or {})}
    proc = torchrun(2, PROBE, out, mode, check=False, fork=fork, extra_env=extra, **kw)
    seen = {}
    for rank in (0, 1):
        if (out / f"rank{rank}.json").exists():
            seen[rank] = json.loads((out / f"rank{rank}.json").read_text())
            seen[rank]["atexit"] = (out / f"rank{rank}.atexit").exists()
            seen[rank]["argv"][1] = "OUT"  # each launch its own folder
    return proc, seen


# "ignored": the launching process ignores SIGINT and SIGUSR1, as a command started with `&` by a script does
# (SIGINT): an ignored signal stays ignored across exec, unless torchrun handles it (SIGINT, SIGTERM, SIGHUP, SIGQUIT)
@pytest.mark.parametrize("signals", ["default", "ignored"])
def test_a_forked_worker_sees_what_a_fresh_one_sees(tmp_path, signals):
    ignore = signals == "ignored"
    saved = {s: signal.signal(s, signal.SIG_IGN if ignore else h)
             for s, h in ((signal.SIGINT, signal.default_int_handler), (signal.SIGUSR1, signal.SIG_DFL))}
    try:
        real, real_seen = _launch(tmp_path, "real", "ok", fork=False)
        forked, forked_seen = _launch(tmp_path, "forked", "ok", fork=True)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    assert real_seen[0]["sigint"] == "<built-in function default_int_handler>"
    assert real_seen[0]["sigusr1"] == str(signal.SIG_IGN if ignore else signal.SIG_DFL)
    assert real.returncode == forked.returncode == 0, forked.stderr[-3000:]
    assert [s.pop("forked") for s in (real_seen[0], real_seen[1], forked_seen[0], forked_seen[1])] == \
        [False, False, True, True]
    assert real_seen == forked_seen
    assert forked_seen[0]["name"] == "__main__" and forked_seen[0]["env"]["PROBE_VAR"] == "from-the-launch"
    assert forked_seen[0]["threads"] == 2 and forked_seen[0]["all_reduce"] == 3.0 and forked_seen[1]["atexit"]
    assert forked_seen[0]["path0"] == str(REPO / "tests" / "distributed") and forked_seen[0]["on_path"]
    hello = sorted(line for line in forked.stdout.splitlines() if "says hello" in line)
    assert hello == sorted(line for line in real.stdout.splitlines() if "says hello" in line) == \
        ["rank 0 says hello", "rank 1 says hello"]


@pytest.mark.parametrize("mode, says", [("exit3", "exitcode  : 3"), ("raise", "ValueError: boom from the probe")])
def test_a_failed_worker_fails_the_launch_the_same_way(tmp_path, mode, says):
    real, _ = _launch(tmp_path, "real", mode, fork=False)
    forked, _ = _launch(tmp_path, "forked", mode, fork=True)
    assert real.returncode == forked.returncode == 1
    for proc in (real, forked):
        assert says in proc.stderr and "Root Cause (first observed failure)" in proc.stderr, proc.stderr[-3000:]


def test_a_hung_launch_times_out_and_leaves_no_worker(tmp_path):
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        _launch(tmp_path, "forked", "hang", fork=True, timeout=20)
    assert time.monotonic() - start < 60
    for rank in (0, 1):
        pid = int((tmp_path / "forked" / f"rank{rank}.pid").read_text())
        for _ in range(50):  # killed with the launch's process group (a zombie until its new parent reaps it)
            if not running(pid):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"rank {rank}'s worker (pid {pid}) outlived its launch's timeout")
    # the server goes on: the next launch runs
    proc, seen = _launch(tmp_path, "after", "ok", fork=True)
    assert proc.returncode == 0 and seen[1]["all_reduce"] == 3.0


def test_a_launch_that_sets_what_an_interpreter_reads_at_start_runs_the_real_torchrun(tmp_path):
    proc, seen = _launch(tmp_path, "warnings", "ok", fork=True, env={"PYTHONWARNINGS": "default"})
    assert proc.returncode == 0 and seen[0]["forked"] is False and seen[1]["forked"] is False

"""The sandbox running a code case is killed from outside (`sandbox_kill`): the case is run again on a fresh worker,
harness or container and gets the verdict of a sandbox that never failed, never a failure charged to the program
(`megarl.sandbox.harness_protocol.RERUNS`); a sandbox that keeps failing is named as the sandbox's failure.

Local backend: the worker process, or its persistent code harness, SIGKILLed while the case's program runs. Docker:
`docker kill` on the case's container (skipped, with the reason, where no Docker engine or image is at hand).
And the named fault (`MEGARL_FAULT=sandbox_kill@S`, `megarl.faults.kill_sandbox`) on either backend: the sandbox
killed with the case handed to it; a whole run with it is in test_run_faults.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import pytest

from megarl import faults, procs
from megarl.sandbox import Limits, RunResult
from megarl.sandbox.harness_protocol import RERUNS, HarnessBackend
from megarl.verifiers.code import CodeVerifier

pytestmark = [pytest.mark.faults, pytest.mark.distributed]
GOLD = {"test": "assert f(1) == 2\nassert f(5) == 6", "entry_point": "f"}
GOOD = "def f(x):\n    return x + 1\n"
SLOW = "import time\n\n\ndef f(x):\n    time.sleep(1.5)\n    return x + 1\n"  # the case the sandbox dies under


def _harness_pid(worker_pid: int) -> int:
    for pid in procs.descendants(worker_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"--serve" in f.read():
                    return pid
        except OSError:
            continue
    raise AssertionError("no persistent code harness under the sandbox worker")


@pytest.mark.parametrize("victim", ["worker", "harness"])
def test_a_local_sandbox_killed_mid_case_runs_the_case_again(victim, capfd):
    verifier = CodeVerifier(workers=1)
    sandbox = verifier.sandbox
    try:
        assert verifier.verify(GOOD, GOLD).outcome == "correct"  # the worker and its harness are up
        worker = sandbox._all[0].proc.pid
        target = worker if victim == "worker" else _harness_pid(worker)
        killer = threading.Timer(0.7, os.kill, (target, signal.SIGKILL))  # the program sleeps 1.5 s
        killer.start()
        t0 = time.monotonic()
        result = verifier.verify(SLOW, GOLD)
        seconds = time.monotonic() - t0
        killer.join()
        assert (result.outcome, result.score, result.normalized) == ("correct", 1.0, "2/2 tests passed"), result
        assert not procs.running(target)
        assert "megarl: the local sandbox failed on 1 code case(s) (first: " in capfd.readouterr().err
        assert verifier.verify(GOOD, GOLD).outcome == "correct"  # the fresh worker serves on
        print(f"local sandbox {victim} killed mid-case: verdict after {seconds:.1f} s (the case re-run)")
    finally:
        sandbox.close()


class _Failing(HarnessBackend):
    """A sandbox whose every run fails, as a worker killed each time would."""

    name = "failing"
    limits = Limits()

    def __init__(self):
        self.runs = 0

    def run_many(self, jobs):
        self.runs += len(jobs)
        return [RunResult.error("worker failed: worker exited with status -9") for _ in jobs]


def test_a_sandbox_that_keeps_failing_is_named_and_not_charged_to_the_program(monkeypatch):
    failing = _Failing()
    monkeypatch.setattr(CodeVerifier, "sandbox", property(lambda self: failing))
    result = CodeVerifier().verify(GOOD, GOLD)
    assert failing.runs == RERUNS + 1
    assert result.outcome == "parse_error" and result.score == 0.0
    assert result.normalized == (f"sandbox_error, not the program's (after {RERUNS} re-run(s)): worker failed: "
                                 "worker exited with status -9")


def test_a_docker_container_killed_mid_case_runs_the_case_again():
    from megarl.sandbox.docker import DEFAULT_IMAGE, docker_status

    image = os.environ.get("MEGARL_SANDBOX_IMAGE", DEFAULT_IMAGE)
    reason = docker_status(image)
    if reason:
        pytest.skip(f"no Docker engine or sandbox image here: {reason}")
    verifier = CodeVerifier(backend="docker", image=image, workers=1)
    sandbox = verifier.sandbox
    try:
        assert verifier.verify(GOOD, GOLD).outcome == "correct"
        up = sandbox.containers()
        killer = threading.Timer(0.7, lambda: subprocess.run([sandbox.docker, "kill", *up], capture_output=True,
                                                             timeout=60))
        killer.start()
        result = verifier.verify(SLOW, GOLD)
        killer.join()
        assert (result.outcome, result.score) == ("correct", 1.0), result
    finally:
        sandbox.close()


def _docker_or_skip() -> str:
    from megarl.sandbox.docker import DEFAULT_IMAGE, docker_status

    image = os.environ.get("MEGARL_SANDBOX_IMAGE", DEFAULT_IMAGE)
    reason = docker_status(image)
    if reason:
        pytest.skip(f"no Docker engine or sandbox image here: {reason}")
    return image


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_the_sandbox_kill_fault_kills_the_case_s_sandbox_and_the_case_runs_again(backend, monkeypatch, capfd):
    kwargs = {"backend": "docker", "image": _docker_or_skip()} if backend == "docker" else {}
    verifier = CodeVerifier(workers=1, **kwargs)
    sandbox = verifier.sandbox
    try:
        unharmed = verifier.verify(GOOD, GOLD)  # the sandbox (and its harness pool) up before the fault
        assert (unharmed.outcome, unharmed.sandbox_reruns) == ("correct", 0), unharmed
        before = set(sandbox.containers()) if backend == "docker" else set()
        monkeypatch.setenv(faults.ENV, "sandbox_kill@2")
        assert faults.fire("sandbox_kill", 2)
        t0 = time.monotonic()
        result = verifier.verify(GOOD, GOLD)
        seconds = time.monotonic() - t0
        assert (result.outcome, result.score, result.normalized) == ("correct", 1.0, "2/2 tests passed"), result
        assert not faults.take("sandbox_kill")
        err = capfd.readouterr().err
        assert "megarl: fault injected: sandbox_kill at step 2 on rank 0" in err
        if backend == "local":  # the case run again by the harness protocol (`RERUNS`), counted in the row
            assert result.sandbox_reruns == 1
            assert "megarl: sandbox_kill: SIGKILLed the local sandbox's worker (pid " in err, err
            assert "a code case handed to it and unanswered" in err
        else:  # killed just before the case; the Docker pool runs it on a fresh container (`_drive_all`), uncounted
            killed = re.findall(r"SIGKILLed container (\S+) \(docker kill: \1\), just before a code case", err)
            assert len(killed) == len(before) >= 1, (err, before)  # every container of this process: both pools'
            for name in killed:  # gone: replaced, not reused
                left = subprocess.run([sandbox.docker, "ps", "-aq", "--filter", f"name={name}"], capture_output=True,
                                      text=True, timeout=60).stdout.split()
                assert left == [], (name, left)
        again = verifier.verify(GOOD, GOLD)  # the replacement serves on, the fault spent
        assert (again.outcome, again.sandbox_reruns) == ("correct", 0)
        with capfd.disabled():
            print(f"sandbox_kill on the {backend} sandbox: the verdict {seconds:.2f} s after the case was handed "
                  f"over (unharmed {unharmed.seconds:.2f} s, then {again.seconds:.2f} s)")
    finally:
        sandbox.close()

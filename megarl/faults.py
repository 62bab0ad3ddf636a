"""Fault injection, for the tests that prove a run survives faults (`tests/faults/`), and for anyone who wants to
see it: `MEGARL_FAULT=name@step[:rank][,name@step[:rank]...]` injects each named fault once, at that step, on that
rank (default: rank 0), and says so on stderr (`megarl: fault injected: <name> at step <step> on rank <rank>`).

A fault fires in the first attempt of a run only (torchrun's `TORCHELASTIC_RESTART_COUNT` is 0 or unset), so the
workers an elastic torchrun restarts after it run on unharmed, as they would after a real fault.

Faults (`FAULTS`):
  trainer_sigkill     the rank kills itself with SIGKILL after the step (and its checkpoint, if one is due)
  kill_during_save    the rank kills itself with SIGKILL in the step's checkpoint save, after every rank wrote its
                      files and before the checkpoint is published (the rename)
  disk_full_on_save   the step's checkpoint save fails on the rank with ENOSPC, as on a full disk
  slow_node           the rank sleeps MEGARL_FAULT_SLOW_S seconds (default 5) before the step: the others wait
  engine_crash        the built-in engine's process (--async-staleness >= 1), or the in-process SGLang CPU
                      engine's scheduler and detokenizer, killed with SIGKILL before the step's generation
  engine_hang         the same processes stopped with SIGSTOP before the step's generation
  reward_worker_crash a reward worker (--reward-workers >= 1) kills itself with SIGKILL while it scores the first
                      sample the pool takes up after the fault fired (a sample of the step), after verifying it and
                      before answering: the pool replaces it and scores the sample again (`megarl.reward.pool`)
  sandbox_kill        the sandbox that takes the first code sample scored after the fault fired (in a reward
                      worker with --reward-workers >= 1, else in the trainer's process) is SIGKILLed from outside,
                      as the OOM killer or a node fault would: the local backend's worker process and everything
                      under it (its persistent harness, the program), with the case handed to it and unanswered;
                      the Docker backend's containers (`docker kill`) just before the case is handed over, so the
                      case meets a dead container. The sandbox replaces it and runs the case again (local:
                      `megarl.sandbox.harness_protocol.RERUNS`, counted in the row's `reward_sandbox_reruns`;
                      Docker: inside its pool, uncounted). `kill_sandbox` says how the
                      moment is caught; a sandbox not started yet leaves the fault to the next code sample

How each fault is detected, how long the recovery takes and how the run compares with an uninterrupted one, as
measured: docs/results.md, "Runs that survive faults".
"""

from __future__ import annotations

import array
import errno
import fcntl
import os
import signal
import subprocess
import sys
import termios
import threading
import time
from functools import lru_cache

from megarl import procs
from megarl.errors import ConfigError

ENV = "MEGARL_FAULT"
FAULTS = ("trainer_sigkill", "kill_during_save", "disk_full_on_save", "slow_node", "engine_crash", "engine_hang",
          "reward_worker_crash", "sandbox_kill")
_ARMED: set[str] = set()  # faults fired at this step that a component of this process carries out when it gets there


@lru_cache(maxsize=None)
def _parse(spec: str) -> dict[tuple[str, int], int]:
    """name@step[:rank],... -> {(name, step): rank}; a ConfigError naming the variable and the allowed names."""
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, where = item.partition("@")
        step, _, rank = where.partition(":")
        if name not in FAULTS or not step.isdigit() or (rank and not rank.isdigit()):
            raise ConfigError(f"{ENV}={spec!r}: {item!r} is not name@step[:rank] with a name among "
                              f"{', '.join(FAULTS)}")
        out[(name, int(step))] = int(rank or 0)
    return out


def check() -> None:
    """Raise a ConfigError for a malformed MEGARL_FAULT (the run checks it before any work)."""
    _parse(os.environ.get(ENV, ""))


def due(name: str, step: int, rank: int | None = None) -> bool:
    """Whether fault `name` is to fire now, at `step` on this rank (`rank`: default the RANK variable)."""
    spec = os.environ.get(ENV, "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    return _parse(spec).get((name, step)) == rank


def announce(name: str, step: int) -> None:
    print(f"megarl: fault injected: {name} at step {step} on rank {os.environ.get('RANK', '0')}",
          file=sys.stderr, flush=True)


def fire(name: str, step: int) -> bool:
    """Inject `name` at `step` if it is due here: the faults this module can cause by itself; True when it fired
    (for the faults the caller carries out)."""
    if not due(name, step):
        return False
    announce(name, step)
    if name in ("trainer_sigkill", "kill_during_save"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif name == "disk_full_on_save":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (injected by MEGARL_FAULT)")
    elif name == "slow_node":
        time.sleep(float(os.environ.get("MEGARL_FAULT_SLOW_S", "5")))
    elif name in ("reward_worker_crash", "sandbox_kill"):
        arm(name)  # the reward pool (or the code verifier) of this process takes it on its next sample (`take`)
    return True


def arm(name: str) -> None:
    """Leave fault `name` for the next component of this process that `take`s it (a reward worker arms the
    sandbox_kill the pool hands it with its sample)."""
    _ARMED.add(name)


def take(name: str) -> bool:
    """Whether fault `name` was fired and not yet carried out; True once only (for the component that carries it
    out, e.g. the reward pool for reward_worker_crash)."""
    try:
        _ARMED.remove(name)  # atomic: of several threads asking at once, one gets it
    except KeyError:
        return False
    return True


def break_engine(engine, name: str) -> None:
    """engine_crash / engine_hang on the engine's own processes, wherever `engine` wraps it: the built-in engine's
    process, SGLang's CPU engine's scheduler and detokenizer, or vLLM's CPU engine core and worker."""
    while not hasattr(engine, "kill_for_fault"):
        if not hasattr(engine, "inner"):
            raise ConfigError(f"{ENV}: {name} needs the built-in engine in a process of its own (--rollout-backend "
                              "builtin with --async-staleness >= 1), SGLang's CPU engine (--rollout-backend "
                              "sglang without a GPU) or vLLM's (--rollout-backend vllm without a GPU)")
        engine = engine.inner
    engine.kill_for_fault(hang=name == "engine_hang")


def engine_health(engine) -> dict:
    """engine_restarts and engine_seconds_lost, once the engine's process has been restarted ({} before)."""
    while engine is not None and not hasattr(engine, "restarts"):
        engine = getattr(engine, "inner", None)
    if engine is None or not engine.restarts:
        return {}
    return {"engine_restarts": engine.restarts, "engine_seconds_lost": engine.seconds_lost}


# How the host-side end of a sandbox looks from outside, by its command line: a local backend's worker
# (`megarl.sandbox.local._Worker`), a Docker backend's `docker run -i` client (`megarl.sandbox.docker`).
_LOCAL_WORKER = b"from megarl.sandbox.local import worker_main"
_DOCKER_LABEL = b"megarl.sandbox"


class SandboxKill:
    """sandbox_kill, carried out from outside the sandbox (`kill_sandbox` starts it): the sandbox processes this
    process started (local workers, `docker run` clients; found in /proc by their command lines) are stopped
    (SIGSTOP) before the case is handed over; a thread then waits for the first of them whose request pipe holds
    more than it held when stopped (the case, written and not yet read) and kills it: a local worker with SIGKILL,
    together with every process under it; a container with `docker kill`. The others go on (SIGCONT) at once;
    all of them at `finish()` (after the verdict) or after `timeout_s` if no case reached them."""

    def __init__(self, watched: dict, timeout_s: float):
        self.watched, self._finished = watched, threading.Event()
        self._thread = threading.Thread(target=self._kill_when_handed, args=(timeout_s,), daemon=True,
                                        name="megarl-sandbox-kill")
        self._thread.start()

    def finish(self) -> None:
        self._finished.set()
        self._thread.join()

    def _kill_when_handed(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline and not self._finished.is_set():
                for pid, (container, fd, before) in self.watched.items():
                    if _unread(fd) > before:
                        _kill_host(pid, container)
                        return
                time.sleep(0.002)
            print("megarl: sandbox_kill: no code case reached a stopped sandbox process: nothing killed",
                  file=sys.stderr, flush=True)
        finally:
            for pid, (_, fd, _) in self.watched.items():
                os.close(fd)
                _resume(pid)


def kill_sandbox(timeout_s: float = 120.0) -> SandboxKill | _Killed | None:
    """Start sandbox_kill on the sandbox that takes the next case (`SandboxKill`); None, and the fault left armed
    for the next code sample, when no sandbox process of this process is up yet (a backend that starts lazily)."""
    hosts = _sandbox_hosts()
    containers = [(pid, container) for pid, container in hosts if container is not None]
    if containers:
        # Docker: killed before the case is handed over. Stopping the `docker run` clients as below stalls the
        # Docker pool itself (measured: the case then timed out and nothing was killed), so the case meets a
        # dead container instead, which the pool finds and replaces (`DockerSandbox._drive_all`).
        for pid, container in containers:
            _kill_host(pid, container, handed=False)
        return _Killed()
    writers = _pipe_writers()
    watched = {}
    for pid, container in hosts:
        fd = next((writers[ino] for ino in _pipes_of(pid) if ino in writers), None)
        if fd is None:  # no request pipe of ours (not yet handed over by a starting backend): not one to watch
            continue
        try:
            os.kill(pid, signal.SIGSTOP)
        except OSError:
            continue
        fd = os.dup(fd)
        watched[pid] = (container, fd, _unread(fd))
    if not watched:
        arm("sandbox_kill")
        return None
    return SandboxKill(watched, timeout_s)


class _Killed:
    """A sandbox_kill carried out at once (the Docker backend's): nothing to wait for."""

    def finish(self) -> None:
        pass


def _kill_host(pid: int, container: tuple[str, str] | None, handed: bool = True) -> None:
    if container is None:
        victims = [pid, *procs.descendants(pid)]  # read before the kill: orphans are re-parented after it
        for victim in victims:
            try:
                os.kill(victim, signal.SIGKILL)
            except OSError:  # gone already (a process of the case that ended)
                pass
        what = f"the local sandbox's worker (pid {pid}) and the {len(victims) - 1} process(es) under it"
    else:
        docker, name = container
        done = subprocess.run([docker, "kill", name], capture_output=True, text=True, timeout=60)
        what = f"container {name} (docker kill: {(done.stdout or done.stderr).strip() or done.returncode})"
    when = "a code case handed to it and unanswered" if handed else "just before a code case is handed to it"
    print(f"megarl: sandbox_kill: SIGKILLed {what}, {when}", file=sys.stderr, flush=True)


def _sandbox_hosts() -> list[tuple[int, tuple[str, str] | None]]:
    """(pid, None) of the local sandbox workers this process started; (pid, (docker, container name)) of its
    `docker run` clients."""
    out = []
    for pid in procs.children().get(os.getpid(), []):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(_LOCAL_WORKER in a for a in argv):
            out.append((pid, None))
        elif len(argv) > 1 and argv[1] == b"run" and _DOCKER_LABEL in argv and b"--name" in argv:
            out.append((pid, (argv[0].decode(), argv[argv.index(b"--name") + 1].decode())))
    return out


def _pipe_writers() -> dict[str, int]:
    """This process's write ends of pipes: the pipe's inode -> the fd. The host end of a sandbox's request pipe is
    one; its reader (the worker, after moving it off fd 0; the `docker run` client) holds the other end."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            with open(f"/proc/self/fdinfo/{fd}") as f:
                flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
        except (OSError, StopIteration, ValueError):
            continue
        if target.startswith("pipe:") and flags & os.O_ACCMODE == os.O_WRONLY:
            out[target] = int(fd)
    return out


def _pipes_of(pid: int) -> set[str]:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    out = set()
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("pipe:"):
            out.add(target)
    return out


def _unread(fd: int) -> int:
    """Bytes written into the pipe `fd` and not yet read (FIONREAD)."""
    n = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, n)
    return n[0]


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except OSError:
        pass

"""The Docker backend: a pool of warm, hardened containers, each running `jobexec.main` as pid 1.

The pool talks to each container over `docker run -i`'s stdin/stdout, one JSON line per job each way (never
pickle: a container is untrusted). A container is replaced after a job that timed out, ran out of memory, was
killed or broke the runner, and after `jobs_per_container` jobs. Containers carry the label `megarl.sandbox` and
are started with `--rm`; `close()` (also run at exit) removes every container the pool started.
Build the default image with `tools/build_sandbox_image.py`, or pass `image=` (any image with `python3`).
"""

from __future__ import annotations

import atexit
import json
import queue
import subprocess
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from megarl.sandbox.base import Job, LineReader, Limits, RunResult
from megarl.sandbox.local import PREIMPORTS

DEFAULT_IMAGE = "megarl-sandbox:latest"
LABEL = "megarl.sandbox"
_RUNNER = (Path(__file__).parent / "jobexec.py").read_text()
_RECYCLE_AFTER = {"timeout", "memory_limit", "killed", "sandbox_error"}


class DockerUnavailable(RuntimeError):
    """No Docker engine, or no sandbox image: the message says which and how to get it."""


def docker_status(image: str = DEFAULT_IMAGE, docker: str = "docker") -> str | None:
    """None when `image` can run here, else the reason it cannot (for skips and errors)."""
    try:
        r = subprocess.run([docker, "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True,
                           timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"no docker CLI ({e})"
    if r.returncode != 0:
        return f"no Docker engine reachable ({r.stderr.strip().splitlines()[-1] if r.stderr.strip() else 'docker version failed'})"
    r = subprocess.run([docker, "image", "inspect", image], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        return f"image {image!r} not found: build it with `python tools/build_sandbox_image.py --tag {image}`"
    return None


class DockerSandbox:
    name = "docker"

    def __init__(self, workers: int = 2, limits: Limits | None = None, image: str = DEFAULT_IMAGE,
                 python: str = "python3", jobs_per_container: int = 1000, docker: str = "docker",
                 preimports: str = PREIMPORTS):
        self.workers = workers
        self.limits = limits or Limits()
        self.image, self.python, self.docker = image, python, docker
        self.jobs_per_container = jobs_per_container
        self.preimports = preimports
        self._idle: queue.Queue[_Container] | None = None
        self._live: set[_Container] = set()
        self._lock = threading.Lock()  # start/close
        self._live_lock = threading.Lock()
        self.started = self.recycled = 0

    def __getstate__(self):
        return {k: getattr(self, k) for k in ("workers", "limits", "image", "python", "jobs_per_container",
                                              "docker", "preimports")}

    def __setstate__(self, state):
        self.__init__(**state)

    def start(self) -> "DockerSandbox":
        with self._lock:
            if self._idle is not None:
                return self
            reason = docker_status(self.image, self.docker)
            if reason:
                raise DockerUnavailable(reason)
            self._idle = queue.Queue()
            with ThreadPoolExecutor(self.workers) as pool:
                for container in pool.map(lambda _: self._new_container(), range(self.workers)):
                    self._idle.put(container)
            atexit.register(self.close)
        return self

    def _run_args(self) -> list[str]:
        lim = self.limits
        memory = max(256, lim.memory_mb + 128)  # the job's allowance plus the runner
        return [self.docker, "run", "-i", "--rm", "--label", LABEL, "--network", "none", "--read-only",
                "--tmpfs", "/tmp:size=64m", "--memory", f"{memory}m", "--memory-swap", f"{memory}m",
                "--pids-limit", str(lim.processes + 2), "--cpus", "1", "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges", "--user", "65534:65534",
                "--ulimit", f"nofile={lim.open_files}", "--ulimit", f"fsize={lim.file_mb << 20}",
                "--log-driver", "none", "--shm-size", "1m", "-e", f"MEGARL_PREIMPORTS={self.preimports}"]

    def _new_container(self) -> "_Container":
        name = f"megarl-sb-{uuid.uuid4().hex[:12]}"
        container = _Container(name, self._run_args() + ["--name", name, self.image, self.python, "-I", "-S",
                                                         "-c", _RUNNER], self.docker)
        with self._live_lock:
            self._live.add(container)
            self.started += 1
        return container

    def run(self, job: Job) -> RunResult:
        self.start()
        wire = job.to_wire(self.limits)
        container = self._idle.get()
        try:
            result = container.run(wire, timeout=wire["limits"]["wall_s"] + 30)
        except Exception as e:  # noqa: BLE001 - the container died or hung
            result = RunResult.error(f"container {container.name}: {e}")
        if result.status in _RECYCLE_AFTER or container.jobs >= self.jobs_per_container:
            container = self._recycle(container)
        self._idle.put(container)
        return result

    def _recycle(self, old: "_Container") -> "_Container":
        with self._live_lock:
            self._live.discard(old)
            self.recycled += 1
        threading.Thread(target=old.remove, daemon=True).start()
        while True:
            try:
                return self._new_container()
            except Exception:  # noqa: BLE001 - engine hiccup: retry rather than shrink the pool
                time.sleep(1)

    def run_many(self, jobs: Sequence[Job], depth: int = 4) -> list[RunResult]:
        """Like `run` for each job, with up to `depth` jobs queued in each container: the next job is already in
        the runner's stdin while one runs, which hides the round trip through the Docker daemon."""
        self.start()
        wires = [job.to_wire(self.limits) for job in jobs]
        results: list[RunResult | None] = [None] * len(jobs)
        todo = deque(range(len(jobs)))
        lock = threading.Lock()

        def take():
            with lock:
                return todo.popleft() if todo else None

        def drive():
            container = self._idle.get()
            inflight: deque[int] = deque()
            draining = False
            try:
                while True:
                    while not draining and len(inflight) < depth and (i := take()) is not None:
                        container.send(wires[i])
                        inflight.append(i)
                    if not inflight:
                        return
                    i = inflight.popleft()
                    try:
                        results[i] = container.receive(wires[i]["limits"]["wall_s"] + 30)
                    except Exception as e:  # noqa: BLE001 - the container broke: its queued jobs go back
                        results[i] = RunResult.error(f"container {container.name}: {e}")
                        with lock:
                            todo.extendleft(reversed(inflight))
                        inflight.clear()
                        draining = True
                    if results[i].status in _RECYCLE_AFTER or container.jobs >= self.jobs_per_container:
                        draining = True
                    if draining and not inflight:
                        container, draining = self._recycle(container), False
            finally:
                self._idle.put(container)

        with ThreadPoolExecutor(self.workers) as pool:
            for future in [pool.submit(drive) for _ in range(self.workers)]:
                future.result()
        return results

    def describe(self) -> str:
        return (f"docker, {self.workers} warm containers of {self.image}: no network, read-only root, tmpfs /tmp, "
                f"{max(256, self.limits.memory_mb + 128)} MB, {self.limits.processes + 2} pids, 1 CPU, no "
                "capabilities, no-new-privileges, uid 65534, no log driver; pid-1 runner kills all after each job")

    def close(self) -> None:
        with self._lock, self._live_lock:
            live, self._live, self._idle = list(self._live), set(), None
        for container in live:
            container.remove()


class _Container:
    def __init__(self, name: str, argv: list[str], docker: str):
        self.name, self.docker, self.jobs = name, docker, 0
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self._lines = LineReader(self.proc.stdout.fileno())
        try:
            json.loads(self._readline(60))
        except Exception:
            self.remove()
            raise

    def run(self, wire: dict, timeout: float) -> RunResult:
        self.send(wire)
        return self.receive(timeout)

    def send(self, wire: dict) -> None:
        self.jobs += 1
        self.proc.stdin.write(json.dumps(wire).encode() + b"\n")
        self.proc.stdin.flush()

    def receive(self, timeout: float) -> RunResult:
        line = self._readline(timeout)
        if len(line) > 64 << 20:
            raise ValueError("oversized answer")
        return RunResult.from_wire(json.loads(line))

    def _readline(self, timeout: float) -> bytes:
        return self._lines.readline(timeout, lambda: "the container's runner exited")

    def remove(self) -> None:
        try:
            self.proc.stdin.close()  # the runner exits at EOF, and --rm removes the container
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        subprocess.run([self.docker, "rm", "-f", self.name], capture_output=True, timeout=60)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

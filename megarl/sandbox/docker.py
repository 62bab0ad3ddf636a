"""The Docker backend: a pool of warm, hardened containers, each running `jobexec.main` as pid 1.

Code-verifier cases (`Job.harness`) go to a second pool, started on the first such case, whose containers run the
persistent trusted harness (`serve` in `guest/harness.py`) as pid 1 instead: same flags, one case line in and one
verdict payload line out, every program forked from a zygote made before any case, everything killed after each case,
`/tmp` and `/dev/shm` emptied; a case past its wall-clock limit gets its container replaced.

The pool talks to each container over `docker run -i`'s stdin/stdout, one JSON line per job each way (never
pickle: a container is untrusted). A container is replaced after a job that timed out, ran out of memory, was
killed or broke the runner, and after `jobs_per_container` jobs. A container that dies under a job (its memory
cgroup's OOM killer took the harness or the runner, with nothing of the job's left to take: in a harness container
the programs always go first, their spawner keeping a lower OOM score; its pipe broke; `docker update` failed) is
replaced too: the jobs queued behind that job go to the fresh one, the job itself is rerun once, and a job that kills a
second container gets a `memory_limit` verdict (see `_drive_all`). Containers carry the label `megarl.sandbox` and
are started with `--rm`; `close()` (also run at exit) removes every container the pool started.
Build the default image with `tools/build_sandbox_image.py`, or pass `image=` (any image with `python3`).
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import subprocess
import tempfile
import threading
import time
import uuid
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from megarl.sandbox.base import Job, LineReader, Limits, RunResult, register_sandbox
from megarl.sandbox.guest import isolation
from megarl.sandbox.guest_code import HARNESS_FILES, HARNESS_PREIMPORTS, PREIMPORTS, RUNNER_FILES
from megarl.sandbox.harness_protocol import HarnessBackend, server_verdict

DEFAULT_IMAGE = "megarl-sandbox:latest"
LABEL = "megarl.sandbox"
_RECYCLE_AFTER = {"timeout", "memory_limit", "killed", "sandbox_error"}
# A dead container's replacement is retried once a second this many times (an engine hiccup), then the run fails
# with a message: an engine that is gone must not hold the reward worker forever.
RECYCLE_TRIES = 30
# A job whose container dies under it is rerun once on a fresh container; dying the second time is its verdict.
_KILLS_BEFORE_VERDICT = 2
# A container's memory beyond its job's (case's): the runner (~15 MB measured) or the harness and its spawner
# (~26 MB), and room for page cache. The container's cgroup is what counts the job's memory as a whole.
RUNNER_OVERHEAD_MB, HARNESS_OVERHEAD_MB = 64, 96
# A container's python reads its code as the first line on stdin (any size; argv is capped at 128 KiB): the
# sibling modules are registered under the names the harness loads them by, then the main file runs as __main__.
_BOOT = """
import json, os, sys, types
line = b""
while not line.endswith(b"\\n"):
    chunk = os.read(0, 1 << 20)
    if not chunk:
        sys.exit("no code on stdin")
    line += chunk
files = json.loads(line)
main_name, main_source = files.pop("__main__")
for name, source in files.items():
    module = types.ModuleType("_megarl_sandbox_" + name[:-3])
    sys.modules[module.__name__] = module
    exec(compile(source, name, "exec"), module.__dict__)
del line, files
exec(compile(main_source, main_name, "exec"), {"__name__": "__main__"})
"""


def _bundle(main: str, files: dict[str, str]) -> bytes:
    """The first stdin line of a container: its main file and the sibling modules it loads."""
    siblings = {name: src for name, src in files.items() if name != main}
    return json.dumps({**siblings, "__main__": [main, files[main]]}).encode() + b"\n"


def seccomp_profile() -> dict:
    """Docker's seccomp profile for harness containers: everything allowed but what megarl's own filter refuses
    to programs, minus what the spawner needs to give each program its namespaces (unshare, setns, mounts). The
    harness installs the program filter itself, on top, in every program process; Docker's default profile would
    refuse the spawner its user namespace."""
    needed = {"unshare", "setns", "mount", "umount2", "pivot_root"}
    names = [n for n in isolation.denied_syscall_names() if n not in needed]
    return {"defaultAction": "SCMP_ACT_ALLOW",
            "syscalls": [{"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]}


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
        why = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "docker version failed"
        return f"no Docker engine reachable ({why})"
    r = subprocess.run([docker, "image", "inspect", image], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        return f"image {image!r} not found: build it with `python tools/build_sandbox_image.py --tag {image}`"
    return None


@register_sandbox("docker")
class DockerSandbox(HarnessBackend):
    name = "docker"
    # The `Sandbox` capability: jobs may carry `harness` (the code verifier's fast path). They go to containers
    # whose pid 1 is a persistent trusted harness, which runs case after case, each program in fresh children of
    # a zygote made before any case, and kills every other process of the container after each case.
    harness_server = True

    def __init__(self, workers: int = 2, limits: Limits | None = None, image: str = DEFAULT_IMAGE,
                 python: str = "python3", jobs_per_container: int = 1000, docker: str = "docker",
                 preimports: str = PREIMPORTS):
        self.workers = workers
        self.limits = limits or Limits()
        self.image, self.python, self.docker = image, python, docker
        self.jobs_per_container = jobs_per_container
        self.preimports = preimports
        self._idle: queue.Queue[_Container] | None = None
        self._harness_idle: queue.Queue[_Container] | None = None  # code-harness containers, started on demand
        self._live: set[_Container] = set()
        self._removing: list[threading.Thread] = []  # recycled containers being removed in the background
        self._lock = threading.Lock()  # start/close
        self._live_lock = threading.Lock()
        self._name_prefix = f"megarl-sb-{uuid.uuid4().hex[:8]}-"  # this pool's containers, for close() to check
        self._profile: str | None = None  # the harness containers' seccomp profile, written on first use
        self.started = self.recycled = 0
        self.spawner: dict = {}  # what the first harness container's spawner could set up

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

    def _run_args(self, harness: bool) -> list[str]:
        lim = self.limits
        memory = self._memory_mb(lim.memory_mb, harness)
        args = [self.docker, "run", "-i", "--rm", "--label", LABEL, "--network", "none", "--read-only",
                "--tmpfs", "/tmp:size=64m", "--memory", f"{memory}m", "--memory-swap", f"{memory}m",
                # the runner and its job; the harness, its spawner (two processes) and its program processes
                "--pids-limit", str(lim.processes + (4 if harness else 2)), "--cpus", "1", "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges", "--user", "65534:65534",
                "--ulimit", f"nofile={lim.open_files}", "--ulimit", f"fsize={lim.file_mb << 20}",
                "--log-driver", "none", "--shm-size", "1m", "--security-opt", f"seccomp={self._profile_path()}"]
        return args

    @staticmethod
    def _memory_mb(memory_mb: int, harness: bool) -> int:
        """A container's memory: its job's (case's) allowance plus the runner's (harness's)."""
        return memory_mb + (HARNESS_OVERHEAD_MB if harness else RUNNER_OVERHEAD_MB)

    def _profile_path(self) -> str:
        with self._live_lock:
            if self._profile is None:
                fd, self._profile = tempfile.mkstemp(prefix="megarl-seccomp-", suffix=".json")
                with os.fdopen(fd, "w") as f:
                    json.dump(seccomp_profile(), f)
                atexit.register(_unlink_quietly, self._profile)
        return self._profile

    def _new_container(self, harness: bool = False) -> "_Container":
        name = f"{self._name_prefix}{uuid.uuid4().hex[:12]}"
        if harness:  # pid 1: the code verifier's persistent harness (guest/harness.py's serve), not the runner
            cfg = {"preimports": HARNESS_PREIMPORTS, "memory_mb": self.limits.memory_mb, "memory_accounted": True,
                   "nproc_extra": 3}  # the container's cgroup counts every page; the spawner runs as the programs
            code = _bundle("harness.py", HARNESS_FILES)
            command = [self.python, "-I", "-c", _BOOT, "--serve", json.dumps(cfg)]
        else:
            code = _bundle("jobexec.py", RUNNER_FILES)
            command = [self.python, "-I", "-c", _BOOT, json.dumps({"preimports": self.preimports})]
        container = (_HarnessContainer if harness else _Container)(
            name, self._run_args(harness) + ["--name", name, self.image] + command, self.docker, code,
            self._memory_mb(self.limits.memory_mb, harness))
        with self._live_lock:
            self._live.add(container)
            self.started += 1
        return container

    def _harness_pool(self) -> "queue.Queue[_Container]":
        self.start()
        with self._lock:
            if self._harness_idle is None:
                idle: queue.Queue[_Container] = queue.Queue()
                with ThreadPoolExecutor(self.workers) as pool:
                    for container in pool.map(lambda _: self._new_container(harness=True), range(self.workers)):
                        idle.put(container)
                        self.spawner = container.hello.get("spawner", {})
                missing = self.spawner.get("missing") or ([] if self.spawner.get("fresh") else ["no namespaces"])
                if missing:
                    warnings.warn("megarl sandbox (docker backend): the harness containers' spawner could not set "
                                  f"up fresh namespaces per case ({'; '.join(missing)}): program processes share the "
                                  "container's pid counter and /tmp, cleaned between cases", RuntimeWarning,
                                  stacklevel=3)
                if not self.spawner.get("denials_counted"):
                    warnings.warn("megarl sandbox (docker backend): no seccomp user notification in the harness "
                                  "containers: the program filter refuses what it refused before, but the refusals "
                                  "are not counted for the reward-hacking signals", RuntimeWarning, stacklevel=3)
                self._harness_idle = idle
        return self._harness_idle

    def _pool_for(self, wire: dict) -> "queue.Queue[_Container]":
        return self._harness_pool() if "harness" in wire else self._idle

    def run(self, job: Job) -> RunResult:
        self.start()
        wire = job.to_wire(self.limits)
        return self._drive_all([wire], self._pool_for(wire), drivers=1, depth=1)[0]

    def _recycle(self, old: "_Container") -> "_Container":
        with self._live_lock:
            self._live.discard(old)
            self.recycled += 1
        remover = threading.Thread(target=old.remove, daemon=True)
        remover.start()
        with self._live_lock:
            self._removing = [t for t in self._removing if t.is_alive()] + [remover]
        for _ in range(RECYCLE_TRIES):
            try:
                return self._new_container(harness=isinstance(old, _HarnessContainer))
            except Exception as e:  # noqa: BLE001 - engine hiccup: retry rather than shrink the pool
                error = e
                time.sleep(1)
        raise RuntimeError(f"docker sandbox: no fresh container after {RECYCLE_TRIES} tries over ~{RECYCLE_TRIES} s "
                           f"(is the Docker engine at DOCKER_HOST={os.environ.get('DOCKER_HOST', '(default)')} still "
                           f"running?); the last error: {error}")

    def run_many(self, jobs: Sequence[Job], depth: int = 4) -> list[RunResult]:
        """Like `run` for each job, with up to `depth` jobs queued in each container: the next job is already in
        the runner's stdin while one runs, which hides the round trip through the Docker daemon."""
        self.start()
        wires = [job.to_wire(self.limits) for job in jobs]
        if any("harness" in wire for wire in wires) and not all("harness" in wire for wire in wires):
            with ThreadPoolExecutor(self.workers) as pool:  # mixed kinds: one at a time, each to its own pool
                return list(pool.map(self.run, jobs))
        idle = self._pool_for(wires[0]) if wires else self._idle
        return self._drive_all(wires, idle, drivers=self.workers, depth=depth)

    def _drive_all(self, wires: list[dict], idle: "queue.Queue[_Container]", drivers: int,
                   depth: int) -> list[RunResult]:
        """Run `wires` on `drivers` containers taken from `idle`, up to `depth` queued in each.

        A container that dies (its `docker run` exits, its pipe breaks, `docker update` fails, the harness loses its
        spawner) is replaced by a fresh one. The jobs queued behind the one it was running had not started: they go
        back to the queue, whatever happened. The job it was running is rerun once on a fresh container; a job
        that kills a second container gets `died` (out of memory: the container's memory cgroup is the only limit
        that kills a container's harness or runner). So every job gets its own verdict, in a bounded number of
        containers (at most two per job)."""
        results: list[RunResult | None] = [None] * len(wires)
        todo = deque(range(len(wires)))
        killed = [0] * len(wires)  # containers that died while the job ran (or could not be given it)
        lock = threading.Lock()

        def take():
            with lock:
                return todo.popleft() if todo else None

        def requeue(indices):
            with lock:
                todo.extendleft(reversed(list(indices)))

        def fault(i: int, container: _Container, error: _Died) -> None:
            with lock:
                killed[i] += 1
                if killed[i] < _KILLS_BEFORE_VERDICT:
                    todo.appendleft(i)  # once more, on a fresh container
                    return
            results[i] = container.died(wires[i], error, killed[i])

        def drive():
            container = idle.get()
            inflight: deque[int] = deque()
            draining = False  # no more jobs for this container: it is replaced once what it holds is answered
            try:
                while True:
                    while not draining and len(inflight) < depth and (i := take()) is not None:
                        if inflight and wires[i]["limits"]["memory_mb"] != wires[inflight[-1]]["limits"]["memory_mb"]:
                            requeue([i])  # another memory limit: after what is queued has run
                            break
                        try:
                            container.send(wires[i])
                        except _Died as e:
                            draining = True
                            if inflight:  # it died under a job sent before: that job's answer says so
                                requeue([i])
                            else:
                                fault(i, container, e)
                            break
                        inflight.append(i)
                    if inflight:
                        i = inflight.popleft()
                        try:
                            results[i] = container.receive(wires[i]["limits"]["wall_s"] + container.grace_s, wires[i])
                        except _Died as e:  # it died running job i: the jobs queued behind it had not started
                            fault(i, container, e)
                            requeue(inflight)
                            inflight.clear()
                            draining = True
                        except Exception as e:  # noqa: BLE001 - the container broke: its queued jobs go back
                            results[i] = container.failure(wires[i], e)
                            requeue(inflight)
                            inflight.clear()
                            draining = True
                        else:
                            if container.stuck:  # still running job i: the jobs behind it never will
                                requeue(inflight)
                                inflight.clear()
                            if results[i].status in _RECYCLE_AFTER or container.jobs >= self.jobs_per_container:
                                draining = True
                    elif not draining:
                        return
                    if draining and not inflight:
                        container, draining = self._recycle(container), False
            finally:
                idle.put(container)

        with ThreadPoolExecutor(drivers) as pool:
            for future in [pool.submit(drive) for _ in range(drivers)]:
                future.result()
        return results

    def describe(self) -> str:
        return (f"docker, {self.workers} warm containers of {self.image}: no network, read-only root, the job's "
                f"memory + {RUNNER_OVERHEAD_MB} MB, {self.limits.processes + 2} pids, 1 CPU, no capabilities, "
                "no-new-privileges, uid 65534, no log driver, megarl's seccomp profile; each job in a pid "
                "namespace of its own with a minimal root, fresh tmpfs /tmp and /dev/shm, Landlock and the program "
                "seccomp filter, where the engine allows a user namespace (else the pid-1 runner kills all and "
                "cleans up after each job)")

    def containers(self) -> list[str]:
        """Ids of this pool's containers that Docker still has (running or not): none after `close()`."""
        out = subprocess.run([self.docker, "ps", "-aq", "--filter", f"name={self._name_prefix}"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.split()

    def close(self) -> None:
        with self._lock, self._live_lock:
            live, self._live, self._idle, self._harness_idle = list(self._live), set(), None, None
            removing, self._removing = self._removing, []
        for container in live:
            container.remove()
        for remover in removing:  # nothing left behind: recycled ones too
            remover.join(timeout=120)
        # A container whose `docker run` was still starting when it was removed can appear afterwards (the daemon
        # creates it once the client gets through; on a loaded host that takes seconds). Remove what is left of
        # this pool's containers until none is, for at most 60 s.
        deadline = time.monotonic() + 60
        while True:
            try:
                left = self.containers()
            except (OSError, subprocess.TimeoutExpired):
                return
            if not left or time.monotonic() > deadline:
                return
            subprocess.run([self.docker, "rm", "-f", *left], capture_output=True, timeout=60)
            time.sleep(0.5)


class _Died(Exception):
    """The container cannot run another job: its `docker run` exited, its pipe broke, `docker update` failed, or
    its harness lost its spawner (and exits). `running`: it died while running the job (not while being given it);
    `results`: the results of the tests that job finished (harness containers)."""

    def __init__(self, message: str, running: bool = True, results: list | None = None):
        super().__init__(message)
        self.running, self.results = running, results or []


class _Container:
    grace_s = 30.0  # past the job's wall-clock limit, which the runner enforces itself
    stuck = False  # still running a job the pool gave up on: the jobs queued behind it will never run

    def __init__(self, name: str, argv: list[str], docker: str, code: bytes, memory_mb: int):
        self.name, self.docker, self.jobs, self.memory_mb = name, docker, 0, memory_mb
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self._lines = LineReader(self.proc.stdout.fileno())
        try:
            self.proc.stdin.write(code)
            self.proc.stdin.flush()
            self.hello = json.loads(self._readline(60))
        except Exception:
            self.remove()
            raise

    def send(self, wire: dict) -> None:
        """Queue a job; first, where its memory differs from the last job's, the container's memory follows
        (`docker update`): the container's cgroup is what counts a job's memory as a whole."""
        if self.proc.poll() is not None:
            raise _Died(f"container {self.name}: its `docker run` exited (status {self.proc.returncode})", False)
        wanted = DockerSandbox._memory_mb(wire["limits"]["memory_mb"], isinstance(self, _HarnessContainer))
        if wanted != self.memory_mb:
            try:
                subprocess.run([self.docker, "update", "--memory", f"{wanted}m", "--memory-swap", f"{wanted}m",
                                self.name], capture_output=True, text=True, timeout=60, check=True)
            except subprocess.CalledProcessError as e:
                why = e.stderr.strip().splitlines()[-1] if e.stderr.strip() else f"exit status {e.returncode}"
                raise _Died(f"container {self.name}: `docker update --memory {wanted}m` failed: {why}", False) from e
            except subprocess.TimeoutExpired as e:
                raise _Died(f"container {self.name}: `docker update` did not answer in 60 s", False) from e
            self.memory_mb = wanted
        self.jobs += 1
        try:
            self.proc.stdin.write(json.dumps(self._message(wire)).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as e:
            raise _Died(f"container {self.name}: its stdin: {e}", False) from e

    def _message(self, wire: dict) -> dict:
        return wire

    def receive(self, timeout: float, wire: dict) -> RunResult:
        try:
            line = self._readline(timeout)
        except (EOFError, OSError) as e:
            raise _Died(f"container {self.name}: {e}") from e
        if len(line) > 64 << 20:
            raise ValueError("oversized answer")
        return RunResult.from_wire(json.loads(line))

    def failure(self, wire: dict, error: Exception) -> RunResult:
        return RunResult.error(f"container {self.name}: {error}")

    def died(self, wire: dict, error: _Died, kills: int) -> RunResult:
        """The verdict of a job whose container died under it `kills` times (each time a fresh container but the
        first): out of memory, since the container's memory cgroup is the only limit that kills it; or, for a job
        no container could be given, the error."""
        if not error.running:
            return RunResult.error(f"no container could be given the job ({kills} tried): {error}")
        return RunResult(status="memory_limit", detail=self._died_detail(wire, error, kills))

    @staticmethod
    def _died_detail(wire: dict, error: _Died, kills: int) -> str:
        return (f"out of memory: the job killed its container {kills} times (rerun on a fresh one), which only its "
                f"memory limit of {wire['limits']['memory_mb']} MB does; last: {error}")

    def _readline(self, timeout: float) -> bytes:
        return self._lines.readline(timeout, lambda: "the container's runner exited")

    def remove(self) -> None:
        try:
            self.proc.stdin.close()  # the runner (or harness) exits at EOF, and --rm removes the container
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


class _HarnessContainer(_Container):
    """A container whose pid 1 is the persistent code harness: a case line in; a line per test result as each
    is done, then a final line, out. The run's secret is added here, never sent into the container; a case cut
    short (its wall-clock limit, a harness that died) keeps the results of the tests it finished."""

    grace_s = 2.0  # the job's wall-clock limit is this pool's to enforce: the harness has none of its own

    def _message(self, wire: dict) -> dict:
        return {**wire["harness"], "limits": wire["limits"]}

    def receive(self, timeout: float, wire: dict) -> RunResult:
        start = time.monotonic()
        results: list = []
        try:
            while True:
                left = max(0.0, timeout - (time.monotonic() - start))
                line = json.loads(self._readline(left))
                if line.get("done"):
                    break
                results.append(line["r"])
            final, status, detail = line, "ok", line.get("error", "")
        except TimeoutError:  # the caller recycles the container: its pid 1 dies and all with it
            final, status = {"incomplete": "timeout"}, "timeout"
            detail = f"wall-clock limit of {wire['limits']['wall_s']} s"
            self.stuck = True
        except (EOFError, OSError, ValueError) as e:
            raise _Died(f"container {self.name}: {e}", results=results) from e
        if str(final.get("error", "")).startswith("spawner:"):  # the harness exits after this answer
            raise _Died(f"container {self.name}: {final['error']}", results=results)
        return self._result(wire, final, results, status, detail, start)

    @staticmethod
    def _result(wire: dict, final: dict, results: list, status: str, detail: str, start: float) -> RunResult:
        return RunResult(status=status, exit_code=0 if status == "ok" else None, detail=detail,
                         wall_s=round(time.monotonic() - start, 4), cpu_s=final.get("cpu_s", 0.0),
                         stdout=server_verdict(wire["stdin"].strip(), final, results),
                         seccomp_denied=final.get("seccomp_denied", {}))

    def died(self, wire: dict, error: _Died, kills: int) -> RunResult:
        """The case's verdict: the tests that passed before the container died, then a `memory_limit` failure (see
        `_Container.died`); a failure the harness reported in the same case may be the death seen from the harness
        (a program whose pipe broke), so the memory failure stands for it."""
        if not error.running:
            return super().died(wire, error, kills)
        detail = self._died_detail(wire, error, kills)
        passed = [r for r in error.results if isinstance(r, dict) and r.get("ok")]
        return self._result(wire, {"incomplete": "memory_limit", "error": detail}, passed, "memory_limit", detail,
                            time.monotonic())


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass

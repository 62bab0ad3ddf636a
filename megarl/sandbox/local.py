"""The local backend: pre-forked worker processes that fork a confined child per job.

Per worker (once, at start): a network namespace (with a user namespace first when not root), the preimports,
O_PATH handles of the read-only roots. Per job: worker -> R (unshares a pid namespace) -> I (pid 1 there, the
supervisor, trusted) -> P (the program: unprivileged uid or no capabilities, rlimits, Landlock, seccomp, fresh
cwd). When I exits the kernel kills whatever P left in the namespace, detached or not.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import json
import logging
import os
import queue
import select
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from megarl.sandbox.base import Job, LineReader, Limits, RunResult, register_sandbox
from megarl.sandbox.guest import cgroups
from megarl.sandbox.guest import isolation as iso_mod
from megarl.sandbox.guest.jobexec import address_space_base, compiled, remove_tree, run_program, write_all, write_files
from megarl.sandbox.guest.spawner import forked_ok, unshare_fork_setns
# (HARNESS_FILES and PREIMPORTS were defined here until they moved to guest_code.py; the names stay importable from
# this module until megarl 0.3)
from megarl.sandbox.guest_code import HARNESS_FILES, HARNESS_PATH, HARNESS_PREIMPORTS, PREIMPORTS  # noqa: F401
from megarl.sandbox.harness_protocol import HarnessBackend, server_verdict

log = logging.getLogger(__name__)

HARNESS_MB = 1024  # the persistent harness and its spawner: their memory cgroup holds twice this
_TMP, _SHM, _WORK = "/tmp", "/dev/shm", "/tmp/w"  # a job's (and a case's) own tmpfs mounts, and its cwd
_TMPFS_INODES = 16384
UID_BASE = 1_600_000_000  # job uids from here: far above any account, so a job's files belong to nobody real
_START_TIMEOUT_S = 30.0
_WARNED: set[str] = set()
_UID_SLOTS = itertools.count()
_LIVE_SLOTS: set[int] = set()  # the uid slots (mod 16) of this process's sandboxes until their close()
_SLOTS_LOCK = threading.Lock()


@register_sandbox("local")
class LocalSandbox(HarnessBackend):
    """`workers` pre-forked workers; jobs beyond that queue. Starts lazily; `close()` (or exit) stops it."""

    name = "local"

    def __init__(self, workers: int = 2, limits: Limits | None = None, preimports: str = PREIMPORTS,
                 uid_base: int = UID_BASE):
        self.workers = workers
        self.limits = limits or Limits()
        self.preimports = preimports
        self.uid_base = uid_base
        self._idle: queue.Queue[_Worker] | None = None
        self._all: list[_Worker] = []
        self._root: str | None = None
        self._lock = threading.Lock()
        self.isolation: iso_mod.HostIsolation | None = None
        self._uid_slot: int | None = None
        self._cgroup: cgroups.MemoryCgroup | None = None  # this sandbox's; its workers' below it

    def __getstate__(self):  # picklable into reward workers: configuration only, started again there
        return {"workers": self.workers, "limits": self.limits, "preimports": self.preimports,
                "uid_base": self.uid_base}

    def __setstate__(self, state):
        self.__init__(**state)

    def start(self) -> "LocalSandbox":
        with self._lock:
            if self._idle is not None:
                return self
            # Job directories on tmpfs where there is one: creating and removing them per job is then cheap.
            # (only where the job uid can walk there: a job's exec'd process has no capability to pass a 0700 dir)
            shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) and iso_mod.world_traversable("/dev/shm") else None
            self._root = tempfile.mkdtemp(prefix="megarl-sandbox-", dir=shm)
            os.chmod(self._root, 0o711)
            memory_root, self._no_cgroup = cgroups.find_memory_root()
            if memory_root is not None:
                self._cgroup = memory_root.child(f"megarl-sandbox-{os.getpid()}-{self.uids()[0]}")
            self._idle = queue.Queue()
            for i in range(self.workers):
                worker = self._spawn(i)
                self._all.append(worker)
                self._idle.put(worker)
            self.isolation = iso_mod.HostIsolation(**self._all[0].isolation)
            if self._cgroup is None:
                self.isolation.warnings.append(
                    f"no memory cgroup ({self._no_cgroup}): memory is bounded per process (RLIMIT_AS), files by "
                    "the size of each job's tmpfs mounts, memfds are refused; a job may still hold about "
                    "processes x memory_mb")
            _warn_once(self.isolation)
            atexit.register(self.close)
        return self

    def _spawn(self, index: int) -> "_Worker":
        cfg = {"index": index, "root": self._root, "uid": self.uids()[index], "preimports": self.preimports,
               "cgroup": self._cgroup and {"path": os.path.join(self._cgroup.path, f"w{index}"),
                                           "version": self._cgroup.version}}
        return _Worker(cfg)

    def uids(self) -> list[int]:
        """The job uids of this sandbox's workers (root hosts): one per worker, distinct between sandboxes (of
        this process: by start order; of others: by pid), so RLIMIT_NPROC and the uid sweep never count or
        reach another's jobs, and nothing run for one sandbox (e.g. its persistent code harnesses) is taken
        for another's leftovers."""
        if self._uid_slot is None:  # the next slot in turn that no open sandbox of this process holds: the 17th
            # sandbox of a process would otherwise share the uids and the memory cgroup of the 1st, and closing
            # either removed the other's empty cgroups (a case's), failing its next case
            with _SLOTS_LOCK:
                for _ in range(16):
                    slot = next(_UID_SLOTS) % 16
                    if slot not in _LIVE_SLOTS:
                        break
                else:
                    raise RuntimeError("more than 16 local sandboxes open at once in one process")
                _LIVE_SLOTS.add(slot)
                self._uid_slot = slot
        base = self.uid_base + (os.getpid() % 400_000) * 16 * 256 + self._uid_slot * 256
        return [base + i for i in range(self.workers)]

    def run(self, job: Job) -> RunResult:
        self.start()
        wire = job.to_wire(self.limits)
        worker = self._idle.get()
        try:
            result = worker.run(wire, timeout=wire["limits"]["wall_s"] + 30)
        except Exception as e:  # noqa: BLE001 - a worker died or hung: replace it, report the job as lost
            log.warning("sandbox worker %d failed (%s); restarting it", worker.cfg["index"], e)
            worker.kill()
            replacement = self._spawn(worker.cfg["index"])
            self._all[self._all.index(worker)] = replacement
            worker = replacement
            result = RunResult.error(f"worker failed: {e}")
        finally:
            self._idle.put(worker)
        return result

    @property
    def harness_server(self) -> bool:  # the `Sandbox` capability
        """Whether jobs may carry `harness` (the code verifier's fast path): each worker then keeps one trusted
        harness process, pid 1 of its own pid namespace, that runs case after case, each program in fresh forked
        children, and kills everything a case left behind. Needs a pid namespace; without one the verifier sends
        the harness as an ordinary job."""
        self.start()
        return self.isolation.pid_ns

    def run_many(self, jobs: Sequence[Job]) -> list[RunResult]:
        self.start()
        with ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(self.run, jobs))

    def describe(self) -> str:
        self.start()
        memory = f"memory cgroup v{self._cgroup.version}" if self._cgroup else "NO memory cgroup"
        return f"local, {self.workers} workers: {self.isolation.describe()}, {memory}"

    def close(self) -> None:
        with self._lock:
            for worker in self._all:
                worker.close()
            self._all, self._idle = [], None
            if self._root:
                remove_tree(self._root)
                self._root = None
            if self._cgroup is not None:
                os.close(self._cgroup.dir_fd)
                cgroups.remove_cgroup_tree(self._cgroup.path)
                self._cgroup = None
            if self._uid_slot is not None:
                with _SLOTS_LOCK:
                    _LIVE_SLOTS.discard(self._uid_slot)
                self._uid_slot = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _warn_once(isolation: iso_mod.HostIsolation) -> None:
    for message in isolation.warnings:
        if message not in _WARNED:
            _WARNED.add(message)
            warnings.warn(f"megarl sandbox (local backend): {message}", RuntimeWarning, stacklevel=3)


class _Worker:
    """The parent's handle on one worker process: one JSON line per job each way."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parents[2])] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from megarl.sandbox.local import worker_main; worker_main()", json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        self._lines = LineReader(self.proc.stdout.fileno())
        hello = json.loads(self._readline(_START_TIMEOUT_S))
        self.isolation = hello["isolation"]

    def run(self, wire: dict, timeout: float) -> RunResult:
        self.proc.stdin.write(json.dumps(wire).encode() + b"\n")
        self.proc.stdin.flush()
        return RunResult.from_wire(json.loads(self._readline(timeout)))

    def _readline(self, timeout: float) -> bytes:
        """The worker's next line; EOFError as soon as the worker is dead (a process it started may still hold its
        stdout open: a job's supervisor), TimeoutError after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._lines.readline(min(1.0, max(0.0, deadline - time.monotonic())),
                                            lambda: f"worker exited with status {self.proc.wait()}")
            except TimeoutError:
                if self.proc.poll() is not None:
                    raise EOFError(f"worker exited with status {self.proc.returncode}") from None
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no answer in {timeout:.0f} s") from None

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - whatever stops a clean exit (a broken pipe, a timeout): kill it instead
            self.kill()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


# ---- the worker process -------------------------------------------------------------------------------------

def worker_main() -> None:
    cfg = json.loads(sys.argv[1])
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    worker = _WorkerSide(cfg)
    proto_out.write(json.dumps({"isolation": asdict(worker.iso)}).encode() + b"\n")
    proto_out.flush()
    try:
        for line in iter(proto_in.readline, b""):
            proto_out.write(json.dumps(worker.run(json.loads(line))).encode() + b"\n")
            proto_out.flush()
    finally:
        worker.drop_harness()
        remove_tree(worker.dir)
        try:  # the last worker of a sandbox whose owner died without close() removes the root too
            os.rmdir(cfg["root"])
        except OSError:
            pass


class _WorkerSide:
    def __init__(self, cfg: dict):
        self.iso = iso = probe_and_enter(cfg["uid"])
        self.dir = tempfile.mkdtemp(prefix=f"w{cfg['index']}-", dir=cfg["root"])  # a restarted worker: a new one
        os.chmod(self.dir, 0o711)
        self.jobs = 0
        self.harness: _Harness | None = None
        self.warned = False
        for name in cfg["preimports"].split():
            try:
                __import__(name)
            except ImportError:
                pass
        # Opened once: the read-only roots, for each job's Landlock ruleset.
        self.read_roots = iso_mod.read_roots()
        self.read_fds = [(os.open(p, os.O_PATH | os.O_CLOEXEC), os.path.isdir(p)) for p in self.read_roots]
        self.cgroups = {}
        if cfg.get("cgroup"):  # harness (and its spawner), case (program processes), job (plain jobs)
            base = cgroups.MemoryRoot(cfg["cgroup"]["path"], cfg["cgroup"]["version"])
            self.cgroups = {part: base.child(part) for part in ("harness", "case", "job")}
            self.cgroups["harness"].set_limit(2 * HARNESS_MB)
        self.job_memory_mb = 0
        self.seccomp = iso_mod.seccomp_program(deny_memfd=not self.cgroups) if iso.seccomp else None
        self.supervised = iso_mod.seccomp_program(deny_memfd=not self.cgroups, notify=True) \
            if iso.seccomp_notify else None
        self.base_vsize = address_space_base()
        gc.freeze()  # what exists now is never scanned by a job's collector: fewer copy-on-write page copies per fork
        self.pidns_fd = None
        if iso.pid_ns and iso.root:
            fd = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            if forked_ok(lambda: unshare_fork_setns(iso_mod, fd)):
                self.pidns_fd = fd
        self.private_tmp = forked_ok(lambda: iso_mod.unshare(iso_mod.CLONE_NEWNS | iso_mod.CLONE_NEWIPC))

    def run(self, job: dict) -> dict:
        self.jobs += 1
        if job.get("harness") is not None:
            return self._run_harness(job)
        workdir = None if self.private_tmp else os.path.join(self.dir, f"j{self.jobs}")
        try:
            if workdir is not None:  # no mount namespace: a directory of this worker's, removed after the job
                os.mkdir(workdir, 0o700)
                write_files(workdir, job.get("files", {}))
                self._chown_tree(workdir)
            if self.iso.uid is not None:
                job["limits"]["nproc"] = job["limits"]["processes"]  # the uid is this worker's alone
            elif self.iso.user_ns:  # counted per user namespace (Linux >= 5.14): this worker, I and the job
                job["limits"]["nproc"] = job["limits"]["processes"] + 3
            if "job" in self.cgroups and job["limits"]["memory_mb"] != self.job_memory_mb:
                self.cgroups["job"].set_limit(job["limits"]["memory_mb"])
                self.job_memory_mb = job["limits"]["memory_mb"]
            compiled(job["source"])  # here, before the fork: the next jobs with the same source reuse it
            return self._fork_job(job, workdir)
        except Exception as e:  # noqa: BLE001 - report, keep serving
            return {"status": "sandbox_error", "detail": f"worker: {type(e).__name__}: {e}"}
        finally:
            if workdir is not None:
                remove_tree(workdir)

    def _chown_tree(self, workdir: str) -> None:
        if self.iso.uid is None:
            return
        for base, dirs, files in os.walk(workdir):
            for name in [base] + [os.path.join(base, n) for n in dirs + files]:
                os.chown(name, self.iso.uid, self.iso.uid)

    def _run_harness(self, job: dict) -> dict:
        """One code-verifier case through this worker's persistent harness. Its answer lines (a result per test
        as each is done, then a final line) become the verdict line, with the run's secret added here: the
        harness never has it. A case cut short (its wall-clock limit, a harness that died) keeps the results of
        the tests it finished."""
        lim, start = job["limits"], time.monotonic()
        results: list = []
        final: dict = {}
        try:
            if not self.iso.pid_ns:
                raise OSError("no pid namespace on this host")
            if self.harness is None:
                self.harness = _Harness(self, os.path.join(self.dir, f"h{self.jobs}"))
                missing = self.harness.spawner.get("missing")
                if missing and not self.warned:  # the worker's stderr is its parent's
                    self.warned = True
                    print(f"megarl sandbox (local backend): the code harness's spawner could not set up: "
                          f"{'; '.join(missing)}", file=sys.stderr, flush=True)
            final = self.harness.run_case({**job["harness"], "limits": lim}, lim["wall_s"], results)
            status = "ok"
        except TimeoutError:
            self.drop_harness()  # pid 1 of the namespace dies: everything the case started dies with it
            final, status = {"incomplete": "timeout"}, "timeout"
        except (EOFError, OSError, ValueError) as e:
            self.drop_harness()
            final, status = {"incomplete": "sandbox_error", "error": f"code harness: {type(e).__name__}: {e}"}, \
                "sandbox_error"
        detail = f"wall-clock limit of {lim['wall_s']} s" if status == "timeout" else final.get("error", "")
        return {"status": status, "exit_code": 0 if status == "ok" else None, "detail": detail,
                "wall_s": round(time.monotonic() - start, 4), "cpu_s": final.get("cpu_s", 0.0),
                "stdout": server_verdict(job["stdin"].strip(), final, results),
                "seccomp_denied": final.get("seccomp_denied", {})}

    def drop_harness(self) -> None:
        if self.harness is not None:
            self.harness.kill()
            self.harness = None

    def _fork_job(self, job: dict, workdir: str | None) -> dict:
        r, w = os.pipe2(os.O_CLOEXEC)
        if self.pidns_fd is not None:  # root: I is our own child, one fork less than through R
            iso_mod.unshare(iso_mod.CLONE_NEWPID)
            try:
                pid = os.fork()
                if pid == 0:
                    self._i_main(job, workdir, w)
            finally:
                iso_mod.setns(self.pidns_fd, iso_mod.CLONE_NEWPID)  # our next child is in our own pid ns again
        else:
            pid = os.fork()
            if pid == 0:  # R: the process that unshares, so that its child I is pid 1 of a new namespace
                code = 1
                try:
                    if self.iso.pid_ns:
                        iso_mod.unshare(iso_mod.CLONE_NEWPID)
                    if os.fork() == 0:
                        self._i_main(job, workdir, w)
                    os.close(w)
                    os.wait()
                    code = 0
                finally:
                    os._exit(code)
        os.close(w)
        data = self._read_result(r, pid, job["limits"]["wall_s"] + 10)
        os.close(r)
        os.waitpid(pid, 0)
        if not data:
            return {"status": "sandbox_error", "detail": "the job's supervisor died without a result"}
        return json.loads(data)

    def _i_main(self, job: dict, workdir: str | None, w: int):
        """I: pid 1 of the job's namespace; supervises P, writes the result to `w`, exits (the kernel then kills
        whatever P left in the namespace, and the job's mount and IPC namespaces, its tmpfs files with them,
        are gone). Never returns."""
        code = 1
        try:
            if workdir is None:
                workdir = self._private_tmp(job)
            cleanup = None if self.iso.pid_ns else self._kill_uid
            result = run_program(job, workdir, self.base_vsize, confine=self._confine, cleanup=cleanup,
                                 denials=iso_mod.DenialCounter if self.supervised is not None else None)
            os.write(w, json.dumps(result).encode())
            code = 0
        finally:
            os._exit(code)

    def _private_tmp(self, job: dict) -> str:
        """In I: a mount and IPC namespace of the job's own, fresh tmpfs mounts on /tmp and /dev/shm (each up
        to half the job's memory; a memory cgroup counts them too), the job's files in /tmp/w, its cwd."""
        iso_mod.unshare(iso_mod.CLONE_NEWNS | iso_mod.CLONE_NEWIPC)
        iso_mod.make_mounts_private()
        size = max(1, job["limits"]["memory_mb"] // 2)
        for target in (_TMP, _SHM):  # (what lies beneath of the interpreter's files, e.g. a venv, stays)
            iso_mod.tmpfs_keeping(target, size, _TMPFS_INODES, self.read_roots)
        os.mkdir(_WORK, 0o700)
        write_files(_WORK, job.get("files", {}))
        self._chown_tree(_WORK)
        return _WORK

    def _confine(self, handoff: int | None) -> None:
        """In P, after fork: the job's cgroup, a high OOM score, then drop privileges, Landlock, close every fd
        above 2, seccomp (its listener sent to I on `handoff`, where the filter has a supervisor)."""
        if "job" in self.cgroups:
            self.cgroups["job"].enter()
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
        writes = [_TMP, _SHM, os.devnull] if self.private_tmp else [os.getcwd(), os.devnull]
        iso_mod.Confinement(self.iso, self.read_fds, writes, self.seccomp, self.supervised).apply((), handoff)
        if "random" in sys.modules:  # a fork shares the worker's generator state: reseed from the kernel
            sys.modules["random"].seed()

    @staticmethod
    def _read_result(r: int, pid: int, guard_s: float) -> bytes:
        """I enforces the job's limits; this deadline only guards against I itself hanging."""
        data, deadline = b"", time.monotonic() + guard_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, 9)
                return b""
            chunk = os.read(r, 1 << 20)
            if not chunk:
                return data
            data += chunk

    def _kill_uid(self) -> None:
        """Without a pid namespace: SIGKILL every process of the job's uid (kill(-1) as that uid)."""
        if not self.iso.uid:  # never as root: kill(-1) as root would reach every process on the host
            return
        pid = os.fork()
        if pid == 0:
            try:
                os.setresuid(self.iso.uid, self.iso.uid, self.iso.uid)
                if os.getuid() == self.iso.uid != 0:
                    os.kill(-1, 9)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)


class _Harness:
    """A worker's persistent code harness (`guest/harness.py`'s `serve`): a fresh lean interpreter, pid 1 of its own pid
    namespace, in the worker's `harness` cgroup, answering a line per test result and a final line per case.
    Started on the first case; killed and started again after a case that timed out or broke it."""

    def __init__(self, side: _WorkerSide, workdir: str):
        iso = side.iso
        os.mkdir(workdir, 0o700)
        cfg = {"read_roots": iso_mod.read_roots(), "preimports": HARNESS_PREIMPORTS,
               "isolation": {k: v for k, v in asdict(iso).items() if k != "warnings"},
               # what else runs as the programs' uid: the harness; in a user ns the worker, R and the spawner too
               "nproc_extra": 1 if iso.uid is not None else 4,
               "memory_accounted": bool(side.cgroups), "memory_mb": Limits().memory_mb}
        if side.cgroups:
            cfg["harness_cgroup"] = side.cgroups["harness"].path
            cfg["case_cgroup"] = {"path": side.cgroups["case"].path, "version": side.cgroups["case"].version}
        self.dir, self.err_path = workdir, workdir + ".err"  # its stderr: what it says if it dies
        case_r, self.case_w = os.pipe2(os.O_CLOEXEC)
        ans_r, ans_w = os.pipe2(os.O_CLOEXEC)
        pid_r, pid_w = os.pipe2(os.O_CLOEXEC)
        self.pid = os.fork()
        if self.pid == 0:  # R: unshares the pid namespace so that its child is pid 1 there, then waits on it
            code = 1
            try:
                # R keeps none of the worker's pipes: should the worker die (killed from outside), its parent reads
                # EOF at once, and the harness reads EOF on its case pipe and exits, R with it
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1):
                    os.dup2(null, fd)
                os.close(null)
                os.close(self.case_w)
                os.close(ans_r)
                iso_mod.unshare(iso_mod.CLONE_NEWPID)
                harness = os.fork()
                if harness == 0:
                    os.dup2(case_r, 0)
                    os.dup2(ans_w, 1)
                    os.dup2(os.open(self.err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
                    os.execve(sys.executable, [sys.executable, "-I", HARNESS_PATH, "--serve", json.dumps(cfg)],
                              {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})  # none of the host's environment
                os.write(pid_w, b"%d" % harness)
                os.waitpid(harness, 0)
                code = 0
            finally:
                os._exit(code)
        for fd in (case_r, ans_w, pid_w):
            os.close(fd)
        self.harness_pid = int(os.read(pid_r, 32) or 0)
        os.close(pid_r)
        self.lines = LineReader(ans_r)
        try:
            hello = json.loads(self.lines.readline(_START_TIMEOUT_S, self._last_words))
        except Exception:
            self.kill()
            raise
        if not hello.get("ready"):
            self.kill()
            raise OSError(f"the code harness did not start: {hello!r:.200}")
        self.spawner = hello.get("spawner", {})

    def run_case(self, case: dict, timeout: float, results: list) -> dict:
        """Send a case; collect its results into `results` as they come; its final line. TimeoutError past
        `timeout` seconds, EOFError if the harness dies (`results` holds what came before either)."""
        write_all(self.case_w, json.dumps(case).encode() + b"\n")
        deadline = time.monotonic() + timeout
        while True:
            line = json.loads(self.lines.readline(max(0.0, deadline - time.monotonic()), self._last_words))
            if line.get("done"):
                return line
            results.append(line["r"])

    def _last_words(self) -> str:
        try:
            with open(self.err_path, "rb") as f:
                tail = f.read()[-600:].decode("utf-8", "replace").strip()
        except OSError:
            tail = ""
        return "the code harness exited" + (f": {tail}" if tail else "")

    def kill(self) -> None:
        if self.harness_pid:
            try:
                os.kill(self.harness_pid, 9)
            except ProcessLookupError:
                pass
        os.waitpid(self.pid, 0)
        for fd in (self.case_w, self.lines.fd):
            os.close(fd)
        remove_tree(self.dir)
        try:
            os.unlink(self.err_path)
        except OSError:
            pass


def probe_and_enter(uid: int) -> iso_mod.HostIsolation:
    """Enter the worker's namespaces and find out what jobs can get; every gap becomes a warning."""
    iso = iso_mod.HostIsolation(root=os.geteuid() == 0)
    if iso.root:
        try:
            iso_mod.unshare(iso_mod.CLONE_NEWNET)
            iso.net_ns = True
        except OSError as e:
            iso.warnings.append(f"no network namespace ({e}): jobs share the host's network")
    else:
        try:
            iso_mod.enter_user_namespace(iso_mod.CLONE_NEWNET)
            iso.user_ns = iso.net_ns = True
        except OSError as e:
            iso.warnings.append(f"no user namespaces ({e}): no network or pid namespace; jobs share the host's "
                                "network and a process a job detaches can outlive it")
    iso.pid_ns = forked_ok(lambda: iso_mod.unshare(iso_mod.CLONE_NEWPID))
    if not iso.pid_ns and iso.net_ns:
        iso.warnings.append("no pid namespace: processes a job detaches are killed by uid/process group only")
    if iso.root:
        iso.uid = uid
    iso.landlock_abi = iso_mod.landlock_abi()
    if iso.landlock_abi == 0:
        iso.warnings.append("no Landlock: a job can read and write wherever its uid can (host temp dirs included)")
    elif iso.landlock_abi < 4 and not iso.net_ns:
        iso.warnings.append(f"Landlock ABI {iso.landlock_abi} has no TCP rule and there is no network namespace: "
                            "only the seccomp socket filter keeps jobs off the network")
    if iso.root and not iso_mod.python_install_world_readable():
        if iso.landlock_abi:
            iso.keep_dac_read_search = True
        else:
            iso.warnings.append("the Python install is not readable by the jobs' uid and there is no Landlock to "
                                "confine a read capability: jobs can import only the preimported modules")
    iso.seccomp = iso_mod.seccomp_supported() and forked_ok(
        lambda: (iso_mod.prctl(iso_mod.PR_SET_NO_NEW_PRIVS, 1), iso_mod.seccomp_install(iso_mod.seccomp_program())))
    if not iso.seccomp:
        iso.warnings.append("no seccomp filter on this host/architecture")
    else:
        why = iso_mod.why_no_seccomp_notify()
        iso.seccomp_notify = not why
        if why:
            iso.warnings.append(f"no seccomp user notification ({why}): the program filter refuses what it did, "
                                "but its refusals are not counted for the reward-hacking signals")
    return iso

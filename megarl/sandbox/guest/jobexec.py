"""Run one job in a forked child and supervise it: the part every backend shares.

Standard library only and no megarl imports: the Docker backend ships this file's source into its containers
(`python3 -c <source>`), where `main()` is the container's pid 1 (see `megarl/sandbox/docker.py`).

The job's program is exec'd as `__main__` inside a fork of the calling (pre-warmed) interpreter, so imports the
caller already did cost nothing. Its stdin is a memfd (no writer to deadlock), stdout and stderr are pipes read
here with a byte cap, and the wall-clock deadline is enforced here with SIGKILL of the whole process group.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import resource
import select
import signal
import sys
import time
import traceback

MEMORY_EXIT = 107  # exit status of a program that died of MemoryError (its stderr says so too)
_OPEN_MAX = 1 << 16


def run_program(job: dict, workdir: str, base_vsize: int, confine=None, cleanup=None, fork=os.fork,
                denials=None) -> dict:
    """Fork the job's program, supervise it to its end, then call `cleanup()` (kill what it left behind).

    `confine(handoff)` runs in the child after the standard fds, cwd and rlimits are set; it must close every fd
    above 2. With `denials` (`isolation.DenialCounter`, given a poller), the child's seccomp filter is supervised
    here: `handoff` is the socket it sends its listener on (else None), and the result's `seccomp_denied` counts
    the refusals (the job's processes, and any process they started, all under the filter).
    The address-space limit is `base_vsize` (`address_space_base()` of the long-lived process) plus the job's
    memory: the same for every job, whatever the process has grown to since (a limit that followed it would
    tell a job something of the jobs before it). `fork` makes the job's process (e.g. in a pid namespace of its
    own). Returns the wire form of `RunResult`.
    """
    lim = job["limits"]
    code = compiled(job["source"])
    stdin_fd = os.memfd_create("stdin", os.MFD_CLOEXEC)
    write_all(stdin_fd, job.get("stdin", "").encode())
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    vsize = base_vsize
    poller = select.poll()
    counter = denials(poller) if denials is not None else None
    handoff = counter.expect() if counter is not None else None
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    start = time.monotonic()
    pid = fork()
    if pid < 0:
        raise OSError("could not fork the job's process")
    if pid == 0:  # the program; never returns
        try:
            _child(code if code is not None else job["source"], lim, workdir, stdin_fd, out_w, err_w, vsize,
                   confine, handoff)
        finally:
            os._exit(70)
    for fd in (stdin_fd, out_w, err_w) + ((handoff,) if handoff is not None else ()):
        os.close(fd)
    try:
        result = _supervise(pid, out_r, err_r, lim, start, poller, counter)
    finally:
        if cleanup is not None:
            cleanup()
        if counter is not None:  # every listener closed: a process still blocked on one gets ENOSYS, then dies
            denied = counter.take()
    if counter is not None:
        result["seccomp_denied"] = denied
    for fd in (out_r, err_r):
        os.close(fd)
    return result


def _child(source, lim, workdir, stdin_fd, out_w, err_w, vsize, confine, handoff):
    os.setsid()  # own session and process group: one killpg reaches everything it forks without setsid
    os.dup2(stdin_fd, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.chdir(workdir)
    set_job_rlimits(lim, vsize)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    if confine is not None:
        confine(handoff)
    else:
        close_fds_from(3)
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8",
                                 errors="replace")
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8",
                                  errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True)
    sys.argv = ["main.py"]
    status = 0
    try:
        code = source if not isinstance(source, str) else compile(source, "main.py", "exec")
        exec(code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": builtins})
    except SystemExit as e:
        status = _exit_status(e.code)
    except MemoryError:
        status = MEMORY_EXIT
        os.write(2, b"\nMemoryError\n")
    except BaseException as e:  # noqa: BLE001 - report like the interpreter would, without this frame
        try:
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        except BaseException:  # noqa: BLE001 - the traceback cannot be printed (a broken stderr, a str() that raises)
            pass
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - a stream the program broke or closed: the job's status stands
            pass
    os._exit(status)


def close_fds_from(low: int) -> None:
    """Close every fd >= low. Lists /proc/self/fd: where close_range is filtered (Docker's seccomp profile on
    older engines) `os.closerange` falls back to one close() per number, ~35 ms for 65536."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        os.closerange(low, _OPEN_MAX)
        return
    for fd in fds:
        if fd >= low:
            try:
                os.close(fd)
            except OSError:
                pass


_COMPILED: dict[str, object] = {}


def compiled(source: str):
    """The code object of a source this process ran before (e.g. the code verifier's harness), else None.

    Call it in the long-lived process (worker, container runner) before forking: the fork inherits the cache.
    A source seen for the first time is compiled and kept only if it is large (small programs are cheap to
    compile and rarely repeat); one that does not compile is left to the child, which reports the error.
    """
    code = _COMPILED.get(source)
    if code is None and len(source) > 4096:
        try:
            code = _COMPILED[source] = compile(source, "main.py", "exec")
        except (SyntaxError, ValueError):
            return None
        if len(_COMPILED) > 64:
            _COMPILED.pop(next(iter(_COMPILED)))
    return code


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a code whose str() raises, or a broken stderr: status 1 all the same
        pass
    return 1


def set_job_rlimits(lim: dict, vsize: int) -> None:
    """The rlimits of a job from its limits (`Limits` as a dict); `vsize`: what the forked interpreter maps."""
    cpu = max(1, int(-(-lim["cpu_s"] // 1)))
    _limit(resource.RLIMIT_CPU, cpu, cpu + 1)
    # Address space: what the forked interpreter already maps plus the job's allowance.
    address = vsize + lim["memory_mb"] * (1 << 20)
    _limit(resource.RLIMIT_AS, address, address)
    fsize = lim["file_mb"] * (1 << 20)
    _limit(resource.RLIMIT_FSIZE, fsize, fsize)
    _limit(resource.RLIMIT_NOFILE, lim["open_files"], lim["open_files"])
    _limit(resource.RLIMIT_CORE, 0, 0)
    if "nproc" in lim:  # set by the backend only where it is per job (a dedicated uid)
        _limit(resource.RLIMIT_NPROC, lim["nproc"], lim["nproc"])


def _limit(which: int, soft: int, hard: int) -> None:
    """Lower a limit; never above a hard limit the caller already has (raising one needs CAP_SYS_RESOURCE)."""
    _, current = resource.getrlimit(which)
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (soft, hard))


def _supervise(pid: int, out_r: int, err_r: int, lim: dict, start: float, poller, denials) -> dict:
    """Read the job's output and wait for its end, answering its seccomp refusals (`denials`) on the way: the
    job waits for each answer, so they are served in the same loop, as they come."""
    pidfd = os.pidfd_open(pid)
    for fd in (out_r, err_r, pidfd):
        poller.register(fd, select.POLLIN)
    bufs = {out_r: bytearray(), err_r: bytearray()}
    cap = lim["output_bytes"]
    deadline = start + lim["wall_s"]
    reason = None
    exited = False
    while not exited and reason is None:
        left = deadline - time.monotonic()
        if left <= 0:
            reason = "timeout"
            break
        for fd, events in poller.poll(max(1, int(left * 1000))):
            if denials is not None and denials.handle(fd, events):
                continue
            if fd == pidfd:
                exited = True
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                poller.unregister(fd)
            else:
                bufs[fd] += chunk
                if len(bufs[fd]) > cap:
                    reason = "output_limit"
    if reason is not None:
        _kill(pid)
    _, wstatus, ru = os.wait4(pid, 0)
    wall = time.monotonic() - start
    os.close(pidfd)
    _kill(pid)  # the process group: children it forked without leaving it
    for fd in (out_r, err_r):  # what is already in the pipes; never wait for a writer that may outlive the job
        _drain(fd, bufs[fd], cap)
    stdout, stderr = bytes(bufs[out_r][:cap]), bytes(bufs[err_r][:cap])
    cpu = ru.ru_utime + ru.ru_stime
    peak_mb = ru.ru_maxrss / 1024
    result = {"exit_code": None, "signal": None, "wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
              "peak_mb": round(peak_mb, 1), "stdout": stdout.decode("utf-8", "replace"),
              "stderr": stderr.decode("utf-8", "replace"), "detail": ""}
    if os.WIFSIGNALED(wstatus):
        result["signal"] = os.WTERMSIG(wstatus)
    else:
        result["exit_code"] = os.WEXITSTATUS(wstatus)
    result["status"], result["detail"] = classify(reason, result, lim, stderr)
    return result


def classify(reason, r: dict, lim: dict, stderr: bytes) -> tuple[str, str]:
    if reason == "timeout":
        return "timeout", f"wall-clock limit of {lim['wall_s']} s"
    if reason == "output_limit":
        return "output_limit", f"more than {lim['output_bytes']} bytes of output"
    sig = r["signal"]
    if sig is not None:
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and r["cpu_s"] >= lim["cpu_s"] - 0.05):
            return "timeout", f"CPU limit of {lim['cpu_s']} s"
        if sig == signal.SIGXFSZ:
            return "output_limit", f"a file larger than {lim['file_mb']} MB"
        if sig == signal.SIGKILL and r["peak_mb"] >= 0.9 * lim["memory_mb"]:
            return "memory_limit", "killed near the memory limit (out of memory)"
        return "killed", f"killed by signal {sig}"
    if r["exit_code"] == MEMORY_EXIT and b"MemoryError" in stderr[-4096:]:
        return "memory_limit", f"MemoryError under a limit of {lim['memory_mb']} MB"
    if r["exit_code"] == 0:
        return "ok", ""
    return "nonzero_exit", ""


def _kill(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _drain(fd: int, buf: bytearray, cap: int) -> None:
    os.set_blocking(fd, False)
    while len(buf) <= cap:
        try:
            chunk = os.read(fd, 1 << 16)
        except (BlockingIOError, OSError):
            return
        if not chunk:
            return
        buf += chunk


def write_all(fd: int, data: bytes) -> None:
    """All of `data` to `fd` (one `os.write` may take less)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def address_space_base(slack_mb: int = 64) -> int:
    """What this process maps now plus `slack_mb` for what it may add, rounded up to 64 MiB (so that two
    processes with the same imports get the same figure): the base of the address-space limit of its jobs."""
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") + (slack_mb << 20)
    return -(-size // (64 << 20)) * (64 << 20)


def write_files(workdir: str, files: dict) -> None:
    """Write the job's files under `workdir`; a path that leaves it is an error."""
    root = os.path.realpath(workdir)
    for rel, text in files.items():
        path = os.path.realpath(os.path.join(root, rel))
        if not path.startswith(root + os.sep):
            raise ValueError(f"job file {rel!r} is outside the job directory")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def remove_tree(path: str) -> None:
    """Remove a directory tree of any depth or mode a job left, without recursion and without long paths: the
    entries of each subdirectory are moved up into the top directory (fd-relative renames), then the emptied
    subdirectory goes; never touches the directory that holds `path`."""
    try:
        os.chmod(path, 0o700, follow_symlinks=False)
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    except OSError:  # not a directory (or a symlink): just the entry itself
        _unlink(path)
        return
    try:
        while entries := list(os.scandir(top)):
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    _hoist(top, entry.name)
                else:
                    _unlink(entry.name, top)
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass


def _hoist(top: int, name: str) -> None:
    """Move the entries of `top/name` into `top` (under fresh names), then remove the empty `top/name`."""
    import uuid

    try:
        os.chmod(name, 0o700, dir_fd=top)
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
    except FileNotFoundError:
        return
    try:
        for child in [e.name for e in os.scandir(sub)]:
            os.rename(child, f".rm-{uuid.uuid4().hex}", src_dir_fd=sub, dst_dir_fd=top)
    finally:
        os.close(sub)
    os.rmdir(name, dir_fd=top)


# ---- the Docker container's pid 1 --------------------------------------------------------------------------

def _kill_all_but_me() -> None:
    """As the container's pid 1: SIGKILL every other process and reap them all, orphans included."""
    if os.getpid() != 1:
        raise RuntimeError("refusing kill(-1) outside a container's pid 1")
    try:
        os.kill(-1, signal.SIGKILL)  # every process we may signal but ourselves
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def main() -> None:
    """Container pid 1: read jobs as JSON lines on stdin, answer results as JSON lines on stdout."""
    if os.getpid() != 1:  # it SIGKILLs every process it may signal after each job: only ever as a container's init
        sys.exit("jobexec.main runs only as pid 1 of a container (it kills every other process it can signal)")
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    base = "/tmp"
    cfg = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    for name in cfg.get("preimports", "").split():  # imports done once, shared by every fork
        try:
            __import__(name)
        except ImportError:
            pass
    base_vsize = address_space_base()  # (/proc is out of sight in the minimal root)
    iso = sys.modules.get("_megarl_sandbox_isolation")
    denials = iso.DenialCounter if iso is not None and iso.seccomp_supported() and \
        not iso.why_no_seccomp_notify() else None
    setup = _fresh_setup(denials is not None)  # before becoming non-dumpable (which forbids mapping a user
    _set_nondumpable()  # namespace); after it this process may be pid 1 of a namespace of its own. Non-dumpable:
    # no job ptraces us
    confine = _job_filter(denials is not None) if setup is None else (
        lambda handoff: setup.confinement.apply((), handoff))
    import gc

    gc.freeze()  # fewer copy-on-write page copies in each forked job
    stdout.write(json.dumps({"ready": True, "python": sys.version.split()[0],
                             "spawner": setup.describe() if setup else {}}).encode() + b"\n")
    stdout.flush()
    for n, line in enumerate(iter(stdin.readline, b"")):
        workdir = "/tmp/w" if setup is not None else os.path.join(base, f"job{n}")
        try:
            job = json.loads(line)
            if setup is not None:
                setup.begin(job["limits"]["memory_mb"])
            else:
                os.mkdir(workdir, 0o700)
            write_files(workdir, job.get("files", {}))
            result = run_program(job, workdir, base_vsize, confine=confine, cleanup=_kill_all_but_me,
                                 fork=setup.fork_raw if setup is not None else os.fork,
                                 denials=denials if confine is not None else None)
        except Exception as e:  # noqa: BLE001 - one bad job must not take the runner down
            result = {"status": "sandbox_error", "detail": f"runner: {type(e).__name__}: {e}"}
        _kill_all_but_me()
        if setup is not None:  # fresh tmpfs /tmp and /dev/shm: nothing of this job is left for the next
            setup.fresh_state()
        else:
            for scratch in (base, "/dev/shm"):  # the container's only writable places: leave nothing
                for entry in _listdir(scratch):
                    remove_tree(os.path.join(scratch, entry)) if os.path.isdir(os.path.join(scratch, entry)) \
                        else _unlink(os.path.join(scratch, entry))
        stdout.write(json.dumps(result).encode() + b"\n")
        stdout.flush()


def _fresh_setup(supervised: bool):
    """In a container shipped with megarl's `spawner` (the Docker backend's bundle), and allowed a user
    namespace: each job gets what the code harness's programs get (a pid namespace of its own, a minimal root,
    fresh tmpfs mounts, Landlock, the program seccomp filter, `supervised` or not). None otherwise (the runner
    then cleans up)."""
    spawner = sys.modules.get("_megarl_sandbox_spawner")
    iso = sys.modules.get("_megarl_sandbox_isolation")
    if spawner is None or iso is None:
        return None
    host = iso.HostIsolation(landlock_abi=iso.landlock_abi(), seccomp=iso.seccomp_supported(),
                             seccomp_notify=supervised)
    cfg = {"fresh": True, "isolation": {"landlock_abi": host.landlock_abi, "seccomp": host.seccomp,
                                        "seccomp_notify": host.seccomp_notify},
           "read_roots": iso.read_roots(), "memory_mb": 256, "memory_accounted": True}
    setup = spawner.FreshSetup(cfg, iso)
    setup.enter()
    return setup if setup.mounted and setup.pid_ns_fd is not None else None


def _job_filter(supervised: bool):
    """In a container shipped with `isolation` (megarl's Docker backend): each job, on top of the container's
    confinement, runs under the program seccomp filter (no SysV IPC or message queue that could outlive it, no
    namespace, no socket but socketpair; `supervised`, its listener sent on the handoff socket) with a high OOM
    score. None where the module is not there."""
    iso = sys.modules.get("_megarl_sandbox_isolation")
    if iso is None or not iso.seccomp_supported():
        return None
    program = iso.seccomp_program()
    notify_fprog = iso.sock_fprog(iso.seccomp_program(notify=True)) if supervised else None

    def confine(handoff):
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
        iso.prctl(iso.PR_SET_NO_NEW_PRIVS, 1)
        if handoff is not None and supervised:
            iso.hand_over_listener(notify_fprog, handoff)
        else:
            iso.seccomp_install(program)
        close_fds_from(3)

    return confine


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _unlink(path: str, dir_fd: int | None = None) -> None:
    try:
        os.unlink(path, dir_fd=dir_fd)
    except OSError:
        pass


def _set_nondumpable() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except Exception:  # noqa: BLE001 - an image without ctypes: the runner still works, less hardened
        pass


if __name__ == "__main__":
    main()

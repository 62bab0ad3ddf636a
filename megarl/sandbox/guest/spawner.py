"""The spawner of the code harness: it forks every program process, and gives each case a fresh start.

Standard library only: the harness loads it by path, and the Docker backend ships its source into containers.

The harness (H, trusted: it runs the tests) forks the spawner (Z) before it reads any test or response, so
nothing Z holds, and nothing forked from Z, knows a test. Z keeps the privileges H started with (root on a root
host, root of the worker's user namespace otherwise; in a Docker container it makes a user namespace of its
own), runs no untrusted code and never sees a test. H asks Z, over a socket pair:

- `spawn` a program process P, with the pipes H gives it, under the case's memory limit (its cgroup, where there
  is one, and the size of its tmpfs mounts);
- `status` of P once it has exited (its wait status, which the kernel sets: the program cannot forge it);
- `kill` P (its whole pid namespace), or `reap` it: kill it and give its status;
- `end` the case: kill and reap every P of the case (before answering, with the CPU time they used, as the
  kernel counted it), then replace /tmp and /dev/shm (the work directory is /tmp/w) with fresh, empty tmpfs
  mounts (right after answering, before reading the next request: an unmount waits on the kernel, and the
  harness need not), so that nothing a case wrote reaches the next case or stays in memory after it.

What a program process gets (`FreshSetup`, where the host allows; `describe()` says what is in force):
- a fresh pid namespace of its own, where it is pid 1: everything it starts dies with it, and it sees the same
  pids on every run;
- Z's mount namespace (made by Z, private): /tmp, /tmp/w (its cwd) and /dev/shm are tmpfs mounts of the case,
  the host's are out of sight; Z's IPC namespace (private, and SysV IPC and POSIX message queues are refused by
  the seccomp filter, so nothing can be stored there);
- the case's memory cgroup (heap, memfds, tmpfs pages and children counted together), rlimits, a raised OOM
  score (the kernel kills programs before the harness);
- no capabilities (the worker's job uid on root hosts), no_new_privs, its own Landlock domain (reads: the Python
  install and system libraries; writes: /tmp, /dev/shm, /dev/null; no signal or abstract socket outside it),
  and the program seccomp filter (`isolation.seccomp_program`).
Without those privileges (`PlainSetup`: the harness runs as an ordinary sandbox job, already confined by the
backend, one job per case) Z only forks, and scopes each program's signals with Landlock where it can.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import socket
import sys
import time

COMPILE_EXIT = 86  # a stdio program process that could not compile its source exits with this
_TMP, _SHM, _WORK = "/tmp", "/dev/shm", "/tmp/w"
_INODES = 16384  # files per tmpfs mount: bounds what a case can leave (and what replacing a mount costs)


_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
            signal.SIGALRM, signal.SIGPIPE, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGXFSZ)


def ignore_signals() -> None:
    """What a trusted process of the harness does first: no signal a program could send ends it."""
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)


def default_signals() -> None:
    """What a program process does first: the dispositions of a fresh Python process (ignored ones are
    inherited across fork and exec: a program's pool workers would otherwise ignore SIGTERM)."""
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets it at start-up


class Spawner:
    """H's handle on Z. `modes` maps a mode name to the function a program process runs (given its kept fds)."""

    def __init__(self, cfg: dict, modes: dict, iso_mod):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                self.sock.close()
                _spawner_main(theirs, cfg, modes, iso_mod)
                code = 0
            finally:
                os._exit(code)
        theirs.close()
        self.sock.settimeout(60)
        self.info = json.loads(self._ask(b"hello"))

    def spawn(self, mode: str, fds: list[int], rlimits: list, memory_mb: int, stdin: int | None = None,
              stdout: int | None = None) -> tuple[int, int]:
        """Fork a program process holding `fds` (closed here); (its pid, a pidfd) or (-1, -1) if it could not
        be forked. `stdin`/`stdout` (indexes into `fds`) become its fds 0/1; everything else is /dev/null."""
        params = json.dumps({"mode": mode, "rlimits": rlimits, "memory_mb": memory_mb, "stdin": stdin,
                             "stdout": stdout}).encode()
        try:
            socket.send_fds(self.sock, [b"spawn " + params], fds)
        finally:
            for fd in fds:
                os.close(fd)
        msg, got, _, _ = socket.recv_fds(self.sock, 64, 1)
        if not msg:
            raise RuntimeError("the spawner is gone")
        pid = int(msg.split()[0])
        return (pid, got[0]) if pid > 0 else (-1, -1)

    def status(self, pid: int) -> tuple[int, int]:
        """(wait status, OOM kills in the case so far) of an exited (or killed) program process."""
        status, oom = self._ask(b"status %d" % pid).split()
        return int(status), int(oom)

    def kill(self, pid: int) -> None:
        """Kill a program process (everything in its pid namespace); `end` reaps it."""
        self._ask(b"kill %d" % pid)

    def reap(self, pid: int) -> tuple[int, int]:
        """Kill a program process (everything in its pid namespace) and reap it: like `status`."""
        status, oom = self._ask(b"reap %d" % pid).split()
        return int(status), int(oom)

    def cpu_seconds(self, pid: int) -> float | None:
        """The CPU seconds (user + system, every thread) program process `pid` has used so far, or None once it
        is gone. Read from its CPU-time clock here where Z's pids are ours (a root host, or no pid namespace),
        else asked of Z, in whose pid namespace they are (a Docker container: Z is pid 1 of its own)."""
        if self.info.get("own_pids", True):
            return process_cpu_seconds(pid)
        reply = self._ask(b"cpu %d" % pid)
        return None if reply.startswith(b"-") else float(reply)

    def end(self) -> tuple[int, float, dict[str, int]]:
        """Kill and reap every program process of the case, fresh mounts; the case's OOM kills, the CPU seconds
        (user + system) its program processes used, from the kernel's accounting of each reaped one, and the
        syscalls the program filter refused them, by name, as the kernel notified them (`isolation.DenialCounter`;
        {} where the filter has no supervisor)."""
        oom, cpu, denied = self._ask(b"end").split(maxsplit=2)
        return int(oom), float(cpu), json.loads(denied)

    def _ask(self, msg: bytes) -> bytes:
        self.sock.send(msg)
        reply = self.sock.recv(1 << 16)
        if not reply:
            raise RuntimeError("the spawner is gone")
        return reply


# ---- Z ------------------------------------------------------------------------------------------------------

def _spawner_main(sock, cfg: dict, modes: dict, iso_mod) -> None:
    ignore_signals()
    setup = FreshSetup(cfg, iso_mod) if cfg.get("fresh") else PlainSetup(cfg, iso_mod)
    setup.enter()
    children: dict[int, int | None] = {}  # pid -> wait status once reaped
    cpu = [0.0]  # CPU seconds of the case's reaped program processes
    # One loop serves the harness's requests and supervises the program filter's refusals (no thread: we fork).
    # No request keeps it long while a program of the case runs (a fork, a pidfd, a wait for an exited process);
    # the slow ones (`end`'s mounts) come when every program of the case is dead.
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    setup.supervise(poller)
    while True:
        ready = poller.poll()
        if setup.denials is not None:
            for fd, events in ready:
                if fd != sock.fileno():
                    setup.denials.handle(fd, events)
        if not any(fd == sock.fileno() for fd, _ in ready):
            continue
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)
        except OSError:
            return
        if not msg:
            return
        verb, _, arg = msg.partition(b" ")
        after = None
        try:
            reply, reply_fds, after = _handle(verb, arg, fds, setup, modes, children, cpu)
        except Exception as e:  # noqa: BLE001 - a failed request must not end the spawner
            reply, reply_fds = b"-1 " + repr(e).encode()[:200], []
        finally:
            for fd in fds:
                os.close(fd)
        socket.send_fds(sock, [reply], reply_fds)
        for fd in reply_fds:
            os.close(fd)
        if after is not None:  # work the reply need not wait for; the next request waits for it
            after()


def _handle(verb: bytes, arg: bytes, fds: list[int], setup, modes: dict, children: dict, cpu: list):
    if verb == b"spawn":
        params = json.loads(arg)
        setup.begin(params["memory_mb"])
        handoff = setup.denials.expect() if setup.denials is not None else None
        pid = setup.fork(lambda: _program_process(setup, modes[params["mode"]], params, fds, handoff))
        if handoff is not None:
            os.close(handoff)
        if pid <= 0:
            return b"-1", [], None
        children[pid] = None
        return b"%d" % pid, [os.pidfd_open(pid)], None
    if verb == b"status":
        status = _wait(children, int(arg), cpu)
        return b"%d %d" % (status, setup.oom_kills()), [], None
    if verb == b"kill":
        _kill(int(arg))
        return b"ok", [], None
    if verb == b"reap":
        _kill(int(arg))
        status = _wait(children, int(arg), cpu)
        return b"%d %d" % (status, setup.oom_kills()), [], None
    if verb == b"end":
        # Every process of the case is killed and reaped before the reply; replacing the tmpfs mounts (which
        # frees the files the case wrote) follows right after it, before the next request is read.
        for pid in [p for p, s in children.items() if s is None]:
            _kill(pid)
        setup.kill_rest()
        for pid in list(children):
            _wait(children, pid, cpu)
        cpu[0] += setup.reap_rest()
        children.clear()
        denied = setup.denials.take() if setup.denials is not None else {}  # (nothing pending: all are reaped)
        reply, cpu[0] = b"%d %.6f %s" % (setup.oom_kills(), cpu[0], json.dumps(denied).encode()), 0.0
        return reply, [], lambda: (setup.fresh_state(), setup.next_case())
    if verb == b"cpu":
        seconds = process_cpu_seconds(int(arg)) if int(arg) in children else None
        return b"-1" if seconds is None else b"%.9f" % seconds, [], None
    if verb == b"hello":
        return json.dumps(setup.describe()).encode(), [], None
    raise ValueError(f"unknown request {verb!r}")


def process_cpu_seconds(pid: int) -> float | None:
    """Process `pid`'s CPU time, user + system over all its threads, from its CPU-time clock: clock_gettime on
    the clock id the kernel makes for a process (MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED) = ~pid << 3 | 2),
    resolved in the caller's pid namespace. Needs no /proc, which a confined harness no longer has. None once
    the process is gone (or where the kernel refuses the clock)."""
    try:
        return time.clock_gettime((~pid << 3) | 2)
    except (OSError, OverflowError):
        return None


def _wait(children: dict, pid: int, cpu: list) -> int:
    if children.get(pid) is None:
        try:
            _, children[pid], usage = os.wait4(pid, 0)
            cpu[0] += usage.ru_utime + usage.ru_stime
        except ChildProcessError:
            children[pid] = 0
    return children[pid]


def _kill(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _program_process(setup, run, params: dict, fds: list[int], handoff: int | None) -> None:
    """In the forked program process: its own session, the case's cgroup and limits, its confinement (its
    filter's listener sent on `handoff` where the filter has a supervisor), then the mode's function with the
    fds it keeps. Never returns."""
    code = 70
    try:
        default_signals()
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for target, index in ((0, params["stdin"]), (1, params["stdout"]), (2, None)):
            os.dup2(fds[index] if index is not None else null, target)
        kept = [fd for i, fd in enumerate(fds) if i not in (params["stdin"], params["stdout"])]
        setup.confine_program(params["rlimits"], tuple(kept), handoff)
        code = 0
        run(*kept)
    finally:
        os._exit(code)


def lower_rlimits(rlimits: list) -> None:
    """Lower each limit to `value`; never above a hard limit already in force (raising one needs a capability)."""
    for which, value in rlimits:
        hard = resource.getrlimit(which)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))


class PlainSetup:
    """No privileges (the harness runs as a sandbox job, already confined): fork, scope signals, limit."""

    fresh = False
    denials = None  # the supervisor of the program filter's refusals (`isolation.DenialCounter`), where there is one

    def __init__(self, cfg: dict, iso_mod):
        self.cfg, self.iso_mod = cfg, iso_mod
        self.abi = iso_mod.landlock_abi()

    def enter(self) -> None:
        pass

    def supervise(self, poller) -> None:
        """Program processes get no filter of ours here (the harness's job has the backend's, whose refusals the
        backend counts): nothing to supervise."""

    def describe(self) -> dict:
        return {"fresh": False, "cgroup": False, "pid_ns": False, "own_pids": True}

    def fork(self, child) -> int:
        """Fork and run `child()` (which never returns) in the child; its pid, or -1."""
        pid = self.fork_raw()
        if pid == 0:
            child()
        return pid

    def fork_raw(self) -> int:
        try:
            return os.fork()
        except OSError:
            return -1

    def confine_program(self, rlimits: list, kept: tuple[int, ...], handoff: int | None = None) -> None:
        os.chdir(self.cfg["workdir"])
        lower_rlimits(rlimits)
        self.iso_mod.landlock_scope_only(self.abi)  # no signal to the harness or its spawner
        self.iso_mod.close_fds_except(kept)

    def begin(self, memory_mb: int) -> None:
        pass

    def next_case(self) -> None:
        pass

    def kill_rest(self) -> None:
        pass

    def reap_rest(self) -> float:
        return 0.0

    def oom_kills(self) -> int:
        return 0

    def fresh_state(self) -> None:
        pass


class FreshSetup(PlainSetup):
    """Privileged: a private mount and IPC namespace for all program processes, fresh tmpfs mounts per case, a
    pid namespace per program process, the case's memory cgroup. What could not be had is reported by
    `describe()` (and warned about by the backend)."""

    def __init__(self, cfg: dict, iso_mod):
        super().__init__(cfg, iso_mod)
        self.iso = iso_mod.HostIsolation(**cfg["isolation"])
        self.pid_ns_fd: int | None = None
        self.cgroup = None  # the case's memory cgroup (the local backend)
        self.oom_counter = None  # else a container's own memory cgroup, read only: its OOM kills (Docker)
        self.adj_fd: int | None = None  # our own oom_score_adj, raised around each program fork (`fork_raw`)
        self.adj_own = b"0"
        self.cgroup_fd: int | None = None
        self.cgroup_mb = 0
        self.memory_mb = cfg.get("memory_mb", 512)
        self.mounted = self.minimal_root = False
        self.own_pids = True
        self.confinement = None
        self.oom_base = 0
        self.missing: list[str] = []

    def enter(self) -> None:
        iso = self.iso_mod
        if self.cfg.get("cgroup"):  # first: /sys is out of sight in the minimal root (the files stay open)
            where = self.cfg["cgroup"]
            self.cgroup = self.cfg["cgroups_module"].MemoryCgroup(where["path"], where["version"])
            self.cgroup_fd = self.cgroup.procs_fd()
            self.next_case()
        elif self.cfg.get("oom_cgroup"):
            where = self.cfg["oom_cgroup"]
            self.oom_counter = self.cfg["cgroups_module"].MemoryCgroup(where["path"], where["version"])
            self.next_case()
        try:
            self._namespaces()
        except OSError as e:
            self.missing.append(f"no private mounts ({e.strerror or e})")
        read_fds = [(os.open(p, os.O_PATH | os.O_CLOEXEC), os.path.isdir(p)) for p in self.cfg["read_roots"]]
        deny_memfd = not self.cfg.get("memory_accounted")
        seccomp = iso.seccomp_program(deny_memfd=deny_memfd) if self.iso.seccomp else None
        supervised = iso.seccomp_program(deny_memfd=deny_memfd, notify=True) if self.iso.seccomp_notify else None
        self.confinement = iso.Confinement(self.iso, read_fds, self._writes(), seccomp, supervised)
        import gc

        gc.freeze()  # a program process's collector never walks what exists now: fewer pages copied per fork

    def _namespaces(self) -> None:
        """A private mount and IPC namespace (first a user namespace, where Z has no capability: a Docker
        container) with a minimal root and fresh tmpfs mounts, and the way to a pid namespace per program."""
        iso = self.iso_mod
        self.own_pids = os.geteuid() == 0  # (else H's pids are not ours: see _become_pid1_of_own_namespace)
        if not self.own_pids:  # a Docker container's unprivileged user: a user namespace of our own
            iso.enter_user_namespace(iso.CLONE_NEWNS | iso.CLONE_NEWIPC | iso.CLONE_NEWPID)
            self._become_pid1_of_own_namespace()
        else:
            iso.unshare(iso.CLONE_NEWNS | iso.CLONE_NEWIPC)
        iso.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans of programs come to us, not to the harness
        pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)  # (no /proc in the minimal root)
        memfd_why = iso.memfds_not_executable()
        self._oom_scores()
        iso.make_mounts_private()
        try:
            iso.minimal_root(_TMP, self.cfg["read_roots"])
            iso.pivot_into(_TMP)
            self.minimal_root = True
        except OSError as e:
            self.missing.append(f"no minimal root ({e.strerror or e}): programs can stat() host paths")
            if memfd_why:  # (in the minimal root there is no /proc, and execveat is refused: no way to run one)
                self.missing.append(f"memfds are executable ({memfd_why})")
        self.fresh_state()
        self.mounted = True
        if forked_ok(lambda: unshare_fork_setns(iso, pid_ns)):
            self.pid_ns_fd = pid_ns
        else:
            self.missing.append("no pid namespace per program process")

    def _oom_scores(self) -> None:
        """Program processes first for the OOM killer, whatever their size: they fork with an `oom_score_adj` of
        1000, which they cannot change (no /proc in the minimal root). We keep our own lower (the harness's): in a
        Docker container, whose memory cgroup holds the harness, us and the programs, an even score let the
        kernel pick us over the program that had filled memfds (not in its RSS), and that killed the container.
        The fd stays open for `fork_raw` to raise our score around each fork; where lowering it again is refused
        (an `oom_score_adj_min` above it), we stay at 1000 as the programs do."""
        try:
            fd = os.open("/proc/self/oom_score_adj", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return
        try:
            own = os.pread(fd, 16, 0).strip() or b"0"
            os.pwrite(fd, b"1000", 0)
            os.pwrite(fd, own, 0)
        except OSError:
            os.close(fd)
            return
        self.adj_fd, self.adj_own = fd, own

    def _become_pid1_of_own_namespace(self) -> None:
        """Z's pid namespace belongs to a user namespace Z has no capability in, so it could not return to it
        after making one per program: Z forks the spawner proper as pid 1 of a pid namespace of its own user
        namespace, and only waits for it."""
        pid = os.fork()
        if pid == 0:
            return
        self.iso_mod.close_fds_except(())  # its socket: the harness must see EOF when the spawner proper ends
        _, status = os.waitpid(pid, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)

    def supervise(self, poller) -> None:
        """Where the program filter has a supervisor: it serves on `poller`, the spawner's loop."""
        if self.iso.seccomp_notify:
            self.denials = self.iso_mod.DenialCounter(poller)

    def describe(self) -> dict:
        return {"fresh": self.mounted, "pid_ns": self.pid_ns_fd is not None, "cgroup": self.cgroup is not None,
                "minimal_root": self.minimal_root, "missing": self.missing,
                "own_pids": self.own_pids, "denials_counted": self.denials is not None}

    def fork_raw(self) -> int:
        """fork(), the child (which gets 0) being pid 1 of a fresh pid namespace where that is possible; -1 if
        it could not be forked."""
        if self.adj_fd is not None:
            os.pwrite(self.adj_fd, b"1000", 0)  # the child's score (see `_oom_scores`)
        pid = -1
        try:
            if self.pid_ns_fd is None:
                pid = super().fork_raw()
            else:
                self.iso_mod.unshare(self.iso_mod.CLONE_NEWPID)
                pid = super().fork_raw()
                if pid != 0:
                    self.iso_mod.setns(self.pid_ns_fd, self.iso_mod.CLONE_NEWPID)  # our next child: in our own again
            return pid
        finally:
            if self.adj_fd is not None and pid != 0:  # (the child keeps 1000)
                os.pwrite(self.adj_fd, self.adj_own, 0)

    def confine_program(self, rlimits: list, kept: tuple[int, ...], handoff: int | None = None) -> None:
        if not self.mounted:  # nothing private to give: the harness still confines (Landlock, seccomp) below
            os.chdir("/")
        else:
            os.chdir(_WORK)
        if self.cgroup_fd is not None:
            os.write(self.cgroup_fd, b"0")
        lower_rlimits(rlimits)
        self.confinement.apply(kept, handoff)

    def _writes(self) -> list[str]:
        return [_TMP, _SHM, os.devnull] if self.mounted else [os.devnull]

    def begin(self, memory_mb: int) -> None:
        """Before a spawn: the case's memory limit, where it differs from the last case's."""
        if memory_mb != self.memory_mb:
            self.memory_mb = memory_mb
            if self.mounted:
                self.fresh_state()  # the tmpfs mounts are sized by the case's memory (nothing runs yet)
        if self.cgroup is not None and memory_mb != self.cgroup_mb:
            self.cgroup.set_limit(memory_mb)
            self.cgroup_mb = memory_mb

    def next_case(self) -> None:
        counter = self.cgroup or self.oom_counter
        if counter is not None:
            self.oom_base = counter.oom_kills()

    def kill_rest(self) -> None:
        """Without a pid namespace per program: kill(-1), which spares only this process and the namespace's
        init, the harness (FreshSetup runs only under the persistent harness, pid 1 of its own namespace)."""
        if self.pid_ns_fd is None:
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def reap_rest(self) -> float:
        """Reap what `kill_rest` killed (orphans come to us, the subreaper); their CPU seconds."""
        cpu = 0.0
        if self.pid_ns_fd is None:
            while True:
                try:
                    cpu += sum(os.wait4(-1, 0)[2][:2])
                except ChildProcessError:
                    break
        return cpu

    def oom_kills(self) -> int:
        counter = self.cgroup or self.oom_counter
        return counter.oom_kills() - self.oom_base if counter is not None else 0

    def fresh_state(self) -> None:
        """New, empty tmpfs mounts for /tmp (the work directory /tmp/w in it) and /dev/shm; files count
        against the case's memory (half of it each at most, and the cgroup counts them too)."""
        iso = self.iso_mod
        for target in (_TMP, _SHM):
            size, kept = max(1, self.memory_mb // 2), iso.beneath(target, self.cfg["read_roots"])
            if kept and self.minimal_root:  # e.g. a virtualenv under /tmp, which the new tmpfs must not hide: made
                iso.tmpfs(iso.STAGE, size, _INODES)  # ready aside, with the roots bound from where they are now,
                for path in kept:  # then moved over the old one. Not recursively: each root is bound on its own
                    # (nested ones too: a virtualenv and its site-packages), and a recursive bind would copy the
                    # last case's binds beneath it as well, so the mounts grew with every case (a harness of the
                    # code demo reached 115,000 mounts, and each case slowed down with them)
                    iso.bind_readonly(path, iso.STAGE + path[len(target):], os.path.isdir(path), recursive=False)
                if self.mounted:
                    iso.umount(target)
                iso.mount(iso.STAGE, target, None, iso.MS_MOVE)
                continue
            if self.mounted:
                iso.umount(target)
            iso.tmpfs_keeping(target, size, _INODES, kept)
        os.mkdir(_WORK, 0o700)
        uid = self.iso.uid if self.iso.uid is not None else os.getuid()
        os.chown(_WORK, uid, uid)
        if self.confinement is not None:
            self.confinement.refresh(self._writes())  # Landlock rules name the mounts: the new ones


def unshare_fork_setns(iso, fd: int) -> None:
    """Raises unless this process can make a pid namespace for a child and return to its own after."""
    iso.unshare(iso.CLONE_NEWPID)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if os.getpid() == 1 else 1)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        raise OSError("the child was not pid 1 of a new namespace")
    iso.setns(fd, iso.CLONE_NEWPID)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if os.getpid() != 1 else 1)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        raise OSError("setns did not return to our own pid namespace")


def forked_ok(fn) -> bool:
    """Whether `fn` succeeds, tried in a throwaway child so this process is unchanged."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0

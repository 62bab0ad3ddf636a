"""Memory cgroups for the sandbox: what a job or a code-verifier case holds in memory, counted and capped as one.

Standard library only (the harness loads it by path). A cgroup's memory counts every page its processes touch:
their heaps, memfds, the tmpfs files they write (/tmp, /dev/shm, the work directory), and every process they
fork, so `memory_mb` bounds the case as a whole, not each process. Pages of tmpfs files stay charged to the
cgroup after the processes die, until the files go (the spawner replaces the tmpfs mounts after each case).

Where it works:
- cgroup v2 with the memory controller enabled for the cgroup this process is in (a delegated subtree, e.g.
  systemd's `Delegate=yes`, or a container given one): `memory.max`, `memory.swap.max`, `memory.events`;
- cgroup v1's memory hierarchy, as root: `memory.limit_in_bytes`, `memory.memsw.limit_in_bytes`,
  `memory.oom_control`.
Elsewhere `find_memory_root()` says why not and the sandbox falls back to per-process limits (see
`megarl/sandbox/__init__.py`).
"""

from __future__ import annotations

import os

_V1_ROOT = "/sys/fs/cgroup/memory"


def container_memory_cgroup() -> dict | None:
    """Inside a container: its own memory cgroup where it is mounted at /sys/fs/cgroup (Docker mounts the
    container's own directory there, read only), to count the kernel's OOM kills in it; None where there is none to
    read. Nothing is written there."""
    for path, version, name in ((_V1_ROOT, 1, "memory.oom_control"), ("/sys/fs/cgroup", 2, "memory.events")):
        if os.access(os.path.join(path, name), os.R_OK):
            return {"path": path, "version": version}
    return None


class MemoryCgroup:
    """One memory cgroup (a directory); created by `MemoryRoot.child`, removed by `remove`. Its files are reached
    through a directory fd opened at construction, so it keeps working where /sys is out of sight (the
    spawner's minimal root)."""

    def __init__(self, path: str, version: int):
        self.path, self.version = path, version
        self.dir_fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def procs_fd(self) -> int:
        """An fd open for writing on the file that moves a process here: writing b"0" to it moves the writing
        process, which must be single-threaded (open it while privileged; the write is checked against the opener
        on v2 and against the writer's uid on v1). `cgroup.procs` on v2; `tasks` on v1, which moves the writing
        thread (the whole process, when it has one thread) without the kernel's global threadgroup lock: a write
        to v1's `cgroup.procs` waits for an RCU grace period (~7-11 ms measured on a 2-vCPU VM when attaches are
        tens of ms apart), and blocks every fork on the host meanwhile."""
        name = "cgroup.procs" if self.version == 2 else "tasks"
        return os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)

    def enter(self) -> None:
        """Move this (single-threaded) process here: see `procs_fd`."""
        fd = self.procs_fd()
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)

    def set_limit(self, mb: int) -> None:
        """Cap memory (and swap: none beyond it) at `mb` MiB."""
        limit = str(mb << 20)
        fd = self.dir_fd
        if self.version == 2:
            _write(fd, "memory.max", limit)
            _write(fd, "memory.swap.max", "0", missing_ok=True)
            return
        memsw = os.access("memory.memsw.limit_in_bytes", os.F_OK, dir_fd=fd)
        if memsw and int(_read(fd, "memory.limit_in_bytes")) < (mb << 20):
            _write(fd, "memory.memsw.limit_in_bytes", limit)  # raising: memsw first (it must stay >= mem)
            _write(fd, "memory.limit_in_bytes", limit)
        else:
            _write(fd, "memory.limit_in_bytes", limit)
            if memsw:
                _write(fd, "memory.memsw.limit_in_bytes", limit)

    def oom_kills(self) -> int:
        """How many processes the kernel killed here for lack of memory, so far."""
        text = _read(self.dir_fd, "memory.events" if self.version == 2 else "memory.oom_control")
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        """Remove the cgroup (its processes must be gone; charges left move to the parent)."""
        os.close(self.dir_fd)
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def remove_cgroup_tree(path: str) -> None:
    """Remove a cgroup and every cgroup below it (their processes must be gone)."""
    for base, _, _ in sorted(os.walk(path), key=lambda entry: -entry[0].count("/")):
        try:
            os.rmdir(base)
        except OSError:
            pass


class MemoryRoot:
    """Where this process may make memory cgroups: below its own cgroup."""

    def __init__(self, path: str, version: int):
        self.path, self.version = path, version

    def child(self, name: str) -> MemoryCgroup:
        path = os.path.join(self.path, name)
        os.makedirs(path, exist_ok=True)
        cgroup = MemoryCgroup(path, self.version)
        if self.version == 2:
            _write(cgroup.dir_fd, "cgroup.subtree_control", "+memory", missing_ok=True)  # for its own children
        return cgroup


def find_memory_root() -> tuple[MemoryRoot | None, str]:
    """(the root to create memory cgroups under, "") or (None, why there is none): cgroup v2 first, then v1."""
    own = _own_cgroups()
    why = []
    base = _v2_mount()
    if "" in own and base:  # cgroup v2: a `0::/path` line
        path = os.path.join(base, own[""].lstrip("/"))
        if _makes_children(path, "memory.max", why, "cgroup v2"):
            return MemoryRoot(path, 2), ""
    else:
        why.append("cgroup v2: not in a v2 hierarchy")
    if "memory" in own and os.path.isdir(_V1_ROOT):
        path = os.path.join(_V1_ROOT, own["memory"].lstrip("/"))
        if _makes_children(path, "memory.limit_in_bytes", why, "cgroup v1"):
            return MemoryRoot(path, 1), ""
    else:
        why.append("cgroup v1: no memory hierarchy")
    return None, "; ".join(why)


def _makes_children(path: str, limit_file: str, why: list[str], label: str) -> bool:
    """Whether a child of `path` can be made and has `limit_file` (the memory controller); why not, if not."""
    probe = os.path.join(path, f"megarl-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
    except OSError as e:
        why.append(f"{label}: cannot create a child of {path} ({e.strerror})")
        return False
    try:
        if os.path.exists(os.path.join(probe, limit_file)):
            return True
        why.append(f"{label}: no memory controller delegated to {path}")
        return False
    finally:
        os.rmdir(probe)


def _own_cgroups() -> dict[str, str]:
    """controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    out: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for c in controllers.split(",") if controllers else [""]:
                    out[c] = path
    except OSError:
        pass
    return out


def _v2_mount() -> str | None:
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                fstype = fields[fields.index("-") + 1]
                if fstype == "cgroup2":
                    return fields[4]
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read(dir_fd: int, name: str) -> str:
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return os.read(fd, 1 << 16).decode()
    finally:
        os.close(fd)


def _write(dir_fd: int, name: str, value: str, missing_ok: bool = False) -> None:
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)

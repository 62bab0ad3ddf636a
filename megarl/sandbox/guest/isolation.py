"""Kernel isolation primitives for the local backend, through ctypes: namespaces, Landlock, seccomp, capabilities.

`local.probe_and_enter()` finds out what this host allows (run once per worker, at start); `Confinement` applies it
to one job's process after fork. Nothing here imports anything beyond the standard library.

Seccomp refusals, counted (`DenialCounter`). The program filter refuses silently: a program that calls a refused
syscall through a path no reading of its text sees (ctypes, a syscall by number, a C extension) would leave no
trace. Where the kernel has SECCOMP_RET_USER_NOTIF (Linux >= 5.0), the refusals go to a supervisor in the process
that forked the program (the harness's spawner; the local worker's or the Docker runner's job supervisor), which
answers EPERM, as the filter did, and counts them by syscall for the reward-hacking signals
(`RunResult.seccomp_denied`). What it does not change: what is refused and with which errno (so no verdict
changes), and it adds nothing to a program that calls no refused syscall but a socket pair per program process
to hand over the listener. What it does not see: refusals of other layers (Landlock, below; a missing capability,
e.g. `setuid`; resource limits), clone3's ENOSYS and memfd_create's EPERM (left silent on purpose, see
`seccomp_program`), the counts of a case cut off at its wall-clock limit (its harness is killed with them), and,
in Docker harness containers, the syscalls the container's own seccomp profile refuses as well (`ptrace`, `bpf`,
SysV IPC...: the engine's filter answers ERRNO, which takes precedence over our USER_NOTIF, so only `socket`,
`clone`/`unshare` with namespace flags, `setns`, `mount`, `umount2`, `pivot_root` and x32 numbers are counted
there).

Landlock refusals are not counted. Linux >= 6.15 logs them, but only through the audit subsystem, and that is not
usable by the sandbox: audit is off on the hosts measured (AUDIT_GET: enabled=0, no auditd), turning it on is a
host-wide switch that needs CAP_AUDIT_CONTROL, reading its records needs CAP_AUDIT_READ in the initial user
namespace (an unprivileged user, or root of a user namespace, gets EPERM for both, measured on 6.18), and the
kernel multicasts them only to sockets of the initial network namespace, where our workers are not. So what
Landlock alone refuses leaves no count: reads outside the Python install and system libraries, writes outside
the job's tmpfs, and signals or abstract-socket connects outside its domain, when made through a path computed at
run time and the error caught by the program (the static check sees literal paths, the stderr check sees
uncaught PermissionErrors only). Where the harness gives programs a minimal root (no host paths at all) most of
those fail with ENOENT before Landlock is asked.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import platform
import select
import socket
import stat
import struct
import sys
from dataclasses import dataclass, field

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEW_ANY = 0x7E020000  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_NOATIME, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x400, 0x4000, 1 << 18
MNT_DETACH = 2
MS_MOVE = 0x2000
PR_SET_DUMPABLE = 4
PR_SET_KEEPCAPS = 8
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 47, 2
CAP_DAC_READ_SEARCH = 2
NOBODY = 65534


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def prctl(option: int, arg: int = 0) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


# ---- mounts and user namespaces ------------------------------------------------------------------------------

_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda v: None if v is None else v.encode())
    _check(_libc.mount(enc(source), target.encode(), enc(fstype), flags, enc(data)), f"mount {target}")


def umount(target: str) -> None:
    """Detach the mount at `target` (lazily: gone from the tree now, freed when nothing uses it)."""
    _check(_libc.umount2(target.encode(), MNT_DETACH), f"umount {target}")


def make_mounts_private() -> None:
    """In a fresh mount namespace: nothing mounted here propagates back to the namespace it was copied from."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)


def tmpfs(target: str, size_mb: int, inodes: int, mode: int = 0o1777) -> None:
    """A fresh, empty tmpfs at `target`: `size_mb` of pages and `inodes` files at most; nothing on it runs as a
    program (noexec), and reading leaves no trace (noatime) for a later reader to see."""
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME,
          f"size={max(1, size_mb)}m,nr_inodes={inodes},mode={mode:o}")


def memfds_not_executable() -> str:
    """In this pid namespace and those made below it (Linux >= 6.3): a memfd is sealed against execution unless
    created with MFD_EXEC (not allowed either). "" when done, else why not."""
    try:
        with open("/proc/sys/vm/memfd_noexec", "w") as f:
            f.write("2")
        return ""
    except FileNotFoundError:
        return "no vm.memfd_noexec (Linux < 6.3)"
    except OSError as e:
        return f"vm.memfd_noexec: {e.strerror}"


_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_MS_BIND, _MS_REMOUNT, _MS_RDONLY = 0x1000, 0x20, 0x1
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
STAGE = "/.next"  # in a minimal root: where the next case's tmpfs is made ready before it replaces /tmp


def beneath(mount_point: str, paths: list[str]) -> list[str]:
    """The `paths` a mount at `mount_point` would hide (a checkout or virtualenv under /tmp)."""
    return [p for p in paths if p.startswith(mount_point.rstrip("/") + "/")]


def bind_readonly(source: str, dest: str, is_dir: bool = True, recursive: bool = True) -> None:
    """Bind `source` at `dest` (created: a directory, or an empty file), read-only, nosuid, nodev; with the mounts
    beneath `source` too unless not `recursive`."""
    if is_dir:
        os.makedirs(dest, 0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dest), 0o755, exist_ok=True)
        open(dest, "w").close()
    mount(source, dest, None, _MS_BIND | (MS_REC if recursive else 0))
    mount(None, dest, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | MS_NOSUID | MS_NODEV)


def tmpfs_keeping(target: str, size_mb: int, inodes: int, keep: list[str], mode: int = 0o1777) -> None:
    """`tmpfs`, with the paths of `keep` that lie beneath `target` bound back into it, read-only: a job's fresh
    /tmp must not hide the interpreter or its packages when they live under /tmp. Needs /proc (the paths are held
    open across the mount and bound from /proc/self/fd)."""
    kept = [(p, os.open(p, os.O_PATH | os.O_CLOEXEC), os.path.isdir(p)) for p in beneath(target, keep)
            if os.path.exists(p)]
    try:
        tmpfs(target, size_mb, inodes, mode)
        for path, fd, is_dir in kept:
            bind_readonly(f"/proc/self/fd/{fd}", path, is_dir)
    finally:
        for _, fd, _ in kept:
            os.close(fd)


def minimal_root(target: str, read_roots: list[str]) -> None:
    """Build at `target` (in a private mount namespace) a root that holds only `read_roots` (bound read-only, at
    the same paths), the usual device files, and empty /tmp and /dev/shm for tmpfs mounts. After
    `pivot_into(target)` nothing else of the host exists, not even to stat(); no /proc either (its pids would
    show the host's activity, a channel between runs). The roots are opened before `target` is mounted over,
    so a root beneath `target` (a virtualenv under /tmp) is bound too."""
    sources: list[tuple[str, int | None, bool]] = []  # (path, O_PATH fd or None for a symlink, is a directory)
    for path in sorted(set(read_roots) | set(DEVICES)):
        if any(path.startswith(b + "/") for b, _, _ in sources) or not os.path.lexists(path):
            continue
        link = os.path.islink(path)  # e.g. /lib -> usr/lib on merged-/usr systems
        sources.append((path, None if link else os.open(path, os.O_PATH | os.O_CLOEXEC), os.path.isdir(path)))
    try:
        tmpfs(target, 4, 4096, 0o755)
        for path, fd, is_dir in sources:
            dest = target + path
            if fd is None:
                os.makedirs(os.path.dirname(dest), 0o755, exist_ok=True)
                os.symlink(os.readlink(path), dest)
            elif path in DEVICES:  # bound writable (writes to /dev/null)
                os.makedirs(os.path.dirname(dest), 0o755, exist_ok=True)
                open(dest, "w").close()
                mount(f"/proc/self/fd/{fd}", dest, None, _MS_BIND | MS_REC)
            else:
                bind_readonly(f"/proc/self/fd/{fd}", dest, is_dir)
        for empty in ("/tmp", "/dev/shm", STAGE):
            os.makedirs(target + empty, 0o755 if empty != STAGE else 0o700, exist_ok=True)
    finally:
        for _, fd, _ in sources:
            if fd is not None:
                os.close(fd)


def pivot_into(target: str) -> None:
    """Make `target` (a mount point) this mount namespace's root; the old root is detached."""
    os.chdir(target)
    _check(_libc.syscall(_PIVOT_ROOT[platform.machine()], b".", b"."), "pivot_root")
    umount(".")  # the old root, which pivot_root(".", ".") leaves stacked on the new one
    os.chdir("/")


def enter_user_namespace(extra_flags: int = 0) -> None:
    """Become root of a new user namespace (mapping only this uid/gid), with `extra_flags` namespaces too."""
    uid, gid = os.getuid(), os.getgid()
    unshare(CLONE_NEWUSER | extra_flags)
    for path, text in (("uid_map", f"0 {uid} 1"), ("setgroups", "deny"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{path}", "w") as f:
            f.write(text)


# ---- capabilities -------------------------------------------------------------------------------------------

class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


# ---- Landlock -----------------------------------------------------------------------------------------------

_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT = 444, 445, 446  # the same number on every architecture
_LL_EXECUTE, _LL_WRITE_FILE, _LL_READ_FILE, _LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_LL_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
_LL_FILE_ONLY = _LL_EXECUTE | _LL_WRITE_FILE | _LL_READ_FILE | (1 << 14) | (1 << 15)
_LL_NET_TCP = (1 << 0) | (1 << 1)  # bind, connect (ABI 4)
_LL_SCOPE_ALL = (1 << 0) | (1 << 1)  # abstract unix sockets, signals (ABI 6)
_LL_READ = _LL_EXECUTE | _LL_READ_FILE | _LL_READ_DIR


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    ret = _libc.syscall(_LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # ..._CREATE_RULESET_VERSION
    return max(0, ret)


def landlock_fs_mask(abi: int) -> int:
    return _LL_FS_BY_ABI[min(abi, 5)]


def landlock_ruleset(abi: int, read_fds: list[tuple[int, bool]], write_fds: list[tuple[int, bool]]) -> int:
    """A ruleset fd: reads/executes only beneath `read_fds`, anything beneath `write_fds`, no TCP bind/connect
    (ABI >= 4), no signals or abstract sockets outside the domain (ABI >= 6). Each entry is (O_PATH fd,
    is_directory). Enforce it with `landlock_restrict_self` (needs no_new_privs or CAP_SYS_ADMIN)."""
    fs = landlock_fs_mask(abi)
    attr = struct.pack("QQQ", fs, _LL_NET_TCP if abi >= 4 else 0, _LL_SCOPE_ALL if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _check(_libc.syscall(_LL_CREATE, buf, ctypes.c_size_t(size), ctypes.c_uint32(0)), "landlock ruleset")
    try:
        for fds, access in ((read_fds, _LL_READ), (write_fds, fs)):
            for fd, is_dir in fds:
                rule = _PathBeneath(access if is_dir else access & _LL_FILE_ONLY, fd)
                _check(_libc.syscall(_LL_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0), "landlock rule")
    except BaseException:
        os.close(ruleset)
        raise
    os.set_inheritable(ruleset, False)
    return ruleset


def landlock_scope_only(abi: int) -> None:
    """A nested Landlock domain that only scopes (ABI >= 6): no signal to, nor abstract unix socket of, any
    process outside it. For program children of a harness that cannot give them namespaces of their own."""
    if abi < 6:
        return
    attr = struct.pack("QQQ", 0, 0, _LL_SCOPE_ALL)
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _check(_libc.syscall(_LL_CREATE, buf, ctypes.c_size_t(24), ctypes.c_uint32(0)), "landlock ruleset")
    try:
        _check(_libc.syscall(_LL_RESTRICT, ruleset, 0), "landlock restrict")
    finally:
        os.close(ruleset)


# ---- seccomp ------------------------------------------------------------------------------------------------

# Syscalls a test program never needs and an escape often does: tracing other processes, namespaces, mounts,
# kernel keyrings, BPF, perf, module loading, handle-based opens (which bypass path checks), io_uring, SysV IPC
# and POSIX message queues (state that would outlive a case), executing an fd (a memfd binary), kcmp and
# pidfd_getfd (other processes' files). Numbers: x86_64, aarch64.
_SYSCALLS = {
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "mount": (165, 40),
    "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51), "unshare": (272, 97), "setns": (308, 268),
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219), "bpf": (321, 280),
    "perf_event_open": (298, 241), "kexec_load": (246, 104), "kexec_file_load": (320, 294),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106), "reboot": (169, 142),
    "swapon": (167, 224), "swapoff": (168, 225), "name_to_handle_at": (303, 264), "open_by_handle_at": (304, 265),
    "userfaultfd": (323, 282), "uselib": (134, None), "iopl": (172, None), "ioperm": (173, None),
    "acct": (163, 89), "syslog": (103, 116),
    "shmget": (29, 194), "shmat": (30, 196), "shmctl": (31, 195), "shmdt": (67, 197), "semget": (64, 190),
    "semop": (65, 193), "semctl": (66, 191), "semtimedop": (220, 192), "msgget": (68, 186), "msgsnd": (69, 189),
    "msgrcv": (70, 188), "msgctl": (71, 187), "mq_open": (240, 180), "mq_unlink": (241, 181),
    "mq_timedsend": (242, 182), "mq_timedreceive": (243, 183), "mq_notify": (244, 184),
    "mq_getsetattr": (245, 185), "execveat": (322, 281), "kcmp": (312, 272), "pidfd_getfd": (438, 438),
    "memfd_secret": (447, 447), "quotactl": (179, 60), "lookup_dcookie": (212, 18), "fanotify_init": (300, 262),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
}
_ARCH_INDEX = {"x86_64": 0, "aarch64": 1}
# (audit arch, socket, socketpair, clone, clone3, memfd_create) per architecture
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 41, 53, 56, 435, 319), "aarch64": (0xC00000B7, 198, 199, 220, 435, 279)}


def denied_syscall_names() -> list[str]:
    """The syscalls the program filter refuses outright, by name (for Docker's seccomp profile)."""
    return sorted(_SYSCALLS)


_RET_ALLOW, _RET_KILL = 0x7FFF0000, 0x80000000
_RET_ERRNO = 0x00050000
_RET_USER_NOTIF = 0x7FC00000
EPERM, ENOSYS = 1, 38
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
AF_UNIX = 1


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def seccomp_supported() -> bool:
    return platform.machine() in _SECCOMP_ARCH


class _Bpf:
    """A classic-BPF program with named jump targets (resolved by `assemble`)."""

    def __init__(self):
        self.code: list[tuple] = []
        self.labels: dict[str, int] = {}

    def op(self, code: int, k: int, jt: str | None = None, jf: str | None = None) -> None:
        self.code.append((code, jt, jf, k))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def assemble(self) -> bytes:
        out = []
        for i, (code, jt, jf, k) in enumerate(self.code):
            rel = (lambda name, i=i: 0 if name is None else self.labels[name] - i - 1)
            out.append(struct.pack("HBBI", code, rel(jt), rel(jf), k))
        return b"".join(out)


def seccomp_program(deny_memfd: bool = False, notify: bool = False) -> bytes:
    """The filter every program (and the harness) runs under: EPERM for the deny list, for socket() of any
    family (no network, no host unix socket: socketpair(AF_UNIX) still works), for clone() with a namespace flag,
    and for memfd_create when `deny_memfd` (where no cgroup counts a memfd's pages); ENOSYS for clone3 (its flags
    are behind a pointer, so glibc falls back to clone); kill on a foreign ABI.

    With `notify` the refusals that say a program reached for what it must not have (the deny list, socket(),
    socketpair() of another family, clone() with a namespace flag, x32 numbers) go to a supervisor instead
    (SECCOMP_RET_USER_NOTIF, see `DenialCounter`), which answers EPERM as the filter does without it. Two stay
    silent: clone3's ENOSYS (every thread an honest program starts tries it first) and memfd_create's EPERM
    (refused for memory accounting, not as an escape; the code harness itself tries it)."""
    audit_arch, nr_socket, nr_socketpair, nr_clone, nr_clone3, nr_memfd = _SECCOMP_ARCH[platform.machine()]
    arch = _ARCH_INDEX[platform.machine()]
    deny = {nrs[arch] for nrs in _SYSCALLS.values() if nrs[arch] is not None}
    deny = sorted(deny | {nr_socket})
    p = _Bpf()
    p.op(_LD_W_ABS, 4)  # seccomp_data.arch
    p.op(_JEQ_K, audit_arch, None, "kill")
    p.op(_LD_W_ABS, 0)  # seccomp_data.nr
    p.op(_JGE_K, 0x40000000, "eperm")  # x32 syscalls on x86_64; no such numbers elsewhere
    for nr in deny:
        p.op(_JEQ_K, nr, "eperm")
    if deny_memfd:
        p.op(_JEQ_K, nr_memfd, "quiet")
    p.op(_JEQ_K, nr_clone3, "enosys")
    p.op(_JEQ_K, nr_socketpair, "socketpair")
    p.op(_JEQ_K, nr_clone, None, "allow")
    p.op(_LD_W_ABS, 16)  # clone's flags: args[0], low half on little-endian
    p.op(_JSET_K, CLONE_NEW_ANY, "eperm", "allow")
    p.label("socketpair")
    p.op(_LD_W_ABS, 16)  # its family
    p.op(_JEQ_K, AF_UNIX, "allow", "eperm")
    p.label("allow")
    p.op(_RET_K, _RET_ALLOW)
    p.label("eperm")
    p.op(_RET_K, _RET_USER_NOTIF if notify else _RET_ERRNO | EPERM)
    p.label("quiet")
    p.op(_RET_K, _RET_ERRNO | EPERM)
    p.label("enosys")
    p.op(_RET_K, _RET_ERRNO | ENOSYS)
    p.label("kill")
    p.op(_RET_K, _RET_KILL)
    return p.assemble()


def sock_fprog(program: bytes):
    """A pointer to a `struct sock_fprog` of `program`, made ahead of a fork (it keeps its buffer alive)."""
    fprog = _SockFprog(len(program) // 8)
    fprog.buf = ctypes.create_string_buffer(program, len(program))
    fprog.filter = ctypes.cast(fprog.buf, ctypes.c_void_p)
    return ctypes.byref(fprog)


def seccomp_install(program: bytes) -> None:
    """Needs no_new_privs (or CAP_SYS_ADMIN)."""
    _check(_libc.prctl(PR_SET_SECCOMP, 2, sock_fprog(program), 0, 0), "seccomp")


# ---- the supervisor of the filter's refusals ------------------------------------------------------------------

_NR_SECCOMP = {"x86_64": 317, "aarch64": 277}
_SET_MODE_FILTER, _FLAG_NEW_LISTENER = 1, 1 << 3
# _IOWR('!', 0, struct seccomp_notif) and _IOWR('!', 1, struct seccomp_notif_resp): 80 and 24 bytes
_NOTIF_RECV, _NOTIF_SEND = 0xC0502100, 0xC0182101
_NOTIF = struct.Struct("=QIIiIQ6Q")  # id, pid, flags, then seccomp_data: nr, arch, instruction pointer, args
_RESP = struct.Struct("=QqiI")  # id, val, error (a negative errno), flags


def seccomp_install_listener(fprog) -> int:
    """Install the filter `fprog` (a pointer to a sock_fprog) with a new listener: the fd of its notifications
    (close-on-exec). Needs no_new_privs; fails (EBUSY) where a filter already in force has a listener."""
    return _check(_libc.syscall(_NR_SECCOMP[platform.machine()], _SET_MODE_FILTER, _FLAG_NEW_LISTENER, fprog),
                  "seccomp listener")


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _CmsgFd(ctypes.Structure):  # struct cmsghdr + one int: CMSG_SPACE(sizeof(int)) bytes
    _fields_ = [("len", ctypes.c_size_t), ("level", ctypes.c_int), ("type", ctypes.c_int), ("fd", ctypes.c_int),
                ("pad", ctypes.c_int)]


class _MsgHdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32), ("iov", ctypes.c_void_p),
                ("iovlen", ctypes.c_size_t), ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


class _Handoff:
    """A one-byte message carrying one fd (SCM_RIGHTS), built once, before any fork: sending it from a program
    process is one libc call, where the `socket` module's objects cost the freshly forked child ~0.35 ms of page
    copies (measured)."""

    def __init__(self):
        self.byte = ctypes.create_string_buffer(b"l", 1)
        self.iov = _IoVec(ctypes.cast(self.byte, ctypes.c_void_p), 1)
        self.cmsg = _CmsgFd(ctypes.sizeof(_CmsgFd) - 4, socket.SOL_SOCKET, socket.SCM_RIGHTS, -1, 0)
        self.msg = _MsgHdr(None, 0, ctypes.cast(ctypes.byref(self.iov), ctypes.c_void_p), 1,
                           ctypes.cast(ctypes.byref(self.cmsg), ctypes.c_void_p), ctypes.sizeof(_CmsgFd), 0)
        self.ref = ctypes.byref(self.msg)


_HANDOFF = _Handoff()


def hand_over_listener(fprog, sock_fd: int) -> None:
    """In a program process: install the filter with a listener, send the listener over the socket `sock_fd` to
    the supervisor (`DenialCounter.expect`), and close both here: the program must never hold its own listener
    (it could answer its own refusals with "continue"). Raises if the supervisor did not get it: a filter whose
    listener is closed answers ENOSYS, not the EPERM the program would get without a supervisor."""
    listener = seccomp_install_listener(fprog)
    _HANDOFF.cmsg.fd = listener
    sent = _libc.sendmsg(sock_fd, _HANDOFF.ref, 0)
    err = ctypes.get_errno()
    os.close(listener)
    os.close(sock_fd)
    if sent != 1:
        raise OSError(err, f"handing the seccomp listener over: {os.strerror(err)}")


def why_no_seccomp_notify() -> str:
    """"" where a program filter with a supervisor can be installed here (Linux >= 5.0, seccomp here), else why
    not; tried in a throwaway child."""
    if not seccomp_supported():
        return f"no seccomp filter for {platform.machine()}"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        why = b""
        try:
            prctl(PR_SET_NO_NEW_PRIVS, 1)
            os.close(seccomp_install_listener(sock_fprog(seccomp_program(notify=True))))
        except OSError as e:
            why = str(e).encode()[:200]
        finally:
            os.write(w, why or b"ok")
            os._exit(0)
    os.close(w)
    why = os.read(r, 256).decode()
    os.close(r)
    os.waitpid(pid, 0)
    return "" if why == "ok" else why or "the probe died"


_NS_FLAGS = {CLONE_NEWNS: "NEWNS", 0x02000000: "NEWCGROUP", 0x04000000: "NEWUTS", CLONE_NEWIPC: "NEWIPC",
             CLONE_NEWUSER: "NEWUSER", CLONE_NEWPID: "NEWPID", CLONE_NEWNET: "NEWNET"}


def denied_name(nr: int, args: tuple[int, ...]) -> str:
    """A refused syscall as the evidence names it: `ptrace`, `socket(AF_INET)`, `clone(NEWUSER|NEWNET)`."""
    arch = platform.machine()
    _, nr_socket, nr_socketpair, nr_clone, _, _ = _SECCOMP_ARCH[arch]
    if nr >= 0x40000000:
        return f"x32 syscall {nr - 0x40000000}"
    if nr in (nr_socket, nr_socketpair):
        family = args[0] & 0xFFFFFFFF
        try:
            family = socket.AddressFamily(family).name
        except ValueError:
            family = f"family {family}"
        return f"{'socket' if nr == nr_socket else 'socketpair'}({family})"
    name = _NAMES_BY_NR.setdefault(arch, {nrs[_ARCH_INDEX[arch]]: n for n, nrs in _SYSCALLS.items()}).get(nr)
    if nr == nr_clone or name == "unshare":
        flags = "|".join(v for k, v in _NS_FLAGS.items() if args[0] & k)
        return f"{name or 'clone'}({flags})" if flags else name or "clone"
    return name or f"syscall {nr}"


_NAMES_BY_NR: dict[str, dict[int, str]] = {}
DENIED_KINDS = 32  # distinct names a count keeps, "other" included


class DenialCounter:
    """The supervisor of the program filter's refusals (`seccomp_program(notify=True)`): answers each one EPERM,
    as the filter itself does without a supervisor, and counts it by syscall (`denied_name`). The count is the
    kernel's: it sees a syscall made through any path (ctypes, a syscall by number, a C extension), which
    neither reading the program nor its stderr does.

    It lives in the process that forks the program processes, on that process's own poll loop (`poller`, a
    `select.poll` the caller also polls its own fds on; `handle` takes the events that are ours): no thread, in
    a process that forks. Each program process sends its listener on a socket made for it by `expect` before the
    fork (`hand_over_listener`). The supervisor must never stall, since the process it answers waits for the
    answer: it calls RECV only once poll says a notification is pending, and then RECV returns at once (the
    kernel counts pending notifications, and one whose caller died meanwhile gives ENOENT); SEND never waits.
    Should the supervisor be gone (its process died, `close` ran), the kernel answers every refusal ENOSYS instead
    of EPERM: the program is refused all the same, and the case is lost with its harness anyway.

    Only refusals the program saw are counted (SEND succeeded): one interrupted by a signal before its answer is
    restarted by the kernel and notified again, one whose process was killed never returned."""

    def __init__(self, poller):
        self.poller = poller
        self.handoffs: dict[int, object] = {}  # our end of each socket a program process sends its listener on
        self.listeners: set[int] = set()
        self.counts: dict[str, int] = {}
        self._buf = bytearray(_NOTIF.size)

    def expect(self) -> int:
        """The fd of a socket to give the next program process (closed here by `forked`): it sends its listener
        on it (`hand_over_listener`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.handoffs[ours.fileno()] = ours
        self.poller.register(ours.fileno(), select.POLLIN)
        return theirs.detach()

    @staticmethod
    def forked(theirs: int) -> None:
        """After the fork, in this process: the program process's end of its handoff socket is its own."""
        os.close(theirs)

    def handle(self, fd: int, events: int) -> bool:
        """Serve `fd`'s poll `events` if `fd` is one of ours (a handoff or a listener); whether it was."""
        if fd in self.listeners:
            if events & select.POLLIN:
                self._answer(fd)
            elif events & (select.POLLHUP | select.POLLERR | select.POLLNVAL):  # every process it filtered is gone
                self._drop(fd)
            return True
        sock = self.handoffs.pop(fd, None)
        if sock is None:
            return False
        self.poller.unregister(fd)
        try:
            _, fds, _, _ = socket.recv_fds(sock, 16, 1)
        except OSError:
            fds = []
        sock.close()
        for listener in fds:
            self.listeners.add(listener)
            self.poller.register(listener, select.POLLIN)
        return True

    def _answer(self, fd: int) -> None:
        buf = self._buf
        buf[:] = bytes(len(buf))  # RECV refuses a buffer that is not zeroed
        try:
            fcntl.ioctl(fd, _NOTIF_RECV, buf)
        except OSError:  # ENOENT: its caller was killed or interrupted after poll saw it
            return
        nid, _, _, nr, _, _, *args = _NOTIF.unpack(buf)
        try:
            fcntl.ioctl(fd, _NOTIF_SEND, _RESP.pack(nid, 0, -EPERM, 0))
        except OSError:  # ENOENT: gone before the answer; the syscall never returned
            return
        key = denied_name(nr, tuple(args))
        if key not in self.counts and len(self.counts) >= DENIED_KINDS - 1:
            key = "other"  # a program may name endless kinds (socket families, x32 numbers): a bounded report
        self.counts[key] = self.counts.get(key, 0) + 1

    def _drop(self, fd: int) -> None:
        self.listeners.discard(fd)
        self.poller.unregister(fd)
        os.close(fd)

    def take(self) -> dict[str, int]:
        """The counts so far, reset; every socket and listener closed. Call it once every program process is
        reaped: nothing is pending then, and a listener or handoff kept past its processes would leak."""
        for fd in list(self.listeners):
            self._drop(fd)
        for fd, sock in self.handoffs.items():
            self.poller.unregister(fd)
            sock.close()
        self.handoffs.clear()
        counts, self.counts = self.counts, {}
        return counts


class Confinement:
    """What confining a process takes, prepared once (the Landlock ruleset, the seccomp program, the capability
    sets, as kernel and ctypes objects) so that applying it in a freshly forked process is a handful of calls:
    every Python object a fork's child touches costs a page copy, and a spawner forks one per program.

    `apply` confines the calling process for good: drop to the job uid (or no capabilities), no_new_privs,
    Landlock (read `read_fds`, write only beneath `write_paths`; no signal or abstract socket outside its own
    domain), close every fd above 2 but `keep_fds`, then seccomp."""

    def __init__(self, iso: "HostIsolation", read_fds: list[tuple[int, bool]], write_paths: list[str],
                 seccomp: bytes | None, supervised: bytes | None = None):
        self.iso, self.read_fds, self.ruleset = iso, read_fds, None
        keep = 1 << CAP_DAC_READ_SEARCH if iso.keep_dac_read_search else 0
        # ambient: the code verifier's harness job execs a fresh interpreter, which must still reach the Python
        # install and its job directory (Landlock confines what the capability can read either way)
        self._caps = (ctypes.byref(_CapHeader(0x20080522, 0)),  # _LINUX_CAPABILITY_VERSION_3
                      (_CapData * 2)(_CapData(keep, keep, keep if iso.uid is not None else 0), _CapData(0, 0, 0)))
        self._ambient = [c for c in range(32) if keep >> c & 1] if iso.uid is not None else []
        self._fprog = sock_fprog(seccomp) if seccomp is not None else None
        self._supervised = sock_fprog(supervised) if supervised is not None else None
        self.refresh(write_paths)

    def refresh(self, write_paths: list[str]) -> None:
        """A new Landlock ruleset for `write_paths` as they are mounted now (after they were replaced)."""
        if self.ruleset is not None:
            os.close(self.ruleset)
            self.ruleset = None
        if self.iso.landlock_abi:
            write_fds = [(os.open(p, os.O_PATH | os.O_CLOEXEC), os.path.isdir(p)) for p in write_paths]
            try:
                self.ruleset = landlock_ruleset(self.iso.landlock_abi, self.read_fds, write_fds)
            finally:
                for fd, _ in write_fds:
                    os.close(fd)

    def apply(self, keep_fds: tuple[int, ...] = (), handoff: int | None = None) -> None:
        """With `handoff` (`DenialCounter.expect`'s socket) and a `supervised` program: that filter, its listener
        sent to the supervisor; else the plain `seccomp` program."""
        uid = self.iso.uid
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            if self._ambient:
                _libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0)
            os.setresuid(uid, uid, uid)
            _check(_libc.capset(*self._caps), "capset")
            for cap in self._ambient:
                _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0), "prctl(PR_CAP_AMBIENT)")
        elif os.geteuid() == 0:  # root inside a user namespace (non-root host user): keep no capability
            _check(_libc.capset(*self._caps), "capset")
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        if self.ruleset is not None:
            _check(_libc.syscall(_LL_RESTRICT, self.ruleset, 0), "landlock restrict")
        if handoff is not None and self._supervised is not None:
            close_fds_except(tuple(keep_fds) + (handoff,))
            hand_over_listener(self._supervised, handoff)
            return
        close_fds_except(keep_fds)
        if self._fprog is not None:
            _check(_libc.prctl(PR_SET_SECCOMP, 2, self._fprog, 0, 0), "seccomp")


def confine(iso: "HostIsolation", write_paths: list[str], read_fds: list[tuple[int, bool]],
            seccomp: bytes | None, keep_fds: tuple[int, ...] = ()) -> None:
    """`Confinement(...).apply(keep_fds)`, for a process confined once."""
    Confinement(iso, read_fds, write_paths, seccomp).apply(keep_fds)


def close_fds_except(keep: tuple[int, ...]) -> None:
    """Close every fd above 2 but `keep` (close_range by the ranges around them: no /proc needed)."""
    low = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 16)


# ---- what this host allows ----------------------------------------------------------------------------------

@dataclass
class HostIsolation:
    """What the local backend applies on this host; reported by `LocalSandbox.describe()`."""

    root: bool = False
    user_ns: bool = False  # non-root only: a user namespace makes the net/pid namespaces possible
    net_ns: bool = False  # per worker: no interface but a down loopback
    pid_ns: bool = False  # per job: everything the job spawned dies with it
    uid: int | None = None  # per-worker unprivileged uid the jobs run as (root hosts)
    keep_dac_read_search: bool = False  # the Python install is not world-readable (e.g. under /root)
    landlock_abi: int = 0
    seccomp: bool = False
    seccomp_notify: bool = False  # the program filter's refusals go to a supervisor, which counts them
    warnings: list[str] = field(default_factory=list)

    def describe(self) -> str:
        parts = [f"net ns {'per worker' if self.net_ns else 'NO'}", f"pid ns {'per job' if self.pid_ns else 'NO'}"]
        if self.uid is not None:
            parts.append(f"uid {self.uid}" + (" (+CAP_DAC_READ_SEARCH, reads confined by Landlock)"
                                              if self.keep_dac_read_search else ""))
        else:
            parts.append("no capabilities" + (" (user ns)" if self.user_ns else ""))
        if self.landlock_abi:
            parts.append(f"Landlock ABI {self.landlock_abi} (fs" + (", TCP" if self.landlock_abi >= 4 else "")
                         + (", signals" if self.landlock_abi >= 6 else "") + ")")
        else:
            parts.append("NO Landlock")
        parts.append(("seccomp (refusals counted)" if self.seccomp_notify else "seccomp") if self.seccomp
                     else "NO seccomp")
        parts.append("rlimits, fresh tmpfs /tmp and /dev/shm per job")
        return ", ".join(parts)


def python_install_world_readable() -> bool:
    """True when an unprivileged uid can read the standard library (every parent directory is world-x)."""
    return world_traversable(os.path.dirname(os.__file__))


def world_traversable(path: str) -> bool:
    """True when any uid can walk to `path` (it and every parent directory are world-x)."""
    path = os.path.realpath(path)
    while path not in ("/", ""):
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        path = os.path.dirname(path)
    return True


def read_roots() -> list[str]:
    """Paths a job may read: the interpreter, its libraries and the system's, a few device files."""
    roots = {"/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache", "/etc/localtime",
             "/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"}
    roots.update({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                  os.path.dirname(os.path.realpath(sys.executable))})
    for entry in sys.path:  # site-packages and the like; never the current directory or a source checkout
        if entry and "-packages" in entry and os.path.isdir(entry):
            roots.add(entry)
    return sorted(p for p in roots if os.path.exists(p))

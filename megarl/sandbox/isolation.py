"""Kernel isolation primitives for the local backend, through ctypes: namespaces, Landlock, seccomp, capabilities.

`probe()` finds out what this host allows (run once per worker, at start); `JobConfiner` applies it to one job's
process after fork. Nothing here imports anything beyond the standard library.
"""

from __future__ import annotations

import ctypes
import os
import platform
import stat
import struct
import sys
from dataclasses import dataclass, field

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
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


# ---- capabilities -------------------------------------------------------------------------------------------

class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def set_capabilities(caps: int, ambient: bool = False) -> None:
    """Effective = permitted = `caps` (a bit mask of capabilities below 32), inheritable = none; with `ambient`,
    inheritable and ambient = `caps` too, so that they survive an execve by this non-root uid."""
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)(_CapData(caps, caps, caps if ambient else 0), _CapData(0, 0, 0))
    _check(_libc.capset(ctypes.byref(header), data), "capset")
    for cap in range(32) if ambient else ():
        if caps >> cap & 1:
            _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0), "prctl(PR_CAP_AMBIENT)")


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


def landlock_restrict(abi: int, read_fds: list[tuple[int, bool]], write_fds: list[tuple[int, bool]]) -> None:
    """Confine the calling thread: reads/executes only beneath `read_fds`, anything beneath `write_fds`, no TCP
    bind/connect (ABI >= 4), no signals or abstract sockets outside the domain (ABI >= 6).

    Each entry is (O_PATH fd, is_directory). Needs no_new_privs (or CAP_SYS_ADMIN).
    """
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
        _check(_libc.syscall(_LL_RESTRICT, ruleset, 0), "landlock restrict")
    finally:
        os.close(ruleset)


# ---- seccomp ------------------------------------------------------------------------------------------------

# Syscalls a test program never needs and an escape often does: tracing other processes, namespaces, mounts,
# kernel keyrings, BPF, perf, module loading, handle-based opens (which bypass path checks), io_uring.
_DENY_X86_64 = [101, 310, 311, 165, 166, 155, 161, 272, 308, 248, 249, 250, 321, 298, 246, 320, 175, 313, 176,
                169, 167, 168, 303, 304, 323, 134, 172, 173, 163, 103]
_DENY_AARCH64 = [117, 270, 271, 40, 39, 41, 51, 97, 268, 217, 218, 219, 280, 241, 104, 294, 105, 273, 106, 142,
                 224, 225, 264, 265, 282, 89, 116]
_DENY_COMMON = [425, 426, 427, 428, 429, 430, 431, 432, 433, 442]  # io_uring_*, new mount API
_SECCOMP_ARCH = {"x86_64": (0xC000003E, _DENY_X86_64, 41), "aarch64": (0xC00000B7, _DENY_AARCH64, 198)}
_RET_ALLOW, _RET_KILL, _RET_EPERM = 0x7FFF0000, 0x80000000, 0x00050000 | 1
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
AF_UNIX = 1


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def seccomp_supported() -> bool:
    return platform.machine() in _SECCOMP_ARCH


def seccomp_program() -> bytes:
    """A classic-BPF filter: EPERM for the deny list and for sockets other than AF_UNIX; kill on a foreign ABI."""
    audit_arch, deny, nr_socket = _SECCOMP_ARCH[platform.machine()]
    deny = sorted(set(deny + _DENY_COMMON))
    prog: list[tuple[int, int, int, int]] = []
    n = len(deny)
    # Layout: 0 ld arch | 1 jeq | 2 kill | 3 ld nr | 4 x32? | 5..4+n deny | 5+n socket? | 6+n ld arg0 |
    #         7+n jeq AF_UNIX | 8+n allow | 9+n eperm
    allow, eperm = 8 + n, 9 + n
    prog.append((_LD_W_ABS, 0, 0, 4))
    prog.append((_JEQ_K, 1, 0, audit_arch))
    prog.append((_RET_K, 0, 0, _RET_KILL))
    prog.append((_LD_W_ABS, 0, 0, 0))
    prog.append((_JGE_K, eperm - 5, 0, 0x40000000))  # x32 syscalls on x86_64; no such numbers elsewhere
    for i, nr in enumerate(deny):
        prog.append((_JEQ_K, eperm - (5 + i) - 1, 0, nr))
    prog.append((_JEQ_K, 0, allow - (5 + n) - 1, nr_socket))
    prog.append((_LD_W_ABS, 0, 0, 16))  # args[0], low half on little-endian
    prog.append((_JEQ_K, 0, 1, AF_UNIX))
    prog.append((_RET_K, 0, 0, _RET_ALLOW))
    prog.append((_RET_K, 0, 0, _RET_EPERM))
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def seccomp_install(program: bytes) -> None:
    """Needs no_new_privs (or CAP_SYS_ADMIN)."""
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    _check(_libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(fprog), 0, 0), "seccomp")


def confine(iso: "HostIsolation", workdir: str, read_fds: list[tuple[int, bool]], devnull_fd: int,
            seccomp: bytes | None) -> None:
    """Confine the calling process for good: drop to the job uid (or no capabilities), no_new_privs, Landlock
    (read `read_fds`, write only `workdir` and /dev/null), close every fd above 2, then seccomp."""
    if iso.uid is not None:
        os.setgroups([])
        os.setresgid(iso.uid, iso.uid, iso.uid)
        if iso.keep_dac_read_search:
            prctl(PR_SET_KEEPCAPS, 1)
        os.setresuid(iso.uid, iso.uid, iso.uid)
        # ambient: the code verifier's harness job execs a fresh interpreter, which must still reach the
        # Python install and its job directory (Landlock confines what the capability can read either way)
        set_capabilities(1 << CAP_DAC_READ_SEARCH if iso.keep_dac_read_search else 0,
                         ambient=iso.keep_dac_read_search)
    elif os.geteuid() == 0:  # root inside a user namespace (non-root host user): keep no capability
        set_capabilities(0)
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    if iso.landlock_abi:
        job_fd = os.open(workdir, os.O_PATH | os.O_CLOEXEC)
        landlock_restrict(iso.landlock_abi, read_fds, [(job_fd, True), (devnull_fd, False)])
    os.closerange(3, 1 << 16)
    if seccomp is not None:
        seccomp_install(seccomp)


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
        parts.append("seccomp" if self.seccomp else "NO seccomp")
        parts.append("rlimits, fresh cwd, process-group kill")
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

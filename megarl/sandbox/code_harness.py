"""Trusted test harness for `megarl/verifiers/code.py`: runs the tests, while the program runs in other processes.

Standard library only. Two ways to run it:
- persistent (`serve`): the local backend's workers and the Docker backend's harness containers keep it running
  as pid 1 of its own pid namespace; a case (program, tests, limits) comes in as a JSON line, the verdict payload
  goes out as one, and the backend adds the run's secret;
- as a job (`main`, where the host has no pid namespace): the job execs this file in a fresh interpreter, with
  `solution.py` (the untrusted program) and `spec.json` (the tests) as job files and the secret on stdin.

Why it cannot be fooled by the program:
- The program never runs in this process. It runs in children of a zygote forked before this process read any
  test, so a program finds no tests (nor other responses) in the memory or stack it inherits; the job files are
  unlinked before the first program starts. Children's fds are only /dev/null (or their own stdin/stdout pipes)
  and a request/answer pipe pair; this process is non-dumpable, so a child can neither ptrace it nor open
  /proc/<pid>/fd/*, and the verdict channel is never in a child.
- Test code (`check(candidate)`, asserts) runs here; `candidate` and any other name the tests take from the
  program are proxies that call into the child. Values cross back pickled and are unpickled with no class
  but a few builtins allowed: an object whose `__eq__` always returns True, an int subclass, anything not plain
  data is refused, so the comparisons the tests make are between plain values.
- The secret is never in a child's memory: as a job, it is read from stdin only after the last test; persistent,
  this process never has it. `sys.exit(0)`, `os._exit`, `atexit` hooks, killing this process or its pipes,
  printing a fake verdict: each leaves either a failed test or no verdict line with the secret, and no line means
  no reward.
Stdin/stdout tests: each input in a fresh child (stdin a memfd, stdout a capped pipe, its own process group,
killed at the per-test deadline); the comparison is done here, never by the program.
"""

import ast
import builtins
import io
import json
import os
import pickle
import resource
import select
import signal
import struct
import sys
import time
import traceback

DONE = "@@megarl-code-done"
_MAX_FRAME = 64 << 20
_PLAIN_CLASSES = {"complex", "set", "frozenset", "bytearray"}
_CHILD_RLIMITS = []  # (resource, value) set in each program child; only the persistent harness sets them
_ZYGOTE = None  # the Zygote every program child is forked from (set by main / serve)


def main():
    """One run as a sandbox job (`python -I harness.py` in a fresh interpreter, exec'd by the job's stub: the
    fork the job started as holds the job, tests included, in its memory): the program in `solution.py`, the
    tests in `spec.json`, the secret on stdin."""
    global _ZYGOTE
    _nondumpable()
    _ZYGOTE = Zygote(reap_all=False)  # before this process reads the tests
    spec = json.load(open("spec.json"))
    source = open("solution.py", encoding="utf-8").read()
    for name in ("spec.json", "solution.py", "harness.py"):  # the job directory is the programs' cwd
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass
    try:
        payload = run_case(source, spec)
    finally:
        _ZYGOTE.reap()
    finish(payload)


def run_case(source, spec):
    """The verdict payload for one program against one spec (the tests run here, the program in children)."""
    try:
        compile(source, "solution.py", "exec")  # only to report a syntax error; each child compiles its own
    except (SyntaxError, ValueError) as e:
        return {"compile_error": f"{type(e).__name__}: {e}", "results": []}
    mode = spec["mode"]
    if mode == "function":
        return {"results": run_function_tests(spec, source)}
    if mode == "io":
        return {"results": run_io_tests(spec, source)}
    if mode == "call":
        return {"results": run_call_tests(spec, source)}
    raise ValueError(f"unknown mode {mode!r}")


def finish(payload):
    secret = sys.stdin.read().strip()  # only now: never in the memory of a child that ran the program
    sys.stdout.flush()
    _write_all(1, verdict_line(secret, json.dumps(payload)).encode())


def verdict_line(secret, payload_json):
    """What proves a run: the marker, the run's secret, the payload (JSON text), on a line of their own. Written
    here by the harness as a job; by the backend, which holds the secret, for the persistent harness."""
    return f"\n{DONE} {secret} {payload_json}\n"


def _nondumpable():
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE, 0
        raise OSError("cannot make the harness non-dumpable")


# ---- function-style tests: check(candidate) or top-level asserts ----------------------------------------------

def run_function_tests(spec, code):
    """HumanEval (`def check(candidate)`, one test) or MBPP-style top-level asserts (one test each)."""
    tree, check_code = _parsed_test(spec["test"])
    program = Program(code, spec["time_s"])
    try:
        if check_code is not None:
            return [_check_style(spec, check_code, program)]
        return _assert_style(spec, tree, program)
    finally:
        program.kill()


_TESTS = {}


def _parsed_test(test):
    """The test's syntax tree and, for a `check(candidate)` test, its code object; kept for the next run of the
    same test (a persistent harness sees each problem's test once per sample of its group)."""
    if test not in _TESTS:
        tree = ast.parse(test, "test.py")
        is_check = any(isinstance(n, ast.FunctionDef) and n.name == "check" for n in tree.body)
        if len(_TESTS) >= 256:
            _TESTS.pop(next(iter(_TESTS)))
        _TESTS[test] = tree, compile(tree, "test.py", "exec") if is_check else None
    return _TESTS[test]


def _check_style(spec, check_code, program):
    if program.load_error:
        return _fail("program", program.load_error)
    env = RemoteGlobals(program)
    try:
        exec(check_code, env)
        env["check"](env.proxy(spec["entry_point"]))
    except BaseException as e:  # noqa: BLE001 - whatever the tests raise is a failure
        timed_out = isinstance(e, CandidateError) and str(e).startswith("no answer within")
        return _fail("timeout" if timed_out else "check", _describe(e))
    return {"ok": True}


def _assert_style(spec, tree, program):
    env = RemoteGlobals(program)
    results = []
    total = sum(isinstance(n, ast.Assert) for n in tree.body)
    for node in tree.body:
        stop = spec.get("early_stop") and results and not results[-1]["ok"]
        if isinstance(node, ast.Assert) and (stop or program.load_error):
            results.append(_fail("skipped" if stop else "program", program.load_error or "early stop"))
            continue
        try:
            exec(compile(ast.Module([node], []), "test.py", "exec"), env)
            if isinstance(node, ast.Assert):
                results.append({"ok": True})
        except BaseException as e:  # noqa: BLE001
            if isinstance(node, ast.Assert):
                results.append(_fail("assert", _describe(e)))
            else:  # setup code failed: every assert left fails
                results += [_fail("setup", _describe(e))] * (total - len(results))
                break
        if program.dead:  # a timeout or a crash took the program down: the next test gets a fresh one
            program.kill()
            program.__init__(program.source, program.time_s)
            env.clear()
    return results


class RemoteGlobals(dict):
    """Globals of the test code: a name the tests do not define comes from the program, as a proxy."""

    def __init__(self, program):
        super().__init__()
        self.program = program

    def __missing__(self, name):
        if name.startswith("__") or hasattr(builtins, name):
            raise KeyError(name)  # let the interpreter look in builtins
        kind, value = self.program.request(("lookup", name))
        if kind == "callable":
            value = self.proxy(name)
        elif kind != "value":
            raise KeyError(name)
        self[name] = value
        return value

    def proxy(self, name):
        program = self.program

        def call(*args, **kwargs):
            kind, value = program.request(("call", name, args, kwargs))
            if kind != "ok":
                raise CandidateError(value)
            return value

        call.__name__ = name
        return call


class CandidateError(Exception):
    pass


class Program:
    """The untrusted program, loaded in a forked child that answers lookups and calls over a pipe pair."""

    def __init__(self, source, time_s):
        self.source, self.time_s = source, time_s
        self.dead = False
        req_r, self.req_w = os.pipe()
        self.resp_r, resp_w = os.pipe()
        self.pid = _ZYGOTE.spawn("server", [req_r, resp_w])
        if self.pid < 0:
            self.dead, self.load_error = True, "the program could not be started (process limit)"
            return
        _send(self.req_w, source.encode("utf-8", "surrogatepass"))
        kind, value = self._receive(max(time_s, 1.0))
        self.load_error = None if kind == "ready" else value

    def request(self, message):
        if self.dead:
            return "dead", "the program is no longer running"
        try:
            _send(self.req_w, pickle.dumps(message))
        except (OSError, pickle.PicklingError, TypeError, AttributeError) as e:
            self.dead = True
            return "dead", f"cannot send to the program: {type(e).__name__}"
        return self._receive(self.time_s)

    def _receive(self, timeout):
        try:
            return _PlainUnpickler(io.BytesIO(_receive(self.resp_r, timeout))).load()
        except TimeoutError:
            self.dead = True
            return "timeout", f"no answer within {self.time_s} s"
        except EOFError:
            self.dead = True
            return "dead", "the program exited"
        except Exception as e:  # noqa: BLE001 - anything but plain data in the answer
            self.dead = True
            return "bad_value", f"not plain data: {e}"

    def kill(self):
        _kill_group(self.pid)  # the zygote, its parent, reaps it
        _PENDING.pop(self.resp_r, None)
        for fd in (self.req_w, self.resp_r):
            try:
                os.close(fd)
            except OSError:
                pass


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "builtins" and name in _PLAIN_CLASSES:
            return getattr(builtins, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def _program_child(req_r, resp_w):
    """A program child serving lookups and calls: its first frame is the program's source."""
    _isolate_child(keep=(req_r, resp_w), stdin=None, stdout=None)
    env = {"__name__": "solution", "__builtins__": builtins}
    try:
        source = _receive(req_r, None).decode("utf-8", "surrogatepass")
        exec(compile(source, "solution.py", "exec"), env)
        _send(resp_w, pickle.dumps(("ready", None)))
    except BaseException as e:  # noqa: BLE001
        _send(resp_w, pickle.dumps(("error", _describe(e))))
        return
    while True:
        message = pickle.loads(_receive(req_r, None))
        try:
            answer = _serve(env, message)
        except BaseException as e:  # noqa: BLE001 - SystemExit included: the test fails, the server goes on
            answer = ("raise", _describe(e))
        try:
            data = pickle.dumps(answer)
        except Exception:  # noqa: BLE001
            data = pickle.dumps(("raise", f"unserializable value of type {type(answer[1]).__name__}"))
        _send(resp_w, data)


def _serve(env, message):
    op, name = message[0], message[1]
    if op == "lookup":
        if name not in env:
            return "missing", None
        value = env[name]
        return ("callable", None) if callable(value) else ("value", _plain(value))
    fn = env.get(name)
    if fn is None and isinstance(env.get("Solution"), type):  # LeetCode-style `class Solution`
        fn = getattr(env["Solution"](), name)
    return "ok", _plain(fn(*message[2], **message[3]))


def _plain(value):
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return value.tolist()
    return value


# ---- stdin/stdout and call-based tests (APPS / CodeContests) --------------------------------------------------

def run_io_tests(spec, code):
    results = []
    for inp, expected in zip(spec["inputs"], spec["outputs"]):
        if spec.get("early_stop") and results and not results[-1]["ok"]:
            results.append(_fail("skipped", "early stop"))
            continue
        cap = max(1 << 16, 4 * len(expected))
        status, out = _run_stdio(code, inp, spec["time_s"], cap)
        if status != "ok":
            results.append(_fail(status, ""))
        elif same_output(out, expected):
            results.append({"ok": True})
        else:
            results.append(_fail("wrong_answer", out[:200]))
    return results


def run_call_tests(spec, code):
    program = Program(code, spec["time_s"])
    results = []
    try:
        for args, expected in zip(spec["inputs"], spec["outputs"]):
            if spec.get("early_stop") and results and not results[-1]["ok"]:
                results.append(_fail("skipped", "early stop"))
                continue
            if program.load_error:
                results.append(_fail("program", program.load_error))
                continue
            kind, value = program.request(("call", spec["fn_name"], list(args) if isinstance(args, list)
                                           else [args], {}))
            if kind != "ok":
                results.append(_fail(kind, str(value)[:200]))
            elif _same_value(value, expected):
                results.append({"ok": True})
            else:
                results.append(_fail("wrong_answer", repr(value)[:200]))
            if program.dead:
                program.kill()
                program.__init__(code, spec["time_s"])
    finally:
        program.kill()
    return results


def _same_value(value, expected):
    value = _lists(value)
    if value == expected:
        return True
    return isinstance(expected, list) and len(expected) == 1 and value == expected[0]  # APPS wraps outputs


def _lists(v):
    if isinstance(v, (list, tuple)):
        return [_lists(x) for x in v]
    if isinstance(v, dict):
        return {k: _lists(x) for k, x in v.items()}
    return v


def same_output(got, expected):
    """Whitespace-tolerant: equal line by line with trailing blanks ignored, or equal as whitespace-split tokens."""
    def lines(text):
        out = [line.rstrip() for line in text.strip("\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(got) == lines(expected) or got.split() == expected.split()


def _run_stdio(source, stdin_text, time_s, cap):
    stdin_fd = os.memfd_create("stdin")
    _write_all(stdin_fd, stdin_text.encode())
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe()
    code_r, code_w = os.pipe()
    status_r, status_w = os.pipe()
    pid = _ZYGOTE.spawn("stdio", [stdin_fd, out_w, code_r, status_w])
    try:
        if pid < 0:
            return "runtime_error", ""
        try:
            _write_all(code_w, source.encode("utf-8", "surrogatepass"))
        except OSError:
            pass  # it died before reading its program: no status byte, a runtime error below
        os.close(code_w)
        code_w = None
        buf, status = bytearray(), None
        deadline = time.monotonic() + time_s
        pidfd = os.pidfd_open(pid)  # not our child (the zygote's), but its exit is visible here all the same
        eof = exited = False
        while not (eof and exited) and status is None:
            left = deadline - time.monotonic()
            if left <= 0:
                status = "timeout"
                break
            ready, _, _ = select.select([pidfd] + ([] if eof else [out_r]), [], [], left)
            if pidfd in ready:
                exited = True
            if out_r in ready:
                chunk = os.read(out_r, 1 << 16)
                eof = not chunk
                buf += chunk
                if len(buf) > cap:
                    status = "output_limit"
            if exited and not eof and out_r not in ready:
                break  # exited, and something it left behind still holds the pipe: take what is there
        _kill_group(pid)
        os.close(pidfd)
        if status is None:
            os.set_blocking(status_r, False)
            try:
                code = os.read(status_r, 1)
            except BlockingIOError:
                code = b""
            status = "ok" if code == b"\0" else "runtime_error"
        return status, buf.decode("utf-8", "replace")
    finally:
        for fd in (out_r, status_r, code_w):
            if fd is not None:
                os.close(fd)


def _stdio_child(stdin_fd, out_w, code_r, status_w):
    """A program child for one stdin/stdout test: its source comes on `code_r`, its exit status goes back as one
    byte on `status_w` (no byte: it was killed)."""
    _isolate_child(keep=(code_r, status_w), stdin=stdin_fd, stdout=out_w)
    chunks = []
    while chunk := os.read(code_r, 1 << 16):
        chunks.append(chunk)
    os.close(code_r)
    status = 0
    try:
        exec(compile(b"".join(chunks).decode("utf-8", "surrogatepass"), "main.py", "exec"),
             {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as e:
        status = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001
        status = 1
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001
        status = status or 1
    try:
        os.write(status_w, bytes([status & 0xFF]))
    except OSError:
        pass
    os._exit(status & 0xFF)


def _kill_group(pid):
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# ---- the zygote: where every program child comes from -------------------------------------------------------

class Zygote:
    """A child of the harness made before the harness holds any test, answer key or other response: every
    program child is forked from it, so no program can find the tests in the memory it inherits (nor the
    programs of other cases). Asked over a socket pair: `spawn` (the child's fds passed along), `reap`.

    With `reap_all` (the persistent harness, pid 1 of its namespace) it is the subreaper of its children and
    `reap` kills every process of the namespace but pid 1 and itself; otherwise only its children's groups."""

    def __init__(self, reap_all):
        import socket

        self._socket = socket
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        _flush_std()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                self.sock.close()
                _zygote_main(theirs, reap_all)
            finally:
                os._exit(0)
        theirs.close()
        self.sock.settimeout(30)

    def spawn(self, mode, fds):
        """Fork a program child holding `fds` (closed here); its pid, or -1 when it could not be forked."""
        try:
            self._socket.send_fds(self.sock, [mode.encode() + b" " + json.dumps(_CHILD_RLIMITS).encode()], fds)
        finally:
            for fd in fds:
                os.close(fd)
        return int(self._ask())

    def reap(self):
        self.sock.send(b"reap")
        self._ask()

    def _ask(self):
        reply = self.sock.recv(64)
        if not reply:
            raise RuntimeError("the zygote is gone (a program killed it)")
        return reply


def _zygote_main(sock, reap_all):
    import socket

    if reap_all:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come here
    children = set()
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)
        except OSError:
            return
        if not msg:
            return
        _reap(children, block=False)
        if msg == b"reap":
            if reap_all:
                _kill_all_but_init()
            else:
                for pid in children:
                    _kill_group(pid)
                _reap(children, block=True)
            sock.send(b"ok")
            continue
        mode, rlimits = msg.split(b" ", 1)
        try:
            pid = os.fork()
        except OSError:
            pid = -1
        if pid == 0:
            code = 70
            try:
                sock.close()
                _CHILD_RLIMITS[:] = json.loads(rlimits)
                if mode == b"server":
                    _program_child(*fds)
                else:
                    _stdio_child(*fds)
                code = 0
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        if pid > 0:
            children.add(pid)
        sock.send(b"%d" % pid)


def _reap(children, block):
    """Collect exited children (all of them, waiting, when `block`)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)


def _kill_all_but_init():
    """As the subreaper inside a pid namespace: SIGKILL every process there but pid 1 and this one, reap them."""
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _flush_std():
    """Before a fork: nothing the harness buffered may come out of a child's fds 1 and 2."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()


def _isolate_child(keep, stdin, stdout):
    """In a child that will run the program: its own process group, fds 0-2 and `keep` only, and (persistent
    harness) the case's rlimits."""
    os.setpgid(0, 0)
    for which, value in _CHILD_RLIMITS:
        resource.setrlimit(which, (value, value))
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(stdin if stdin is not None else null, 0)
    os.dup2(stdout if stdout is not None else null, 1)
    os.dup2(null, 2)
    low = 3  # close by ranges around the fds kept (close_range: no /proc needed, one syscall per range)
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, max(low, min(os.sysconf("SC_OPEN_MAX"), 1 << 16)))
    # sys.stdin/stdout/stderr stay the harness's own objects over fds 0-2 (flushed before the fork, never read
    # by the harness), which now are /dev/null or the test's pipes: building new ones costs ~0.3 ms a child.


# ---- framing and helpers ----------------------------------------------------------------------------------------

def _send(fd, data):
    _write_all(fd, struct.pack("<I", len(data)) + data)


_PENDING = {}  # fd -> bytes read past the last frame


def _receive(fd, timeout):
    """One length-prefixed frame, in as few reads as the data allows (one select and one read, usually)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    buf = _PENDING.pop(fd, b"")
    need = 4
    while True:
        if len(buf) >= 4:
            (size,) = struct.unpack_from("<I", buf)
            if size > _MAX_FRAME:
                raise ValueError("oversized answer")
            need = 4 + size
            if len(buf) >= need:
                if len(buf) > need:
                    _PENDING[fd] = bytes(buf[need:])
                return bytes(buf[4:need])
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, max(1 << 16, need - len(buf)))
        if not chunk:
            raise EOFError
        buf += chunk


def _fail(kind, detail):
    return {"ok": False, "why": kind, "detail": str(detail)[:300]}


def _describe(e):
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    return text[:300]


# ---- the persistent harness of the local backend ---------------------------------------------------------------

def serve(cfg):
    """`python -I code_harness.py --serve CFG`: one harness for many cases, pid 1 of its own pid namespace.

    Started by a local-backend worker (`megarl/sandbox/local.py`) as root in a fresh pid namespace, or as a
    Docker container's pid 1 (`megarl/sandbox/docker.py`), with its case pipe on fd 0 and its answer pipe on
    fd 1. On the local backend it confines itself exactly as a job is confined (the job uid, Landlock writing
    only to `cfg["workdir"]`, seccomp, every other fd closed). It becomes non-dumpable, then for
    each case line: empties the work directory, runs the case (the program in children of its zygote, forked
    before any case arrived, with the case's rlimits), has the zygote kill every other process of the namespace
    and reap them, and answers one JSON line. Only the worker reads the answers, and it adds the run's secret
    itself, so no program ever sees the channel or the secret. A program that kills the zygote takes this
    harness down with it (the worker reports the case as a sandbox error and starts a new harness).
    """
    global _ZYGOTE
    if os.getpid() != 1:
        raise RuntimeError("the persistent harness must be pid 1 of its own pid namespace")
    workdir = cfg["workdir"]
    os.makedirs(workdir, 0o700, exist_ok=True)
    os.chdir(workdir)
    confining = "isolation" in cfg  # the local backend; in a Docker container the container is the confinement
    if confining:
        iso_mod = _load_sibling("isolation")
        read_fds = [(os.open(p, os.O_PATH | os.O_CLOEXEC), os.path.isdir(p)) for p in cfg["read_roots"]]
        devnull_fd = os.open(os.devnull, os.O_PATH | os.O_CLOEXEC)
        iso = iso_mod.HostIsolation(**cfg["isolation"])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for name in cfg["preimports"].split():
        try:
            __import__(name)
        except ImportError:
            pass
    with open("/proc/self/statm") as f:  # read now: /proc is out of reach once confined
        vsize = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") + (32 << 20)  # + what caches may add
    if confining:
        iso_mod.confine(iso, workdir, read_fds, devnull_fd, iso_mod.seccomp_program() if iso.seccomp else None)
    _nondumpable()
    import gc

    gc.freeze()
    # The case and answer pipes move off fds 0 and 1, which become /dev/null under the same sys.stdin/stdout
    # objects: whatever a test prints goes nowhere, and the program children inherit working streams.
    case_fd, answer_fd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    _ZYGOTE = Zygote(reap_all=True)
    _write_all(answer_fd, b'{"ready": true}\n')
    for line in os.fdopen(case_fd, "rb"):
        case = json.loads(line)
        _empty_dir(workdir)
        for scratch in cfg.get("scratch", ()):  # a container's other writable places: nothing passes between cases
            _empty_dir(scratch, keep=workdir)
        _CHILD_RLIMITS[:] = _case_rlimits(case["limits"], vsize, cfg.get("nproc_extra"))
        try:
            payload = run_case(case["code"], case["spec"])
        finally:
            _ZYGOTE.reap()
        sys.stdout.flush()
        _write_all(answer_fd, (json.dumps(payload) + "\n").encode())


def _case_rlimits(lim, vsize, nproc_extra):
    cpu = max(1, int(-(-lim["cpu_s"] // 1)))
    wanted = [(resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, vsize + lim["memory_mb"] * (1 << 20)),
              (resource.RLIMIT_FSIZE, lim["file_mb"] * (1 << 20)), (resource.RLIMIT_NOFILE, lim["open_files"])]
    if nproc_extra is not None:  # not in a container: RLIMIT_NPROC counts the uid across the host there
        wanted.append((resource.RLIMIT_NPROC, lim["processes"] + nproc_extra))
    clamped = []
    for which, value in wanted:  # never above a hard limit the harness already has (it cannot raise one)
        hard = resource.getrlimit(which)[1]
        clamped.append((which, value if hard == resource.RLIM_INFINITY else min(value, hard)))
    return clamped


def _empty_dir(path, keep=None):
    """Remove what the last case left in the work directory (usually nothing: one listdir)."""
    for entry in os.scandir(path):
        if entry.path == keep:
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                os.chmod(entry.path, 0o700)
                _empty_dir(entry.path)
                os.rmdir(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            pass


def _write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]


def _load_sibling(name):
    """A module of this directory by path: the harness runs as a script (`-I`), not from the megarl package."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
    spec = importlib.util.spec_from_file_location(f"_megarl_sandbox_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(json.loads(sys.argv[2]))
    else:
        main()

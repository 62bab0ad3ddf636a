"""Trusted test harness for `megarl/verifiers/code.py`: runs the tests, while the program runs in other processes.

Standard library only (with its siblings `rpc`, `spawner`, `isolation`, `cgroups`, loaded by path). Two
ways to run it:
- persistent (`serve`): the local backend's workers and the Docker backend's harness containers keep it running
  as pid 1 of its own pid namespace; a case (program, tests, limits) comes in as a JSON line, one JSON line per
  test result goes out as soon as the test is done, then a final line, and the backend adds the run's secret;
- as a job (`main`, where the host has no pid namespace): the job execs this file in a fresh interpreter, with
  `solution.py` (the untrusted program), `spec.json` (the tests) and the sibling modules as job files and the
  secret on stdin; it prints a signed line per test result and a signed verdict line at the end.
Either way a case that ends early (its wall-clock limit, a crash) keeps the results of the tests already run.
The final line (the verdict, as a job) also gives `cpu_s`: the CPU seconds (user + system) the case's program
processes used, as the kernel counted each one the spawner reaped, plus this process's while it ran the tests.

Why it cannot be fooled by the program:
- The program never runs in this process. Every program process is forked by the spawner (`spawner.py`), which
  this process forks before it reads any test, so a program finds no tests (nor other responses) in the memory
  it inherits; as a job, the job files are unlinked before the first program starts. A program process has
  /dev/null or its own pipes as fds, a fresh pid namespace where it is pid 1, its own Landlock domain (no signal
  to this process), the program seccomp filter; this process is non-dumpable and ignores every signal.
- Test code runs here, in a namespace whose missing names come from the program (`rpc`): values cross
  as plain data only, bounded in size; the row's `prompt` code (helpers the tests call) runs here and cannot be
  replaced by the program; comparisons are between plain values this process holds.
- The verdict channel is this process's own pipe, and the secret is never in a program process: the persistent
  harness never has it (the backend adds it), and as a job it is read after the spawner is forked. A program's
  exit status (stdin/stdout tests) is what the kernel reports to the spawner, not a byte the program could write.
  `sys.exit(0)`, `os._exit`, `atexit` hooks, signals, printing a fake verdict: each leaves either a failed test or
  no verdict line with the secret, and no line means no reward.
- Nothing a case does reaches a later case: the spawner kills every program process of a case and replaces its
  /tmp and /dev/shm mounts before this process answers the case's last line.
"""

import ast
import json
import os
import resource
import select
import signal
import sys
import time

DONE = "@@megarl-code-done"
PART = "@@megarl-code-part"
HARNESS_MB = 1024  # what the persistent harness itself may add to its address space (bounded work on any input)


def _load(name):
    """A sibling module of this directory: from the bundle (Docker) or by path (the harness runs as a script)."""
    key = f"_megarl_sandbox_{name}"
    if key in sys.modules:
        return sys.modules[key]
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


rpc = _load("rpc")
_spawner = _load("spawner")


def verdict_line(secret, payload_json):
    """What proves a run: the marker, the run's secret, the payload (JSON text), on a line of their own. Written
    by the harness as a job; by the backend, which holds the secret, for the persistent harness."""
    return f"\n{DONE} {secret} {payload_json}\n"


def part_line(secret, result_json):
    """One test's result, signed like the verdict: what counts when a run ends before its verdict line."""
    return f"\n{PART} {secret} {result_json}\n"


class CompileError(Exception):
    pass


class Context:
    """What running one case needs: the spawner and the program processes' rlimits."""

    def __init__(self, spawner, rlimits, memory_mb):
        self.spawner, self.rlimits, self.memory_mb = spawner, rlimits, memory_mb
        self.oom_kills = 0  # seen so far in the case: a program process killed with more is out of memory

    def program(self, source, spec):
        prompt_code = _parsed_test(spec.get("test", ""), spec.get("prompt") or "")[2]
        return rpc.Program(self.spawner, source, _marshalled(prompt_code), spec["time_s"], self.rlimits,
                           self.memory_mb)


def run_case(source, spec, ctx):
    """The results of one program against one spec, one per test as each is done (the tests run here, the
    program in program processes). Raises CompileError when the program does not compile."""
    rpc.begin_case(spec.get("wall_s"))
    mode = spec["mode"]
    if mode == "function":
        return run_function_tests(spec, source, ctx)
    if mode == "io":
        return run_io_tests(spec, source, ctx)
    if mode == "call":
        return run_call_tests(spec, source, ctx)
    raise ValueError(f"unknown mode {mode!r}")


def _fail(kind, detail):
    return {"ok": False, "why": kind, "detail": str(detail)[:300]}


def _failure_kind(e, default):
    return "timeout" if isinstance(e, rpc.ProgramTimeout) else default


# ---- function-style tests: check(candidate) or top-level asserts ----------------------------------------------

def run_function_tests(spec, source, ctx):
    """HumanEval (`def check(candidate)`, one test) or MBPP-style top-level asserts (one test each)."""
    tree, check_code, prompt_code = _parsed_test(spec.get("test", ""), spec.get("prompt") or "")
    program = ctx.program(source, spec)
    try:
        if program.compile_error:
            raise CompileError(program.compile_error)
        if check_code is not None:
            yield _check_style(spec, check_code, prompt_code, program)
        else:
            yield from _assert_style(spec, tree, prompt_code, program)
    finally:
        program.release()  # the spawner's `end` kills it


_TESTS = {}


def _parsed_test(test, prompt):
    """The test's syntax tree, its code object for a `check(candidate)` test, and the prompt's code object;
    kept for the next run of the same row (a persistent harness sees each row once per sample of its group)."""
    key = (test, prompt)
    if key not in _TESTS:
        tree = ast.parse(test, "test.py")
        is_check = any(isinstance(n, ast.FunctionDef) and n.name == "check" for n in tree.body)
        if len(_TESTS) >= 256:
            _TESTS.pop(next(iter(_TESTS)))
        _TESTS[key] = (tree, compile(tree, "test.py", "exec") if is_check else None,
                       compile(prompt, "prompt.py", "exec") if prompt else None)
    return _TESTS[key]


_MARSHALLED = {}


def _marshalled(code):
    """A code object as the program process loads it (kept: one per row)."""
    if code is None:
        return b""
    if code not in _MARSHALLED:
        import marshal

        if len(_MARSHALLED) >= 256:
            _MARSHALLED.pop(next(iter(_MARSHALLED)))
        _MARSHALLED[code] = marshal.dumps(code)
    return _MARSHALLED[code]


def _test_globals(program, prompt_code, entry_point):
    """The tests' namespace: the row's prompt code run here (its helpers are the tests', whatever the program
    defines), the entry point and every other missing name from the program."""
    env = rpc.RemoteGlobals(program)
    if prompt_code is not None:
        exec(prompt_code, env)
        env.pop(entry_point, None)  # the prompt's stub of the function asked for: the program's is the one tested
    return env


def _check_style(spec, check_code, prompt_code, program):
    if program.load_error:
        return _fail("program", program.load_error)
    try:
        env = _test_globals(program, prompt_code, spec["entry_point"])
        exec(check_code, env)
        env["check"](env.proxy(spec["entry_point"]))
    except BaseException as e:  # noqa: BLE001 - whatever the tests raise is a failure
        return _fail(_failure_kind(e, "check"), rpc.describe(e))
    return {"ok": True}


def _assert_style(spec, tree, prompt_code, program):
    entry = spec.get("entry_point", "")
    setup = []  # the statements that are not asserts, run so far: run again for a restarted program
    env = None
    failed = False
    for node in tree.body:
        is_assert = isinstance(node, ast.Assert)
        if is_assert and (program.load_error or (spec.get("early_stop") and failed)):
            failed = True
            yield _fail("program" if program.load_error else "skipped", program.load_error or "early stop")
            continue
        try:
            if env is None:
                env = _test_globals(program, prompt_code, entry)
                for done in setup:
                    exec(done, env)
            code = compile(ast.Module([node], []), "test.py", "exec")
            exec(code, env)
            if is_assert:
                yield {"ok": True}
            else:
                setup.append(code)
        except BaseException as e:  # noqa: BLE001 - whatever the test code raises (SystemExit too) fails its asserts
            failed = True
            if is_assert:
                yield _fail(_failure_kind(e, "assert"), rpc.describe(e))
            else:  # setup code failed: every assert left fails
                for _ in range(sum(isinstance(n, ast.Assert) for n in tree.body[tree.body.index(node):])):
                    yield _fail("setup", rpc.describe(e))
                return
        if program.dead:  # a timeout or a crash took the program down: the next test gets a fresh one
            program.restart()
            env = None


# ---- stdin/stdout and call-based tests (APPS / CodeContests) --------------------------------------------------

def run_io_tests(spec, source, ctx):
    failed = False
    for i, (inp, expected) in enumerate(zip(spec["inputs"], spec["outputs"])):
        if spec.get("early_stop") and failed:
            yield _fail("skipped", "early stop")
            continue
        cap = max(1 << 16, 4 * len(expected))
        status, out = _run_stdio(ctx, source, inp, spec["time_s"], cap)
        if status == "compile_error" and i == 0:
            raise CompileError(out[:300])
        if status != "ok":
            result = _fail("runtime_error" if status == "compile_error" else status, out[:200])
        elif same_output(out, expected):
            result = {"ok": True}
        else:
            result = _fail("wrong_answer", out[:200])
        failed = failed or not result["ok"]
        yield result


def run_call_tests(spec, source, ctx):
    program = ctx.program(source, spec)
    failed = False
    try:
        if program.compile_error:
            raise CompileError(program.compile_error)
        for args, expected in zip(spec["inputs"], spec["outputs"]):
            if spec.get("early_stop") and failed:
                yield _fail("skipped", "early stop")
                continue
            if program.load_error:
                result = _fail("program", program.load_error)
            else:
                try:
                    value = program.request(("call", spec["fn_name"], list(args) if isinstance(args, list)
                                             else [args], {}))[0]
                    result = {"ok": True} if _same_value(value, expected) else \
                        _fail("wrong_answer", rpc.short_repr(value))
                except rpc.CandidateError as e:
                    result = _fail(_failure_kind(e, "runtime_error"), str(e)[:200])
                except BaseException as e:  # noqa: BLE001 - comparing what came back failed
                    result = _fail("wrong_answer", rpc.describe(e))
            failed = failed or not result["ok"]
            yield result
            if program.dead:
                program.restart()
    finally:
        program.release()  # the spawner's `end` kills it


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


def _stdin_fd(text):
    """A readable fd holding `text` from its start: a memfd, or an unlinked file where memfds are refused."""
    try:
        fd = os.memfd_create("stdin")
    except OSError:
        fd = os.open(".", os.O_TMPFILE | os.O_RDWR, 0o600)
    rpc.write_all(fd, text.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _run_stdio(ctx, source, stdin_text, time_s, cap):
    """One stdin/stdout test in a fresh program process: (status, its stdout)."""
    stdin_fd = _stdin_fd(stdin_text)
    out_r, out_w = os.pipe()
    code_r, code_w = os.pipe()
    pid, pidfd = ctx.spawner.spawn("stdio", [stdin_fd, out_w, code_r], ctx.rlimits, ctx.memory_mb, stdin=0,
                                   stdout=1)
    try:
        if pid < 0:
            return "runtime_error", ""
        try:
            rpc.write_all(code_w, source.encode("utf-8", "surrogatepass"))
        except OSError:
            pass  # it died before reading its program: its exit status says so
        os.close(code_w)
        code_w = None
        buf, status = bytearray(), None
        limit = rpc.Limit(time_s, lambda: ctx.spawner.cpu_seconds(pid))  # its CPU time (see rpc.Limit)
        eof = exited = False
        while not (eof and exited) and status is None:
            left = limit.left()
            ready, _, _ = select.select([pidfd] + ([] if eof else [out_r]), [], [], max(left, 0.0))
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
            if left <= 0 and status is None and not (eof and exited):
                status = "timeout"  # (after one last look: what it wrote in time counts)
        wstatus, oom = ctx.spawner.reap(pid)
        if status is None:
            status = _stdio_status(wstatus, oom > ctx.oom_kills)
        ctx.oom_kills = oom
        return status, buf.decode("utf-8", "replace")
    finally:
        for fd in (out_r, code_w, pidfd):
            if fd is not None and fd >= 0:
                os.close(fd)


def _stdio_status(wstatus, oom):
    if os.WIFEXITED(wstatus):
        code = os.WEXITSTATUS(wstatus)
        return "ok" if code == 0 else "compile_error" if code == _spawner.COMPILE_EXIT else "runtime_error"
    sig = os.WTERMSIG(wstatus)
    if sig == signal.SIGXCPU:
        return "timeout"
    if sig == signal.SIGKILL and oom:
        return "memory_limit"
    return "runtime_error"


def stdio_program(code_r):
    """A program process for one stdin/stdout test: its source comes on `code_r`; it runs as `__main__`; its
    exit status is the kernel's (the spawner reads it), whatever the program writes to its fds."""
    import builtins
    import types

    chunks = []
    while chunk := os.read(code_r, 1 << 16):
        chunks.append(chunk)
    os.close(code_r)
    module = types.ModuleType("__main__")
    env = module.__dict__
    env.update(__builtins__=builtins, __file__="main.py")
    sys.modules["__main__"] = module
    try:
        code = compile(b"".join(chunks).decode("utf-8", "surrogatepass"), "main.py", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError) as e:
        os.write(1, rpc.describe(e).encode())
        os._exit(_spawner.COMPILE_EXIT)
    status = 0
    try:
        exec(code, env)
    except SystemExit as e:
        status = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - any exception of the program is exit status 1, as in the interpreter
        status = 1
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001 - a broken stdout at exit fails the program, as in the interpreter
        status = status or 1
    os._exit(status & 0xFF)


MODES = {"server": rpc.program_server, "stdio": stdio_program}


# ---- the persistent harness ---------------------------------------------------------------------------------

def serve(cfg):
    """`python -I harness.py --serve CFG`: one harness for many cases, pid 1 of its own pid namespace.

    Started by a local-backend worker (`megarl/sandbox/local.py`) as root (or root of the worker's user
    namespace) in a fresh pid namespace, or as a Docker container's pid 1 (`megarl/sandbox/docker.py`), with its
    case pipe on fd 0 and its answer pipe on fd 1. It forks the spawner (which keeps its privileges), then
    confines itself: the job uid on the local backend, Landlock with no write access anywhere, the seccomp filter,
    every other fd closed, non-dumpable, an address-space limit of its own; it ignores every signal. Then for each
    case line: the spawner begins the case; the tests run, one answer line per result as it comes; the spawner
    ends the case (kills every program process of it, fresh tmpfs mounts); a final line. Only the backend reads
    the answers, and it adds the run's secret itself, so no program ever sees the channel or the secret.
    """
    if os.getpid() != 1:
        raise RuntimeError("the persistent harness must be pid 1 of its own pid namespace")
    _spawner.ignore_signals()
    os.chdir("/")
    iso_mod = _load("isolation")
    local = "isolation" in cfg  # the local backend; a Docker container's harness finds out for itself
    iso = iso_mod.HostIsolation(**cfg["isolation"]) if local else iso_mod.HostIsolation(
        landlock_abi=iso_mod.landlock_abi(), seccomp=iso_mod.seccomp_supported(),
        seccomp_notify=iso_mod.seccomp_supported() and not iso_mod.why_no_seccomp_notify())
    read_roots = cfg.get("read_roots") or iso_mod.read_roots()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for name in cfg["preimports"].split():
        try:
            __import__(name)
        except ImportError:
            pass
    with open("/proc/self/statm") as f:  # read now: /proc is out of reach once confined
        vsize = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") + (32 << 20)  # + what caches may add
    vsize = -(-vsize // (64 << 20)) * (64 << 20)  # the same for every harness with the same imports
    if cfg.get("harness_cgroup"):
        with open(os.path.join(cfg["harness_cgroup"], "cgroup.procs"), "w") as f:
            f.write("0")
    cgroups = _load("cgroups") if cfg.get("case_cgroup") or not local else None
    spawner = _spawner.Spawner({"fresh": True, "isolation": {k: v for k, v in iso.__dict__.items() if k != "warnings"},
                                "read_roots": read_roots, "cgroup": cfg.get("case_cgroup"), "cgroups_module": cgroups,
                                # a container's own, to tell a program the OOM killer took from another SIGKILL
                                "oom_cgroup": None if local else cgroups.container_memory_cgroup(),
                                "memory_accounted": cfg.get("memory_accounted", False),
                                "memory_mb": cfg.get("memory_mb", 512)}, MODES, iso_mod)
    read_fds = [(os.open(p, os.O_PATH | os.O_CLOEXEC), os.path.isdir(p)) for p in read_roots]
    harness_iso = iso if local else iso_mod.HostIsolation(landlock_abi=iso.landlock_abi, seccomp=iso.seccomp)
    iso_mod.confine(harness_iso, [os.devnull], read_fds, iso_mod.seccomp_program() if iso.seccomp else None,
                    keep_fds=(spawner.sock.fileno(),))
    _nondumpable()
    resource.setrlimit(resource.RLIMIT_AS, (vsize + (HARNESS_MB << 20),) * 2)
    sys.set_int_max_str_digits(50000)
    import gc

    gc.freeze()
    # The case and answer pipes move off fds 0 and 1, which become /dev/null under the same sys.stdin/stdout
    # objects: whatever a test prints goes nowhere, and program processes inherit working streams.
    case_fd, answer_fd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    _write_line(answer_fd, {"ready": True, "spawner": spawner.info})
    for line in os.fdopen(case_fd, "rb"):
        if not _serve_case(json.loads(line), spawner, answer_fd, vsize, cfg.get("nproc_extra")):
            return  # the spawner is gone: exit, and the backend starts a new harness


def _serve_case(case, spawner, answer_fd, vsize, nproc_extra):
    """Run one case, answering a line per result and a final line; False if this harness cannot go on."""
    lim, start_cpu = case["limits"], time.process_time()
    final, n, alive = {"done": True}, 0, True
    try:
        ctx = Context(spawner, _case_rlimits(lim, vsize, nproc_extra), lim["memory_mb"])
        for result in run_case(case["code"], case["spec"], ctx):
            _write_line(answer_fd, {"t": n, "r": result})
            n += 1
    except CompileError as e:
        final["compile_error"] = str(e)
    except BaseException as e:  # noqa: BLE001 - the harness answers whatever happened
        final["error"] = f"harness: {rpc.describe(e)}"
    try:
        final["oom_kills"], programs_cpu, denied = spawner.end()
        if denied:  # the backend puts them in the run's result (`RunResult.seccomp_denied`)
            final["seccomp_denied"] = denied
        final["cpu_s"] = round(programs_cpu + time.process_time() - start_cpu, 6)
    except BaseException as e:  # noqa: BLE001 - however the spawner broke: say so; the harness is not reused
        final["error"], alive = f"spawner: {rpc.describe(e)}", False
    _write_line(answer_fd, final)
    return alive


def _write_line(fd, obj):
    rpc.write_all(fd, json.dumps(obj).encode() + b"\n")


def _case_rlimits(lim, vsize, nproc_extra):
    cpu = max(1, int(-(-lim["cpu_s"] // 1)))
    wanted = [(resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, vsize + lim["memory_mb"] * (1 << 20)),
              (resource.RLIMIT_FSIZE, lim["file_mb"] * (1 << 20)), (resource.RLIMIT_NOFILE, lim["open_files"]),
              (resource.RLIMIT_CORE, 0)]
    if nproc_extra is not None:  # counted per uid (per user namespace): the backend says what else runs as it
        wanted.append((resource.RLIMIT_NPROC, lim["processes"] + nproc_extra))
    return wanted


def _nondumpable():
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE, 0
        raise OSError("cannot make the harness non-dumpable")


# ---- as a sandbox job -----------------------------------------------------------------------------------------

JOB_FILES = ("harness.py", "rpc.py", "spawner.py", "isolation.py")


def main():
    """One run as a sandbox job (`python -I harness.py` in a fresh interpreter, exec'd by the job's stub: the
    fork the job started as holds the job, tests included, in its memory): the program in `solution.py`, the
    tests in `spec.json`, the secret on stdin. The job is confined by the backend; program processes are this
    one's forks through the spawner, made before anything of the case was read."""
    _spawner.ignore_signals()
    _nondumpable()
    spawner = _spawner.Spawner({"fresh": False, "workdir": os.getcwd()}, MODES, _load("isolation"))
    secret = sys.stdin.read().strip()
    spec = json.load(open("spec.json"))
    source = open("solution.py", encoding="utf-8").read()
    for name in ("spec.json", "solution.py") + JOB_FILES:  # the job directory is the programs' cwd
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass
    payload, start_cpu = {"results": []}, time.process_time()
    try:
        for result in run_case(source, spec, Context(spawner, [], 0)):
            payload["results"].append(result)
            _print(part_line(secret, json.dumps(result)))
    except CompileError as e:
        payload["compile_error"] = str(e)
    except BaseException as e:  # noqa: BLE001 - the harness answers whatever happened
        payload["error"] = f"harness: {rpc.describe(e)}"
    finally:
        programs_cpu = spawner.end()[1]
    payload["cpu_s"] = round(programs_cpu + time.process_time() - start_cpu, 6)
    _print(verdict_line(secret, json.dumps(payload)))


def _print(text):
    sys.stdout.flush()
    rpc.write_all(1, text.encode())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(json.loads(sys.argv[2]))
    else:
        main()

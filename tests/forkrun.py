"""torchrun for the suite, its workers forked from a process that imported torch, megatron-core and transformers once.

Each `torchrun --nproc-per-node N script` the suite starts paid for the same imports N + 1 times: torchrun's agent
imports torch (2.3 CPU-seconds), each rank torch, megatron-core, transformers and their companions (~5 s); on two
cores and ~100 launches that was a quarter of the suite's CPU. Here one server process per test process (an xdist
worker) imports them once; a launch forks an agent from it, which runs torchrun's own `main` (argument parsing,
rendezvous, the elastic agent, worker monitoring, its failure report) with one change: the workers are forked
(torchrun's `--start-method fork`, a function entry point) and run the script as `python -u script args` would,
`__main__` and all, instead of starting a fresh interpreter. The launch's environment, working directory
and `sys.path` are the launch's own; the signal handlers are a fresh interpreter's; exit handlers run at the end
and the exit code is the script's.

Only third-party modules are preloaded (and `megarl.mcore`, whose import hook must come before megatron-core's): a
script imports megarl's modules itself, so registries and the like hold what they would in a fresh process.
`helpers.torchrun` uses this unless asked for the real thing (`fork=False`, another checkout's code, or
MEGARL_TESTS_REAL_TORCHRUN=1); the tests of the launch itself (the README's first run, the fault tests) use the
real torchrun.

    python tests/forkrun.py        # the server: requests on stdin, replies on stdout, one JSON line each
"""

from __future__ import annotations

import atexit
import io
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref

# What a rank of a training run or a distributed test worker imports that is not megarl, most expensive first.
PRELOAD = ("megarl.mcore", "torch", "torch.distributed.run", "torch.distributed.elastic.multiprocessing",
           "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.distributed",
           "megatron.core.dist_checkpointing", "megatron.core.pipeline_parallel", "megatron.core.tensor_parallel",
           "transformers", "transformers.models.auto.tokenization_auto", "transformers.models.qwen2.modeling_qwen2",
           "safetensors.torch", "sympy", "numpy", "matplotlib", "matplotlib.pyplot", "tensorboard", "wandb")


# ---------------------------------------------------------------------------------------------------- the server
def _handlers() -> dict:
    """This process's signal handlers, where they can be set."""
    return {s: signal.getsignal(s) for s in signal.valid_signals()
            if s not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(s) is not None}


def _fresh_interpreter(ignored: set[int]) -> dict:
    """The handlers `python` starts with when its parent ignores `ignored` (an ignored signal stays ignored across
    exec, every other is reset): SIGINT raises KeyboardInterrupt unless ignored, SIGPIPE and SIGXFSZ are ignored."""
    fresh = {s: signal.SIG_IGN if int(s) in ignored else signal.SIG_DFL for s in _handlers()}
    fresh[signal.SIGINT] = signal.SIG_IGN if int(signal.SIGINT) in ignored else signal.default_int_handler
    fresh[signal.SIGPIPE] = fresh[signal.SIGXFSZ] = signal.SIG_IGN
    return fresh


def _serve() -> None:
    import importlib

    at_start = _handlers()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this machine lacks is imported (or not) by the script itself
            pass
    import gc
    import threading

    tasks = len(os.listdir("/proc/self/task"))
    if threading.active_count() != 1 or tasks != 1:
        raise SystemExit(f"forkrun: the preloaded modules started threads ({tasks}: {threading.enumerate()}); "
                         "a fork would copy one of them only")
    imported = {s: h for s, h in _handlers().items() if at_start.get(s) != h}  # what the preloaded modules set
    gc.freeze()  # the preloaded objects stay out of every later collection (and their pages shared with the forks)
    out = sys.stdout
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:  # one launch at a time: the test process waits for each
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _agent(req, imported)  # never returns
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        out.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        out.flush()


def _agent(req: dict, imported: dict) -> None:
    code = 1
    try:
        os.setsid()  # the launch's own process group: a timeout kills the agent, its workers and their children
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdin = open(0, closefd=False)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)  # python -u
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.path[:] = req["path"]
        import torch.distributed.run as trun

        launch_config = trun.config_from_args

        def config_from_args(args):
            config, _, _ = launch_config(args)
            config.start_method = "fork"
            return config, _run_script, [args.training_script, *args.training_script_args]

        trun.config_from_args = config_from_args
        # the agent starts with the handlers of an interpreter the launching process starts now (and the preloaded
        # modules'); torchrun then installs its own (SIGTERM, SIGINT, SIGHUP, SIGQUIT), and a worker gets what exec
        # and an interpreter's start make of those (`_run_script`)
        _IMPORTED.update(imported)
        _set({**_fresh_interpreter(set(req["ignored"])), **imported})
        sys.argv = ["torchrun", *req["argv"]]
        trun.main(req["argv"])  # torchrun's own main: @record, its failure summary, SystemExit on a failed worker
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then the process ends
        import traceback

        traceback.print_exc()
    _finish(code)


_IMPORTED: dict = {}  # the signal handlers the preloaded modules set


def _set(handlers: dict) -> None:
    for s, h in handlers.items():
        try:
            signal.signal(s, h)
        except (OSError, ValueError):  # one the C library keeps for itself
            pass


def _run_script(script: str, *args: str) -> None:
    """A worker: `python -u script *args` in this already-initialised process."""
    # exec keeps what the agent ignores and resets what it handles (torchrun's SIGTERM handler raising in a worker
    # is not a script's); then the interpreter's own start, and what the preloaded modules set
    ignored = {int(s) for s, h in _handlers().items() if h == signal.SIG_IGN}
    _set({**_fresh_interpreter(ignored), **_IMPORTED})
    # The exit handlers inherited from the server are the preloaded modules' (wandb's media directory, shared by every
    # launch, among them): not this process's to run. The script's own are registered as it runs; of the preloaded
    # ones only logging's flush matters at a script's exit.
    atexit._clear()
    atexit.register(logging.shutdown)
    for f in list(weakref.finalize._registry):
        f.atexit = False
    weakref.finalize._registered_with_atexit = False  # the script's own finalizers still run at its exit
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    _apply_thread_count()
    code = 0
    try:
        _run_main(script)
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    atexit._clear()
    if code:
        _finish(code)
    sys.stdout.flush()
    sys.stderr.flush()
    # returning hands torch's worker wrapper a None, as a script's process ends with 0


def _run_main(script: str) -> None:
    """`script` as the interpreter runs one: the module `__main__` (for good, as exit handlers see it), `__file__`
    absolute, `sys.argv[0]` as given (runpy would make both absolute and put the old `__main__` back)."""
    import builtins
    import types
    from importlib.machinery import SourceFileLoader

    path = os.path.abspath(script)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __builtins__=builtins, __loader__=SourceFileLoader("__main__", path),
                         __spec__=None, __cached__=None)
    sys.modules["__main__"] = main
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _apply_thread_count() -> None:
    """OpenMP read OMP_NUM_THREADS when the server imported torch; a launch that sets another count gets it."""
    want = os.environ.get("OMP_NUM_THREADS")
    if want and want.isdigit():
        import torch

        if torch.get_num_threads() != int(want):
            torch.set_num_threads(int(want))


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _finish(code: int) -> None:
    """The process's end, its output flushed; exit handlers are run by the caller where they are its own."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


# ---------------------------------------------------------------------------------------------------- the client
class Server:
    """One server for this test process, started at its first launch and ended with it (its stdin closes)."""

    _proc: subprocess.Popen | None = None
    env: dict | None = None  # the environment it was started in

    @classmethod
    def get(cls, env: dict, cwd: str) -> subprocess.Popen:
        """The server, started in `env` (the suite's environment for this checkout, not a launch's own: what it
        preloads, and from where, is the same for every launch) and `cwd`."""
        if cls._proc is None or cls._proc.poll() is not None:
            _pending.clear()
            proc = subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__)], cwd=cwd, env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
            reply = _read(proc, 300)
            if "ready" not in reply:
                proc.kill()
                raise RuntimeError(f"the fork server did not start (exit code {proc.wait()})")
            cls._proc, cls.env = proc, dict(env)
            atexit.register(cls._stop, proc)
        return cls._proc

    @staticmethod
    def _stop(proc: subprocess.Popen) -> None:
        proc.stdin.close()  # its loop ends
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_pending = bytearray()


def _read(proc: subprocess.Popen, timeout: float) -> dict:
    """The server's next reply, or {} after `timeout` seconds without one."""
    deadline = time.monotonic() + timeout
    while b"\n" not in _pending:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            return {}
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            raise RuntimeError(f"the fork server ended (exit code {proc.wait()})")
        _pending.extend(chunk)
    line, _, rest = bytes(_pending).partition(b"\n")
    _pending[:] = rest
    return json.loads(line)


# Read when an interpreter starts or the preloaded modules are imported: a launch that sets them otherwise than the
# server's environment runs the real torchrun (PYTHONPATH and OMP_NUM_THREADS are applied to each launch).
_READ_AT_START = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "MKL_", "KMP_", "LD_", "MPL")
_lock = threading.Lock()


def _env_differs(env: dict, server_env: dict) -> list[str]:
    keys = {k for k in {*env, *server_env} if k.startswith(_READ_AT_START) and k != "PYTHONPATH"}
    return sorted(k for k in keys if env.get(k) != server_env.get(k))


def torchrun(argv: list[str], env: dict, cwd: str, timeout: float, tmp: str,
             server_env: dict) -> subprocess.CompletedProcess | None:
    """`python -m torch.distributed.run *argv` in `env` and `cwd` (its workers forked, see above): what
    subprocess.run would give, or subprocess.TimeoutExpired after `timeout` seconds with the launch's process group
    killed. `server_env`: the environment the server starts in, at the first launch. None where a fork cannot
    stand in for the real thing: the launch sets what an interpreter reads at its start (PYTHONWARNINGS, say)
    otherwise, or another thread of this process has a launch running."""
    if _env_differs(env, Server.env or server_env) or not _lock.acquire(blocking=False):
        return None
    try:
        return _launch(argv, env, cwd, timeout, tmp, server_env)
    finally:
        _lock.release()


def _launch(argv: list[str], env: dict, cwd: str, timeout: float, tmp: str,
            server_env: dict) -> subprocess.CompletedProcess:
    proc = Server.get(server_env, cwd)
    base = os.path.join(tmp, f"forkrun-{os.getpid()}-{time.monotonic_ns()}")
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + _site_path()
    req = {"argv": argv, "env": env, "cwd": cwd, "path": [""] + path, "stdout": base + ".out",
           "stderr": base + ".err",
           "ignored": [int(s) for s, h in _handlers().items() if h == signal.SIG_IGN]}
    proc.stdin.write(json.dumps(req).encode() + b"\n")
    pid = _read(proc, 60)["pid"]
    reply = _read(proc, timeout)
    timed_out = "rc" not in reply
    if timed_out:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reply = _read(proc, 60)
    outputs = []
    for suffix in (".out", ".err"):
        with open(base + suffix, errors="backslashreplace") as f:
            outputs.append(f.read())
        os.unlink(base + suffix)
    cmd = [sys.executable, "-m", "torch.distributed.run", *argv]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=outputs[0], stderr=outputs[1])
    return subprocess.CompletedProcess(cmd, reply["rc"], outputs[0], outputs[1])


_SITE: list[str] = []


def _site_path() -> list[str]:
    """sys.path of `python` started with no PYTHONPATH and no script (the interpreter's and site-packages' own)."""
    if not _SITE:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"], env=env,
                             capture_output=True, text=True, check=True)
        _SITE.extend(json.loads(out.stdout))
    return list(_SITE)


if __name__ == "__main__":
    _serve()

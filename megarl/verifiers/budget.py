"""A wall-clock budget that holds in any thread and any process: the work runs in a helper process that is killed
when its time is up.

Why not `signal.alarm`: it only fires in the main thread of the main interpreter, so a grader that relies on it
silently loses its timeout (or raises) inside thread pools, Ray actors and reward workers. Why not a thread with a
timeout: a thread stuck inside sympy or a big-integer power cannot be interrupted at all.

`Guard` keeps one helper process (a plain `python -c` child, so it works from daemonic multiprocessing workers
and after `fork`), sends it `(module:function, args)` as pickles over its stdin and waits on its stdout with
`select` until the deadline. On a timeout the helper is killed and a replacement is started at once, so the next
call usually finds it ready. Calls from several threads are serialised by a lock.

Protects against: infinite loops, runaway CPU (huge powers, deep simplification), a crashed or killed helper, and
a helper growing past `memory_mib` (an address-space limit; the call then fails instead of swapping the host).
Does not protect against: malicious code - the helper only ever runs functions of this package on plain data.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

_HEADER = struct.Struct("!I")
_READY = b"R"
_ROOT = str(Path(__file__).resolve().parents[2])  # the directory that holds the megarl package


class BudgetExceeded(Exception):
    """The call did not return within its budget; the helper was killed."""


class HelperFailed(Exception):
    """The helper died or answered with garbage (not a timeout)."""


class Guard:
    def __init__(self, preload: tuple[str, ...] = (), memory_mib: int = 4096, startup_timeout: float = 60.0):
        self.preload, self.memory_mib, self.startup_timeout = preload, memory_mib, startup_timeout
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._pid = None  # the process that started the helper: a forked copy of this object must not share it
        self._ready = False
        self.last_seconds = 0.0  # how long the last call's work took (its wait for a starting helper excluded)

    def __getstate__(self):
        return {"preload": self.preload, "memory_mib": self.memory_mib, "startup_timeout": self.startup_timeout}

    def __setstate__(self, state):
        self.__init__(**state)

    def call(self, target: str, args: tuple, timeout: float):
        """Run `module:function(*args)` in the helper; raise BudgetExceeded after `timeout` seconds of work.
        An exception raised by the function is re-raised here."""
        with self._lock:
            proc = self._ensure()
            start = time.monotonic()
            deadline = start + timeout
            try:
                _write_frame(proc.stdin, pickle.dumps((target, args), protocol=pickle.HIGHEST_PROTOCOL))
                ok, value = pickle.loads(_read_frame(proc.stdout.fileno(), deadline))
                self.last_seconds = time.monotonic() - start
            except BudgetExceeded:
                self.last_seconds = time.monotonic() - start
                self._restart()
                raise
            except (OSError, EOFError, pickle.UnpicklingError, HelperFailed) as e:
                self._restart()
                raise HelperFailed(f"verifier helper failed: {type(e).__name__}: {e}") from None
            if ok:
                return value
            raise value

    def close(self) -> None:
        with self._lock:
            self._kill()

    def __del__(self):
        try:
            self._kill()
        except Exception:  # noqa: BLE001 - __del__ must not raise (at interpreter shutdown anything can fail)
            pass

    # -- helper process ------------------------------------------------------------------------------------------

    def _ensure(self) -> subprocess.Popen:
        if self._proc is None or self._pid != os.getpid() or self._proc.poll() is not None:
            if self._pid == os.getpid():
                self._kill()
            self._start()
        if not self._ready:  # wait for its imports outside any call's budget
            if _read_exact(self._proc.stdout.fileno(), 1, time.monotonic() + self.startup_timeout) != _READY:
                raise HelperFailed("verifier helper did not start")
            self._ready = True
        return self._proc

    def _start(self) -> None:
        # the parent's import path, so that modules it can import (e.g. ones registering verifiers) load here too
        path = [_ROOT] + [p for p in sys.path if p] + [os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        code = f"from megarl.verifiers.budget import serve; serve({self.preload!r}, {self.memory_mib})"
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      env=env, close_fds=True)
        self._pid, self._ready = os.getpid(), False

    def _kill(self) -> None:
        if self._proc is not None and self._pid == os.getpid():
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            for f in (self._proc.stdin, self._proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        self._proc = None

    def _restart(self) -> None:
        self._kill()
        self._start()  # the replacement imports while the caller carries on


def _write_frame(fh, payload: bytes) -> None:
    fh.write(_HEADER.pack(len(payload)) + payload)
    fh.flush()


def _read_exact(fd: int, n: int, deadline: float) -> bytes:
    chunks, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise BudgetExceeded()
        chunk = os.read(fd, n - got)
        if not chunk:
            raise HelperFailed("helper exited")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int, deadline: float) -> bytes:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    return _read_exact(fd, size, deadline)


def serve(preload: tuple[str, ...], memory_mib: int) -> None:
    """The helper's loop: import, say ready, then answer one framed request at a time until stdin closes."""
    import importlib
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the parent, which kills us
    if memory_mib:
        limit = memory_mib * 1024 * 1024
        try:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ValueError, OSError):
            pass
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints (from imports too) must not corrupt the channel
    for name in preload:
        importlib.import_module(name)
    stdout.write(_READY)
    stdout.flush()
    while True:
        header = stdin.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        target, args = pickle.loads(stdin.read(_HEADER.unpack(header)[0]))
        try:
            module, _, func = target.partition(":")
            reply = (True, getattr(importlib.import_module(module), func)(*args))
        except MemoryError:
            reply = (False, MemoryError("verifier helper ran out of memory"))
        except Exception as e:  # noqa: BLE001 - every failure goes back to the caller
            reply = (False, e)
        try:
            payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - an unpicklable exception or value: its __reduce__ may raise anything
            payload = pickle.dumps((False, RuntimeError(f"{type(e).__name__}: {e}")))
        _write_frame(stdout, payload)

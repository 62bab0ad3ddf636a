"""The sandbox boundary: a program, its input and its limits in; a structured result out."""

from __future__ import annotations

import dataclasses
import os
import select
import time
from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol, Sequence, runtime_checkable

Status = Literal["ok", "nonzero_exit", "timeout", "memory_limit", "output_limit", "killed", "sandbox_error"]
STATUSES: tuple[str, ...] = ("ok", "nonzero_exit", "timeout", "memory_limit", "output_limit", "killed",
                             "sandbox_error")


@dataclass(frozen=True)
class Limits:
    """Per-job limits. Every backend enforces all of them (see the package docstring for how)."""

    wall_s: float = 10.0  # wall-clock time; the job and everything it spawned are killed at the deadline
    cpu_s: float = 10.0  # CPU time (RLIMIT_CPU, rounded up to a whole second)
    memory_mb: int = 512  # address space the program may add (local) / container memory (docker)
    processes: int = 32  # processes and threads the job may run at once
    output_bytes: int = 1 << 20  # stdout and stderr each; more is `output_limit`
    file_mb: int = 16  # largest file the job may write (RLIMIT_FSIZE)
    open_files: int = 256

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_mb", "processes", "output_bytes", "file_mb", "open_files"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be > 0, got {getattr(self, name)!r}")

    def replace(self, **changes) -> "Limits":
        return dataclasses.replace(self, **changes)


@dataclass
class Job:
    """A Python program run as `__main__` in a fresh working directory holding `files`."""

    source: str
    stdin: str = ""
    files: dict[str, str] = field(default_factory=dict)  # relative path -> text content
    limits: Limits | None = None  # None: the sandbox's defaults
    # The code verifier's fast path on backends with `harness_server`: {"code": program, "spec": tests} run by
    # the worker's persistent trusted harness instead of `source`; `stdin` is then the run's secret.
    harness: dict | None = None

    def to_wire(self, default: Limits) -> dict:
        wire = {"source": self.source, "stdin": self.stdin, "files": dict(self.files),
                "limits": dataclasses.asdict(self.limits or default)}
        if self.harness is not None:
            wire["harness"] = self.harness
        return wire


@dataclass
class RunResult:
    status: Status
    exit_code: int | None = None  # None when the job was killed by a signal
    signal: int | None = None
    stdout: str = ""  # truncated to Limits.output_bytes
    stderr: str = ""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_mb: float = 0.0  # peak resident memory of the job's largest process
    detail: str = ""  # why, for statuses other than ok / nonzero_exit

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def from_wire(cls, d: dict) -> "RunResult":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in fields})

    @classmethod
    def error(cls, detail: str) -> "RunResult":
        return cls(status="sandbox_error", detail=detail)


@runtime_checkable
class Sandbox(Protocol):
    """Runs untrusted Python programs. Thread-safe: `run` may be called from several threads at once."""

    name: str
    limits: Limits  # the defaults for jobs without their own

    def run(self, job: Job) -> RunResult: ...

    def run_many(self, jobs: Sequence[Job]) -> list[RunResult]: ...

    def describe(self) -> str: ...  # the isolation in force, one line

    def close(self) -> None: ...


class LineReader:
    """Newline-delimited reads from a pipe with a deadline: how the parent hears its workers and containers (one
    JSON line per answer). Bytes past the newline are kept for the next line."""

    def __init__(self, fd: int):
        self.fd = fd
        self._buf = b""

    def readline(self, timeout: float, on_eof: Callable[[], str]) -> bytes:
        """The next line without its newline; TimeoutError after `timeout` s, EOFError(on_eof()) if the pipe closes."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise TimeoutError(f"no answer in {timeout:.0f} s")
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                raise EOFError(on_eof())
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

"""The sandbox boundary: a program, its input and its limits in; a structured result out.

This module is the whole interface: what a caller (the `code` verifier, the `python` tool) may use and what a
backend must provide. A backend is a `Sandbox`: plain jobs through `run` / `run_many`, the code verifier's tests
through `run_tests` (which a backend usually inherits from `megarl.sandbox.harness_protocol.HarnessBackend`: the trusted
harness run as a job over `run_many`, or through the backend's own persistent harness where it declares one). It
registers under a name with `@register_sandbox(name)`, and `make_sandbox(name)` builds it.
"""

from __future__ import annotations

import dataclasses
import os
import select
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol, Sequence, runtime_checkable

from megarl.registry import Registry

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
    # A case for the backend's persistent trusted harness instead of `source`: {"code": program, "spec": tests},
    # `stdin` then the run's secret. Only `run_tests` makes such jobs, and only for a backend whose
    # `harness_server` is True; a backend without a server never sees one.
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
    # The syscalls the program filter refused the job's processes, as the kernel notified the sandbox's supervisor
    # (`ptrace`, `socket(AF_INET)`, `clone(NEWUSER)` -> count); {} where there were none or nothing counts them
    # (see `megarl/sandbox/guest/isolation.py`). A record, never a verdict: the program saw the same refusals.
    seccomp_denied: dict[str, int] = field(default_factory=dict)

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


@dataclass
class CodeCase:
    """One program and the tests it must pass (`Sandbox.run_tests`). `spec` is the trusted harness's test spec,
    as `megarl.verifiers.code.parse_gold` makes it (`mode` function / io / call, the tests, `time_s`,
    `early_stop`); `guest/harness.py` runs it. The case's wall-clock limit is `limits.wall_s`."""

    code: str
    spec: dict[str, Any]
    limits: Limits | None = None  # None: the sandbox's defaults


@dataclass
class TestResult:
    """One test, as the trusted harness saw it."""

    __test__ = False  # (not a pytest class)
    ok: bool
    why: str | None = None  # a failure's kind: wrong_answer, runtime_error, timeout, memory_limit, skipped, ...
    detail: Any = ""

    @classmethod
    def from_wire(cls, d: dict) -> "TestResult":
        return cls(ok=bool(d.get("ok")), why=d.get("why"), detail=d.get("detail", ""))


@dataclass
class CaseResult:
    """What `run_tests` established about one `CodeCase`.

    Only what the trusted harness proved counts: `proved` is False when no line with this run's secret came back
    (the harness never finished a test, or something forged its output), and then nothing else but `run` holds.
    `tests` are the tests the harness ran or started, in order; a run that ended early (`complete` False: its
    wall-clock limit, a harness or container that died) ends with a failed test for what stopped it. A program
    that does not compile has `compile_error` and no verdict on its tests."""

    run: RunResult  # the sandbox's run of the harness: its status, detail and timings
    proved: bool = False
    tests: list[TestResult] = field(default_factory=list)
    complete: bool = False  # the harness's final verdict came back
    compile_error: str | None = None
    cpu_s: float | None = None  # what checking cost: the harness's count of CPU seconds, else the sandbox's
    reruns: int = 0  # times the case ran again because the sandbox failed on it (`harness_protocol.RERUNS`)

    @property
    def tests_run(self) -> int:
        """Tests the harness ran or started: every result but those skipped by early stop."""
        return sum(t.why != "skipped" for t in self.tests)


@runtime_checkable
class Sandbox(Protocol):
    """Runs untrusted Python programs. Thread-safe: `run` may be called from several threads at once.

    Capabilities are declared, never probed: every backend sets each field below (inheriting
    `megarl.sandbox.harness_protocol.HarnessBackend` gives the documented defaults)."""

    name: str
    limits: Limits  # the defaults for jobs without their own
    # Capability, default False: the backend keeps a persistent trusted harness that runs `Job.harness` cases
    # (and adds the run's secret to its verdict itself), so `run_tests` may send cases to it instead of running
    # the harness as a job. The local backend declares it where the host gives it a pid namespace, Docker always.
    harness_server: bool

    def run(self, job: Job) -> RunResult: ...

    def run_many(self, jobs: Sequence[Job]) -> list[RunResult]: ...  # in order; as many at once as it has workers

    def run_tests(self, cases: Sequence[CodeCase], persistent: bool = True) -> list[CaseResult]:
        """Each program against its tests, with the verdict of the trusted harness (one `CaseResult` per case, in
        order). `persistent=False` runs the harness as a job even where the backend has a harness server."""
        ...

    def describe(self) -> str: ...  # the isolation in force, one line

    def close(self) -> None: ...


SANDBOXES: Registry[Callable[..., Sandbox]] = Registry(
    "sandbox backend", builtins=("megarl.sandbox.local", "megarl.sandbox.docker"))
# @register_sandbox("mine") on a backend class (or builder). Callers build it as `make_sandbox("mine", workers=N,
# limits=Limits(...))` (the code verifier, the python tool), plus keyword arguments of its own (docker: `image`).
register_sandbox = SANDBOXES.register


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

"""The `python` tool: a call's code runs as a program in megarl's sandbox (`megarl.sandbox`, local by default,
Docker with `--sandbox docker`), under the call's time, memory and output limits.

The code runs like a notebook cell: statements in order, and the value of a last bare expression is printed
(`12*34` shows `408`). The wrapper that does this runs inside the sandbox, so nothing of the model's code is
parsed or compiled in the trainer. What the model sees: stdout; after a failure, what it printed and the error
(the exception's last line, the time or memory limit, the output cut). The isolation is the sandbox's own, for
any job (SECURITY.md): no network, no host files, processes and memory bounded, everything gone after the call.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from megarl.sandbox import Job, Limits, RunResult, make_sandbox
from megarl.tool_calls import Observation, ToolCall, ToolSettings, register_tool

CELL_FILE = "cell.py"
# Trusted: runs inside the sandbox, reads the model's code from the job's file.
CELL_RUNNER = """\
import ast, sys, traceback
source = open("cell.py", encoding="utf-8", errors="replace").read()
try:
    tree = ast.parse(source, "<cell>")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(tree, "<cell>", "exec"), scope)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), scope)
        if value is not None:
            print(repr(value))
except SystemExit:
    raise
except BaseException as e:
    sys.stdout.flush()
    sys.stderr.write(traceback.format_exception_only(type(e), e)[-1])
    sys.exit(1)
"""


class PythonTool:
    """Runs each call's `code` argument in a sandbox; the calls of one `run_many` run `workers` at a time."""

    name = "python"

    def __init__(self, settings: ToolSettings):
        self.settings = settings
        s = settings
        self.limits = Limits(wall_s=s.timeout_s, cpu_s=s.timeout_s, memory_mb=s.memory_mb,
                             output_bytes=s.output_bytes)
        self._sandbox = None
        self._lock = threading.Lock()  # one sandbox, however many calls ask for it first at once

    @property
    def sandbox(self):
        with self._lock:
            if self._sandbox is None:
                s = self.settings
                extra = {"image": s.image} if s.sandbox == "docker" and s.image else {}
                self._sandbox = make_sandbox(s.sandbox, workers=s.workers, limits=self.limits, **extra)
            return self._sandbox

    def run_many(self, calls: Sequence[ToolCall]) -> list[Observation]:
        if not calls:
            return []
        with ThreadPoolExecutor(self.settings.workers) as pool:
            return list(pool.map(self._run, calls))

    def _run(self, call: ToolCall) -> Observation:
        code = call.arguments.get("code")
        if not isinstance(code, str):
            return Observation('error: the python tool takes one argument, "code": a string of Python', "error")
        start = time.perf_counter()
        try:
            result = self.sandbox.run(Job(CELL_RUNNER, files={CELL_FILE: code}, limits=self.limits))
        except Exception as e:  # noqa: BLE001 - a sandbox that cannot start is the call's error, not the rollout's
            result = RunResult.error(f"{type(e).__name__}: {e}")
        return observation(result, self.limits, time.perf_counter() - start)

    def close(self) -> None:
        with self._lock:
            if self._sandbox is not None:
                self._sandbox.close()
                self._sandbox = None


def observation(result: RunResult, limits: Limits, seconds: float) -> Observation:
    """What the model sees of a sandbox run, and the syscalls the sandbox refused it as the kernel counted them (a
    program that catches the EPERM runs on: nothing in its text or status says so)."""
    from megarl.verifiers.signals import seccomp_evidence

    refused = seccomp_evidence(result.seccomp_denied) if result.seccomp_denied else ""
    out = result.stdout.rstrip("\n")
    why = {
        "nonzero_exit": lambda: (result.stderr.strip().splitlines() or [f"exit status {result.exit_code}"])[-1],
        "timeout": lambda: f"timed out after {limits.wall_s:g} s",
        "memory_limit": lambda: f"memory limit of {limits.memory_mb} MB exceeded",
        "output_limit": lambda: f"output cut at {limits.output_bytes} bytes",
        "killed": lambda: f"killed ({result.detail or f'signal {result.signal}'})",
        "sandbox_error": lambda: f"the sandbox failed ({result.detail[:200]})",
    }.get(result.status)
    if why is None:
        return Observation(out, "ok", seconds, refused)
    text = f"{out}\nerror: {why()}" if out else f"error: {why()}"
    return Observation(text, "timeout" if result.status == "timeout" else "error", seconds, refused)


@register_tool("python")
def build_python(settings: ToolSettings) -> PythonTool:
    return PythonTool(settings)

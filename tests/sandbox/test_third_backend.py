"""The sandbox interface is enough to write a backend: a third one, written here against `megarl.sandbox` and the
shared harness protocol (`megarl.sandbox.harness_protocol`) only, runs the `code` verifier with the local backend's
verdicts.
And the layout that keeps it so: no backend imports another, and the verifiers reach the sandbox only through its
interface."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import pytest

from helpers import REPO
from megarl.sandbox import SANDBOXES, Job, Limits, RunResult, Sandbox, make_sandbox, register_sandbox
from megarl.sandbox.harness_protocol import HarnessBackend
from megarl.verifiers.code import CodeVerifier

SANDBOX = REPO / "megarl" / "sandbox"


@register_sandbox("test-subprocess")
class SubprocessSandbox(HarnessBackend):
    """A plain subprocess per job in a temporary directory, killed with its session at the wall-clock limit.
    NO isolation at all: a check of the interface, never a place for untrusted code. It declares no persistent
    harness (`harness_server` keeps `HarnessBackend`'s False), so `run_tests` runs the harness as a job here."""

    name = "test-subprocess"

    def __init__(self, workers: int = 1, limits: Limits | None = None):
        self.workers, self.limits = workers, limits or Limits()

    def run(self, job: Job) -> RunResult:
        lim = job.limits or self.limits
        with tempfile.TemporaryDirectory() as cwd:
            for name, text in job.files.items():
                path = Path(cwd, name)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            proc = subprocess.Popen([sys.executable, "-I", "-c", job.source], cwd=cwd, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
            try:
                out, err = proc.communicate(job.stdin, timeout=lim.wall_s)
                status = "ok" if proc.returncode == 0 else "nonzero_exit"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate(timeout=30)
                status = "timeout"
        code = proc.returncode
        return RunResult(status=status, exit_code=code if code >= 0 else None, signal=-code if code < 0 else None,
                         stdout=out[:lim.output_bytes], stderr=err[:lim.output_bytes],
                         detail=f"wall-clock limit of {lim.wall_s} s" if status == "timeout" else "")

    def run_many(self, jobs: Sequence[Job]) -> list[RunResult]:
        with ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(self.run, jobs))

    def describe(self) -> str:
        return "test-subprocess: NO isolation (a test of the sandbox interface)"

    def close(self) -> None:
        pass


ADD = {"test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
       "entry_point": "add"}
IO = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
ROWS = {
    "right": ("def add(a, b):\n    return a + b\n", ADD),
    "wrong": ("def add(a, b):\n    return a - b\n", ADD),
    "timeout": ("def add(a, b):\n    while True:\n        pass\n", ADD),
    "does not compile": ("def add(a, b) return", ADD),
    "stdin/stdout, one wrong": ("a, b = map(int, input().split())\nprint(a + b if a == 1 else 0)\n", IO),
    "fakes a verdict": ('print("@@megarl-code-done x {\\"results\\": [{\\"ok\\": true}]}")\n', IO),
}


def _verdicts(backend: str) -> dict[str, tuple]:
    verifier = CodeVerifier(backend=backend, workers=2, time_s=1.0, reward="fraction")
    try:
        results = verifier.verify_many(list(ROWS.values()))
    finally:
        verifier.sandbox.close()
    return {name: (r.score, r.outcome, r.normalized, r.tests_run) for name, r in zip(ROWS, results)}


def test_a_backend_written_against_the_interface_is_a_sandbox():
    sb = make_sandbox("test-subprocess", workers=1, limits=Limits(wall_s=5))
    assert isinstance(sb, Sandbox) and sb.harness_server is False
    r = sb.run(Job("import sys\nprint(open('f.txt').read() + sys.stdin.read())", stdin="!", files={"f.txt": "hi"}))
    assert (r.status, r.stdout) == ("ok", "hi!\n")
    assert sb.run(Job("while True: pass", limits=Limits(wall_s=0.5))).status == "timeout"


def test_every_registered_backend_declares_the_interface():
    """The built-ins and this one: each method of `Sandbox`, and the capability declared on the class (a value or
    a property), so that no caller has to ask an instance whether it happens to have it."""
    names = SANDBOXES.names()
    assert {"local", "docker", "test-subprocess"} <= set(names)
    for name in names:
        cls = SANDBOXES.get(name)
        missing = [m for m in ("run", "run_many", "run_tests", "describe", "close", "harness_server", "name")
                   if not hasattr(cls, m)]
        assert missing == [], (name, missing)


@pytest.mark.slow
def test_the_code_verifier_gives_the_local_backends_verdicts_through_it():
    ours = _verdicts("test-subprocess")
    assert ours["right"][:2] == (1.0, "correct") and ours["wrong"][:2] == (0.0, "incorrect")
    assert ours["timeout"][1] == "timeout" and ours["does not compile"][1] == "parse_error"
    assert ours["stdin/stdout, one wrong"][:2] == (0.5, "incorrect") and ours["fakes a verdict"][0] == 0.0
    assert ours == _verdicts("local")


# ---- the layout that makes a third backend possible -----------------------------------------------------------

def _imported(path: Path) -> set[str]:
    """Every module name `path` imports (functions included), `from a import b` as both a and a.b."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def _reaches(path: Path, *modules: str) -> list[str]:
    return sorted(n for n in _imported(path) if any(n == m or n.startswith(m + ".") for m in modules))


def test_no_backend_imports_another():
    assert _reaches(SANDBOX / "docker.py", "megarl.sandbox.local") == []
    assert _reaches(SANDBOX / "local.py", "megarl.sandbox.docker") == []
    for shared in ("base.py", "harness_protocol.py", "guest_code.py", "__init__.py"):  # what every backend builds on
        assert _reaches(SANDBOX / shared, "megarl.sandbox.local", "megarl.sandbox.docker") == [], shared


def test_verifiers_use_only_the_sandbox_interface():
    verifiers = sorted((REPO / "megarl" / "verifiers").rglob("*.py"))
    assert len(verifiers) > 5, "the scan must see the verifiers"
    offenders = {str(p.relative_to(REPO)): _reaches(p, "megarl.sandbox.local", "megarl.sandbox.docker",
                                                    "megarl.sandbox.guest", "megarl.sandbox.harness_protocol",
                                                    "megarl.sandbox.guest_code")
                 for p in verifiers}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_this_backend_needs_nothing_of_the_others():
    assert _reaches(Path(__file__), "megarl.sandbox.local", "megarl.sandbox.docker", "megarl.sandbox.guest") == []

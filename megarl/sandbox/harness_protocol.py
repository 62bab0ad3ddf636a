"""The code harness's protocol, host side: how `Sandbox.run_tests` runs a program against its tests on any backend,
and how the verdict is read back. Backend-neutral: the local and Docker backends share it, and a third backend gets
`run_tests` by inheriting `HarnessBackend` and writing only `run`, `run_many`, `describe` and `close`. The guest
side, which runs the tests, is `guest/harness.py`.

Two ways to run a case, by what the backend declares (`Sandbox.harness_server`):
- as a job, on any backend: the job execs `harness.py` in a fresh interpreter, with the program, the spec and the
  harness's sibling modules as job files and the run's secret on stdin; the harness prints a signed line per test
  and a signed verdict line at the end;
- through the backend's persistent harness (`harness_server` True): the job carries the case in `Job.harness` and
  the secret as its stdin; the backend hands the case to its harness, which never sees the secret, and writes the
  answers back as the verdict line itself (`server_verdict`).
Either way a verdict counts only on a line that carries this run's secret (`parse_verdict`): the program runs in
other processes and cannot write to the channel, so printing a fake verdict, exiting early or killing the harness
earns nothing. Exit codes are never read.

A case the sandbox itself failed (`sandbox_error`: its worker, harness or container died or was killed from
outside, the OOM killer on the host, a full disk) says nothing of the program: it is run again, up to `RERUNS`
times, on the fresh worker or harness the backend puts in place, with a new secret, and only the last run's verdict
counts (`CaseResult.reruns` says how many there were). The program is not meant to be able to cause
`sandbox_error` (it runs in other processes, under their own limits, and cannot signal the harness or its worker);
one that found a way would gain nothing by it: a re-run is judged like the first, and a case still failing after
its re-runs keeps `sandbox_error` and scores 0, named as the sandbox's failure (`megarl.verifiers.code`).
"""

from __future__ import annotations

import json
import secrets
import sys
from typing import Sequence

from megarl.sandbox.base import CaseResult, CodeCase, Job, Limits, RunResult, Sandbox, TestResult
from megarl.sandbox.guest.harness import DONE, JOB_FILES, PART, verdict_line
from megarl.sandbox.guest_code import HARNESS_FILES

RERUNS = 2  # times a case the sandbox failed on is run again, each time on a fresh worker, harness or container

# The job's program when the harness is a job: a fresh interpreter for it, since the process a job starts as is a
# fork of the backend's worker or runner and holds the job (tests included) in its memory and stack frames.
EXEC_HARNESS = "import os, sys\nos.execv(sys.executable, [sys.executable, '-I', 'harness.py'])\n"


class HarnessBackend:
    """The base of a backend whose `run_tests` runs this protocol over its own `run_many`. It declares the
    capability defaults of `Sandbox`: `harness_server = False` (the harness runs as a job); a backend with a
    persistent harness overrides it."""

    harness_server: bool = False

    def run_tests(self, cases: Sequence[CodeCase], persistent: bool = True) -> list[CaseResult]:
        return run_tests(self, cases, persistent)


def run_tests(sandbox: Sandbox, cases: Sequence[CodeCase], persistent: bool = True) -> list[CaseResult]:
    """`Sandbox.run_tests` by this protocol: one job per case, all through `sandbox.run_many`; the cases the
    sandbox failed on run again (`RERUNS`, see the module docstring)."""
    if not cases:
        return []
    server = persistent and sandbox.harness_server
    results: list[CaseResult | None] = [None] * len(cases)
    todo = list(range(len(cases)))
    for attempt in range(RERUNS + 1):
        keys = [secrets.token_hex(16) for _ in todo]
        jobs = [case_job(cases[i], secret, cases[i].limits or sandbox.limits, server) for i, secret in zip(todo, keys)]
        for i, run, secret in zip(todo, sandbox.run_many(jobs), keys):
            results[i] = case_result(run, secret)
            results[i].reruns = attempt
        todo = [i for i in todo if results[i].run.status == "sandbox_error"]
        if not todo or attempt == RERUNS:
            return results
        print(f"megarl: the {sandbox.name} sandbox failed on {len(todo)} code case(s) (first: "
              f"{results[todo[0]].run.detail}): run again ({attempt + 1} of {RERUNS})", file=sys.stderr, flush=True)
    return results


def case_job(case: CodeCase, secret: str, limits: Limits, server: bool) -> Job:
    """The job that runs `case`: for the backend's persistent harness, or the harness itself as the job."""
    spec = {**case.spec, "wall_s": limits.wall_s}  # (the harness ends its program waits before the case's end)
    if server:
        return Job(source="", stdin=secret, limits=limits, harness={"code": case.code, "spec": spec})
    files = {name: HARNESS_FILES[name] for name in JOB_FILES}
    return Job(source=EXEC_HARNESS, stdin=secret, limits=limits,
               files={**files, "solution.py": case.code, "spec.json": json.dumps(spec)})


def case_result(run: RunResult, secret: str) -> CaseResult:
    """What the harness proved in `run`, read from the lines that carry `secret`. A run that ended before the
    verdict (the harness's `incomplete` or `error`) gets a failed test for what stopped it: the next test."""
    verdict = parse_verdict(run.stdout, secret)
    if verdict is None:
        return CaseResult(run=run, cpu_s=run.cpu_s or None)
    cpu = verdict.get("cpu_s")
    cpu_s = float(cpu) if isinstance(cpu, (int, float)) else (run.cpu_s or None)
    tests = [TestResult.from_wire(r) for r in verdict.get("results", []) if isinstance(r, dict)]
    if "compile_error" in verdict:
        return CaseResult(run=run, proved=True, tests=tests, complete=True, compile_error=verdict["compile_error"],
                          cpu_s=cpu_s)
    complete = not ("incomplete" in verdict or "error" in verdict)
    if not complete:
        why = verdict.get("incomplete") or ("timeout" if run.status == "timeout" else "sandbox_error")
        tests.append(TestResult(ok=False, why=why, detail=verdict.get("error", run.detail)))
    return CaseResult(run=run, proved=True, tests=tests, complete=complete, cpu_s=cpu_s)


def parse_verdict(stdout: str, secret: str) -> dict | None:
    """The harness's verdict: the last line that starts with the marker and this run's secret; without one, the
    results of the tests the run finished (lines of the part marker and the secret), marked incomplete; None
    when there is neither."""
    prefix, part = f"{DONE} {secret} ", f"{PART} {secret} "
    results = []
    for line in stdout.splitlines():
        if line.startswith(part):
            try:
                results.append(json.loads(line[len(part):]))
            except json.JSONDecodeError:
                return None
    for line in reversed(stdout.splitlines()):
        if line.startswith(prefix):
            try:
                return json.loads(line[len(prefix):])
            except json.JSONDecodeError:
                return None
    return {"results": results, "incomplete": ""} if results else None


def server_verdict(secret: str, final: dict, results: list) -> str:
    """The verdict line a backend writes for a case its persistent harness ran: the results the harness answered
    (a line each) and its final line, signed with the run's secret, which only the backend holds. `cpu_s` goes to
    `RunResult.cpu_s` instead, the seccomp refusals to `RunResult.seccomp_denied`, and the harness's bookkeeping
    (`done`, `oom_kills`) stays out."""
    payload = {k: v for k, v in final.items() if k not in ("done", "oom_kills", "cpu_s", "seccomp_denied")}
    payload["results"] = results
    return verdict_line(secret, json.dumps(payload))

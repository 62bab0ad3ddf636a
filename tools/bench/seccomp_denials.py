"""What supervising the seccomp denials costs: the code verifier's time per case, one case at a time.

    python tools/bench/seccomp_denials.py [--rounds 40] [--json out.json]

One worker, one case at a time (`CodeVerifier(workers=1).verify`), for: an honest program; the code hacks of the
planted hacker's catalogue (`tests/e2e/hack_catalogue.py`, the red-team patterns) and a program that calls ptrace
by number through ctypes; each both with the worker's persistent harness and with the harness as a job per case;
and a plain job (`LocalSandbox.run(Job("print(1)"))`). Prints the median and p90 milliseconds per case of each
group, and the denials the kernel reported for the ctypes program (absent before the supervisor existed). Run it
on the commit before and after a change, alternately, on the same machine: the load of shared cores moves the
absolute figures more than the change does.

`--spawn N` (as root, after the change) measures what the supervisor adds to one program process, interleaved so
that both sides share the load: N forks of a child that sets no_new_privs, installs the program filter and exits,
reaped by the parent, against N where the filter is installed with a listener that the child hands over to a
`DenialCounter` in the parent (a socket pair, one fd passed, received once the child is reaped, as the spawner's
loop does it between requests, then closed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import time
from pathlib import Path

from megarl.sandbox import Job, Limits
from megarl.sandbox.local import LocalSandbox
from megarl.verifiers.code import CodeVerifier

_spec = importlib.util.spec_from_file_location(
    "hack_catalogue", Path(__file__).resolve().parents[2] / "tests" / "e2e" / "hack_catalogue.py")
_catalogue = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_catalogue)
CATALOGUE, hack_text = _catalogue.CATALOGUE, _catalogue.hack_text

GOLD = {"test": "assert f(1) == 2\nassert f(2) == 3\n", "entry_point": "f"}
HONEST = "def f(x):\n    return x + 1\n"
# ptrace(PTRACE_ATTACH, 1) by number: no `import ctypes` for the static check to read
BY_NUMBER = ("m = __import__('ct' + 'ypes')\nm.CDLL(None).syscall(101, 16, 1, 0, 0)\n"
             "def f(x):\n    return x + 1\n")


def _ms(samples: list[float]) -> dict:
    samples = sorted(samples)
    return {"median_ms": round(1000 * statistics.median(samples), 2),
            "p90_ms": round(1000 * samples[max(0, math.ceil(0.9 * len(samples)) - 1)], 2), "n": len(samples)}


def spawn_cost(n: int) -> dict:
    """Median microseconds of a confined fork without and with the supervisor's handoff (see the docstring)."""
    import os
    import select

    from megarl.sandbox.guest import isolation as iso

    plain, supervised = iso.sock_fprog(iso.seccomp_program()), iso.sock_fprog(iso.seccomp_program(notify=True))
    times: dict[str, list[float]] = {"plain filter": [], "supervised filter": []}
    for i in range(2 * n):
        with_supervisor = i % 2 == 1
        poller = select.poll()
        counter = iso.DenialCounter(poller) if with_supervisor else None
        start = time.perf_counter()
        handoff = counter.expect() if counter is not None else None
        pid = os.fork()
        if pid == 0:
            try:
                iso.prctl(iso.PR_SET_NO_NEW_PRIVS, 1)
                if handoff is not None:
                    iso.hand_over_listener(supervised, handoff)
                else:
                    iso._check(iso._libc.prctl(iso.PR_SET_SECCOMP, 2, plain, 0, 0), "seccomp")
            finally:
                os._exit(0)
        if handoff is not None:
            os.close(handoff)
        os.waitpid(pid, 0)
        if counter is not None:  # the listener came (the child sent it before exiting), served without a wait
            for fd, events in poller.poll(0):
                counter.handle(fd, events)
            assert len(counter.listeners) == 1
            counter.take()
        times["supervised filter" if with_supervisor else "plain filter"].append(time.perf_counter() - start)
    return {k: round(1e6 * statistics.median(v), 1) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--json", default="")
    ap.add_argument("--spawn", type=int, default=0)
    args = ap.parse_args()
    if args.spawn:
        print("confined fork + exit + reap, median us:", spawn_cost(args.spawn))
        return
    hacks = [hack_text(k, GOLD) for k, e in enumerate(CATALOGUE) if e[0] == "code"
             if "fork bomb" not in e[2]]  # (a fork bomb's time is its process limit's, not the check's)
    out = {}
    for persistent in (True, False):
        verifier = CodeVerifier(workers=1, persistent_harness=persistent, time_s=2.0)
        mode = "persistent harness" if persistent else "harness as a job"
        verifier.verify(HONEST, GOLD)  # start the worker (and its harness)
        times: dict[str, list[float]] = {"honest": [], "red-team": [], "ctypes ptrace": []}
        last = None
        for _ in range(args.rounds):
            for group, programs in (("honest", [HONEST]), ("ctypes ptrace", [BY_NUMBER]),
                                    ("red-team", hacks[: max(1, len(hacks) // 4)])):
                for program in programs:
                    start = time.perf_counter()
                    result = verifier.verify(program, GOLD)
                    times[group].append(time.perf_counter() - start)
                    if group == "ctypes ptrace":
                        last = result
            hacks = hacks[len(hacks) // 4:] + hacks[: len(hacks) // 4]  # a quarter of the catalogue per round
        for group, samples in times.items():
            out[f"{mode}: {group}"] = _ms(samples)
        out[f"{mode}: ctypes ptrace verdict"] = [last.score, last.outcome, last.signals.get("sandbox_refusal")]
        verifier.sandbox.close()
    sandbox = LocalSandbox(workers=1, limits=Limits(wall_s=5, cpu_s=5))
    sandbox.run(Job("print(1)"))
    samples = []
    for _ in range(args.rounds * 2):
        start = time.perf_counter()
        sandbox.run(Job("print(1)"))
        samples.append(time.perf_counter() - start)
    out["plain job print(1)"] = _ms(samples)
    sandbox.close()
    for key, value in out.items():
        print(f"{key:45s} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""Math verifier benchmark: megarl's `math` verifier against HF math-verify, side by side, in one run.

    python tools/bench/verifier_math.py --data cases.jsonl [--json result.json] [--show-disagreements]
    python tools/bench/verifier_math.py                        # without labelled cases: the pathological set only

The labelled cases are not part of this repository. The README's figures come from 408 of them, taken from the
expectations in the public test suites of huggingface/Math-Verify (`tests/*.py`) and hendrycks/math
(`modeling/math_equivalence_test.py`), plus negatives made by changing the gold's last integer. Any jsonl with
`id`, `response`, `gold`, `label` (is the response correct) and `category` per row works; category `policy` holds
the cases where reasonable graders disagree and is reported apart.

Both verifiers run sequentially on one CPU core (the process pins itself, and megarl's budget helper inherits the
pin), each after a warm-up call that pays its imports. Reported per verifier: accuracy outside category `policy`
(cases where reasonable graders disagree, reported apart), false-positive and false-negative rates outside
`policy`, checks per second over the labelled cases, latency percentiles, and hangs.

A second, synthetic set of pathological answers (exponent towers, a huge factorial, deep nesting, a giant sum,
an unclosed display-math run) measures what each verifier does when sympy or the regex engine could run away.
math-verify runs each of those in a child process killed after `--hard-limit` seconds: a kill is a hang.
megarl's verifier counts as hung when a check returns later than its budget plus one second.

math-verify gets the gold boxed (`\\boxed{gold}`, its best setting on this data) and its default parse/verify.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PATHOLOGICAL = [
    ("exponent tower", r"The answer is $\boxed{10^{10^{10^{10}}}}$.", "1"),
    ("tower vs tower", r"$\boxed{9^{9^{9^{9}}}}$", r"9^{9^{9^{8}}}"),
    ("huge factorial", r"$\boxed{(10^{8})!}$", "1"),
    ("deep parentheses", "$\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}$", "1"),
    ("deep fractions", "$\\boxed{" + "\\frac{1}{" * 300 + "2" + "}" * 300 + "}$", "2"),
    ("giant sum", r"$\boxed{\sum_{k=1}^{10^{12}} k^{2}}$", "1"),
    ("tower arithmetic", r"$\boxed{2^{2^{2^{2^{2^{2}}}}} - 2^{2^{2^{2^{2^{2}}}}} + 1}$", "1"),
    ("symbolic tower", r"$\boxed{x^{x^{x^{x^{x^{x}}}}}}$", r"x^{x^{x^{x^{x}}}}"),
    ("5000-digit integer", "$\\boxed{" + "7" * 5000 + "}$", "7"),
    ("unclosed \\[ run", "\\[" * 10000 + " so 3", "3"),
]

_MV_CHILD = r"""
import json, sys, time
from math_verify import parse, verify
case = json.loads(sys.stdin.read())
t = time.perf_counter()
try:
    ok = bool(verify(parse("\\boxed{" + case["gold"] + "}"), parse(case["response"])))
except Exception:
    ok = False
print(json.dumps({"ok": ok, "seconds": time.perf_counter() - t}))
"""


def pin_one_core() -> int | None:
    try:
        cpu = sorted(os.sched_getaffinity(0))[0]
        os.sched_setaffinity(0, {cpu})
        return cpu
    except (AttributeError, OSError):
        return None


def run_megarl(rows, budget: float):
    from megarl.verifiers.math import MathVerifier

    v = MathVerifier(budget_s=budget)
    v.verify(r"\boxed{1}", "1")  # warm-up: starts the helper and pays sympy's import
    out = []
    start = time.perf_counter()
    for r in rows:
        res = v.verify(r["response"], r["gold"])
        out.append({"ok": res.score == 1.0, "seconds": res.seconds, "outcome": res.outcome,
                    "extracted": res.extracted})
    return out, time.perf_counter() - start, v


def run_math_verify(rows):
    from megarl.cli.verify import mathverify_check

    mathverify_check(r"\boxed{1}", "1")  # warm-up
    out = []
    start = time.perf_counter()
    for r in rows:
        t = time.perf_counter()
        ok = mathverify_check(r["response"], r["gold"])
        out.append({"ok": ok, "seconds": time.perf_counter() - t})
    return out, time.perf_counter() - start


def summarize(rows, verdicts, seconds) -> dict:
    main = [(r, v) for r, v in zip(rows, verdicts) if r["category"] != "policy"]
    policy = [(r, v) for r, v in zip(rows, verdicts) if r["category"] == "policy"]
    neg = [v["ok"] for r, v in main if not r["label"]]
    pos = [v["ok"] for r, v in main if r["label"]]
    lat = sorted(v["seconds"] for v in verdicts)
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]
    return {
        "cases": len(main), "accuracy": sum(v["ok"] == r["label"] for r, v in main) / len(main),
        "errors": sum(v["ok"] != r["label"] for r, v in main),
        "fpr": sum(neg) / max(len(neg), 1), "fnr": sum(not p for p in pos) / max(len(pos), 1),
        "policy_cases": len(policy),
        "policy_accuracy": sum(v["ok"] == r["label"] for r, v in policy) / max(len(policy), 1),
        "checks_per_s": len(rows) / seconds, "seconds": seconds,
        "p50_ms": 1000 * q(0.5), "p99_ms": 1000 * q(0.99), "max_ms": 1000 * lat[-1],
    }


def pathological(budget: float, hard_limit: float, with_mv: bool, verifier) -> list[dict]:
    out = []
    for name, response, gold in PATHOLOGICAL:
        t = time.perf_counter()
        res = verifier.verify(response, gold)
        mine = time.perf_counter() - t
        row = {"case": name, "megarl_outcome": res.outcome, "megarl_s": mine, "megarl_hang": mine > budget + 1.0}
        if with_mv:
            try:
                proc = subprocess.run([sys.executable, "-c", _MV_CHILD], input=json.dumps({"response": response,
                                      "gold": gold}), capture_output=True, text=True, timeout=hard_limit)
                last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
                got = json.loads(last) if last.startswith("{") else {"ok": None, "seconds": None}
                row.update(mv_ok=got["ok"], mv_s=got["seconds"], mv_hang=False)
            except subprocess.TimeoutExpired:
                row.update(mv_ok=None, mv_s=None, mv_hang=True)
        out.append(row)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="labelled cases, jsonl (see above); without it only the pathological set runs")
    p.add_argument("--budget", type=float, default=5.0, help="megarl's per-check budget, seconds")
    p.add_argument("--hard-limit", type=float, default=60.0, help="kill math-verify on a pathological case after this")
    p.add_argument("--no-math-verify", action="store_true")
    p.add_argument("--no-pathological", action="store_true")
    p.add_argument("--show-disagreements", action="store_true")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()

    cpu = pin_one_core()
    print(f"pinned to CPU {cpu}")
    with_mv = not args.no_math_verify
    if with_mv:
        try:
            import math_verify  # noqa: F401 - only to see that it is installed
        except ImportError:
            print("math-verify is not installed (pip install math-verify==0.9.0): megarl only")
            with_mv = False
    report: dict = {}
    if args.data and Path(args.data).is_file():
        verifier = labelled(args, with_mv, report)
    else:
        print(f"no labelled cases{f' at {args.data}' if args.data else ''}: skipping the accuracy comparison. "
              "They are not in this repository; `--data FILE` takes any jsonl of the form this script's docstring "
              "describes (python tools/bench/verifier_math.py --help)")
        from megarl.verifiers.math import MathVerifier

        verifier = MathVerifier(budget_s=args.budget)
    if not args.no_pathological:
        report_pathological(args, with_mv, verifier, report)
    verifier.close()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def labelled(args, with_mv: bool, report: dict):
    """The labelled cases through both verifiers: accuracy, error rates, speed, by category; returns megarl's
    verifier (warm) for the pathological set."""
    rows = [json.loads(line) for line in open(args.data) if line.strip()]
    print(f"{len(rows)} cases from {args.data}")
    mine, mine_s, verifier = run_megarl(rows, args.budget)
    report["megarl"] = summarize(rows, mine, mine_s)
    theirs = None
    if with_mv:
        theirs, theirs_s = run_math_verify(rows)
        report["math-verify"] = summarize(rows, theirs, theirs_s)

    print()
    print(f"{'':<14}{'accuracy':>9}{'errors':>8}{'FPR':>7}{'FNR':>7}{'policy acc':>11}{'checks/s':>10}"
          f"{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}")
    for name, s in report.items():
        print(f"{name:<14}{100 * s['accuracy']:8.1f}%{s['errors']:>8}{100 * s['fpr']:6.1f}%{100 * s['fnr']:6.1f}%"
              f"{100 * s['policy_accuracy']:10.1f}%{s['checks_per_s']:10.1f}{s['p50_ms']:8.2f}{s['p99_ms']:8.1f}"
              f"{s['max_ms']:8.1f}")
    print(f"(accuracy, errors, FPR and FNR over the {report['megarl']['cases']} cases outside `policy`; "
          f"policy: {report['megarl']['policy_cases']} cases)")

    cats = defaultdict(lambda: [0, 0, 0])
    for i, r in enumerate(rows):
        c = cats[r["category"]]
        c[0] += 1
        c[1] += mine[i]["ok"] == r["label"]
        c[2] += theirs[i]["ok"] == r["label"] if theirs else 0
    print()
    print(f"  {'category':<20}{'cases':>6}{'megarl':>9}" + (f"{'math-verify':>13}" if theirs else ""))
    for cat in sorted(cats):
        n, a, b = cats[cat]
        print(f"  {cat:<20}{n:>6}{100 * a / n:8.1f}%" + (f"{100 * b / n:12.1f}%" if theirs else ""))

    if args.show_disagreements:
        print("\ncases megarl gets wrong:")
        for r, v in zip(rows, mine):
            if v["ok"] != r["label"]:
                print(f"  {r['id']:<10} {r['category']:<18} label {r['label']!s:<5} {v['outcome']:<11} "
                      f"gold {r['gold'][:40]!r} extracted {str(v['extracted'])[:40]!r}")
    if with_mv:
        m, t = report["megarl"], report["math-verify"]
        report["speedup"] = m["checks_per_s"] / t["checks_per_s"]
        print(f"\nmegarl: accuracy outside policy {100 * m['accuracy']:.1f}% vs math-verify's "
              f"{100 * t['accuracy']:.1f}%, false positives {100 * m['fpr']:.2f}%, {report['speedup']:.1f}x its "
              "checks per second (one core)")
    return verifier


def report_pathological(args, with_mv: bool, verifier, report: dict) -> None:
    patho = pathological(args.budget, args.hard_limit, with_mv, verifier)
    report["pathological"] = patho
    print("\npathological inputs (seconds; megarl budget %.1f s, math-verify killed after %.0f s):"
          % (args.budget, args.hard_limit))
    for row in patho:
        mv = ""
        if with_mv:
            mv = "HANG (killed)" if row["mv_hang"] else f"{row['mv_s']:.2f} s {'correct' if row['mv_ok'] else 'not'}"
        print(f"  {row['case']:<20} megarl {row['megarl_s']:6.2f} s {row['megarl_outcome']:<12} "
              f"{'HANG' if row['megarl_hang'] else '':<5} math-verify {mv}")
    report["hangs"] = {"megarl": sum(r["megarl_hang"] for r in patho)}
    if with_mv:
        report["hangs"]["math-verify"] = sum(r["mv_hang"] for r in patho)
    print(f"  hangs: {report['hangs']}")


if __name__ == "__main__":
    sys.exit(main())

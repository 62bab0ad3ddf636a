"""Re-check the `code` verifier's verdicts on a run's logged programs with plain Python, outside megarl's sandbox.

    python tools/check_code_verdicts.py runs/tiny_cpu_code/samples.jsonl [--limit N] [--timeout 10]

Each row of the samples file (`--log-samples-interval`) holds the program the policy wrote (`response`), the
row's tests (`answer`: `{"test": "assert f(...) == ...\\n...", "entry_point": "f"}`) and the verifier's verdict
(`outcome`). This script runs `response + "\\n" + test` in a fresh `python -I` subprocess, nothing of megarl
imported, and counts a program as passing when that process exits 0 within `--timeout` seconds. It prints the
agreement with the verifier (`outcome == "correct"`) and every disagreement, and exits 1 unless they agree on
every row: an independent witness that the sandbox's harness neither fails good programs nor passes bad ones.

What it does not check: a program that exits early with status 0 (`raise SystemExit`) passes here and fails in the
harness, which reads no exit codes; such a row shows up as a disagreement, to be read by hand. It runs the
programs unsandboxed: use it on the demo's own outputs, not on untrusted code.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def plain_pass(program: str, test: str, timeout: float) -> bool:
    """Whether `program` followed by the asserts `test` runs to the end in a fresh interpreter."""
    try:
        proc = subprocess.run([sys.executable, "-I", "-c", program + "\n" + test], capture_output=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0


def read_rows(paths: list[Path], limit: int) -> list[dict]:
    rows = []
    for path in paths:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("verifier") == "code" and row.get("outcome"):
                rows.append(row)
    return rows[:limit] if limit else rows


def check(rows: list[dict], timeout: float = 10.0, workers: int = 2) -> list[tuple[dict, bool, bool]]:
    """(row, verifier said correct, plain Python passed) for each row."""
    def one(row: dict) -> tuple[dict, bool, bool]:
        answer = row["answer"] if isinstance(row["answer"], dict) else json.loads(row["answer"])
        return row, row["outcome"] == "correct", plain_pass(row["response"], answer["test"], timeout)

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("samples", nargs="+", type=Path, help="samples.jsonl files of runs with the code verifier")
    p.add_argument("--limit", type=int, default=0, help="check at most this many rows (0 = all)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds a program and its tests may run")
    p.add_argument("--workers", type=int, default=2, help="programs run at a time")
    args = p.parse_args(argv)
    rows = read_rows(args.samples, args.limit)
    if not rows:
        print(f"no rows with verifier 'code' and an outcome in {', '.join(map(str, args.samples))}", file=sys.stderr)
        return 1
    results = check(rows, args.timeout, args.workers)
    agree = sum(said == passed for _, said, passed in results)
    correct = sum(passed for _, _, passed in results)
    for row, said, passed in results:
        if said != passed:
            print(f"DISAGREE step {row.get('step')}: verifier {row['outcome']}, plain Python "
                  f"{'pass' if passed else 'fail'}\n  prompt: {row['prompt']!r}\n  program: {row['response']!r}")
    print(f"verdicts: {len(results)} programs ({correct} pass in plain Python); agreement with the code verifier "
          f"{agree}/{len(results)} = {100 * agree / len(results):.1f}%")
    return 0 if agree == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())

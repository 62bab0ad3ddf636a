"""The last lines of `make demo-math`: the math-reward run against its exact-string control, both judged on the
held-out problems by the `math` verifier (each run's `eval.json`), and how often each run's logged rollouts boxed
a copy of the question (right in value, a not-answer in the row's label; `megarl.verifiers.math`).

    python tools/math_demo_summary.py RUN_DIR CONTROL_DIR

Ends with the demo's line:
    held-out accuracy (sampled): before X% -> after Y% (math reward); exact-string reward: Z%
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def copy_rate(run_dir: Path, verifier) -> tuple[float, int]:
    """(share of the rollout samples logged in the last half of the run that box a not-answer, samples read)."""
    path = run_dir / "samples.jsonl"
    if not path.is_file():
        return 0.0, 0
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    last = max((r["step"] for r in rows), default=0)
    rows = [r for r in rows if r["step"] > last / 2 and isinstance(r["answer"], dict)]
    copies = sum(verifier.verify(r["response"], r["answer"]).outcome != "correct"
                 and verifier.verify(r["response"], r["answer"]["answer"]).outcome == "correct" for r in rows)
    return copies / max(len(rows), 1), len(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="the math-reward run's --output-dir")
    p.add_argument("control_dir", type=Path, help="the exact-string control's --output-dir")
    args = p.parse_args(argv)
    results = {}
    for name, d in (("math", args.run_dir), ("control", args.control_dir)):
        path = d / "eval.json"
        if not path.is_file():
            sys.exit(f"math_demo_summary: no {path}: did the run finish with --eval-data?")
        results[name] = json.loads(path.read_text())
    math_run, control = results["math"], results["control"]
    if not math_run.get("before"):
        sys.exit(f"math_demo_summary: {args.run_dir / 'eval.json'} has no 'before' evaluation")

    from megarl.verifiers import VERIFIERS

    verifier = VERIFIERS.build("math")
    try:
        for name, d in (("math reward", args.run_dir), ("exact-string reward", args.control_dir)):
            rate, n = copy_rate(d, verifier)
            if n:
                print(f"copies of the question in the second half's logged rollouts ({name}): {100 * rate:.1f}% "
                      f"of {n}")
    finally:
        verifier.close()
    print(f"held-out accuracy (greedy): before {100 * math_run['before']['greedy']:.1f}% -> after "
          f"{100 * math_run['after']['greedy']:.1f}% (math reward); exact-string reward: "
          f"{100 * control['after']['greedy']:.1f}%")
    print(f"held-out accuracy (sampled): before {100 * math_run['before']['sampled']:.1f}% -> after "
          f"{100 * math_run['after']['sampled']:.1f}% (math reward); exact-string reward: "
          f"{100 * control['after']['sampled']:.1f}%")


if __name__ == "__main__":
    main()

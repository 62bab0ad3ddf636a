"""`make demo-distill`: on-policy distillation against GRPO on the CPU demo's task, from the same starter.

    python tools/distill_demo.py --student .cache/starter --teacher .cache/distill_teacher --steps N --out DIR

The teacher (`make demo-distill` builds it) is the starter after 800 steps of the demo's own recipe, GRPO, exported
as an HF checkpoint; the student is the starter. Then, each bound by its step count only, on recipes/tiny_cpu.sh
(the demo's recipe, its seed and batch):
the teacher's held-out accuracy (`megarl-eval`, whose pass@1 is the trainer's held-out sampled accuracy), N steps of
on-policy distillation (`--teacher`, `--distill-coef`, `--distill-only`: the teacher's per-token signal alone) and
N steps of GRPO, both from the student starter. It ends with one line:

    held-out accuracy (sampled): before X% -> after Y% (on-policy distillation), Z% (GRPO), teacher T%
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINE = re.compile(r"held-out accuracy \(sampled\): before ([0-9.]+)% -> after ([0-9.]+)%")


def _run(cmd: list[str], env: dict, log: Path) -> str:
    print("+", " ".join(cmd), flush=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        f.write(proc.stdout)
    if proc.returncode:
        sys.exit(f"distill demo: {' '.join(cmd[:4])} ... failed ({proc.returncode}); its output: {log}")
    return proc.stdout


def _train(args, env, name: str, extra: list[str]) -> tuple[float, float]:
    out = Path(args.out) / name
    text = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
                 "megarl/train.py", "recipes/tiny_cpu.sh", "--num-steps", str(args.steps), "--lr", str(args.lr),
                 "--min-lr", str(args.lr / 15), "--output-dir", str(out), *extra], env, Path(args.out) / f"{name}.log")
    found = LINE.findall(text)
    if not found:
        sys.exit(f"distill demo: the {name} run printed no held-out accuracy line ({Path(args.out) / name}.log)")
    before, after = found[-1]
    print(f"{name}: before {before}% -> after {after}%", flush=True)
    return float(before), float(after)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--student", default=str(REPO / ".cache/starter"))
    p.add_argument("--teacher", default=str(REPO / ".cache/distill_teacher"))
    p.add_argument("--steps", type=int, default=200, help="training steps of each run (the same for both)")
    p.add_argument("--distill-coef", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1.5e-4, help="peak learning rate of both runs (the demo's)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "runs/distill"))
    args = p.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "STARTER_DIR": args.student, "PYTHONPATH": str(REPO) + os.pathsep
           + os.environ.get("PYTHONPATH", "")}

    ev = Path(args.out) / "eval-teacher"
    if not (ev / "eval.json").exists():
        _run([sys.executable, "-m", "megarl.cli.eval", "recipes/tiny_cpu.sh", "--checkpoint", args.teacher,
              "--k", "1", "--out", str(ev)], env, Path(args.out) / "eval-teacher.log")
    pass1 = json.loads((ev / "eval.json").read_text())["overall"]["pass@1"]
    teacher = 100 * float(pass1["value"] if isinstance(pass1, dict) else pass1)
    print(f"teacher: {teacher:.1f}%", flush=True)

    before, distilled = _train(args, env, "distill", ["--teacher", args.teacher, "--distill-coef",
                                                      str(args.distill_coef), "--distill-only"])
    _, grpo = _train(args, env, "grpo", [])
    print(f"held-out accuracy (sampled): before {before:.1f}% -> after {distilled:.1f}% (on-policy distillation), "
          f"{grpo:.1f}% (GRPO), teacher {teacher:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Parts (b) and (c) of `make gpu-check`: `megarl/train.py` itself on the GPU, with the CPU demo's recipe
(recipes/tiny_cpu.sh) and a starter model made by tools/make_starter_model.py.

    python tools/gpu_check_train.py sync  --starter DIR --out DIR [--device cuda|cpu] [--timeout S]
    python tools/gpu_check_train.py learn --starter DIR --out DIR [--device cuda|cpu] [--steps 30] [--timeout S]
                                          [-- more train.py flags]

sync   (b) the built-in rollout engine on the device, 3 steps with --verify-weight-sync: passes when the run ends
       well and a probe checked a sync made after an update (`sync_probe_version` >= 1) within the tolerance
       (train.py itself stops on a larger difference).
learn  (c) `--steps` GRPO steps of the recipe on a pool of `--pool` training problems (evenly spaced rows of the
       starter's train.jsonl), all of them every step: passes when the mean reward of the last 5 logged steps is
       above that of the first 5. The rollouts are the engine's, so the reward rises only if the updates reach it.
       Why a pool: over the whole training set 30 steps move nothing measurable (the demo gains ~30 points in 5,400
       steps; measured on CPU, 30 steps at 64 to 1,024 samples a step and rates of 1e-4 to 3e-4 stayed flat or
       fell), while on 32 problems at the recipe's peak rate, held constant, the reward went 0.22 -> 0.63 (CPU, a
       600-step starter).

Each runs train.py under torchrun (one process) with a timeout, prints what it judged and ends with `PASS: ...`
or `FAIL: ...` (exit 0 or 1). `--device cpu` runs the same on CPU, to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WINDOW = 5  # steps averaged at each end of the learning run: one step's mean reward is noisy


def train(args, name: str, flags: list[str]) -> tuple[Path, str | None]:
    """Run the recipe with `flags` into OUT/NAME; returns the run directory and a failure reason (None: ran)."""
    run_dir = Path(args.out).resolve() / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(REPO / "megarl/train.py"), str(REPO / "recipes/tiny_cpu.sh"), "--output-dir", str(run_dir),
           "--rollout-device", args.device, "--log-interval", "1", *flags]
    env = {**os.environ, "STARTER_DIR": str(Path(args.starter).resolve())}
    print("   $ STARTER_DIR=" + env["STARTER_DIR"] + " " + " ".join(cmd[1:]), flush=True)
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=args.timeout, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-3000:]
        print(tail.decode(errors="replace") if isinstance(tail, bytes) else tail)
        return run_dir, f"train.py did not finish within --timeout {args.timeout:.0f} s"
    lines = proc.stdout.splitlines()
    print("\n".join("   | " + line for line in lines[-25:]), flush=True)
    print(f"   train.py exited {proc.returncode} after {time.perf_counter() - t:.0f} s", flush=True)
    if proc.returncode != 0:
        last = next((line for line in reversed(lines) if line.strip()), "")
        return run_dir, f"train.py exited {proc.returncode}: {last.strip()[:300]}"
    return run_dir, None


def write_pool(source: Path, out: Path, size: int) -> Path:
    """`size` evenly spaced rows of `source` (a jsonl of prompts) into `out`."""
    rows = [line for line in source.read_text().splitlines() if line.strip()]
    if size < 1 or size > len(rows):
        raise SystemExit(f"FAIL: --pool {size}: {source} has {len(rows)} problems (allowed: 1 to {len(rows)})")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(rows[i * len(rows) // size] + "\n" for i in range(size)))
    return out


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def judge_sync(rows: list[dict], device: str) -> tuple[bool, str]:
    """A probe that checked a sync made after an update, and (on a GPU) a sync that used GPU memory."""
    checked = [r for r in rows if r.get("sync_probe_version", 0) >= 1 and "sync_probe_absdiff_mean" in r]
    if not checked:
        return False, (f"no step logged a verified sync after an update (sync_probe_version >= 1) in {len(rows)} "
                       "rows of metrics.jsonl")
    worst = max(r["sync_probe_absdiff_mean"] for r in checked)
    peak = max((r.get("sync_peak_gpu_mib") or 0.0) for r in rows)
    if device == "cuda" and not peak > 0:
        return False, "the syncs report no GPU memory (sync_peak_gpu_mib 0): the engine did not run on the GPU"
    versions = sorted({int(r["sync_probe_version"]) for r in checked})
    return True, (f"{len(checked)} syncs verified after updates (versions {versions}), probe |dlogp| mean at most "
                  f"{worst:.2e}, sync {max(r.get('sync_seconds', 0.0) for r in rows):.3f} s, sync peak GPU "
                  f"{peak:.0f} MiB")


def judge_learning(rows: list[dict], steps: int) -> tuple[bool, str]:
    """The mean reward of the last WINDOW steps above that of the first WINDOW."""
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    if len(rewards) < steps:
        return False, f"{len(rewards)} of {steps} steps logged a reward"
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    said = (f"reward first {rewards[0]:.3f} -> last {rewards[-1]:.3f}; mean of steps 1-{WINDOW} {first:.3f} -> "
            f"steps {len(rewards) - WINDOW + 1}-{len(rewards)} {last:.3f}")
    return last > first, said + ("" if last > first else ": the reward did not rise")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=("sync", "learn"))
    p.add_argument("--starter", required=True, help="the starter model directory (tools/make_starter_model.py)")
    p.add_argument("--out", required=True, help="runs go to OUT/sync and OUT/learn")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the built-in engine's device")
    p.add_argument("--steps", type=int, default=30, help="learn: GRPO steps")
    p.add_argument("--pool", type=int, default=32, help="learn: training problems, all of them every step")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds train.py may take")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # more train.py flags, after `--`
    args = p.parse_args(argv[:len(argv) - len(extra) - (1 if "--" in argv else 0)])
    args.extra = extra
    if not (Path(args.starter) / "config.json").is_file():
        print(f"FAIL: --starter {args.starter}: no starter model there (config.json missing)")
        return 1
    if args.part == "sync":
        run_dir, failed = train(args, "sync", ["--num-steps", "3", "--verify-weight-sync", "--eval-data", "",
                                               *args.extra])
        ok, why = (False, failed) if failed else judge_sync(metrics(run_dir), args.device)
    else:
        pool = write_pool(Path(args.starter) / "train.jsonl", Path(args.out) / "learn-pool.jsonl", args.pool)
        run_dir, failed = train(args, "learn", ["--num-steps", str(args.steps), "--prompt-data", str(pool.resolve()),
                                                "--rollout-batch-size", str(args.pool), *args.extra])
        ok, why = (False, failed) if failed else judge_learning(metrics(run_dir), args.steps)
        held_out = run_dir / "eval.json"
        if ok and held_out.exists():
            e = json.loads(held_out.read_text())
            if e.get("before") and e.get("after"):
                why += (f"; held-out (never trained on) sampled {100 * e['before']['sampled']:.1f}% -> "
                        f"{100 * e['after']['sampled']:.1f}%")
    print(("PASS: " if ok else "FAIL: ") + why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

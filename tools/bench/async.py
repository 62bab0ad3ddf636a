"""Asynchronous training against the synchronous loop, side by side on the same cores: `megarl/train.py` with
--async-staleness 0 (synchronous), 1 and 2.

    python tools/bench/async.py                                  # both tasks, the default sizes below
    python tools/bench/async.py --tasks 30m --steps-30m 16 --rounds 2
    python tools/bench/async.py --tasks demo --demo-steps 1500 --seeds 1234,1235 --starter .cache/starter

Two tasks, each run as a real training run (torchrun, one process):
- `30m`: the ~30M-parameter Qwen2 of tools/bench/step.py (random weights, made here), `--prompts-30m` prompts x 8
  samples, 128-token responses, the digit-share reward (`digits_reward.py`). Overlap pays most where generation
  and update take similar time; decoding costs about the same per step whatever the rows, the update grows with
  them: on 2 cores split 1 + 1, 2 prompts (16 rows) is near that point, 4 prompts (32 rows) is update-bound.
  Reported: steps per minute (the median step time after the first K + 2 steps, the queue's start-up), and the
  overlap fraction (rollout + training) / step time against its bound (rollout + training) / max(rollout, training).
  The synchronous loop runs on all the cores and on the trainer's share of them; the ratio is against the faster.
- `demo`: the CPU demo (recipes/tiny_cpu.sh: the arithmetic starter, 8 prompts x 8 samples) for `--demo-steps`
  steps on each seed, then the held-out accuracy the run reports (sampled at temperature 1, 4 per prompt, and
  greedy): the same number of samples in every mode, so this measures what staleness costs in learning. It needs
  the demo starter (`make demo` builds it, or `--starter DIR`); without one this task is skipped, saying so.

The cores. The synchronous loop gets every core for everything (`--threads-per-rank` = `--threads`); the
asynchronous runs split them, the trainer `--threads` - `--rollout-threads` and the engine's process the rest, so
the two compare the same machine. Modes alternate run by run (`--rounds` times for the 30m task), so load from
other processes falls on all of them alike. Asynchronous runs use --off-policy-correction tis (cap 2).

The last line reads `async K=1 vs sync, 30M: X.XXx steps/min; demo held-out sampled at equal samples: sync A% vs
K=1 B%` (`--json FILE` writes every figure).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLUGIN = Path(__file__).resolve().parent / "digits_reward.py"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="30m,demo", help="comma-separated: 30m, demo")
    p.add_argument("--modes", default="0,1,2", help="--async-staleness values to run (0 = synchronous)")
    p.add_argument("--threads", type=int, default=2, help="cores to use: the synchronous run's threads")
    p.add_argument("--rollout-threads", type=int, default=1, help="the asynchronous engine's share of --threads")
    p.add_argument("--steps-30m", type=int, default=16, help="steps of each 30m run")
    p.add_argument("--rounds", type=int, default=2, help="30m runs per mode, alternating modes")
    p.add_argument("--prompts-30m", type=int, default=2, help="30m prompts per step (x 8 samples): 2 is where, on 2 "
                   "cores split 1 + 1, generation and update take about the same time")
    p.add_argument("--demo-steps", type=int, default=5400, help="steps of each demo run (the recipe's 5,400)")
    p.add_argument("--seeds", default="1234,1235", help="demo seeds; every mode runs every seed")
    p.add_argument("--starter", type=Path, default=REPO / ".cache" / "starter", help="the demo's starter")
    p.add_argument("--work", type=Path, default=None, help="where runs are written (default: a temporary dir)")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(args: list, out: Path, timeout: float = 7200) -> list[dict]:
    """One training run (one process); its metrics rows."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port()),
           "megarl/train.py", *map(str, args), "--output-dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(map(str, cmd))}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def mode_args(k: int, a: argparse.Namespace, threads: int | None = None) -> list:
    """Flags of one mode: synchronous on `threads` (default all of --threads), or asynchronous with the cores split."""
    if k == 0:
        return ["--threads-per-rank", threads or a.threads]
    return ["--threads-per-rank", max(a.threads - a.rollout_threads, 1), "--rollout-threads", a.rollout_threads,
            "--async-staleness", k, "--tis-cap", 2]


def variants(modes: list[int], a: argparse.Namespace) -> list[tuple[str, int, int | None]]:
    """(name, K, synchronous threads). The synchronous loop runs twice, on all the cores and on the trainer's share
    of them: on a loaded machine threads that wait for each other can make more cores slower, and the speed-up is
    taken against the faster of the two."""
    out = []
    for k in modes:
        if k == 0:
            out.append(("sync", 0, a.threads))
            if a.threads - a.rollout_threads != a.threads:
                out.append((f"sync-{max(a.threads - a.rollout_threads, 1)}t", 0, max(a.threads - a.rollout_threads, 1)))
        else:
            out.append((f"K={k}", k, None))
    return out


def make_30m(work: Path) -> Path:
    from step import make_model, make_prompts

    model = make_model("30m", work / "qwen2-30m", None)
    data = work / "prompts-30m.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_prompts(512)))
    return model


def bench_30m(a: argparse.Namespace, modes: list[int], work: Path) -> dict:
    model = make_30m(work)
    base = ["recipes/tiny_cpu.sh", "--hf-checkpoint", model, "--prompt-data", work / "prompts-30m.jsonl",
            "--eval-data", "", "--plugins", PLUGIN, "--rollout-batch-size", a.prompts_30m, "--n-samples-per-prompt", 8,
            "--max-response-len", 128, "--micro-batch-size", 8, "--lr", 1e-5, "--min-lr", 1e-5,
            "--num-steps", a.steps_30m, "--log-interval", 1000]
    runs = variants(modes, a)
    seconds: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    overlap: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in runs}
    for r in range(a.rounds):
        for name, k, threads in runs:
            rows = train(base + mode_args(k, a, threads), work / f"30m-{name}-r{r}")
            kept = rows[k + 2:]
            seconds[name] += [row["step_seconds"] for row in kept]
            overlap[name] += [(row.get("overlap", 1.0), row.get("overlap_bound", 1.0)) for row in kept]
            print(f"30m {name} round {r}: median step {statistics.median(row['step_seconds'] for row in kept):.2f} s",
                  flush=True)
    out = {}
    for name, k, _ in runs:
        med = statistics.median(seconds[name])
        out[name] = {"staleness": k, "steps_per_min": 60 / med, "median_step_s": med,
                     "overlap": statistics.mean(o for o, _ in overlap[name]),
                     "overlap_bound": statistics.mean(b for _, b in overlap[name])}
    return out


def bench_demo(a: argparse.Namespace, modes: list[int], work: Path) -> dict | None:
    starter = a.starter
    if not (starter / "config.json").exists():
        print(f"demo task skipped: no starter at {starter} (`make demo` builds it, or pass --starter DIR)")
        return None
    seeds = [int(s) for s in a.seeds.split(",") if s]
    out: dict[int, dict] = {k: {"sampled": [], "greedy": [], "minutes": []} for k in modes}
    for seed in seeds:
        for k in modes:
            run = work / f"demo-k{k}-s{seed}"
            train(["recipes/tiny_cpu.sh", "--hf-checkpoint", starter, "--prompt-data", starter / "train.jsonl",
                   "--eval-data", starter / "heldout.jsonl", "--num-steps", a.demo_steps, "--seed", seed,
                   "--log-interval", 1000, *mode_args(k, a)], run)
            ev = json.loads((run / "eval.json").read_text())
            out[k]["sampled"].append(ev["after"]["sampled"])
            out[k]["greedy"].append(ev["after"]["greedy"])
            out[k]["minutes"].append(ev["train_minutes"])
            out[k]["before"] = ev["before"]
            print(f"demo K={k} seed {seed}: held-out sampled {ev['before']['sampled']:.1%} -> "
                  f"{ev['after']['sampled']:.1%}, greedy {ev['before']['greedy']:.1%} -> {ev['after']['greedy']:.1%}, "
                  f"{ev['train_minutes']:.1f} min", flush=True)
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    modes = [int(k) for k in a.modes.split(",")]
    tasks = set(a.tasks.split(","))
    work = a.work or Path(tempfile.mkdtemp(prefix="megarl-async-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"== {os.cpu_count()} CPUs, --threads {a.threads} (async: trainer {max(a.threads - a.rollout_threads, 1)} + "
          f"engine {a.rollout_threads}); runs in {work}", flush=True)
    started = time.time()
    result: dict = {"args": {k: str(v) for k, v in vars(a).items()}}
    if "30m" in tasks:
        result["30m"] = bench_30m(a, modes, work)
        print(f"\n30M Qwen2, {a.prompts_30m} x 8 samples of 128 tokens:")
        print(f"  {'mode':<8} {'steps/min':>9} {'x sync':>7} {'overlap':>8} {'bound':>6}")
        sync = max((r["steps_per_min"] for r in result["30m"].values() if r["staleness"] == 0), default=None)
        for name, r in result["30m"].items():
            ratio = f"{r['steps_per_min'] / sync:.2f}x" if sync else "-"
            print(f"  {name:<8} {r['steps_per_min']:9.2f} {ratio:>7} {r['overlap']:8.2f} {r['overlap_bound']:6.2f}")
    if "demo" in tasks:
        result["demo"] = bench_demo(a, modes, work)
        if result["demo"]:
            print(f"\ndemo, {a.demo_steps} steps, held-out after training (mean over seeds {a.seeds}; spread = "
                  "max - min):")
            for k, r in result["demo"].items():
                print(f"  {'sync' if k == 0 else f'K={k}':<8} sampled {statistics.mean(r['sampled']):6.1%} "
                      f"(spread {max(r['sampled']) - min(r['sampled']):.1%})  "
                      f"greedy {statistics.mean(r['greedy']):6.1%} "
                      f"(spread {max(r['greedy']) - min(r['greedy']):.1%})  {statistics.mean(r['minutes']):.1f} min")
    result["minutes"] = (time.time() - started) / 60
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    speed = "not run"
    if "30m" in result and {0, 1} <= {r["staleness"] for r in result["30m"].values()}:
        sync = max(r["steps_per_min"] for r in result["30m"].values() if r["staleness"] == 0)
        speed = f"{result['30m']['K=1']['steps_per_min'] / sync:.2f}x steps/min"
    demo = result.get("demo")
    acc = (f"sync {100 * statistics.mean(demo[0]['sampled']):.1f}% "
           f"vs K=1 {100 * statistics.mean(demo[1]['sampled']):.1f}%"
           if demo and {0, 1} <= set(demo) else "not run")
    print(f"async K=1 vs sync, 30M: {speed}; demo held-out sampled at equal samples: {acc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

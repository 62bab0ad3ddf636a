"""Step metrics: reduced over ranks, printed, appended to metrics.jsonl, and plotted at the end."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist


def reduce_over_ranks(values: dict[str, float], keys: list[str]) -> dict[str, float]:
    """Sum (or max, for keys ending in `_max`) each key over all ranks; ranks that don't own a metric pass 0.

    Every rank must call this with the same `keys`.
    """
    sums = torch.tensor([0.0 if k.endswith("_max") else float(values.get(k, 0.0)) for k in keys], dtype=torch.float64)
    maxes = torch.tensor([float(values.get(k, -math.inf)) if k.endswith("_max") else -math.inf for k in keys],
                         dtype=torch.float64)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    return {k: (maxes[i].item() if k.endswith("_max") else sums[i].item()) for i, k in enumerate(keys)}


class MetricsLog:
    """Rank 0 writes `<dir>/metrics.jsonl`. A resumed run appends to it; a fresh run moves an earlier run's file
    aside (`metrics.<time>.jsonl`) rather than mixing the two or deleting it."""

    def __init__(self, output_dir: str, enabled: bool, resumed: bool = False):
        self.enabled = enabled
        self.dir = Path(output_dir)
        self.rows: list[dict] = []
        if enabled:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.path = self.dir / "metrics.jsonl"
            if not resumed and self.path.exists():
                self.path.rename(self.dir / f"metrics.{time.strftime('%Y%m%d-%H%M%S')}.jsonl")

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        row = {"time": time.time(), **row}
        self.rows.append(row)
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")

    def all_rows(self) -> list[dict]:
        """Every row of the file, including those of earlier (resumed-from) runs."""
        if not self.enabled or not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def format_step(row: dict, num_steps: int) -> str:
    return (
        f"step {row['step']:>4}/{num_steps} | reward {row['reward_mean']:.3f} | acc {100 * row['accuracy']:5.1f}% "
        f"| kl {row.get('kl', 0.0):.4f} | clip {row.get('clip_frac', 0.0):.3f} | len {row['response_len']:.1f} "
        f"| {row['step_seconds']:.2f} s (gen {row['t_generate']:.2f} reward {row['t_reward']:.2f} "
        f"logp {row['t_logprobs']:.2f} update {row['t_update']:.2f} sync {row['t_sync']:.2f}) "
        f"| {row['tokens_per_second']:.0f} tok/s"
    )


def plot_rewards(rows: list[dict], path: Path, before_after: dict | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(steps, [r["reward_mean"] for r in rows], alpha=0.35, label="reward (per step)")
    window = max(1, len(rows) // 20)
    smooth = [sum(r["reward_mean"] for r in rows[max(0, i - window + 1): i + 1]) / len(rows[max(0, i - window + 1): i + 1])
              for i in range(len(rows))]
    axes[0].plot(steps, smooth, label=f"reward ({window}-step mean)")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("mean reward")
    axes[0].set_title("GRPO training reward")
    axes[0].legend()
    axes[1].plot(steps, [r.get("kl", 0.0) for r in rows], label="KL(actor || ref)")
    axes[1].plot(steps, [r["response_len"] for r in rows], label="response length")
    axes[1].set_xlabel("step")
    axes[1].set_yscale("symlog", linthresh=1e-3)
    axes[1].legend()
    if before_after:
        axes[0].set_title("GRPO training reward; held-out sampled acc "
                          f"{100 * before_after['before']:.1f}% -> {100 * before_after['after']:.1f}%")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

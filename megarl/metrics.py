"""What a run reports: step metrics reduced over ranks, the console line, `metrics.jsonl`, rollout samples,
TensorBoard and wandb, and the end-of-run figure.

Only rank 0 writes anything. TensorBoard and wandb are optional: a flag that asks for one whose package is missing
prints a warning naming the package and the run goes on without it, since losing a dashboard should never cost a
training run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Protocol, Sequence

import torch
import torch.distributed as dist

from megarl.samples import TrainBatch

# Per-phase seconds that train.py records in each row, in loop order, with the names the console line uses: what
# the step's time is made of. The reward's share is what the step waited on, `t_reward_exposed`; the scoring's own
# time, `t_reward`, is more where rows are scored while others decode (`--reward-overlap`), and the console line
# gives both ("reward 1.20 (0.05 exposed)").
PHASES: tuple[tuple[str, str], ...] = (("t_generate", "rollout"), ("t_reward_exposed", "reward"),
                                       ("t_logprobs", "logp"), ("t_critic", "critic"), ("t_update", "update"),
                                       ("t_sync", "sync"),
                                       ("t_wait_rollout", "wait"))  # asynchronous: the trainer's wait for a batch


def reduce_over_ranks(values: dict[str, float], keys: list[str]) -> dict[str, float]:
    """Sum (or max, for keys ending in `_max`) each key over all ranks; ranks that don't own a metric pass 0.

    Every rank must call this with the same `keys`.
    """
    sums = torch.tensor([0.0 if k.endswith("_max") else float(values.get(k, 0.0)) for k in keys], dtype=torch.float64)
    maxes = torch.tensor([float(values.get(k, -math.inf)) if k.endswith("_max") else -math.inf for k in keys],
                         dtype=torch.float64)
    from megarl.mcore.parallel import all_reduce_host  # NCCL reduces device tensors only

    sums = all_reduce_host(sums, op=dist.ReduceOp.SUM)
    maxes = all_reduce_host(maxes, op=dist.ReduceOp.MAX)
    return {k: (maxes[i].item() if k.endswith("_max") else sums[i].item()) for i, k in enumerate(keys)}


# -- sinks: TensorBoard and wandb --------------------------------------------------------------------------------


class Sink(Protocol):
    def scalars(self, row: dict, step: int) -> None: ...
    def samples(self, rows: list[dict], step: int) -> None: ...
    def close(self) -> None: ...


def _numeric(row: dict) -> dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardSink:
    """Every numeric metric as a scalar under its metrics.jsonl name; samples as a markdown table (TEXT tab)."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter  # ImportError without the tensorboard package

        self.writer = SummaryWriter(log_dir=log_dir)

    def scalars(self, row: dict, step: int) -> None:
        for k, v in _numeric(row).items():
            self.writer.add_scalar(k, v, step)

    def samples(self, rows: list[dict], step: int) -> None:
        def cell(x) -> str:
            return str(x).replace("|", "\\|").replace("\n", "\\n")

        lines = ["| prompt | response | reward | outcome |", "|---|---|---|---|"]
        lines += [f"| {cell(r['prompt'])} | {cell(r['response'])} | {r['reward']:.3f} | {cell(r['outcome'])} |"
                  for r in rows]
        self.writer.add_text("rollout_samples", "\n".join(lines), step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One wandb run per output directory: a resumed megarl run continues the wandb run it started (its id is kept
    in `<output-dir>/wandb-run-id`). `offline` writes under `<output-dir>/wandb/` and needs no network; upload later
    with `wandb sync`."""

    def __init__(self, project: str, mode: str, name: str, output_dir: Path, config: dict, resumed: bool):
        import wandb  # ImportError without the wandb package

        id_file = output_dir / "wandb-run-id"
        run_id = id_file.read_text().strip() if resumed and id_file.is_file() else None
        self.wandb = wandb
        self.run = wandb.init(project=project, mode=mode, name=name or None, dir=str(output_dir), config=config,
                              id=run_id, resume="allow" if run_id else None)
        id_file.write_text(self.run.id)

    def scalars(self, row: dict, step: int) -> None:
        self.run.log(_numeric(row), step=step)

    def samples(self, rows: list[dict], step: int) -> None:
        columns = ["step", "prompt", "response", "reward", "outcome", "advantage"]
        table = self.wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])
        self.run.log({"rollout_samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()
        self.wandb.teardown()  # waits for wandb's service process to write everything out


def open_sinks(logging_cfg, output_dir: str, run_config: dict, resumed: bool) -> list[Sink]:
    """The sinks the logging flags ask for. Call on rank 0 only."""
    lg, sinks = logging_cfg, []
    if lg.tensorboard_dir:
        try:
            sinks.append(TensorBoardSink(lg.tensorboard_dir))
        except ImportError:
            _warn("--tensorboard-dir needs the tensorboard package (pip install tensorboard); "
                  "continuing without TensorBoard")
    if lg.wandb_project and lg.wandb_mode != "disabled":
        try:
            sinks.append(WandbSink(lg.wandb_project, lg.wandb_mode, lg.wandb_run_name, Path(output_dir), run_config,
                                   resumed))
        except ImportError:
            _warn("--wandb-project needs the wandb package (pip install 'megarl[wandb]' or pip install wandb); "
                  "continuing without wandb")
        except Exception as e:  # no login, no network, a bad project name: say so before any training is done
            from megarl.errors import ConfigError

            raise ConfigError(f"--wandb-project {lg.wandb_project}: wandb could not start a run ({type(e).__name__}: "
                              f"{e}); run `wandb login`, or use --wandb-mode offline (no network needed) or disabled"
                              ) from e
    return sinks


def _warn(msg: str) -> None:
    print(f"megarl: warning: {msg}", file=sys.stderr, flush=True)


# -- the metrics file and the samples file -----------------------------------------------------------------------


def _move_aside(path: Path) -> None:
    if path.exists():
        path.rename(path.with_name(f"{path.stem}.{time.strftime('%Y%m%d-%H%M%S')}{path.suffix}"))


def _drop_rows_after(path: Path, step: int) -> None:
    """Keep only the rows of `path` (jsonl with a "step" field) up to `step`; rewritten atomically."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines(keepends=True)
            if line.strip() and json.loads(line).get("step", 0) <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)


class MetricsLog:
    """Rank 0 writes `<dir>/metrics.jsonl` (one row per step) and `<dir>/samples.jsonl` (rollout samples), and
    forwards both to its sinks. A resumed run appends; a fresh run moves an earlier run's files aside
    (`metrics.<time>.jsonl`) rather than mixing the two or deleting them."""

    def __init__(self, output_dir: str, enabled: bool, resumed: bool = False, sinks: Sequence[Sink] = (),
                 resume_step: int | None = None, constants: dict | None = None):
        """`constants`: numbers fixed for the run (prompts left out at load...), repeated in every row so that any
        row of the file tells them."""
        self.enabled = enabled
        self.constants = dict(constants or {})
        self.dir = Path(output_dir)
        self.path = self.dir / "metrics.jsonl"
        self.samples_path = self.dir / "samples.jsonl"
        self.sinks = list(sinks) if enabled else []
        self.rows: list[dict] = []
        if enabled:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not resumed:
                _move_aside(self.path)
                _move_aside(self.samples_path)
            elif resume_step is not None:
                # A killed run may have logged steps after its last checkpoint; the resumed run logs them again.
                _drop_rows_after(self.path, resume_step)
                _drop_rows_after(self.samples_path, resume_step)

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        row = {"time": time.time(), **row, **self.constants}
        self.rows.append(row)
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        for sink in self.sinks:
            sink.scalars(row, row["step"])

    def write_samples(self, step: int, rows: list[dict]) -> None:
        if not self.enabled or not rows:
            return
        with self.samples_path.open("a") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
        for sink in self.sinks:
            sink.samples(rows, step)

    def all_rows(self) -> list[dict]:
        """Every row of the file, including those of earlier (resumed-from) runs."""
        if not self.enabled or not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def rollout_sample_rows(step: int, samples: Sequence, prompts: Sequence, limit: int,
                        batch: TrainBatch | None = None, tokenizer=None) -> list[dict]:
    """The first `limit` samples of a rollout (whole groups first, as samples are stored group by group) as
    plain rows. `prompts` is the dataset, indexed by each sample's `prompt_index`. With the step's `batch`, the
    reward is the final one and each row gets its advantage (per-token advantages: their mean over the loss mask).
    With the `tokenizer`, a sample holding tokens the policy did not generate (a tool's output) gets `trajectory`:
    its whole response as spans `{"mask": 1 | 0, "text": ...}`, mask 0 marking what the loss leaves out."""
    rows = []
    for i, s in enumerate(list(samples)[:limit]):
        record = prompts[s.prompt_index]
        # `answer` and `verifier` as in training data, so `megarl-verify samples.jsonl` re-scores saved rollouts
        row = {"step": step, "prompt_index": s.prompt_index, "prompt": record.prompt, "answer": record.label,
               "verifier": record.verifier, "response": s.response_text, "reward": float(s.reward),
               "outcome": s.outcome,
               "advantage": None, "response_len": len(s.response_ids), "status": s.status.value,
               "weight_version": s.weight_version, **s.metadata,
               **({"signals": dict(s.signals)} if getattr(s, "signals", None) else {})}
        if batch is not None:
            adv, mask = batch.advantages[i], batch.loss_mask[i]
            row["reward"] = float(batch.rewards[i])
            row["advantage"] = float(adv) if adv.dim() == 0 else float((adv * mask).sum() / mask.sum().clamp(min=1))
        if tokenizer is not None and 0 in s.loss_mask:
            row["trajectory"] = masked_spans(s.response_ids, s.loss_mask, tokenizer)
        rows.append(row)
    return rows


def masked_spans(ids: Sequence[int], mask: Sequence[int], tokenizer) -> list[dict]:
    """Consecutive tokens of equal mask, decoded (special tokens kept): `[{"mask": 1, "text": ...}, ...]`."""
    spans, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            spans.append({"mask": int(mask[start]),
                          "text": tokenizer.decode(list(ids[start:i]), skip_special_tokens=False)})
            start = i
    return spans


class PhaseTimer:
    """Seconds of a step's phases, by their metric names (`PHASES`): `with timer("t_update"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(**{name: time.perf_counter() - start})

    def add(self, **seconds: float) -> None:
        for name, value in seconds.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + value


# -- the console line ------------------------------------------------------------------------------------------


def eta_seconds(elapsed: float, steps_done: int, steps_left: int, time_left: float | None = None) -> float | None:
    """Remaining wall time at this run's average pace, capped by a time budget; None before the first step."""
    if steps_done <= 0:
        return None
    eta = elapsed / steps_done * steps_left
    return min(eta, max(time_left, 0.0)) if time_left is not None else eta


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s % 60:02d}s"


def _phase(row: dict, key: str, label: str) -> str:
    """One phase of the console line; "" when the row lacks it. The reward gives both its times ("reward 1.20
    (0.05 exposed)"), or `t_reward` alone in a row without the exposed part."""
    if key == "t_reward_exposed" and "t_reward" in row:
        exposed = f" ({row[key]:.2f} exposed)" if key in row else ""
        return f"{label} {row['t_reward']:.2f}{exposed}"
    return f"{label} {row[key]:.2f}" if key in row else ""


def reward_throughput(programs: float, tests: float, cpu_seconds: float, seconds: float) -> dict[str, float]:
    """The step's sandbox throughput: `programs` scored in a sandbox, the `tests` they ran and the sandbox's
    `cpu_seconds` for them (summed over ranks), over `seconds`, the scoring's wall time (the slowest rank's: ranks
    score at the same time, each with its own workers). Empty when no program ran in a sandbox."""
    if programs <= 0:
        return {}
    seconds = max(seconds, 1e-9)
    return {"reward_programs_per_s": programs / seconds, "reward_tests_per_s": tests / seconds,
            "sandbox_cpu_ms_per_program": 1000 * cpu_seconds / programs}


def format_step(row: dict, num_steps: int, eta: float | None = None) -> str:
    """One progress line; any metric the row lacks (entropy when it is not computed, ...) is left out."""
    parts = [f"step {row['step']:>{len(str(num_steps))}}/{num_steps}"]
    if eta is not None:
        parts.append(f"eta {_duration(eta)}")
    fields = (("reward_mean", "reward", "{:.3f}"), ("accuracy", "acc", "{:.1%}"), ("kl", "kl", "{:.4f}"),
              ("clip_frac", "clip", "{:.3f}"), ("entropy", "ent", "{:.3f}"), ("response_len", "len", "{:.1f}"),
              ("value_loss", "vloss", "{:.4f}"), ("explained_variance", "ev", "{:.2f}"),  # these two: PPO
              ("tool_call_rate", "tool", "{:.1%}"),  # tool_use
              ("distill/reverse_kl", "tkl", "{:.4f}"), ("distill/adv_share", "tshare", "{:.0%}"),  # distillation
              ("distill/teacher_s", "teacher", "{:.2f}s"))
    parts += [f"{label} {fmt.format(row[k])}" for k, label, fmt in fields if k in row]
    if row.get("hack/any", 0.0) > 0:  # reward hacking (`megarl.reward.hacking`): the share flagged, its top signal
        top = max((k for k in row if k.startswith("hack/") and k not in ("hack/any", "hack/rm_length_corr")),
                  key=lambda k: row[k])
        parts.append(f"hack {row['hack/any']:.1%} ({top.removeprefix('hack/')} {row[top]:.1%})")
    if "step_seconds" in row:
        phases = " ".join(p for k, label in PHASES if (p := _phase(row, k, label)))
        parts.append(f"{row['step_seconds']:.2f} s ({phases})" if phases else f"{row['step_seconds']:.2f} s")
    if "tokens_per_second" in row:
        parts.append(f"{row['tokens_per_second']:.0f} tok/s")
    return " | ".join(parts)


# -- the end-of-run figure -------------------------------------------------------------------------------------


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_run(rows: list[dict], path: Path, held_out: list[tuple] | None = None, kl: bool = True) -> Path:
    """One PNG: reward, accuracy, KL to the reference (`kl`; without a reference the policy's entropy instead),
    response length, the time per step split by phase (each a raw and a smoothed curve), and the held-out
    accuracy curve, `held_out` = (step, sampled, greedy) points (before training, every --eval-interval, after).
    Missing metrics leave their panel empty rather than failing the run's last step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    window = max(1, len(rows) // 20)
    hacks = sorted({k for r in rows for k in r if k.startswith("hack/") and k != "hack/rm_length_corr"
                    and r[k] > 0})
    fig, axes = plt.subplots(2, 4 if hacks else 3, figsize=(20 if hacks else 15, 8))
    if hacks:  # a fourth column: the signals' rates on top (`megarl.reward.hacking`); the other panels as before
        ax = axes[0, 3]
        ax.set_title("reward-hacking signals (share of samples)")
        ax.set_xlabel("step")
        for key in hacks:
            ax.plot(steps, _smooth([r.get(key, 0.0) for r in rows], window), label=key.removeprefix("hack/"))
        ax.legend(loc="best", fontsize=8)
        axes[1, 3].axis("off")
        axes = axes[:, :3]
    third = ("kl", "KL(actor || ref)", "symlog") if kl else ("entropy", "entropy (no reference model)", None)
    panels = (("reward_mean", "mean reward", None), ("accuracy", "accuracy (train rollouts)", None), third,
              ("response_len", "response length (tokens)", None))
    for ax, (key, title, scale) in zip(axes.flat, panels):
        ax.set_title(title)
        ax.set_xlabel("step")
        values = [r.get(key) for r in rows]
        if not rows or any(v is None for v in values):
            ax.text(0.5, 0.5, f"no {key} recorded", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.plot(steps, values, alpha=0.3 if window > 1 else 1.0, label="per step")
        if window > 1:
            ax.plot(steps, _smooth(values, window), label=f"{window}-step mean")
        if scale:
            ax.set_yscale(scale, linthresh=1e-4)
        ax.legend(loc="best", fontsize=8)

    ax = axes.flat[4]
    ax.set_title("seconds per step, by phase")
    ax.set_xlabel("step")
    rows = [{"t_reward_exposed": r["t_reward"], **r} if "t_reward" in r else r for r in rows]  # older rows: serial
    present = [(k, label) for k, label in PHASES if rows and all(k in r for r in rows)]
    if present:
        ax.stackplot(steps, *[_smooth([r[k] for r in rows], window) for k, _ in present],
                     labels=[label for _, label in present], alpha=0.8)
        ax.legend(loc="upper left", fontsize=8)
    _plot_held_out(axes.flat[5], held_out or [])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def held_out_curve(rows: list[dict], before: dict | None, after: dict | None, steps: int) -> list[tuple]:
    """(step, sampled, greedy) of every held-out evaluation: before training (step 0), each --eval-interval (the
    rows' `eval_sampled` / `eval_greedy`), after training (`steps`)."""
    points = [(0, before["sampled"], before["greedy"])] if before else []
    points += [(r["step"], r["eval_sampled"], r["eval_greedy"]) for r in rows if "eval_sampled" in r]
    return points + ([(steps, after["sampled"], after["greedy"])] if after else [])


def _plot_held_out(ax, points: list[tuple]) -> None:
    if not points:
        ax.axis("off")
        return
    ax.set_title("held-out accuracy")
    ax.set_xlabel("step")
    at = [p[0] for p in points]
    for column, label in ((1, "sampled"), (2, "greedy")):
        values = [100 * p[column] for p in points]
        ax.plot(at, values, marker="o", label=label)
        ax.annotate(f"{values[-1]:.1f}%", (at[-1], values[-1]), textcoords="offset points", xytext=(4, 4),
                    fontsize=8)
    ax.set_ylim(0, 100)
    ax.set_ylabel("%")
    ax.legend(loc="best", fontsize=8)

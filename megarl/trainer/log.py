"""The run's log: `metrics.jsonl` (and TensorBoard or wandb when asked) opened with the resolved config beside it,
and the end of the run: peak memory, the before/after table, the figure, the log closed."""

from __future__ import annotations

import json
import resource

from megarl.config import SAVED_CONFIG, Config
from megarl.mcore import parallel
from megarl.metrics import MetricsLog, held_out_curve, open_sinks, plot_run, rollout_sample_rows
from megarl.reward.hacking import flagged_rows
from megarl.stages.algorithm import AlgorithmStage
from megarl.trainer.build import TrainingRun


def open_log(run: TrainingRun) -> MetricsLog:
    """The run's metrics log, with the resolved config written beside it (`config.json`, rank 0)."""
    lg, resumed = run.cfg.logging, run.start_step > 0
    sinks = open_sinks(lg, lg.output_dir, run.cfg.to_dict(), resumed=resumed) if run.info.rank == 0 else []
    counts = {k: v for k, v in run.record.items() if k.endswith("_too_long")}
    log = MetricsLog(lg.output_dir, enabled=run.info.rank == 0, resumed=resumed, sinks=sinks,
                     resume_step=run.start_step if resumed else None, constants=counts)
    if log.enabled:
        (log.dir / SAVED_CONFIG).write_text(json.dumps(run.record, indent=1) + "\n")
    return log


def write_samples(run: TrainingRun, log: MetricsLog, step: int, samples, batch) -> None:
    """samples.jsonl after a step: every --log-samples-interval steps, --log-samples-count of them; with
    --log-hack-samples, this rank's samples that carried a reward-hacking signal, with their evidence."""
    lg = run.cfg.logging
    if log.enabled and lg.log_samples_interval and step % lg.log_samples_interval == 0:
        log.write_samples(step, rollout_sample_rows(step, samples, run.prompts, lg.log_samples_count, batch,
                                                    run.tokenizer))
    if log.enabled and lg.log_hack_samples:
        log.write_samples(step, flagged_rows(step, samples, run.prompts))


def finish(run: TrainingRun, log: MetricsLog, before: dict | None, after: dict | None, minutes: float,
           steps: int) -> None:
    """The end of a run on every rank: peak memory, the before/after table and figure (rank 0), the log closed."""
    say = run.say
    say(f"megarl: peak memory per process {peak_rss_mib():.0f} MiB (max over ranks)")
    rows = log.all_rows()
    if rows:  # rank 0
        try:
            plot_run(rows, log.dir / "training.png", held_out_curve(rows, before, after, steps),
                     kl=AlgorithmStage.needs_reference(run.cfg))
        except ImportError as e:  # no matplotlib (a GPU machine set up by `make gpu-check`): the run still ends well
            say(f"training curves: not drawn ({e})")
    if after:
        _report(say, log, before, after, minutes, steps, len(run.eval_prompts), run.cfg)
    elif rows:
        say(f"training curves: {log.dir / 'training.png'}")
    log.close()



def peak_rss_mib() -> float:
    return parallel.max_over_ranks(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)


def _report(say, log, before: dict | None, after: dict, minutes: float, steps: int, n_prompts: int,
            cfg: Config) -> None:
    result = {"after": after, "before": before, "train_minutes": minutes, "steps": steps, "eval_prompts": n_prompts}
    say("")
    metric = cfg.logging.eval_metric_name
    say(f"held-out {metric} on {n_prompts} prompts never trained on ({steps} steps, {minutes:.1f} min of training):")
    say(f"  {'':<30}{'before':>8}{'after':>8}")
    sampled = f"sampled (temp {cfg.rollout.rollout_temperature:g}, {cfg.logging.eval_samples_per_prompt}/prompt)"
    for key, label in (("sampled", sampled), ("greedy", "greedy")):
        b = f"{100 * before[key]:7.1f}%" if before else "      -"
        say(f"  {label:<30}{b}{100 * after[key]:7.1f}%")
    if log.enabled:
        (log.dir / "eval.json").write_text(json.dumps(result, indent=2))
        say(f"training curves: {log.dir / 'training.png'}")
    if before:
        say(f"held-out {metric} (sampled): before {100 * before['sampled']:.1f}% "
            f"-> after {100 * after['sampled']:.1f}%")
        if "tool_call_rate" in before and "tool_call_rate" in after:
            say(f"tool-call rate: before {100 * before['tool_call_rate']:.1f}% -> "
                f"after {100 * after['tool_call_rate']:.1f}%")

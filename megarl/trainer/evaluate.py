"""Held-out evaluation: accuracy sampled and greedy through the run's rollout and reward functions, before
training, every `--eval-interval` steps and after."""

from __future__ import annotations

import torch

from megarl.mcore import parallel
from megarl.stages.collect import sampling_params
from megarl.stages.colocation import enter_rollout, enter_training
from megarl.trainer.build import TrainingRun


def evaluate(run: TrainingRun, quiet: bool = False) -> dict:
    """Held-out accuracy, sampled (temperature, `--eval-samples-per-prompt` each) and greedy, through the run's
    rollout function and reward function; DP ranks split the prompts, each model replica's leader runs its share.
    The engine must hold the GPU (`enter_rollout`)."""
    cfg, info = run.cfg, run.info
    if not quiet:
        run.say(f"megarl: evaluating on {len(run.eval_prompts)} held-out prompts "
                f"({cfg.logging.eval_samples_per_prompt} samples each, and greedy)", flush=True)
    mine = run.eval_prompts[info.dp_rank :: info.dp_size]
    # sampled correct, sampled total, greedy correct, greedy total; sampled trajectories that called a tool
    counts = torch.zeros(6, dtype=torch.float64)
    if info.is_mp_leader and mine:
        seed = cfg.training.seed + 17 + info.dp_rank
        for slot, params in ((0, sampling_params(cfg.rollout, run.tokenizer, seed=seed,
                                                 n=cfg.logging.eval_samples_per_prompt)),
                             (2, sampling_params(cfg.rollout, run.tokenizer, seed=seed, n=1, greedy=True))):
            samples = run.rollout_fn(run.engine, mine, params, run.reward, run.tokenizer)
            counts[slot] += sum(s.outcome == "correct" for s in samples)
            counts[slot + 1] += len(samples)
            if slot == 0:
                counts[4] += sum(s.metadata.get("tool_used", 0.0) for s in samples)
                counts[5] += any("tool_used" in s.metadata for s in samples)
    counts = parallel.all_reduce_host(counts)
    out = {"sampled": float(counts[0] / counts[1].clamp(min=1)), "greedy": float(counts[2] / counts[3].clamp(min=1))}
    if counts[5] > 0:  # a rollout function that calls tools (`tool_use`)
        out["tool_call_rate"] = float(counts[4] / counts[1].clamp(min=1))
    return out


def evaluate_between_steps(run: TrainingRun, step: int) -> dict:
    """`--eval-interval`: held-out accuracy after `step`, as metrics.jsonl keys, the GPU handed to the engine for it
    and back. The seeds are those of every evaluation, so the curve compares like with like."""
    probe = enter_rollout(run.actor, run.engine, run.cfg.training, run.sync)  # the probe first (--verify-weight-sync)
    result = evaluate(run, quiet=True)
    enter_training(run.actor, run.engine, keep_weights=True)  # no sync before the next rollout: the weights stay
    run.say(f"step {step}: held-out sampled {100 * result['sampled']:.1f}%, greedy {100 * result['greedy']:.1f}%")
    return {"eval_sampled": result["sampled"], "eval_greedy": result["greedy"], **probe}

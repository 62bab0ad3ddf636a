"""Held-out evaluation: accuracy sampled and greedy through the run's rollout and reward functions, before
training, every `--eval-interval` steps and after."""

from __future__ import annotations

import torch

from megarl.evaluation.generate import EVAL_SEED_OFFSET, accuracy_sums, sample_and_score
from megarl.evaluation.metrics import per_prompt
from megarl.mcore import parallel
from megarl.stages.collect import sampling_params
from megarl.stages.colocation import enter_rollout, enter_training
from megarl.trainer.build import TrainingRun


def evaluate(run: TrainingRun, quiet: bool = False) -> dict:
    """Held-out accuracy, sampled (temperature, `--eval-samples-per-prompt` each) and greedy, through the run's
    rollout function and reward function (`megarl.evaluation.generate`, what `megarl-eval` runs); DP ranks split the
    prompts, each model replica's leader runs its share. The engine must hold the GPU (`enter_rollout`).

    `sampled` is the mean pass@1 and `greedy` the greedy pass@1 (the names metrics.jsonl and eval.json have always
    had); with several samples a prompt, `pass@N` and `maj@N` (N = `--eval-samples-per-prompt`) come too."""
    cfg, info = run.cfg, run.info
    n = cfg.logging.eval_samples_per_prompt
    if not quiet:
        run.say(f"megarl: evaluating on {len(run.eval_prompts)} held-out prompts "
                f"({n} samples each, and greedy)", flush=True)
    mine = run.eval_prompts[info.dp_rank :: info.dp_size]
    # sum of pass@1, prompts, greedy correct, greedy prompts; sampled trajectories that called a tool, whether any
    # recorded it; sums of pass@n and maj@n
    counts = torch.zeros(8, dtype=torch.float64)
    if info.is_mp_leader and mine:
        seed = cfg.training.seed + EVAL_SEED_OFFSET + info.dp_rank
        for slot, params in ((0, sampling_params(cfg.rollout, run.tokenizer, seed=seed, n=n)),
                             (2, sampling_params(cfg.rollout, run.tokenizer, seed=seed, n=1, greedy=True))):
            results = sample_and_score(run.rollout_fn, run.engine, mine, params, run.reward, run.tokenizer)
            counts[slot], counts[slot + 1] = accuracy_sums(results)
            if slot == 0:
                counts[4] += sum(sum(r.tool_used) for r in results)
                counts[5] += any(r.tool_used for r in results)
                counts[6] += per_prompt(results, f"pass@{n}").sum()
                counts[7] += per_prompt(results, f"maj@{n}").sum()
    counts = parallel.all_reduce_host(counts)
    prompts = counts[1].clamp(min=1)
    out = {"sampled": float(counts[0] / prompts), "greedy": float(counts[2] / counts[3].clamp(min=1))}
    if counts[5] > 0:  # a rollout function that calls tools (`tool_use`)
        out["tool_call_rate"] = float(counts[4] / (prompts * n))
    if n > 1:
        out.update({f"pass@{n}": float(counts[6] / prompts), f"maj@{n}": float(counts[7] / prompts)})
    return out


def evaluate_between_steps(run: TrainingRun, step: int) -> dict:
    """`--eval-interval`: held-out accuracy after `step`, as metrics.jsonl keys, the GPU handed to the engine for it
    and back. The seeds are those of every evaluation, so the curve compares like with like."""
    probe = enter_rollout(run.actor, run.engine, run.cfg.training, run.sync)  # the probe first (--verify-weight-sync)
    result = evaluate(run, quiet=True)
    enter_training(run.actor, run.engine, keep_weights=True)  # no sync before the next rollout: the weights stay
    run.say(f"step {step}: held-out sampled {100 * result['sampled']:.1f}%, greedy {100 * result['greedy']:.1f}%")
    return {"eval_sampled": result["sampled"], "eval_greedy": result["greedy"], **probe}

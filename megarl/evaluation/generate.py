"""Held-out prompts through a rollout function and a reward function, into each prompt's verdicts: the one
computation behind the trainer's evaluation (`megarl.trainer.evaluate`) and `megarl-eval` (`megarl.cli.eval`)."""

from __future__ import annotations

import math
from typing import Sequence

from megarl.data import PromptRecord
from megarl.evaluation.metrics import PromptResult, pass_at_k, subset
from megarl.rollout.base import RolloutEngine, SamplingParams

# Added to the run's seed for the sampled evaluation (and DP rank r adds r): the seeds of every evaluation of a run,
# before, between steps and after, so its curve compares like with like; `megarl-eval --seed S` draws as a run of
# seed S does.
EVAL_SEED_OFFSET = 17


def sample_and_score(rollout_fn, engine: RolloutEngine, prompts: Sequence[PromptRecord], params: SamplingParams,
                     reward, tokenizer) -> list[PromptResult]:
    """`params.n` samples of every prompt, in one call of the rollout function (the engine sees one batch, so the
    samples depend on the seed and the prompts only), judged by `reward`; one `PromptResult` per prompt, in order."""
    if not prompts:
        return []
    samples = rollout_fn(engine, prompts, params, reward, tokenizer)
    groups: list[list] = [[] for _ in prompts]
    for s in samples:
        groups[s.group].append(s)
    if any(len(g) != params.n for g in groups):
        raise RuntimeError(f"the rollout function returned {len(samples)} samples for {len(prompts)} prompts x "
                           f"{params.n}: evaluation needs {params.n} per prompt, each with `group` = its prompt's "
                           "index")
    return [PromptResult(subset(p.row_source, p.verifier), tuple(s.outcome == "correct" for s in g),
                         tuple(s.extracted for s in g),
                         tuple(s.metadata["tool_used"] for s in g if "tool_used" in s.metadata))
            for p, g in zip(prompts, groups)]


def accuracy_sums(results: Sequence[PromptResult]) -> tuple[float, int]:
    """(the sum over prompts of pass@1, the number of prompts): summed over data-parallel ranks by the trainer,
    their ratio is the mean pass@1 `megarl-eval` reports (the share of correct samples when every prompt has the
    same number of them)."""
    return math.fsum(pass_at_k(r.n, r.c, 1) for r in results), len(results)

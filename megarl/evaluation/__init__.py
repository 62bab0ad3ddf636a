"""Evaluation of a policy on held-out prompts: pass@k, maj@k and bootstrap confidence intervals by source.

    generate.py   prompts -> samples -> verdicts, through a rollout function and a reward function: what the
                  trainer's evaluation (`megarl.trainer.evaluate`) and `megarl-eval` (`megarl.cli.eval`) both run
    metrics.py    pass@k (Chen et al. 2021), maj@k, the percentile bootstrap over prompts; numpy only

The command, and the datasets it takes by name (`--data humaneval`), are in `megarl/cli/` (eval.py,
eval_datasets.py).
"""

from megarl.evaluation.metrics import PromptResult, by_subset, maj_at_k, pass_at_k, summarize

__all__ = ["PromptResult", "by_subset", "maj_at_k", "pass_at_k", "summarize"]

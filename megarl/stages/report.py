"""What a step reports: its metrics reduced over ranks, one `metrics.jsonl` row.

Held-out evaluation, the final report and the HF export were here; they are the run's, not a step's:
`megarl.trainer.evaluate`, `megarl.trainer.log`, `megarl.trainer.export`. Their old names here are looked up there
(`__getattr__` below) until megarl 0.3."""

from __future__ import annotations

import os

import torch.distributed as dist

from megarl.algorithms import OFF_POLICY_CORRECTIONS
from megarl.mcore.parallel import ParallelInfo
from megarl.reward.hacking import COUNT_KEYS as _HACK_KEYS, RM_LEN_KEYS as _RM_LEN_KEYS, hack_counts, step_rates
from megarl.reward.pool import SANDBOX_KEYS
from megarl.metrics import reduce_over_ranks, reward_throughput
from megarl.samples import RolloutBatch, SampleStatus, TrainBatch
from megarl.verifiers.signals import BENCH_ENV

_SUM_KEYS = ["n_samples", "reward_sum", "correct", "response_tokens", "truncated", "aborted", "groups",
             "uniform_groups",
             "loss_num", "loss_den", "tokens", "clip_frac_sum", "kl_sum", "entropy_sum", "mismatch_abs_sum",
             "mismatch_abs_max", "mismatch_kl_sum", "is_weight_sum", "is_weight_max", "is_weight_negmin_max",
             # mixture of experts (`megarl.mcore.routing.take_metrics`)
             "router_tokens", "router_entropy_sum", "routing_disagree_sum", "routing_replayed_sum",
             "router_imbalance_sum", "router_layers",
             # on-policy distillation's top-K KL (--distill-topk), the student's before the update
             "distill_topk_kl_sum", "distill_topk_tokens"]
_DS_KEYS = ["ds_prompts_drawn", "ds_groups_dropped", "ds_rounds", "ds_groups_filled"]
# reward health (`megarl.reward.pool.batch_health`): counts add up over ranks, latencies take the worst rank
_REWARD_KEYS = ["reward_n_timeout", "reward_n_no_answer", "reward_n_parse_error", "reward_worker_restarts",
                "reward_sandbox_reruns", "reward_latency_p50_max", "reward_latency_p99_max"]
_TOOL_LATENCY_KEYS = ["tool_latency_p50_max", "tool_latency_p99_max"]  # `tool_use`'s, the worst rank's
# reward models (when rows name one): score sums, agreement with the rule, the seconds of the slowest rank
_RM_KEYS = ["rm_n", "rm_score_sum", "rm_score_sqsum", "rm_agree_n", "rm_agree_sum", "rm_seconds_max"]
# sandboxed rows (`megarl.reward.pool.sandbox_throughput`): sums over ranks, over the slowest rank's scoring time
_SANDBOX_KEYS = [*SANDBOX_KEYS, "reward_seconds_max"]
# the reward-hacking signals' own seconds (summed over samples and ranks), and whether they were on: the bench
# switch (`MEGARL_BENCH_SIGNALS=alternate`) turns them off in odd steps, on every rank alike
_SIGNALS_KEYS = ["reward_signals_seconds", "reward_signals_on_max"]


def step_metrics(step: int, rollout: RolloutBatch, batch: TrainBatch, update: dict, timings: dict, seconds: float,
                 info: ParallelInfo) -> dict:
    """Reduce this step's metrics over ranks (rollout metrics from MP leaders, loss metrics from last stages).
    Rewards are the final ones the advantages came from (shaped, KL folded in)."""
    local: dict[str, float] = {}
    correction_keys = _correction_keys()
    meta = _metadata_keys(rollout.samples)
    if info.is_mp_leader:
        rewards = batch.rewards.view(-1, rollout.group_size)
        local.update(
            n_samples=len(rollout.samples), reward_sum=float(rewards.sum()),
            correct=sum(s.outcome == "correct" for s in rollout.samples),
            response_tokens=sum(len(s.response_ids) for s in rollout.samples),
            truncated=sum(s.status is SampleStatus.TRUNCATED for s in rollout.samples),
            aborted=sum(s.status is SampleStatus.ABORTED for s in rollout.samples),
            groups=rewards.shape[0], uniform_groups=int((rewards.max(1).values == rewards.min(1).values).sum()),
            **{k: rollout.metrics.get(k, 0.0) for k in _DS_KEYS},
            **{k: rollout.metrics.get(k.removesuffix("_max"), 0.0)
               for k in _REWARD_KEYS + _TOOL_LATENCY_KEYS + _RM_KEYS},
            **{k: rollout.metrics.get(k, 0.0) for k in SANDBOX_KEYS}, reward_seconds_max=rollout.reward_seconds,
            **{f"sample_{k}": sum(float(s.metadata.get(k, 0.0)) for s in rollout.samples) for k in meta},
            **hack_counts(rollout.samples), **{k: rollout.metrics.get(k, 0.0) for k in _RM_LEN_KEYS},
            reward_signals_seconds=rollout.metrics.get("reward_signals_seconds", 0.0),
            reward_signals_on_max=rollout.metrics.get("reward_signals_on", 1.0),
        )
    if info.is_last_stage and info.tp_rank == 0 and info.cp_rank == 0:  # CP ranks hold the same whole-sequence sums
        local.update({k: update.get(k, 0.0) for k in _SUM_KEYS + correction_keys if k in update})
    g = reduce_over_ranks(local, _SUM_KEYS + correction_keys + _DS_KEYS + _REWARD_KEYS + _TOOL_LATENCY_KEYS +
                          _RM_KEYS + _SANDBOX_KEYS + _HACK_KEYS + _RM_LEN_KEYS + _SIGNALS_KEYS +
                          [f"sample_{k}" for k in meta])
    n, tok = max(g["n_samples"], 1), max(g["tokens"], 1)
    return {
        "step": step,
        "reward_mean": g["reward_sum"] / n, "accuracy": g["correct"] / n,
        "response_len": g["response_tokens"] / n, "truncated_frac": g["truncated"] / n,
        "aborted_frac": g["aborted"] / n,
        "uniform_group_frac": g["uniform_groups"] / max(g["groups"], 1),
        "reward_timeout_rate": g["reward_n_timeout"] / n, "reward_no_answer_rate": g["reward_n_no_answer"] / n,
        "reward_parse_error_rate": g["reward_n_parse_error"] / n, "reward_worker_restarts": g["reward_worker_restarts"],
        "reward_sandbox_reruns": g["reward_sandbox_reruns"],
        "reward_latency_p50": g["reward_latency_p50_max"], "reward_latency_p99": g["reward_latency_p99_max"],
        "loss": g["loss_num"] / max(g["loss_den"], 1e-12), "kl": g["kl_sum"] / tok,
        "clip_frac": g["clip_frac_sum"] / tok, "grad_norm": update["grad_norm"], "lr": update["lr"],
        "entropy": g["entropy_sum"] / tok,
        "rollout_actor_logp_absdiff_mean": g["mismatch_abs_sum"] / tok,
        "rollout_actor_logp_absdiff_max": g["mismatch_abs_max"],
        "rollout_actor_kl": g["mismatch_kl_sum"] / tok,
        "is_weight_mean": g["is_weight_sum"] / tok, "is_weight_max": g["is_weight_max"],
        "is_weight_min": -g["is_weight_negmin_max"],
        **_correction_metrics(g),
        **({"router_entropy": g["router_entropy_sum"] / g["router_tokens"],
            "router_load_imbalance": g["router_imbalance_sum"] / max(g["router_layers"], 1),
            "routing_topk_disagree_frac": g["routing_disagree_sum"] / g["router_tokens"],
            "routing_replayed_frac": g["routing_replayed_sum"] / g["router_tokens"]}
           if g["router_tokens"] > 0 else {}),
        **({"distill/topk_kl": g["distill_topk_kl_sum"] / g["distill_topk_tokens"]}
           if g["distill_topk_tokens"] > 0 else {}),
        **_rm_metrics(g),
        "n_samples": g["n_samples"], **step_rates(g, g["n_samples"]),  # reward hacking (`megarl.reward.hacking`)
        "reward_signals_s": g["reward_signals_seconds"],
        **({"reward_signals_on": g["reward_signals_on_max"]} if os.environ.get(BENCH_ENV) else {}),
        **reward_throughput(*(g[k] for k in _SANDBOX_KEYS)),
        **({"ds_prompts_drawn": g["ds_prompts_drawn"], "ds_groups_dropped": g["ds_groups_dropped"],
            "ds_rounds": g["ds_rounds"] / info.dp_size,
            "ds_groups_filled": g["ds_groups_filled"]} if g["ds_rounds"] > 0 else {}),
        **{f"sample_{k}": g[f"sample_{k}"] / n for k in meta},  # per-sample numbers of the rollout function
        **(_tool_metrics(g) if "sample_tool_calls" in g else {}),
        "step_seconds": seconds, "tokens_per_second": g["response_tokens"] / max(seconds, 1e-9),
        **timings,
    }


def _tool_metrics(g: dict) -> dict:
    """`tool_use`'s step metrics from its per-sample numbers (sums over ranks) and latencies (worst rank)."""
    calls = max(g["sample_tool_calls"], 1)
    return {"tool_call_rate": g["sample_tool_used"] / max(g["n_samples"], 1),
            "tool_error_rate": g["sample_tool_errors"] / calls, "tool_timeout_rate": g["sample_tool_timeouts"] / calls,
            "tool_output_frac": g["sample_tool_tokens"] / max(g["response_tokens"], 1),
            "tool_latency_p50": g["tool_latency_p50_max"], "tool_latency_p99": g["tool_latency_p99_max"]}


def _correction_keys() -> list[str]:
    """The sums of every registered off-policy correction's weights (`megarl.stages.update`), a plugin's included:
    every rank reduces the same keys, whichever correction runs."""
    return [f"{c}_{k}" for c in OFF_POLICY_CORRECTIONS.names() if c != "none"
            for k in ("tokens", "weight_sum", "weight_max", "clip_sum", "masked_sum")]


def _correction_metrics(g: dict) -> dict:
    """The running correction's weights over the step's tokens: `<name>_weight_mean`, `_weight_max`, `_clip_frac`
    (truncated) and `_masked_frac` (dropped)."""
    out = {}
    for c in OFF_POLICY_CORRECTIONS.names():
        if (tok := g.get(f"{c}_tokens", 0.0)) > 0:
            out.update({f"{c}_weight_mean": g[f"{c}_weight_sum"] / tok, f"{c}_weight_max": g[f"{c}_weight_max"],
                        f"{c}_clip_frac": g[f"{c}_clip_sum"] / tok, f"{c}_masked_frac": g[f"{c}_masked_sum"] / tok})
    return out


def _rm_metrics(g: dict) -> dict:
    """Reward-model health, when a reward model scored rows this step: its score mean and std, the share of rows
    where its verdict matched the rule verifier's (when rows had both), and its seconds (slowest rank)."""
    if g["rm_n"] <= 0:
        return {}
    mean = g["rm_score_sum"] / g["rm_n"]
    out = {"rm_score_mean": mean, "rm_score_std": max(g["rm_score_sqsum"] / g["rm_n"] - mean * mean, 0.0) ** 0.5,
           "rm_seconds": g["rm_seconds_max"]}
    if g["rm_agree_n"] > 0:
        out["rm_agreement"] = g["rm_agree_sum"] / g["rm_agree_n"]
    return out


def _metadata_keys(samples) -> list[str]:
    """The names in any sample's metadata on any rank (every rank must reduce the same keys)."""
    mine = sorted({k for s in samples for k in s.metadata})
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return sorted({k for keys in everyone for k in keys})


_MOVED = {"evaluate": "megarl.trainer.evaluate", "evaluate_between_steps": "megarl.trainer.evaluate",
          "save_hf": "megarl.trainer.export", "finish": "megarl.trainer.log", "peak_rss_mib": "megarl.trainer.log",
          "_report": "megarl.trainer.log"}


def __getattr__(name: str):
    """The run's reporting, moved to `megarl.trainer` (see the module docstring); these names go in megarl 0.3."""
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'megarl.stages.report' has no attribute {name!r}")

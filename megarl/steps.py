"""The named steps of `train.py`'s loop, and the plumbing between ranks that they need."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.algorithms import aggregate, get_advantage_fn, grpo_token_loss
from megarl.config import Config
from megarl.data import PromptRecord, PromptSampler
from megarl.mcore import parallel
from megarl.mcore.actor import MegatronPolicy, OptimConfig
from megarl.mcore.parallel import ParallelInfo
from megarl.rollout.base import SamplingParams
from megarl.samples import RolloutBatch, generate, score, to_train_batch

# -- set-up ----------------------------------------------------------------------------------------------------


def optim_config(t) -> OptimConfig:
    return OptimConfig(lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
                       adam_beta2=t.adam_beta2, clip_grad=t.clip_grad, lr_warmup_steps=t.lr_warmup_steps,
                       lr_decay_steps=t.num_steps * t.updates_per_rollout, lr_decay_style=t.lr_decay_style,
                       use_distributed_optimizer=t.use_distributed_optimizer)


def use_te(impl: str) -> bool | None:
    return {"auto": None, "local": False, "transformer_engine": True}[impl]


def build_engine(hf_dir: str, device: str):
    from megarl.rollout.builtin import BuiltinEngine

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # Weights come from the actor right after, through the same path as every later sync.
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    return BuiltinEngine(config, device=device)


def sync_weights(actor: MegatronPolicy, engine, version: int) -> None:
    """Gather the actor's TP/PP shards into HF-named tensors on the model-parallel leader, push to its engine."""
    named = actor.export_hf()
    if engine is not None:
        engine.update_weights(named, version=version)


def agree_any(flag: bool) -> bool:
    """True on every rank if it is true on any (so all ranks take the same branch)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _broadcast_in_mp_group(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=parallel.mp_leader_global_rank(), group=parallel.mp_group())
    return box[0]


# -- generate and reward -----------------------------------------------------------------------------------------


def prompts_for_rank(sampler: PromptSampler, prompts: list[PromptRecord], global_batch: int,
                     info: ParallelInfo) -> list[PromptRecord]:
    """Every rank draws the same global batch (keeping the sampler in step); each DP rank takes its slice."""
    indices = sampler.next_indices(global_batch)
    per_rank = global_batch // info.dp_size
    return [prompts[i] for i in indices[info.dp_rank * per_rank : (info.dp_rank + 1) * per_rank]]


def sampling_params(cfg: Config, tokenizer, *, seed: int, n: int | None = None, greedy: bool = False) -> SamplingParams:
    r = cfg.rollout
    eos = tokenizer.eos_token_id
    return SamplingParams(
        n=n or r.n_samples_per_prompt, temperature=0.0 if greedy else r.rollout_temperature, top_p=r.rollout_top_p,
        top_k=r.rollout_top_k, max_new_tokens=r.max_response_len,
        stop_token_ids=tuple([eos] if isinstance(eos, int) else (eos or ())), seed=seed,
    )


def _rollout_seed(cfg: Config, step: int, dp_rank: int) -> int:
    return (cfg.training.seed * 1_000_003 + step * 1_009 + dp_rank) % (2**31)


def generate_and_score(engine, batch_prompts, tokenizer, cfg: Config, step: int, info: ParallelInfo) -> RolloutBatch:
    """The leader of each model-parallel group generates and scores; the group's other ranks receive the result."""
    rollout = None
    if info.is_mp_leader:
        rollout = generate(engine, batch_prompts, sampling_params(cfg, tokenizer, seed=_rollout_seed(cfg, step, info.dp_rank)))
        score(rollout, batch_prompts, tokenizer)
    if info.tp_size * info.pp_size > 1:
        rollout = _broadcast_in_mp_group(rollout)
    return rollout


def compute_advantages(rollout: RolloutBatch, algorithm) -> None:
    fn = get_advantage_fn(algorithm.advantage_estimator)
    advantages = fn(rollout.rewards(), eps=algorithm.advantage_eps).flatten().tolist()
    for s, adv in zip(rollout.samples, advantages):
        s.advantage = adv


def make_train_batch(rollout: RolloutBatch, tokenizer) -> dict[str, torch.Tensor]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return to_train_batch(rollout.samples, pad_id=pad)


# -- log-probs and update --------------------------------------------------------------------------------------


def add_logprobs(batch: dict, actor: MegatronPolicy, reference: MegatronPolicy | None, cfg: Config) -> None:
    """Reference log-probs when a KL term is on; the actor's pre-update ("old") log-probs when the rollout batch
    is used for more than one optimizer step. With a single step the old log-probs equal the current ones
    (ratio 1, as in TRL), so computing them again would be a wasted forward pass."""
    kw = dict(micro_batch_size=cfg.training.micro_batch_size, temperature=cfg.rollout.rollout_temperature)
    if reference is not None:
        ref = reference.logprobs(batch["tokens"], **kw)
        if ref is not None:
            batch["ref_logp"] = ref
    if cfg.training.updates_per_rollout > 1:
        old = actor.logprobs(batch["tokens"], **kw)
        if old is not None:
            batch["old_logp"] = old


def make_loss_fn(cfg: Config):
    a = cfg.algorithm

    def loss_fn(logp: torch.Tensor, mb: dict):
        n = mb["_real_rows"]
        logp, mask = logp[:n], mb["loss_mask"][:n]
        old = mb["old_logp"][:n] if "old_logp" in mb else logp.detach()
        ref = mb["ref_logp"][:n] if "ref_logp" in mb else None
        per_token, m = grpo_token_loss(logp, old, ref, mb["advantages"][:n], mask, a.eps_clip, a.eps_clip_high,
                                       a.kl_coef, a.kl_estimator, a.policy_loss)
        num, den = aggregate(per_token, mask, a.loss_aggregation)
        tokens = mask.sum()
        with torch.no_grad():
            # Train/rollout mismatch: the engine's log-probs against the actor's, on the same tokens.
            diff = (logp.detach() - mb["rollout_logp"][:n]).abs() * mask
        metrics = {
            "loss_num": num.detach(), "loss_den": den.detach(), "tokens": tokens,
            "clip_frac_sum": m["clip_frac"] * tokens, "kl_sum": m.get("kl_mean", 0.0) * tokens,
            "mismatch_abs_sum": diff.sum(), "mismatch_abs_max": diff.max() if n else torch.tensor(0.0),
        }
        return num, den, metrics

    return loss_fn


def update(actor: MegatronPolicy, batch: dict, cfg: Config) -> dict[str, float]:
    """`updates_per_rollout` optimizer steps over consecutive slices of this rank's batch."""
    k = cfg.training.updates_per_rollout
    rows = batch["tokens"].shape[0]
    if rows % k:
        raise ValueError(f"{rows} samples per rank cannot be split into --updates-per-rollout {k} mini-batches")
    size = rows // k
    totals: dict[str, float] = {}
    loss_fn = make_loss_fn(cfg)
    for i in range(k):
        mini = {key: v[i * size : (i + 1) * size] for key, v in batch.items()}
        out = actor.train_step(mini, loss_fn, micro_batch_size=cfg.training.micro_batch_size,
                               temperature=cfg.rollout.rollout_temperature)
        for key, v in out.items():
            totals[key] = max(totals.get(key, v), v) if key.endswith("_max") else totals.get(key, 0.0) + v
    totals["grad_norm"] /= k
    totals["lr"] = out["lr"]
    return totals


# -- metrics ----------------------------------------------------------------------------------------------------

_SUM_KEYS = ["n_samples", "reward_sum", "correct", "response_tokens", "truncated", "groups", "uniform_groups",
             "loss_num", "loss_den", "tokens", "clip_frac_sum", "kl_sum", "mismatch_abs_sum", "mismatch_abs_max"]


def step_metrics(step: int, rollout: RolloutBatch, update: dict, timings: dict, seconds: float,
                 info: ParallelInfo) -> dict:
    """Reduce this step's metrics over ranks (rollout metrics from MP leaders, loss metrics from last stages)."""
    local: dict[str, float] = {}
    if info.is_mp_leader:
        rewards = rollout.rewards()
        local.update(
            n_samples=len(rollout.samples), reward_sum=float(rewards.sum()),
            correct=sum(s.outcome == "correct" for s in rollout.samples),
            response_tokens=sum(len(s.response_ids) for s in rollout.samples),
            truncated=sum(s.finish_reason == "length" for s in rollout.samples),
            groups=rewards.shape[0], uniform_groups=int((rewards.max(1).values == rewards.min(1).values).sum()),
        )
    if info.is_last_stage and info.tp_rank == 0:
        local.update({k: update.get(k, 0.0) for k in _SUM_KEYS if k in update})
    g = parallel_reduce(local)
    n, tok = max(g["n_samples"], 1), max(g["tokens"], 1)
    return {
        "step": step,
        "reward_mean": g["reward_sum"] / n, "accuracy": g["correct"] / n,
        "response_len": g["response_tokens"] / n, "truncated_frac": g["truncated"] / n,
        "uniform_group_frac": g["uniform_groups"] / max(g["groups"], 1),
        "loss": g["loss_num"] / max(g["loss_den"], 1e-12), "kl": g["kl_sum"] / tok,
        "clip_frac": g["clip_frac_sum"] / tok, "grad_norm": update["grad_norm"], "lr": update["lr"],
        "rollout_actor_logp_absdiff_mean": g["mismatch_abs_sum"] / tok,
        "rollout_actor_logp_absdiff_max": g["mismatch_abs_max"],
        "step_seconds": seconds, "tokens_per_second": g["response_tokens"] / max(seconds, 1e-9),
        **timings,
    }


def parallel_reduce(local: dict[str, float]) -> dict[str, float]:
    from megarl.metrics import reduce_over_ranks

    return reduce_over_ranks(local, _SUM_KEYS)


def peak_rss_mib(info: ParallelInfo) -> float:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = torch.tensor([kib / 1024.0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


# -- evaluation, export, report ---------------------------------------------------------------------------------


def evaluate(engine, eval_prompts: list[PromptRecord], tokenizer, cfg: Config, info: ParallelInfo) -> dict:
    """Held-out accuracy, sampled (temperature, `eval_samples_per_prompt` each) and greedy; DP ranks split the
    prompts, each model-parallel leader runs its share."""
    mine = eval_prompts[info.dp_rank :: info.dp_size]
    counts = torch.zeros(4, dtype=torch.float64)  # sampled correct, sampled total, greedy correct, greedy total
    if info.is_mp_leader and mine:
        seed = cfg.training.seed + 17 + info.dp_rank
        for slot, params in ((0, sampling_params(cfg, tokenizer, seed=seed, n=cfg.logging.eval_samples_per_prompt)),
                             (2, sampling_params(cfg, tokenizer, seed=seed, n=1, greedy=True))):
            batch = generate(engine, mine, params)
            score(batch, mine, tokenizer)
            counts[slot] += sum(s.outcome == "correct" for s in batch.samples)
            counts[slot + 1] += len(batch.samples)
    dist.all_reduce(counts)
    return {"sampled": float(counts[0] / counts[1].clamp(min=1)), "greedy": float(counts[2] / counts[3].clamp(min=1))}


def save_hf(actor: MegatronPolicy, engine, tokenizer, src_dir: str, out_dir: str, info: ParallelInfo) -> None:
    """Export the actor as an ordinary HF checkpoint directory (config and tokenizer copied from the source)."""
    import shutil

    from safetensors.torch import save_file

    named = actor.export_hf()
    if info.rank == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in named}, str(out / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(Path(src_dir) / "config.json", out / "config.json")
        tokenizer.save_pretrained(str(out))
    dist.barrier()


def report(say, log, before: dict | None, after: dict, minutes: float, steps: int, n_prompts: int, cfg: Config) -> None:
    from megarl.metrics import plot_rewards

    result = {"after": after, "before": before, "train_minutes": minutes, "steps": steps, "eval_prompts": n_prompts}
    say("")
    say(f"held-out accuracy on {n_prompts} prompts never trained on ({steps} steps, {minutes:.1f} min of training):")
    say(f"  {'':<30}{'before':>8}{'after':>8}")
    sampled = f"sampled (temp {cfg.rollout.rollout_temperature:g}, {cfg.logging.eval_samples_per_prompt}/prompt)"
    for key, label in (("sampled", sampled), ("greedy", "greedy")):
        b = f"{100 * before[key]:7.1f}%" if before else "      -"
        say(f"  {label:<30}{b}{100 * after[key]:7.1f}%")
    if log.enabled:
        (log.dir / "eval.json").write_text(json.dumps(result, indent=2))
        rows = log.all_rows()
        if rows:
            png = plot_rewards(rows, log.dir / "reward_curve.png",
                               {"before": before["sampled"], "after": after["sampled"]} if before else None)
            say(f"reward curve: {png}")
    if before:
        say(f"held-out accuracy (sampled): before {100 * before['sampled']:.1f}% -> after {100 * after['sampled']:.1f}%")

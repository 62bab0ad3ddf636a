"""The named steps of `train.py`'s loop, and the plumbing between ranks that they need."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.algorithms import aggregate, get_advantage_fn, get_kl_fn, grpo_token_loss
from megarl.config import Config
from megarl.data import PromptRecord, PromptSampler
from megarl.mcore import parallel
from megarl.mcore.actor import MegatronPolicy, OptimConfig
from megarl.mcore.parallel import ParallelInfo
from megarl.rollout.base import SamplingParams
from megarl.samples import RolloutBatch, Sample, generate, score, to_train_batch
from megarl.verifiers.pool import shared_pool

# -- set-up ----------------------------------------------------------------------------------------------------


def optim_config(t) -> OptimConfig:
    return OptimConfig(lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
                       adam_beta2=t.adam_beta2, clip_grad=t.clip_grad, lr_warmup_steps=t.lr_warmup_steps,
                       lr_decay_steps=t.num_steps * t.updates_per_rollout, lr_decay_style=t.lr_decay_style,
                       use_distributed_optimizer=t.use_distributed_optimizer)


def use_te(impl: str) -> bool | None:
    return {"auto": None, "local": False, "transformer_engine": True}[impl]


def build_engine(hf_dir: str, device: str, cfg: Config | None = None, actor: MegatronPolicy | None = None):
    """This model-parallel leader's rollout engine: the built-in one, an in-process SGLang engine colocated on
    this rank's GPUs, a client of SGLang servers on other nodes (`--rollout-servers`), or Megatron's dynamic
    engine over `actor`'s own model (`--rollout-backend megatron`)."""
    import os

    if cfg is not None and cfg.rollout.rollout_backend == "megatron":
        from megarl.rollout.mcore_engine import MegatronEngine

        return MegatronEngine.for_actor(actor, max_sequence_length=actor.shape.max_position_embeddings,
                                        seed=cfg.training.seed)
    if cfg is not None and cfg.rollout.rollout_backend == "sglang":
        from megarl.rollout.sglang_engine import SGLangEngine, SGLangServers

        r = cfg.rollout
        if r.rollout_servers:
            pusher = dist.get_rank() == 0  # every DP leader generates; one rank pushes weights for all
            urls = r.rollout_servers.split(",")
            # The servers' TP size (launch/slurm/disaggregated.sbatch passes --sglang-tp-size); 0 = ask each server.
            # It sizes the weight-update group: one trainer rank plus every server's TP ranks.
            servers = SGLangServers(urls, tp_sizes=[r.sglang_tp_size] * len(urls) if r.sglang_tp_size else None,
                                    push=pusher)
            if pusher:
                servers.connect(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                int(os.environ.get("MEGARL_WEIGHT_SYNC_PORT", int(os.environ.get("MASTER_PORT", 29500)) + 17)),
                                backend=parallel.default_backend())
            return servers
        return SGLangEngine.launch(hf_dir, tp_size=r.sglang_tp_size or cfg.model.tensor_model_parallel_size,
                                   base_gpu_id=torch.cuda.current_device(), mem_fraction=r.sglang_mem_fraction,
                                   dtype="bfloat16" if cfg.model.bf16 else "auto", seed=cfg.training.seed)
    from megarl.rollout.builtin import BuiltinEngine

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if cfg is not None and cfg.model.bf16 else torch.float32  # CPUs with bf16 units too
    # Weights come from the actor right after, through the same path as every later sync.
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    return BuiltinEngine(config, device=device, dtype=dtype)


# The colocation cycle, one step: enter_rollout -> generate -> enter_training -> train -> sync_weights.


def enter_rollout(actor: MegatronPolicy, engine, cfg: Config) -> None:
    """Hand the GPU to the engine: offload the actor (per --offload-optimizer / --offload-params), then the engine
    re-acquires its KV cache and flushes prefixes cached under the old weights."""
    t = cfg.training
    if t.offload_optimizer or t.offload_params:
        actor.offload(params=t.offload_params, optimizer=t.offload_optimizer)
    if engine is not None:
        engine.resume_memory()


def enter_training(actor: MegatronPolicy, engine, cfg: Config) -> None:
    """Hand the GPU to the actor: the engine releases its KV cache and weights, the actor takes back what it offloaded."""
    if engine is not None:
        engine.release_memory()
    actor.onload()


def sync_weights(actor: MegatronPolicy, engine, version: int, cfg: Config | None = None) -> dict[str, float]:
    """Gather the actor's TP/PP shards into HF-named tensors on the model-parallel leader and push them to its
    engine in buckets (the engine first resumes its weights' memory); with --verify-weight-sync, compare
    log-probs on a probe sequence. Returns the sync's metrics on the leader ({} elsewhere)."""
    from megarl.rollout import weight_sync

    bucket_bytes = cfg.rollout.sync_bucket_mb << 20 if cfg is not None else weight_sync.DEFAULT_BUCKET_BYTES
    if cfg is not None and cfg.rollout.rollout_backend == "megatron":  # the engine runs the actor's own weights
        metrics = weight_sync.stamp(engine, version).metrics() if engine is not None else {}
    else:
        named = actor.export_hf()
        metrics = weight_sync.push(engine, named, version, bucket_bytes).metrics() if engine is not None else {}
        del named
    if cfg is not None and cfg.rollout.verify_weight_sync:
        metrics.update(verify_sync(actor, engine, version, cfg.rollout.verify_sync_tolerance))
    return metrics


def verify_sync(actor: MegatronPolicy, engine, version: int, tolerance: float) -> dict[str, float]:
    """The actor's and the engine's log-probs on one probe sequence must agree (all model-parallel ranks call
    this: the actor's forward is collective). Raises `WeightSyncError` on a mismatch."""
    from megarl.rollout import weight_sync

    probe = weight_sync.probe_sequence(actor.shape.vocab_size, seed=version)
    logp = actor.logprobs(torch.tensor([probe], device=parallel.device()), micro_batch_size=1, temperature=1.0)
    gathered = [None] * dist.get_world_size(parallel.mp_group())
    dist.all_gather_object(gathered, None if logp is None else logp.cpu(), group=parallel.mp_group())
    if engine is None:
        return {}
    engine.resume_memory()  # scoring needs the KV cache
    actor_logp = next(g for g in gathered if g is not None)[0]
    engine_logp = torch.tensor(engine.score([probe], [1], temperature=1.0)[0])
    return weight_sync.check_probe(actor_logp, engine_logp, tolerance)


def close_engine(engine) -> None:
    if engine is not None and hasattr(engine, "shutdown"):
        engine.shutdown()


def agree_any(flag: bool) -> bool:
    """True on every rank if it is true on any (so all ranks take the same branch)."""
    t = parallel.all_reduce_host(torch.tensor([1 if flag else 0], dtype=torch.int32), op=dist.ReduceOp.MAX)
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
        score(rollout, batch_prompts, tokenizer, pool=shared_pool(cfg.data.reward_workers, cfg.data.reward_timeout))
    if info.replica_size > 1:
        rollout = _broadcast_in_mp_group(rollout)
    return rollout


def collect_rollout(engine, sampler: PromptSampler, prompts: list[PromptRecord], tokenizer, cfg: Config, step: int,
                    info: ParallelInfo, buffer: list[list[Sample]]) -> RolloutBatch:
    """Generate and score this rank's share of the step's prompts.

    With `--dynamic-sampling` (DAPO), groups whose verifier *outcomes* are all equal (all correct, all wrong)
    carry no signal and are dropped; more prompts are drawn and generated until every rank has its share, for up
    to `--max-sampling-rounds` rounds. Shaped rewards never decide what is dropped: only outcomes do. If the rounds
    run out, dropped groups fill the gap (their advantages are 0) so every rank trains on the same number of
    samples. Groups beyond the share wait in `buffer` (this rank's; checkpointed) for the next step. All ranks
    draw every round, so the prompt sampler stays in step across ranks. Reports `ds_*` metrics in
    `rollout.metrics`: prompts drawn, groups dropped, rounds, groups filled from the dropped ones.
    """
    a = cfg.algorithm
    if not a.dynamic_sampling:
        batch_prompts = prompts_for_rank(sampler, prompts, cfg.data.rollout_batch_size, info)
        return generate_and_score(engine, batch_prompts, tokenizer, cfg, step, info)
    share = cfg.data.rollout_batch_size // info.dp_size
    kept: list[list[Sample]] = [buffer.pop(0) for _ in range(min(share, len(buffer)))]
    dropped: list[list[Sample]] = []
    first: RolloutBatch | None = None
    gen_s = reward_s = 0.0
    drawn = rounds = 0
    while rounds < a.max_sampling_rounds and agree_any(len(kept) < share):
        batch_prompts = prompts_for_rank(sampler, prompts, cfg.data.rollout_batch_size, info)
        rounds += 1
        if len(kept) >= share:
            continue  # this rank is full; it drew only to keep the sampler in step with the others
        drawn += len(batch_prompts)
        rb = generate_and_score(engine, batch_prompts, tokenizer, cfg, step + 7_919_000 * (rounds - 1), info)
        first = first or rb
        gen_s, reward_s = gen_s + rb.generate_seconds, reward_s + rb.reward_seconds
        for group in _groups(rb):
            (dropped if len({smp.outcome for smp in group}) == 1 else kept).append(group)
    filled = max(0, share - len(kept))
    kept += dropped[:filled]
    buffer.extend(kept[share:])
    del buffer[: max(0, len(buffer) - share)]  # keep the freshest groups, at most one step's worth
    samples = []
    for g, group in enumerate(kept[:share]):
        for smp in group:
            smp.group = g
            samples.append(smp)
    out = RolloutBatch(samples, cfg.rollout.n_samples_per_prompt, generate_seconds=gen_s, reward_seconds=reward_s,
                       metrics=dict(first.metrics) if first is not None else {})
    out.metrics.update(ds_prompts_drawn=float(drawn), ds_groups_dropped=float(len(dropped)), ds_rounds=float(rounds),
                       ds_groups_filled=float(filled))
    return out


def _groups(rollout: RolloutBatch) -> list[list[Sample]]:
    n = rollout.group_size
    return [rollout.samples[i : i + n] for i in range(0, len(rollout.samples), n)]


def shape_rewards(rollout: RolloutBatch, cfg: Config) -> None:
    """DAPO's overlong reward shaping (soft punishment): with L the response length, Lmax the maximum and B the
    buffer, the reward gets  0 for L <= Lmax - B,  -penalty * (L - (Lmax - B)) / B  for Lmax - B < L <= Lmax.
    Applied after scoring and dynamic sampling, so shaping never decides which groups are dropped."""
    a, lmax = cfg.algorithm, cfg.rollout.max_response_len
    if a.overlong_buffer_len <= 0:
        return
    start = lmax - a.overlong_buffer_len
    for smp in rollout.samples:
        over = len(smp.response_ids) - start
        if over > 0:
            smp.reward -= a.overlong_penalty * min(over, a.overlong_buffer_len) / a.overlong_buffer_len


def fold_kl_into_rewards(rollout: RolloutBatch, batch: dict, cfg: Config, info: ParallelInfo) -> None:
    """`--kl-in-reward`: r_i -= kl_coef * sum_t kl_t, the KL of each response to the reference summed over its
    tokens (estimator `--kl-estimator`, on the rollout's own log-probs, the policy that sampled it). The reference
    log-probs live on the last pipeline stage; the per-response sums are broadcast to the other stages."""
    a = cfg.algorithm
    if not (a.kl_in_reward and a.kl_coef > 0):
        return
    kl = torch.zeros(len(rollout.samples), dtype=torch.float64)
    if "ref_logp" in batch:
        mask = batch["loss_mask"].bool()
        zero = torch.zeros_like(batch["rollout_logp"])
        per_token = get_kl_fn(a.kl_estimator)(torch.where(mask, batch["rollout_logp"], zero),
                                              torch.where(mask, batch["ref_logp"].to(zero.dtype), zero))
        kl = torch.where(mask, per_token, zero).sum(dim=-1).double()
    if info.pp_size > 1:
        from megatron.core import parallel_state as ps

        kl = kl.to(parallel.device())
        dist.broadcast(kl, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
        kl = kl.cpu()
    for smp, k in zip(rollout.samples, kl.tolist()):
        smp.reward -= a.kl_coef * k
    rollout.metrics["kl_reward_penalty_mean"] = a.kl_coef * float(kl.mean()) if len(kl) else 0.0


def compute_advantages(rollout: RolloutBatch, algorithm, batch: dict | None = None) -> None:
    """Advantages from the (shaped) rewards through the registry; written to the samples and, when given, to the
    training batch (`batch["advantages"]`)."""
    fn = get_advantage_fn(algorithm.advantage_estimator)
    advantages = fn(rollout.rewards(), eps=algorithm.advantage_eps).flatten()
    for s, adv in zip(rollout.samples, advantages.tolist()):
        s.advantage = adv
    if batch is not None:
        batch["advantages"] = advantages.to(torch.float32)


def make_train_batch(rollout: RolloutBatch, tokenizer, mask_truncated: bool = False) -> dict[str, torch.Tensor]:
    """The actor's batch; with `mask_truncated` (DAPO) responses cut at the length limit are left out of the loss."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = to_train_batch(rollout.samples, pad_id=pad)
    batch["lengths"] = torch.tensor([len(s.prompt_ids) + len(s.response_ids) for s in rollout.samples])
    if mask_truncated:
        cut = torch.tensor([s.finish_reason == "length" for s in rollout.samples])
        batch["loss_mask"] = batch["loss_mask"] * (~cut).unsqueeze(1).float()
    return batch


# -- log-probs and update --------------------------------------------------------------------------------------


def add_logprobs(batch: dict, actor: MegatronPolicy, reference: MegatronPolicy | None, cfg: Config) -> None:
    """Reference log-probs when a KL term is on; the actor's pre-update ("old") log-probs when the rollout batch
    is used for more than one optimizer step. With a single step the old log-probs equal the current ones
    (ratio 1, as in TRL), so computing them again would be a wasted forward pass."""
    kw = dict(micro_batch_size=cfg.training.micro_batch_size, temperature=cfg.rollout.rollout_temperature,
              lengths=batch.get("lengths"), max_tokens_per_micro_batch=cfg.training.max_tokens_per_micro_batch)
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
    kl_coef = 0.0 if a.kl_in_reward else a.kl_coef  # folded into the reward instead (see `fold_kl_into_rewards`)

    def loss_fn(logp: torch.Tensor, mb: dict):
        n = mb["_real_rows"]
        logp, mask = logp[:n], mb["loss_mask"][:n]
        old = mb["old_logp"][:n] if "old_logp" in mb else logp.detach()
        ref = mb["ref_logp"][:n] if "ref_logp" in mb else None
        rollout_logp = mb["rollout_logp"][:n]
        entropy = mb["entropy"][:n] if "entropy" in mb else None
        per_token, m = grpo_token_loss(
            logp, old, ref, mb["advantages"][:n], mask, a.eps_clip, a.eps_clip_high, kl_coef, a.kl_estimator,
            a.policy_loss, rollout_logp=rollout_logp, tis_cap=a.tis_cap, entropy=entropy, entropy_coef=a.entropy_coef,
            clip_ratio_c=a.clip_ratio_c,
        )
        num, den = aggregate(per_token, mask, a.loss_aggregation, max_len=cfg.rollout.max_response_len)
        tokens = mask.sum()
        metrics = {
            "loss_num": num.detach(), "loss_den": den.detach(), "tokens": tokens,
            "clip_frac_sum": m["clip_frac"] * tokens, "kl_sum": m.get("kl_mean", 0.0) * tokens,
            "entropy_sum": m.get("entropy_mean", 0.0) * tokens,
            **mismatch_metrics(logp.detach(), rollout_logp, mask),
        }
        if a.tis_cap > 0:
            metrics["tis_weight_sum"] = m["tis_weight_mean"] * tokens
            metrics["tis_clip_sum"] = m["tis_clip_frac"] * tokens
        return num, den, metrics

    loss_fn.needs_entropy = True  # reported every step; differentiated only when there is an entropy bonus
    loss_fn.entropy_grad = a.entropy_coef != 0
    return loss_fn


def mismatch_metrics(actor_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    """Train/rollout mismatch on the sampled tokens, as sums over masked tokens (divided by the token count once
    all ranks are summed): |actor - rollout| (mean and max), KL(rollout || actor) by the k3 estimator (samples come
    from the rollout engine), and the importance weight exp(actor - rollout) (mean, max, min)."""
    m = mask.bool()
    if not m.any():
        return {"mismatch_abs_sum": 0.0, "mismatch_abs_max": 0.0, "mismatch_kl_sum": 0.0, "is_weight_sum": 0.0}
    d = (actor_logp - rollout_logp)[m]
    w = torch.exp(d)
    return {
        "mismatch_abs_sum": d.abs().sum(), "mismatch_abs_max": d.abs().max(),
        "mismatch_kl_sum": (w - d - 1).sum(), "is_weight_sum": w.sum(), "is_weight_max": w.max(),
        "is_weight_negmin_max": (-w).max(),
    }


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
                               temperature=cfg.rollout.rollout_temperature,
                               max_tokens_per_micro_batch=cfg.training.max_tokens_per_micro_batch)
        for key, v in out.items():
            totals[key] = max(totals.get(key, v), v) if key.endswith("_max") else totals.get(key, 0.0) + v
    totals["grad_norm"] /= k
    totals["lr"] = out["lr"]
    return totals


# -- metrics ----------------------------------------------------------------------------------------------------

_SUM_KEYS = ["n_samples", "reward_sum", "correct", "response_tokens", "truncated", "groups", "uniform_groups",
             "loss_num", "loss_den", "tokens", "clip_frac_sum", "kl_sum", "entropy_sum", "mismatch_abs_sum",
             "mismatch_abs_max", "mismatch_kl_sum", "is_weight_sum", "is_weight_max", "is_weight_negmin_max",
             "tis_weight_sum", "tis_clip_sum"]
_DS_KEYS = ["ds_prompts_drawn", "ds_groups_dropped", "ds_rounds", "ds_groups_filled"]
# reward health (`megarl.verifiers.pool.batch_health`): counts add up over ranks, latencies take the worst rank
_REWARD_KEYS = ["reward_n_timeout", "reward_n_no_answer", "reward_n_parse_error", "reward_worker_restarts",
                "reward_latency_p50_max", "reward_latency_p99_max"]


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
            **{k: rollout.metrics.get(k, 0.0) for k in _DS_KEYS},
            **{k: rollout.metrics.get(k.removesuffix("_max"), 0.0) for k in _REWARD_KEYS},
        )
    if info.is_last_stage and info.tp_rank == 0 and info.cp_rank == 0:  # CP ranks hold the same whole-sequence sums
        local.update({k: update.get(k, 0.0) for k in _SUM_KEYS if k in update})
    g = parallel_reduce(local, _SUM_KEYS + _DS_KEYS + _REWARD_KEYS)
    n, tok = max(g["n_samples"], 1), max(g["tokens"], 1)
    return {
        "step": step,
        "reward_mean": g["reward_sum"] / n, "accuracy": g["correct"] / n,
        "response_len": g["response_tokens"] / n, "truncated_frac": g["truncated"] / n,
        "uniform_group_frac": g["uniform_groups"] / max(g["groups"], 1),
        "reward_timeout_rate": g["reward_n_timeout"] / n, "reward_no_answer_rate": g["reward_n_no_answer"] / n,
        "reward_parse_error_rate": g["reward_n_parse_error"] / n, "reward_worker_restarts": g["reward_worker_restarts"],
        "reward_latency_p50": g["reward_latency_p50_max"], "reward_latency_p99": g["reward_latency_p99_max"],
        "loss": g["loss_num"] / max(g["loss_den"], 1e-12), "kl": g["kl_sum"] / tok,
        "clip_frac": g["clip_frac_sum"] / tok, "grad_norm": update["grad_norm"], "lr": update["lr"],
        "entropy": g["entropy_sum"] / tok,
        "rollout_actor_logp_absdiff_mean": g["mismatch_abs_sum"] / tok,
        "rollout_actor_logp_absdiff_max": g["mismatch_abs_max"],
        "rollout_actor_kl": g["mismatch_kl_sum"] / tok,
        "is_weight_mean": g["is_weight_sum"] / tok, "is_weight_max": g["is_weight_max"],
        "is_weight_min": -g["is_weight_negmin_max"],
        **({"tis_weight_mean": g["tis_weight_sum"] / tok, "tis_clip_frac": g["tis_clip_sum"] / tok}
           if g["tis_weight_sum"] > 0 else {}),
        **({"ds_prompts_drawn": g["ds_prompts_drawn"], "ds_groups_dropped": g["ds_groups_dropped"],
            "ds_rounds": g["ds_rounds"] / info.dp_size,
            "ds_groups_filled": g["ds_groups_filled"]} if g["ds_rounds"] > 0 else {}),
        "step_seconds": seconds, "tokens_per_second": g["response_tokens"] / max(seconds, 1e-9),
        **timings,
    }


def parallel_reduce(local: dict[str, float], keys: list[str]) -> dict[str, float]:
    from megarl.metrics import reduce_over_ranks

    return reduce_over_ranks(local, keys)


def peak_rss_mib(info: ParallelInfo) -> float:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = parallel.all_reduce_host(torch.tensor([kib / 1024.0], dtype=torch.float64), op=dist.ReduceOp.MAX)
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
    counts = parallel.all_reduce_host(counts)
    return {"sampled": float(counts[0] / counts[1].clamp(min=1)), "greedy": float(counts[2] / counts[3].clamp(min=1))}


def save_hf(actor: MegatronPolicy, engine, tokenizer, src_dir: str, out_dir: str, info: ParallelInfo,
            shard_bytes: int = 0) -> None:
    """Export the actor as an ordinary HF checkpoint directory (config and tokenizer copied from the source).
    Streamed: the weights arrive one tensor at a time and go out in safetensors shards (`write_hf_shards`), so
    rank 0 never holds a second copy of the whole model."""
    import shutil

    from megarl.mcore.checkpoint import write_hf_shards

    named = actor.iter_hf()
    if info.rank == 0:
        out = Path(out_dir)
        write_hf_shards(named, out, **({"max_shard_bytes": shard_bytes} if shard_bytes else {}))
        shutil.copy(Path(src_dir) / "config.json", out / "config.json")
        tokenizer.save_pretrained(str(out))
    else:
        for _ in named:  # the gathers and pipeline broadcasts are collective
            pass
    dist.barrier()


def report(say, log, before: dict | None, after: dict, minutes: float, steps: int, n_prompts: int, cfg: Config) -> None:
    from megarl.metrics import plot_run

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
            png = plot_run(rows, log.dir / "training.png",
                           {"before": before["sampled"], "after": after["sampled"]} if before else None)
            say(f"training curves: {png}")
    if before:
        say(f"held-out accuracy (sampled): before {100 * before['sampled']:.1f}% -> after {100 * after['sampled']:.1f}%")

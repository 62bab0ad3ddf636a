"""A run's pieces, built once: the checks before any work, process groups, data, the actor and what the algorithm
needs besides it, the rollout engine and stage, resume; then checkpoints and the end of the run.

The order of construction is fixed (actor, reference, resume, critic, engine): a resumed run restores the RNG
states in between, and every later random draw depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from megarl.config import Config, ConfigError, TrainingConfig, load_plugin_modules, verifier_options
from megarl.data import PromptRecord, PromptSampler, load_prompts
from megarl.mcore import checkpoint, parallel
from megarl.mcore.actor import MegatronPolicy, OptimConfig
from megarl.mcore.parallel import ParallelInfo
from megarl.metrics import MetricsLog, open_sinks
from megarl.model_shape import ModelShape
from megarl.reward import RewardFn, build_reward
from megarl.rollout import RolloutEngine, get_rollout
from megarl.rollout.backends import build_engine, get_backend
from megarl.stages.algorithm import Algorithm
from megarl.stages.collect import Collect, Collector, DynamicSampling, OverlongShaping
from megarl.stages.colocation import WeightSync
from megarl.stages.critic import Critic


def preflight(cfg: Config) -> None:
    """What this machine must offer for the run, checked before any process group or model exists (the flags'
    own rules were checked when they were parsed, `megarl.config`)."""
    from megarl.mcore.parallel import transformer_engine_available

    ok, why = get_backend(cfg.rollout.rollout_backend).available(cfg)
    if not ok:
        raise ConfigError(why)
    if cfg.model.sequence_parallel and not transformer_engine_available():
        raise ConfigError("--sequence-parallel needs a CUDA GPU with Transformer Engine importable")
    if cfg.model.context_parallel_size > 1 and not transformer_engine_available():
        raise ConfigError(f"--context-parallel-size {cfg.model.context_parallel_size} needs Transformer Engine's "
                          "attention on a CUDA GPU (transformer_engine importable); Megatron's local attention, the "
                          "only one on CPU, cannot split a sequence over ranks. Use --context-parallel-size 1")
    if not cfg.model.hf_checkpoint:
        raise ConfigError("--hf-checkpoint is required")
    for flag, path in (("--hf-checkpoint", cfg.model.hf_checkpoint), ("--ref-checkpoint", cfg.model.ref_checkpoint)):
        if path and not (Path(path) / "config.json").is_file():
            raise ConfigError(f"{flag} {path}: not an HF checkpoint directory (no config.json)")
    if cfg.checkpoint.load:
        checkpoint.find_latest(cfg.checkpoint.load)


def optim_config(t: TrainingConfig) -> OptimConfig:
    return OptimConfig(lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
                       adam_beta2=t.adam_beta2, clip_grad=t.clip_grad, lr_warmup_steps=t.lr_warmup_steps,
                       lr_decay_steps=t.num_steps * t.updates_per_rollout, lr_decay_style=t.lr_decay_style,
                       use_distributed_optimizer=t.use_distributed_optimizer)


@dataclass
class Run:
    cfg: Config
    info: ParallelInfo
    say: Callable[..., None]  # print on rank 0 only
    tokenizer: object
    pad_id: int
    prompts: list[PromptRecord]
    eval_prompts: list[PromptRecord]
    sampler: PromptSampler
    actor: MegatronPolicy
    algorithm: Algorithm
    engine: RolloutEngine | None  # on each model replica's leader
    reward: RewardFn
    collect: Collect
    sync: WeightSync
    start_step: int

    def agree_any(self, flag: bool) -> bool:
        return parallel.agree_any(flag)


def start(cfg: Config) -> Run:
    """Process groups, data, models, engine and rollout stage, resumed from `--load` when given."""
    from transformers import AutoTokenizer

    m, d, t, c = cfg.model, cfg.data, cfg.training, cfg.checkpoint
    torch.set_num_threads(t.threads_per_rank)
    torch.manual_seed(t.seed)
    info = parallel.init_distributed(m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                                     timeout_s=t.distributed_timeout_seconds, seed=t.seed, cp=m.context_parallel_size)
    say = print if info.rank == 0 else (lambda *x, **k: None)
    if d.rollout_batch_size % info.dp_size:
        raise ConfigError(f"--rollout-batch-size {d.rollout_batch_size} is not divisible by the data-parallel size "
                          f"{info.dp_size}")
    tokenizer = AutoTokenizer.from_pretrained(m.hf_checkpoint)
    prompts, eval_prompts = _load_data(cfg, tokenizer)
    shape = ModelShape.from_pretrained(m.hf_checkpoint)
    cp = f" x CP {info.cp_size}" if info.cp_size > 1 else ""
    say(f"megarl: {info.world_size} ranks (TP {info.tp_size} x PP {info.pp_size}{cp} x DP {info.dp_size}), "
        f"{shape.family} {shape.num_layers} layers hidden {shape.hidden_size}, {len(prompts)} prompts")

    actor = MegatronPolicy(shape, tp=info.tp_size, pp=info.pp_size, trainable=True, bf16=m.bf16,
                           optim=optim_config(t), use_transformer_engine=m.use_transformer_engine,
                           sequence_parallel=m.sequence_parallel, cp=info.cp_size)
    reference = None
    if Algorithm.needs_reference(cfg):
        reference = MegatronPolicy(shape, tp=info.tp_size, pp=info.pp_size, trainable=False, bf16=m.bf16,
                                   use_transformer_engine=m.use_transformer_engine, cp=info.cp_size)
        reference.load_hf(m.ref_checkpoint or m.hf_checkpoint)
    sampler = PromptSampler(len(prompts), seed=t.seed, shuffle=d.shuffle)
    start_step, rank_state = 0, {}
    if c.load:
        state = checkpoint.load(checkpoint.find_latest(c.load), actor)
        sampler.load_state_dict(state["sampler"])
        start_step, rank_state = state["step"], state["rank_state"]
        say(f"megarl: resumed from {c.load} at step {start_step}")
    else:
        actor.load_hf(m.hf_checkpoint)
    critic = Critic(cfg, shape, info, start_step, optim_config(t)) if Algorithm.needs_critic(cfg) else None
    engine = build_engine(cfg, actor) if info.is_mp_leader else None
    sync = WeightSync(actor, engine, cfg.rollout, info)
    sync(version=start_step)

    reward = build_reward(cfg.reward, verifier_options(cfg.reward, cfg.sandbox), load_plugin_modules(cfg))
    collect = _collect(cfg, Collector(engine, get_rollout(cfg.rollout.rollout_function), reward, tokenizer, prompts,
                                      sampler, cfg.rollout, d.rollout_batch_size, t.seed, info))
    collect.load_rank_state(rank_state)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return Run(cfg, info, say, tokenizer, pad_id, prompts, eval_prompts, sampler, actor,
               Algorithm(cfg, info, reference, critic), engine, reward, collect, sync, start_step)


def _load_data(cfg: Config, tokenizer) -> tuple[list[PromptRecord], list[PromptRecord]]:
    d, lg = cfg.data, cfg.logging
    keys = dict(input_key=d.input_key, label_key=d.label_key, verifier_key=d.verifier_key,
                default_verifier=d.default_verifier, apply_chat_template=d.apply_chat_template)
    prompts = load_prompts(d.prompt_data, tokenizer, **keys)
    eval_prompts = load_prompts(d.eval_data, tokenizer, flag="--eval-data", **keys) if d.eval_data else []
    return prompts, eval_prompts[: lg.eval_max_prompts] if lg.eval_max_prompts else eval_prompts


def _collect(cfg: Config, collector: Collector) -> Collect:
    """The rollout stage the flags ask for: dynamic sampling and overlong shaping around the collector."""
    a = cfg.algorithm
    collect: Collect = collector
    if a.dynamic_sampling:
        collect = DynamicSampling(collector, a.max_sampling_rounds)
    if a.overlong_buffer_len > 0:
        collect = OverlongShaping(collect, cfg.rollout.max_response_len, a.overlong_buffer_len, a.overlong_penalty)
    return collect


def open_log(run: Run) -> MetricsLog:
    lg, resumed = run.cfg.logging, run.start_step > 0
    sinks = open_sinks(lg, lg.output_dir, run.cfg.to_dict(), resumed=resumed) if run.info.rank == 0 else []
    return MetricsLog(lg.output_dir, enabled=run.info.rank == 0, resumed=resumed, sinks=sinks,
                      resume_step=run.start_step if resumed else None)


def save(run: Run, step: int) -> None:
    """Collective. The algorithm's own models first (a critic), then the actor, the data position and this rank's
    rollout state, so the actor's `latest` step always has everything next to it."""
    c = run.cfg.checkpoint
    run.algorithm.save(c.save, step, c.keep_last)
    checkpoint.save(c.save, step, run.actor, {"sampler": run.sampler.state_dict()}, keep_last=c.keep_last,
                    rank_state=run.collect.rank_state())


def close(run: Run) -> None:
    if run.engine is not None:
        run.engine.shutdown()
    parallel.destroy()

"""A run's pieces, built once: the checks before any work, process groups, data, the actor and what the algorithm
needs besides it (resumed from a checkpoint, `megarl.trainer.checkpoints`), the rollout engine and stage; and the
end of the run (`close`).

The order of construction is fixed (actor, reference, resume, critic, engine): a resumed run restores the RNG
states in between, and every later random draw depends on it. An engine that sizes its memory from what is free
when it starts (the colocated SGLang engine, `Backend.launch_first`) comes first instead, on a GPU the actor has not
touched yet, and releases its memory before the actor is built; it draws no random numbers in this process.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from megarl.config import Config, TrainingConfig, saved_config
from megarl.data import PromptRecord, PromptSampler, load_prompts, split_by_length
from megarl.errors import ConfigError
from megarl.mcore import parallel
from megarl.mcore.actor import AdaptersOff, MegatronPolicy, OptimConfig
from megarl.mcore.lora import LoRAOptions
from megarl.mcore.model import MoEOptions
from megarl.mcore.parallel import ParallelInfo
from megarl.model_shape import ModelShape
from megarl.preflight import Layout, check_run, padded_vocab_size, prompt_limit, read_shape
from megarl.procs import stop_with_agent
from megarl.registry import load_plugins
from megarl.reward import RewardFn, build_reward, reward_options
from megarl.reward.compose import spec_error
from megarl.rollout import RolloutEngine, build_rollout
from megarl.rollout.backends import BACKENDS, build_engine
from megarl.rollout.base import as_engine
from megarl.rollout.functions import Rollout
from megarl.rollout.pipeline import OrderedEngine, Pipeline
from megarl.stages.algorithm import AlgorithmStage
from megarl.stages.asynchronous import AsyncCollect
from megarl.stages.collect import Collect, Collector, DynamicSampling, OverlongShaping
from megarl.stages.colocation import WeightSync
from megarl.stages.critic_update import CriticStage
from megarl.teacher import Teachers
from megarl.trainer.checkpoints import agreed_resume, resume
from megarl.trainer.engine_launch import LaunchWait


@dataclass(frozen=True)
class Checked:
    """What `check_before_start` found: the layout, the actor's architecture, the checkpoint to resume from (None: a
    fresh start)."""

    layout: Layout
    shape: ModelShape
    resume_from: Path | None


def check_before_start(cfg: Config) -> Checked:
    """Every check that needs no process group, model or data, on every rank before any work: what this machine
    must offer, then the layout, the checkpoint's config.json and `--load` (`megarl.preflight`, which the
    launchers run on the batch host too). The flags' own rules were checked when they were parsed."""
    from megarl.mcore.parallel import transformer_engine_status

    ok, why = BACKENDS.get(cfg.rollout.rollout_backend).available(cfg)
    if not ok:
        raise ConfigError(why)
    te, te_why = transformer_engine_status() if cfg.model.context_parallel_size > 1 else (True, "")
    if not te:
        raise ConfigError(f"--context-parallel-size {cfg.model.context_parallel_size} needs Transformer Engine's "
                          f"attention on a CUDA GPU ({te_why}); Megatron's local attention, the only one on CPU, "
                          "cannot split a sequence over ranks. Use --context-parallel-size 1")
    return Checked(*check_run(cfg, int(os.environ.get("WORLD_SIZE", "1"))))


def optim_config(t: TrainingConfig) -> OptimConfig:
    return OptimConfig(lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
                       adam_beta2=t.adam_beta2, clip_grad=t.clip_grad, lr_warmup_steps=t.lr_warmup_steps,
                       lr_decay_steps=t.num_steps * t.updates_per_rollout, lr_decay_style=t.lr_decay_style,
                       use_distributed_optimizer=t.use_distributed_optimizer)


@dataclass
class TrainingRun:
    """What `start` built for a training run, and its state between steps (the planner's sizing inputs are
    `megarl.plan.RunSettings`)."""

    cfg: Config
    info: ParallelInfo
    say: Callable[..., None]  # print on rank 0 only
    tokenizer: object
    pad_id: int
    prompts: list[PromptRecord]
    eval_prompts: list[PromptRecord]
    sampler: PromptSampler
    actor: MegatronPolicy
    algorithm: AlgorithmStage
    engine: RolloutEngine | None  # on each model replica's leader
    reward: RewardFn
    rollout_fn: Rollout  # `--rollout-function`, configured: the rollout stage's and evaluation's
    collect: Collect
    sync: WeightSync
    start_step: int
    record: dict  # the resolved config and the run's facts: `config.json` in the output directory and checkpoints
    pending: AsyncCollect | None = None  # asynchronous training: the batches in flight

    def agree_any(self, flag: bool) -> bool:
        return parallel.agree_any(flag)


def start(cfg: Config, checked: Checked) -> TrainingRun:
    """Process groups, data, models, engine and rollout stage, resumed from `checked.resume_from` when set."""
    from transformers import AutoTokenizer

    m, d, t = cfg.model, cfg.data, cfg.training
    stop_with_agent()  # under torchrun: no orphan of a killed agent trains on or saves
    torch.set_num_threads(t.threads_per_rank)
    torch.manual_seed(t.seed)
    info = parallel.init_distributed(m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                                     timeout_s=t.distributed_timeout_seconds, seed=t.seed, cp=m.context_parallel_size,
                                     ep=m.expert_model_parallel_size, etp=m.expert_tensor_parallel_size)
    say = print if info.rank == 0 else (lambda *x, **k: None)
    checked = Checked(checked.layout, checked.shape, agreed_resume(cfg.checkpoint.load, checked.resume_from))
    shape = checked.shape
    tokenizer = AutoTokenizer.from_pretrained(m.hf_checkpoint)
    prompts, eval_prompts, counts = _load_data(cfg, tokenizer, prompt_limit(cfg, shape), say)
    padded = padded_vocab_size(shape.vocab_size, m.make_vocab_size_divisible_by, info.tp_size)
    record = saved_config(cfg, command=sys.argv, world_size=info.world_size, padded_vocab_size=padded, **counts)
    cp = f" x CP {info.cp_size}" if info.cp_size > 1 else ""
    ep = (f"; experts: EP {m.expert_model_parallel_size} x expert-TP {m.expert_tensor_parallel_size or info.tp_size}"
          if shape.is_moe else "")
    moe = (f", {shape.num_experts} experts (top-{shape.moe_top_k}) in {len(shape.moe_layers)} layers"
           if shape.is_moe else "")
    say(f"megarl: {info.world_size} ranks (TP {info.tp_size} x PP {info.pp_size}{cp} x DP {info.dp_size}{ep}), "
        f"{shape.family} {shape.num_layers} layers hidden {shape.hidden_size}{moe}, {len(prompts)} prompts")
    say(_config_lines(cfg))

    model = dict(tp=info.tp_size, pp=info.pp_size, bf16=m.bf16, use_transformer_engine=m.use_transformer_engine,
                 cp=info.cp_size, padded_vocab_size=padded, moe=MoEOptions.from_config(m),
                 logprob_chunk_tokens=m.logprob_chunk_tokens)
    sampler = PromptSampler(len(prompts), seed=t.seed, shuffle=d.shuffle)  # its own RNG, none of torch's
    models = build_models(cfg, checked, info, model, sampler, say)
    actor, reference, critic, start_step, rank_state = (models.actor, models.reference, models.critic,
                                                         models.start_step, models.rank_state)
    engine = rollout_engine = models.engine
    pipeline = Pipeline() if t.async_staleness else None
    if pipeline is not None and engine is not None:  # the loop's calls queue behind the rollouts in flight
        engine = OrderedEngine(rollout_engine, pipeline)
    sync = WeightSync(actor, engine, cfg.rollout, info, timeout_s=t.distributed_timeout_seconds, training=t)
    sync(version=start_step)

    reward = build_reward(cfg.reward, reward_options(cfg), _plugin_modules(cfg))
    rollout_fn = build_rollout(cfg)
    collector = Collector(rollout_engine, rollout_fn, reward, tokenizer, prompts, sampler, cfg.rollout,
                          d.rollout_batch_size, t.seed, info, context=shape.max_position_embeddings,
                          reward_overlap=cfg.reward.reward_overlap)
    pending = AsyncCollect(collector, pipeline, engine, t.async_staleness) if pipeline is not None else None
    collect = _collect(cfg, pending or collector)
    collect.load_rank_state(rank_state)
    if pending is not None:
        pending.start()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    teachers = Teachers(models.teacher, [p.teacher for p in prompts]) if models.teacher else None
    algorithm = AlgorithmStage(cfg, info, reference, critic, teacher=teachers)
    if t.offload_frozen:
        say(f"megarl: --offload-frozen: {len(algorithm.frozen)} frozen model(s), {algorithm.frozen_bytes / 2**20:.1f} "
            "MiB on rank 0, off the device except for their log-probs" if algorithm.frozen else
            "megarl: --offload-frozen: no frozen model of its own to offload (no reference, or the LoRA actor's "
            "base; no local teacher)")
    return TrainingRun(cfg, info, say, tokenizer, pad_id, prompts, eval_prompts, sampler, actor, algorithm, engine,
                       reward,
                       rollout_fn, collect, sync,
                       start_step, record, pending)


@dataclass
class Models:
    """What `build_models` built: the actor, what the algorithm needs besides it, the engine (on each model
    replica's leader), and where a resumed run starts."""

    actor: MegatronPolicy
    reference: MegatronPolicy | None
    critic: CriticStage | None
    engine: RolloutEngine | None
    start_step: int
    rank_state: dict
    teacher: dict | None = None  # on-policy distillation's teachers (--teacher), {name: frozen model or server}


def build_models(cfg: Config, checked: Checked, info: ParallelInfo, model: dict, sampler: PromptSampler,
                 say) -> Models:
    """Actor, reference, resume, critic, engine, in this order (see the module docstring), or the engine first
    when its backend says so (`launch_engine_first`). `model`: MegatronPolicy's layout and precision arguments."""
    m, t = cfg.model, cfg.training
    engine = launch_engine_first(cfg, info, say)
    say(f"megarl: building the actor{' and the reference' if AlgorithmStage.needs_reference(cfg) else ''}")
    actor = MegatronPolicy(checked.shape, trainable=True, optim=optim_config(t), sequence_parallel=m.sequence_parallel,
                           routing_replay=cfg.algorithm.routing_replay,
                           recompute_granularity=m.recompute_granularity,
                           lora=LoRAOptions.from_config(m, seed=t.seed), **model)
    reference = None
    if AlgorithmStage.needs_reference(cfg) and actor.lora is not None:
        reference = AdaptersOff(actor)  # the actor's base weights: frozen, and loaded below
    elif AlgorithmStage.needs_reference(cfg):
        reference = MegatronPolicy(checked.shape, trainable=False, **model)
        reference.load_hf(m.ref_checkpoint or m.hf_checkpoint)
    teacher = build_teacher(cfg, info, model, say)
    start_step, rank_state = resume(cfg, checked.resume_from, actor, sampler, say)
    critic = (CriticStage(cfg, checked.shape, info, optim_config(t), model["padded_vocab_size"], checked.resume_from)
              if AlgorithmStage.needs_critic(cfg) else None)
    if engine is None and info.is_mp_leader:
        engine = as_engine(build_engine(cfg, actor))
    return Models(actor, reference, critic, engine, start_step, rank_state, teacher)


def build_teacher(cfg: Config, info: ParallelInfo, model: dict, say) -> dict | None:
    """On-policy distillation's teachers (`--teacher`, `megarl.teacher.parse_teachers`), {name: teacher}: each a
    frozen Megatron model built from its HF checkpoint with the actor's layout (TP/PP, precision), its own
    architecture (it may be wider or deeper than the actor) and the actor's tokenizer (checked: the per-token
    log-probs of the actor's token ids must mean the same tokens), or a server (an http(s) URL)."""
    from megarl.teacher import HTTPTeacher, check_teacher_tokenizer, parse_teachers
    m = cfg.model
    if not m.teacher:
        return None
    k = cfg.algorithm.distill_topk
    teachers = {}
    for name, source in parse_teachers(m.teacher).items():
        label = f"teacher {name + ' ' if name else ''}"
        if source.startswith(("http://", "https://")):  # a served teacher (SGLang-shaped prompt log-probs)
            say(f"megarl: the {label}is served at {source}")
            teachers[name] = HTTPTeacher(source, timeout_s=cfg.training.distributed_timeout_seconds)
            if k:
                teachers[name].check_topk(k)  # refused now, naming --distill-topk, if it gives no top-k
            continue
        check_teacher_tokenizer(m.hf_checkpoint, source)
        shape = read_shape("--teacher", source)
        if k > shape.vocab_size:
            raise ConfigError(f"--distill-topk {k} is larger than the {label}{source}'s vocabulary of "
                              f"{shape.vocab_size} tokens")
        say(f"megarl: building the {label}{source} ({shape.family} {shape.num_layers} layers hidden "
            f"{shape.hidden_size})")
        layout = dict(model, padded_vocab_size=padded_vocab_size(shape.vocab_size, m.make_vocab_size_divisible_by,
                                                                  info.tp_size))
        teachers[name] = MegatronPolicy(shape, trainable=False, **layout)
        teachers[name].load_hf(source)
    return teachers


def launch_engine_first(cfg: Config, info: ParallelInfo, say) -> RolloutEngine | None:
    """For a backend that sizes its memory pools from the GPU memory free at launch (`Backend.launch_first`):
    launch the engine on each model-parallel leader while the GPUs are still empty, then have it release its
    memory (the actor and the reference are built in what it frees; the first sync resumes its weights, the first
    rollout its KV cache). Every rank waits until all engines have launched, since an engine's TP ranks use the
    GPUs of other trainer ranks: on store keys, for at most --engine-launch-timeout-seconds, and a leader's failure
    stops every rank at once with its message (`megarl.trainer.engine_launch`). None for other backends, and off
    the leaders."""
    global _LAUNCHES
    if not BACKENDS.get(cfg.rollout.rollout_backend).launch_first(cfg):
        return None
    what = f"{cfg.rollout.rollout_backend} engine"
    say(f"megarl: launching the {what} before the actor (it sizes its memory pools from the GPU memory free at "
        "launch)")
    _LAUNCHES += 1  # every rank counts the same launches: their keys are the same
    wait = LaunchWait.over_default_store(f"megarl_engine_launch/{_LAUNCHES}", info.dp_size,
                                         cfg.training.engine_launch_timeout_seconds)
    engine = None
    if info.is_mp_leader:
        wait.started(info.dp_rank, info.rank)
        try:
            engine = as_engine(build_engine(cfg, None))
            engine.release_memory()
        except BaseException as e:
            wait.failed(info.dp_rank, info.rank, e)
            raise
        wait.launched(info.dp_rank)
    wait.wait(info.rank, what)
    return engine


_LAUNCHES = 0


def _config_lines(cfg: Config) -> str:
    """The settings that differ from their defaults, a line per section, for the start of the log."""
    lines = ["megarl: config (non-default settings; all of them: config.json in --output-dir):"]
    lines += [f"  {section}: {' '.join(words)}" for section, words in cfg.non_default_flags().items()]
    return "\n".join(lines)


def _load_data(cfg: Config, tokenizer, limit: int, say) -> tuple[list[PromptRecord], list[PromptRecord], dict]:
    """Training and held-out prompts, without those longer than `limit` tokens; the counts left out."""
    d, lg = cfg.data, cfg.logging
    counts = {}
    sets = []
    for flag, path, name in (("--prompt-data", d.prompt_data, "prompts"), ("--eval-data", d.eval_data, "eval_prompts")):
        kept, counts[f"{name}_too_long"] = load_prompt_file(cfg, path, flag, tokenizer, limit, say) if path else ([], 0)
        sets.append(kept)
    prompts, eval_prompts = sets
    return prompts, eval_prompts[: lg.eval_max_prompts] if lg.eval_max_prompts else eval_prompts, counts


def load_prompt_file(cfg: Config, path: str, flag: str, tokenizer, limit: int, say) -> tuple[list[PromptRecord], int]:
    """The prompts of one data file (the run's keys and chat template), without those longer than `limit` tokens,
    which are counted and named; ConfigError when none is left. `flag` names the file in messages."""
    d = cfg.data
    records = load_prompts(path, tokenizer, flag=flag, input_key=d.input_key, label_key=d.label_key,
                           verifier_key=d.verifier_key, default_verifier=d.default_verifier,
                           apply_chat_template=d.apply_chat_template, spec_error=spec_error)
    kept, long = split_by_length(records, limit)
    if long:
        first = ", ".join(f"{r.source} ({len(r.prompt_ids)} tokens)" for r in long[:3])
        say(f"megarl: left out {len(long)} of {len(records)} {flag} prompts longer than {limit} tokens "
            f"(--max-prompt-len, or the model's context less --max-response-len): {first}"
            f"{', ...' if len(long) > 3 else ''}")
    if not kept:
        raise ConfigError(f"{flag} {path}: every prompt is longer than {limit} tokens (--max-prompt-len); "
                          "raise it, or lower --max-response-len to leave more of the context to prompts")
    return kept, len(long)


def _collect(cfg: Config, collector: Collector) -> Collect:
    """The rollout stage the flags ask for: dynamic sampling and overlong shaping around the collector."""
    a = cfg.algorithm
    collect: Collect = collector
    if a.dynamic_sampling:
        collect = DynamicSampling(collector, a.max_sampling_rounds)
    if a.overlong_buffer_len > 0:
        collect = OverlongShaping(collect, cfg.rollout.max_response_len, a.overlong_buffer_len, a.overlong_penalty)
    return collect


def _plugin_modules(cfg: Config) -> tuple[str, ...]:
    """`--plugins`' module names, for the reward workers to import in turn (imported here already: the command line
    did, `megarl.arguments`; importing again is a no-op)."""
    try:
        return load_plugins(cfg.plugins.plugins)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def close(run: TrainingRun) -> None:
    """The end of the run: megarl's own children first (the asynchronous worker, the rollout function's tools and
    sandboxes, the reward's workers and helpers), then the engine, then the process groups. The order matters for
    an in-process SGLang engine: its `shutdown` SIGKILLs every child of this process, whoever started it, and
    raises if they are not reaped within 60 s. The engine and the process groups are closed even when closing a
    child fails."""
    try:
        if run.pending is not None:
            run.pending.stop()
        run.rollout_fn.close()
        run.reward.close()
    finally:
        try:
            if run.engine is not None:
                run.engine.shutdown()
        finally:
            parallel.destroy()

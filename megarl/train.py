"""GRPO with a Megatron-core actor and a colocated rollout engine.

    torchrun --nproc-per-node N megarl/train.py recipes/<recipe>.sh [--flag value ...]

Each step: generate -> reward -> advantages -> log-probs (actor, reference) -> update -> sync weights -> log
-> checkpoint. Data parallelism splits the prompts (a prompt's group stays on one rank); within a model-parallel
group (TP x PP) the first rank runs the rollout engine and shares the samples with the others.
"""

from __future__ import annotations

import os
import sys

# `torchrun megarl/train.py` puts megarl/ itself first on sys.path, where megarl's own module names could shadow
# top-level packages; replace it with the repository root.
_here = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _here:
    sys.path[0] = os.path.dirname(_here)

import time  # noqa: E402
from dataclasses import replace  # noqa: E402

from megarl.config import Config, ConfigError, help_text, parse_args  # noqa: E402


def preflight(cfg: Config) -> None:
    """Everything that can be checked before any process group or model exists."""
    from pathlib import Path

    import torch

    if cfg.rollout.rollout_backend == "sglang" and not cfg.rollout.rollout_servers:  # the colocated engine
        if not torch.cuda.is_available():
            raise ConfigError("--rollout-backend sglang needs a CUDA GPU and this machine has none; "
                              "use --rollout-backend builtin (the CPU default)")
        from megarl.rollout.sglang_engine import sglang_available

        ok, why = sglang_available()
        if not ok:
            raise ConfigError(f"--rollout-backend sglang: {why}; install it (pip install 'megarl[sglang]') or use "
                              "--rollout-backend builtin")
    if cfg.rollout.rollout_backend == "megatron":
        from megarl.rollout.mcore_engine import megatron_engine_available

        m = cfg.model
        if (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size) != (1, 1, 1):
            raise ConfigError("--rollout-backend megatron needs --tensor-model-parallel-size 1, "
                              "--pipeline-model-parallel-size 1 and --context-parallel-size 1 (the engine runs on "
                              "each replica's first rank only); use --rollout-backend sglang for sharded rollout")
        if cfg.training.offload_params:
            raise ConfigError("--rollout-backend megatron generates with the actor's own weights: --offload-params "
                              "would move them away (--offload-optimizer is fine)")
        ok, why = megatron_engine_available()
        if not ok:
            raise ConfigError(f"--rollout-backend megatron: {why}; use --rollout-backend builtin (the CPU default)")
    if cfg.model.sequence_parallel:
        from megarl.mcore.parallel import transformer_engine_available

        if not transformer_engine_available():
            raise ConfigError("--sequence-parallel needs a CUDA GPU with Transformer Engine importable")
    if cfg.model.context_parallel_size > 1:
        from megarl.mcore.parallel import transformer_engine_available

        if not transformer_engine_available():
            raise ConfigError(f"--context-parallel-size {cfg.model.context_parallel_size} needs Transformer Engine's "
                              "attention on a CUDA GPU (transformer_engine importable); Megatron's local attention, "
                              "the only one on CPU, cannot split a sequence over ranks. Use --context-parallel-size 1")
        if cfg.algorithm.advantage_estimator == "gae":
            raise ConfigError("--context-parallel-size > 1 is not supported with --advantage-estimator gae: the "
                              "critic is built without context parallelism")
    if cfg.rollout.rollout_device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--rollout-device cuda: this machine has no CUDA GPU; allowed here: auto, cpu")
    if not cfg.model.hf_checkpoint:
        raise ConfigError("--hf-checkpoint is required")
    for flag, path in (("--hf-checkpoint", cfg.model.hf_checkpoint), ("--ref-checkpoint", cfg.model.ref_checkpoint)):
        if path and not (Path(path) / "config.json").is_file():
            raise ConfigError(f"{flag} {path}: not an HF checkpoint directory (no config.json)")
    if cfg.checkpoint.load:
        from megarl.mcore.checkpoint import find_latest

        find_latest(cfg.checkpoint.load)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        return 0
    try:
        cfg = parse_args(argv)
        preflight(cfg)
        return run(cfg)
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":  # every rank sees the same config: say it once
            print(f"megarl: error: {e}", file=sys.stderr)
        return 2
    except BaseException as e:  # torchrun then stops the other ranks; say which one failed first
        print(f"megarl: rank {os.environ.get('RANK', '0')} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise


def run(cfg: Config) -> int:
    import torch
    from transformers import AutoTokenizer

    from megarl import ppo, steps
    from megarl.data import PromptSampler, load_prompts
    from megarl.mcore import checkpoint, parallel
    from megarl.mcore.actor import MegatronPolicy
    from megarl.model_shape import ModelShape
    from megarl.metrics import MetricsLog, eta_seconds, format_step, open_sinks, plot_run, rollout_sample_rows

    m, r, d, a, t, c, lg = (cfg.model, cfg.rollout, cfg.data, cfg.algorithm, cfg.training, cfg.checkpoint, cfg.logging)
    torch.set_num_threads(t.threads_per_rank)
    torch.manual_seed(t.seed)
    info = parallel.init_distributed(m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                                     timeout_s=t.distributed_timeout_seconds, seed=t.seed, cp=m.context_parallel_size)
    say = print if info.rank == 0 else (lambda *x, **k: None)
    if t.max_tokens_per_micro_batch and info.pp_size > 1:
        raise ConfigError("--max-tokens-per-micro-batch needs --pipeline-model-parallel-size 1 (pipeline stages "
                          f"exchange fixed-shape micro-batches), got {info.pp_size}")
    if d.rollout_batch_size % info.dp_size:
        raise ConfigError(f"--rollout-batch-size {d.rollout_batch_size} is not divisible by the data-parallel size {info.dp_size}")

    tokenizer = AutoTokenizer.from_pretrained(m.hf_checkpoint)
    keys = dict(input_key=d.input_key, label_key=d.label_key, verifier_key=d.verifier_key,
                default_verifier=d.default_verifier, apply_chat_template=d.apply_chat_template)
    prompts = load_prompts(d.prompt_data, tokenizer, **keys)
    eval_prompts = load_prompts(d.eval_data, tokenizer, flag="--eval-data", **keys) if d.eval_data else []
    if lg.eval_max_prompts:
        eval_prompts = eval_prompts[: lg.eval_max_prompts]
    shape = ModelShape.from_pretrained(m.hf_checkpoint)
    cp = f" x CP {info.cp_size}" if info.cp_size > 1 else ""
    say(f"megarl: {info.world_size} ranks (TP {info.tp_size} x PP {info.pp_size}{cp} x DP {info.dp_size}), "
        f"{shape.family} {shape.num_layers} layers hidden {shape.hidden_size}, {len(prompts)} prompts")

    actor = MegatronPolicy(shape, tp=info.tp_size, pp=info.pp_size, trainable=True, bf16=m.bf16,
                           optim=steps.optim_config(t), use_transformer_engine=steps.use_te(m.transformer_impl),
                           sequence_parallel=m.sequence_parallel, cp=info.cp_size)
    reference = None
    if a.kl_coef > 0:
        reference = MegatronPolicy(shape, tp=info.tp_size, pp=info.pp_size, trainable=False, bf16=m.bf16,
                                   use_transformer_engine=steps.use_te(m.transformer_impl), cp=info.cp_size)
        reference.load_hf(m.ref_checkpoint or m.hf_checkpoint)
    sampler = PromptSampler(len(prompts), seed=t.seed, shuffle=d.shuffle)
    ds_buffer: list = []  # dynamic sampling's surplus groups, this rank's
    start_step = 0
    if c.load:
        state = checkpoint.load(checkpoint.find_latest(c.load), actor)
        sampler.load_state_dict(state["sampler"])
        ds_buffer = state["rank_state"].get("ds_buffer", [])
        start_step = state["step"]
        say(f"megarl: resumed from {c.load} at step {start_step}")
    else:
        actor.load_hf(m.hf_checkpoint)
    critic = ppo.build_critic(cfg, shape, info, start_step)  # PPO's value model; None unless --advantage-estimator gae
    engine = steps.build_engine(m.hf_checkpoint, r.rollout_device, cfg, actor=actor) if info.is_mp_leader else None
    steps.sync_weights(actor, engine, version=start_step, cfg=cfg)

    sinks = open_sinks(lg, lg.output_dir, cfg.to_dict(), resumed=start_step > 0) if info.rank == 0 else []
    log = MetricsLog(lg.output_dir, enabled=info.rank == 0, resumed=start_step > 0, sinks=sinks,
                     resume_step=start_step if start_step > 0 else None)
    eval_before = steps.evaluate(engine, eval_prompts, tokenizer, cfg, info) if eval_prompts and start_step == 0 else None
    if eval_before:
        say(f"held-out before training: sampled {100 * eval_before['sampled']:.1f}%, greedy {100 * eval_before['greedy']:.1f}%")

    train_start = time.perf_counter()
    step = start_step
    while step < t.num_steps:
        t0 = time.perf_counter()
        steps.enter_rollout(actor, engine, cfg)  # colocated: the actor offloads, the engine resumes its KV cache
        # generate, reward (dynamic sampling refills dropped groups), reward shaping
        rollout = steps.collect_rollout(engine, sampler, prompts, tokenizer, cfg, step, info, ds_buffer)
        steps.shape_rewards(rollout, cfg)
        timings = {"t_generate": rollout.generate_seconds, "t_reward": rollout.reward_seconds}
        train_batch = steps.make_train_batch(rollout, tokenizer, mask_truncated=a.mask_truncated)
        steps.enter_training(actor, engine, cfg)  # colocated: the engine releases its memory, the actor onloads
        t1 = time.perf_counter()
        steps.add_logprobs(train_batch, actor, reference, cfg)  # log-probs (old when needed, reference)
        timings["t_logprobs"] = time.perf_counter() - t1
        steps.fold_kl_into_rewards(rollout, train_batch, cfg, info)  # --kl-in-reward only
        if critic is None:
            steps.compute_advantages(rollout, a, train_batch)
            critic_metrics = {}
        else:  # PPO: the critic's values -> GAE advantages, then the critic's own update (megarl/ppo.py)
            critic_metrics = ppo.gae_advantages_and_critic_update(critic, rollout, train_batch, cfg, info)
        t1 = time.perf_counter()
        update = steps.update(actor, train_batch, cfg)
        timings["t_update"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        timings.update(steps.sync_weights(actor, engine, version=step + 1, cfg=cfg))
        timings["t_sync"] = time.perf_counter() - t1
        step += 1
        row = {**steps.step_metrics(step, rollout, update, timings, time.perf_counter() - t0, info), **critic_metrics}
        log.write(row)
        if log.enabled and lg.log_samples_interval and step % lg.log_samples_interval == 0:
            log.write_samples(step, rollout_sample_rows(step, rollout.samples, prompts, lg.log_samples_count))
        if step % lg.log_interval == 0 or step == t.num_steps:
            elapsed = time.perf_counter() - train_start
            budget_left = 60 * t.max_train_minutes - elapsed if t.max_train_minutes > 0 else None
            say(format_step(row, t.num_steps, eta_seconds(elapsed, step - start_step, t.num_steps - step, budget_left)),
                flush=True)
        out_of_time = steps.agree_any(t.max_train_minutes > 0 and time.perf_counter() - train_start > 60 * t.max_train_minutes)
        if c.save and c.save_interval and step % c.save_interval == 0:
            ppo.save_critic(critic, c.save, step, c.keep_last)
            checkpoint.save(c.save, step, actor, {"sampler": sampler.state_dict()}, keep_last=c.keep_last,
                            rank_state={"ds_buffer": ds_buffer})
        if out_of_time:
            say(f"megarl: --max-train-minutes {t.max_train_minutes} reached after step {step}")
            break
    train_minutes = (time.perf_counter() - train_start) / 60

    if c.save and not (c.save_interval and step % c.save_interval == 0):
        ppo.save_critic(critic, c.save, step, c.keep_last)
        checkpoint.save(c.save, step, actor, {"sampler": sampler.state_dict()}, keep_last=c.keep_last,
                            rank_state={"ds_buffer": ds_buffer})
    if c.save_hf:
        steps.save_hf(actor, engine, tokenizer, m.hf_checkpoint, c.save_hf, info)
    steps.enter_rollout(actor, engine, cfg)
    eval_after = steps.evaluate(engine, eval_prompts, tokenizer, cfg, info) if eval_prompts else None
    say(f"megarl: peak memory per process {steps.peak_rss_mib(info):.0f} MiB (max over ranks)")
    if eval_after:
        steps.report(say, log, eval_before, eval_after, train_minutes, step, len(eval_prompts), cfg)
    elif info.rank == 0 and log.all_rows():
        plot_run(log.all_rows(), log.dir / "training.png")
    log.close()
    steps.close_engine(engine)
    parallel.destroy()
    return 0


if __name__ == "__main__":  # dist_checkpointing's save spawns helpers: keep the guard
    sys.exit(main(sys.argv[1:]))

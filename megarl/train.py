"""RL post-training with a Megatron-core actor and a colocated rollout engine.

    torchrun --nproc-per-node N megarl/train.py recipes/<recipe>.sh [--flag value ...]

Each step: generate and score (the registered rollout function, inside dynamic sampling and overlong shaping when
asked; rows are scored as they finish, `--reward-overlap`) -> log-probs (the actor's before the update, the frozen
reference's, as the loss needs them; the last rewards come in meanwhile) -> final rewards and advantages (the
registered estimator, with whatever models it declares it needs) -> update -> sync weights -> log -> checkpoint.
Data parallelism splits the prompts (a prompt's group stays on one rank); within a model replica (TP x CP x PP)
the first rank runs the rollout engine and shares the samples with the others. A step's stages live in
`megarl/stages/`, the run's lifecycle around them (build, resume, checkpoints, evaluation, export, the log) in
`megarl/trainer/`; this file names no algorithm and no backend. With --async-staleness K the batch of step s was
generated with the weights of step s - K while the actor trained (`stages/asynchronous.py`).
"""

from __future__ import annotations

import os
import sys
import time

from megarl.arguments import help_text, parse_args
from megarl.config import Config
from megarl.errors import CheckpointError, ConfigError
from megarl.procs import exiting


def main(argv: list[str]) -> int:
    try:
        if any(a in ("-h", "--help") for a in argv):
            print(help_text(argv))  # with the options of the --plugins it names
            return 0
        cfg = parse_args(argv)
        from megarl import faults
        from megarl.trainer.build import check_before_start

        faults.check()

        return run(cfg, check_before_start(cfg))
    except ConfigError as e:
        rank = os.environ.get("RANK", "0")
        if rank != "0":
            # Every rank sees the same config, so rank 0 says it once: the others wait for torchrun to stop them once
            # rank 0 has exited, and speak only if it does not (an error of their own: a path not mounted). 20 s: on a
            # loaded machine (a test suite on two workers) rank 0's exit took more than 5 s to reach them.
            time.sleep(20)
        print(f"megarl: error: {e}" if rank == "0" else f"megarl: rank {rank}: error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:  # raised on every rank alike: rank 0 says it
        if os.environ.get("RANK", "0") == "0":
            print(f"megarl: error: {e}", file=sys.stderr, flush=True)
        return 3
    except BaseException as e:  # torchrun then stops the other ranks; say which one failed first
        print(f"megarl: rank {os.environ.get('RANK', '0')} failed: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        raise


def run(cfg: Config, checked) -> int:
    from megarl import faults
    from megarl.metrics import PhaseTimer, eta_seconds, format_step
    from megarl.reward.hacking import HackMonitor
    from megarl.stages import report
    from megarl.stages.algorithm import pack
    from megarl.stages.asynchronous import check_staleness, overlap_metrics
    from megarl.stages.colocation import enter_rollout, enter_training
    from megarl.stages.reward import wait_for_rewards
    from megarl.stages.update import update
    from megarl.trainer import build, checkpoints, evaluate, export, log as run_log

    t, lg = cfg.training, cfg.logging
    run = build.start(cfg, checked)  # process groups, data, actor (+ what the algorithm needs), engine, resume
    actor, engine, info, say = run.actor, run.engine, run.info, run.say
    log = run_log.open_log(run)
    eval_before = None
    if run.eval_prompts and run.start_step == 0:
        enter_rollout(actor, engine, t, run.sync)  # the engine takes the GPU (and checks the first sync's probe)
        eval_before = evaluate.evaluate(run)
    if eval_before:
        say(f"held-out before training: sampled {100 * eval_before['sampled']:.1f}%, "
            f"greedy {100 * eval_before['greedy']:.1f}%")

    hacking = HackMonitor(lg.hack_window, lg.hack_alarm)
    train_start = time.perf_counter()
    step = run.start_step
    while step < t.num_steps:
        faults.fire("slow_node", step + 1)
        t0, timer = time.perf_counter(), PhaseTimer()
        # colocated: the actor offloads, the engine resumes its KV cache (and scores the last sync's probe)
        probe_metrics = enter_rollout(actor, engine, t, run.sync)
        for fault in ("engine_crash", "engine_hang"):
            if faults.fire(fault, step + 1):
                faults.break_engine(engine, fault)
        if faults.fire("reward_worker_crash", step + 1) and cfg.reward.reward_workers == 0:
            raise ConfigError(f"{faults.ENV}: reward_worker_crash needs reward workers (--reward-workers >= 1)")
        faults.fire("sandbox_kill", step + 1)  # the first code sample's sandbox, wherever it is scored
        rollout = run.collect(step)  # generate and score (asynchronous: take the batch made K steps ago)
        timer.add(t_generate=rollout.generate_seconds)
        if run.pending is not None:
            timer.add(**run.pending.take_metrics())
            async_metrics = check_staleness(rollout.samples, step, t.async_staleness)
        enter_training(actor, engine)  # colocated: the engine releases its memory, the actor onloads
        with timer("t_logprobs"):
            packed = pack(rollout.samples, run.pad_id, mask_truncated=cfg.algorithm.mask_truncated)
            logp = run.algorithm.logprobs(actor, packed, rollout.samples)
        rollout = wait_for_rewards(rollout)  # --reward-overlap: the last rows were scored during the log-probs
        timer.add(t_reward=rollout.reward_seconds, t_reward_exposed=rollout.reward_exposed_seconds)
        batch, algorithm_metrics = run.algorithm.train_batch(rollout, packed, logp)  # rewards, advantages
        with timer("t_update"):
            update_metrics = update(actor, batch, cfg)
        with timer("t_sync"):
            if run.pending is not None and cfg.rollout.rollout_servers and info.dp_size > 1:
                run.pending.settle()  # servers shared by the DP leaders: their queued batches first
            sync_metrics = {**run.sync(version=step + 1, rows=packed), **probe_metrics}
        step += 1
        seconds = time.perf_counter() - t0
        if run.pending is not None:
            sync_metrics.update(async_metrics, **overlap_metrics(timer.seconds, seconds))
        row = {**report.step_metrics(step, rollout, batch, update_metrics, {**timer.seconds, **sync_metrics},
                                     seconds, info), **algorithm_metrics, **faults.engine_health(engine)}
        if run.eval_prompts and lg.eval_interval and step % lg.eval_interval == 0 and step < t.num_steps:
            row.update(evaluate.evaluate_between_steps(run, step))  # the last step's evaluation follows the loop
        alarm = hacking.observe(row, row["n_samples"])  # the same row on every rank: the same verdict
        log.write(row)
        run_log.write_samples(run, log, step, rollout.samples, batch)  # every Nth step's, and the flagged ones
        elapsed = time.perf_counter() - train_start
        if step % lg.log_interval == 0 or step == t.num_steps:
            left = 60 * t.max_train_minutes - elapsed if t.max_train_minutes > 0 else None
            say(format_step(row, t.num_steps, eta_seconds(elapsed, step - run.start_step, t.num_steps - step, left)),
                flush=True)
        if alarm:
            say(f"megarl: warning: {alarm}", flush=True)
        stop = checkpoints.save_when_due(run, step, alarm is not None, elapsed)  # a save, then perhaps a stop
        faults.fire("trainer_sigkill", step)
        if stop:
            say(stop)
            break
    train_minutes = (time.perf_counter() - train_start) / 60
    if run.pending is not None:
        run.pending.cancel()  # batches made ahead for steps that will not run
    export.export(run)  # --save-hf, --save-peft
    enter_rollout(actor, engine, t, run.sync)  # the last sync's probe is checked before the evaluation generates
    eval_after = evaluate.evaluate(run) if run.eval_prompts else None
    run_log.finish(run, log, eval_before, eval_after, train_minutes, step)
    build.close(run)
    return 0


if __name__ == "__main__":  # dist_checkpointing's save spawns helpers: keep the guard
    sys.exit(exiting(main(sys.argv[1:])))  # exiting: the exit's last collections made cheap (one run a process)

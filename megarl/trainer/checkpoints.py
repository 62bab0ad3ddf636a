"""A run's checkpoints: where a run starts (a checkpoint, or the HF weights) and what a save holds. The format of
a model's own checkpoint is `megarl.mcore.checkpoint`'s."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from megarl.checkpoint_layout import find_resume
from megarl.config import Config
from megarl.data import PromptSampler
from megarl.errors import ConfigError
from megarl.mcore import checkpoint
from megarl.mcore.actor import MegatronPolicy

if TYPE_CHECKING:
    from megarl.trainer.build import TrainingRun


def agreed_resume(load: str, path: Path | None) -> Path | None:
    """Collective: `path`, the checkpoint this rank's preflight chose under --load, once every rank chose the same.
    Each rank reads --load on its own before the process groups exist; ranks that read it at different moments
    while something else wrote there (the workers of an earlier run whose torchrun agent was killed, a second job
    with the same --save) resumed from different steps, their replicas apart, and the run died later in a
    collective mismatch. Here it stops before any state is loaded or written, naming what each rank saw."""
    import torch.distributed as dist

    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, str(path) if path is not None else "")
    if len(set(seen)) > 1:
        ranks: dict[str, list[int]] = {}
        for r, p in enumerate(seen):
            ranks.setdefault(p, []).append(r)
        views = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs[:4]))}"
                          f"{f' and {len(rs) - 4} more' if len(rs) > 4 else ''}: {p or 'no checkpoint'}"
                          for p, rs in ranks.items())
        raise ConfigError(f"--load {load} changed while this run started, so its ranks would resume "
                          f"from different checkpoints ({views}). Another process is writing there (the workers "
                          "of an earlier run whose torchrun was killed? a second job with the same --save?): stop "
                          "it, then start this run again; nothing was loaded or written")
    return path


def resume(cfg: Config, path: Path | None, actor: MegatronPolicy, sampler: PromptSampler, say) -> tuple[int, dict]:
    """Load `path` (the actor, its optimizer and RNG states, the data position), or the HF weights when None;
    returns the step to start from and this rank's saved rollout state. With LoRA the base weights always come from
    --hf-checkpoint (a checkpoint holds the adapters only, and checks that this is the base they were trained on)."""
    if path is None:
        if cfg.checkpoint.load:
            say(f"megarl: --load {cfg.checkpoint.load} holds no checkpoint yet: starting afresh from --hf-checkpoint")
        actor.load_hf(cfg.model.hf_checkpoint)
        if cfg.model.lora_checkpoint:
            adapters = checkpoint.find_latest(cfg.model.lora_checkpoint, flag="--lora-checkpoint")
            checkpoint.load_weights(adapters, actor)
            say(f"megarl: LoRA adapters from {adapters}")
        return 0, {}
    root = Path(cfg.checkpoint.load)
    if cfg.checkpoint.ckpt_step < 0 and root != path:  # what a resume from `latest` skipped, and why
        for note in find_resume(root)[1]:
            say(f"megarl: --load {root}: {note}")
    if actor.lora is not None:
        actor.load_hf(cfg.model.hf_checkpoint)
    state = checkpoint.load(path, actor)
    sampler.load_state_dict(state["sampler"])
    say(f"megarl: resumed from {path} at step {state['step']}")
    return state["step"], state["rank_state"]


def save(run: TrainingRun, step: int) -> None:
    """Collective. The algorithm's own models first (a critic), then the actor, the data position, this rank's
    rollout state and the resolved config, so the actor's `latest` step always has everything next to it."""
    c = run.cfg.checkpoint
    run.actor.onload()  # since the sync, the gradients (and with --offload-optimizer the optimizer) are off the GPU
    run.algorithm.save(c.save, step, c.keep_last)
    checkpoint.save(c.save, step, run.actor, {"sampler": run.sampler.state_dict()}, keep_last=c.keep_last,
                    rank_state=run.collect.rank_state(), config=run.record)


def save_when_due(run: TrainingRun, step: int, alarm: bool, elapsed: float) -> str | None:
    """Collective, after each step: save when one is due, and say why the run stops here, if it does. It stops after
    saving when --stop-on-hacking and any rank's hacking alarm went off (`alarm`), or when any rank is past
    --max-train-minutes after `elapsed` seconds of training; every rank agrees on both."""
    t, c, lg = run.cfg.training, run.cfg.checkpoint, run.cfg.logging
    hacked = lg.stop_on_hacking and run.agree_any(alarm)
    out_of_time = run.agree_any(t.max_train_minutes > 0 and elapsed > 60 * t.max_train_minutes)
    if c.save and (out_of_time or hacked or step == t.num_steps or
                   (c.save_interval and step % c.save_interval == 0)):
        save(run, step)
    if hacked:
        return f"megarl: stopped by --stop-on-hacking after step {step} of {t.num_steps}, checkpoint saved in {c.save}"
    if out_of_time:
        return (f"megarl: stopped by --max-train-minutes {t.max_train_minutes:g} after step {step} of "
                f"{t.num_steps}: the learning-rate schedule, set for all the steps, did not finish")
    return None

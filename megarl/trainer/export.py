"""The trained actor out of megarl: an ordinary HF checkpoint (`--save-hf`), or its LoRA adapters in PEFT form
(`--save-peft`)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megarl.mcore.actor import MegatronPolicy
from megarl.mcore.parallel import ParallelInfo
from megarl.trainer.build import TrainingRun


def export(run: TrainingRun) -> None:
    """Collective. What `--save-hf` and `--save-peft` ask for, after the last step."""
    c, m = run.cfg.checkpoint, run.cfg.model
    if c.save_hf:
        save_hf(run.actor, run.tokenizer, m.hf_checkpoint, c.save_hf, run.info)
    if c.save_peft:
        run.actor.save_peft(m.hf_checkpoint, c.save_peft)


def save_hf(actor: MegatronPolicy, tokenizer, src_dir: str, out_dir: str, info: ParallelInfo,
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

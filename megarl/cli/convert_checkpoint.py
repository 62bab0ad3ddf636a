"""Convert a megarl (Megatron dist_checkpointing) checkpoint to a Hugging Face checkpoint directory, offline.

    megarl-convert-checkpoint --load checkpoints/r1_math --out hf/r1_math-step500 [--ckpt-step 500]
    torchrun --nproc-per-node 4 -m megarl.cli.convert_checkpoint --load ... --out ...   # too big for one process

`--load` is a run's checkpoint directory (its latest step, or --ckpt-step N) or one step's `iter_N` directory,
saved at any TP x PP layout. The checkpoint's own `config.json` (written by train.py) names the HF checkpoint the
run started from, whose `config.json` and tokenizer the output copies (`--hf-checkpoint` to take them from
elsewhere), and the padded vocabulary the weights were saved with (the padding rows are dropped). The weights
are loaded at TP = the number of processes, PP 1, and written as safetensors shards by the same code as
train.py's `--save-hf` (`megarl.stages.report.save_hf`). The output loads in `transformers` as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from megarl.config import SAVED_CONFIG, ConfigError
from megarl.preflight import read_shape, resolve_load


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megarl-convert-checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="a run's checkpoint directory, or one step's iter_N directory")
    p.add_argument("--ckpt-step", type=int, default=-1, help="the step to convert (default: the latest)")
    p.add_argument("--out", required=True, help="the HF checkpoint directory to write (must not exist)")
    p.add_argument("--hf-checkpoint", default="", help="take config.json and the tokenizer from this HF directory "
                   "(default: the run's --hf-checkpoint, from the checkpoint's config.json)")
    return p.parse_args(argv)


def plan(args: argparse.Namespace) -> tuple[Path, str, dict]:
    """(the iter_N directory, the HF source directory, the checkpoint's saved config); ConfigError when any is
    missing, before any process group or model exists."""
    path = resolve_load(args.load, args.ckpt_step)
    if path is None:
        raise ConfigError(f"--load {args.load}: no checkpoint there (no 'latest' file and no iter_N given)")
    saved_path = path / SAVED_CONFIG
    if not saved_path.is_file():
        raise ConfigError(f"{path}: no {SAVED_CONFIG} (a checkpoint saved before megarl recorded its config); "
                          "convert it with train.py: --load it with --num-steps <its step> --save-hf DIR")
    saved = json.loads(saved_path.read_text())
    source = args.hf_checkpoint or saved["config"]["model"]["hf_checkpoint"]
    read_shape("--hf-checkpoint", source)  # the architecture must be readable before anything is built
    if Path(args.out).exists():
        raise ConfigError(f"--out {args.out} already exists; choose a new directory")
    return path, source, saved


def convert(path: Path, source: str, saved: dict, out: str) -> None:
    """Collective over the processes (TP = their number): load the weights, write the HF directory."""
    from transformers import AutoTokenizer

    from megarl.mcore import checkpoint, parallel
    from megarl.mcore.actor import MegatronPolicy
    from megarl.model_shape import ModelShape
    from megarl.stages.report import save_hf

    tp = int(os.environ.get("WORLD_SIZE", "1"))
    padded = saved.get("padded_vocab_size", 0)
    if padded % tp:
        raise ConfigError(f"{path} holds a vocabulary padded to {padded} rows, which {tp} processes (TP) cannot "
                          "split evenly; run with a number of processes that divides it")
    info = parallel.init_distributed(tp=tp, pp=1, timeout_s=1800)
    try:
        # The layer spec this machine has (TE and local checkpoints share their names); the run's precision.
        policy = MegatronPolicy(ModelShape.from_pretrained(source), tp=tp, pp=1, trainable=False,
                                bf16=saved["config"]["model"]["bf16"], padded_vocab_size=padded)
        checkpoint.load_weights(path, policy)
        save_hf(policy, AutoTokenizer.from_pretrained(source), source, out, info)
    finally:
        parallel.destroy()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        path, source, saved = plan(args)
        convert(path, source, saved, args.out)
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"convert_checkpoint: error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        print(f"convert_checkpoint: wrote {args.out} from {path} (HF config and tokenizer from {source})")
    return 0


if __name__ == "__main__":  # dist_checkpointing spawns helpers: keep the guard
    sys.exit(main())

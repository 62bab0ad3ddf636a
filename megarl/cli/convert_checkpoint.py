"""Convert a megarl (Megatron dist_checkpointing) checkpoint to a Hugging Face checkpoint directory, offline; with
LoRA, to and from a PEFT adapter directory.

    megarl-convert-checkpoint --load checkpoints/r1_math --out hf/r1_math-step500 [--ckpt-step 500]
    torchrun --nproc-per-node 4 -m megarl.cli.convert_checkpoint --load ... --out ...   # too big for one process
    megarl-convert-checkpoint --load checkpoints/lora_run --to peft --out peft/lora_run     # what --save-peft writes
    megarl-convert-checkpoint --from-peft peft/adapter --out checkpoints/adapter  # then: train.py --lora-checkpoint

`--load` is a run's checkpoint directory (its latest step, or --ckpt-step N) or one step's `iter_N` directory,
saved at any TP x PP layout. The checkpoint's own `config.json` (written by train.py) names the HF checkpoint the
run started from, whose `config.json` and tokenizer the output copies (`--hf-checkpoint` to take them from
elsewhere), and the padded vocabulary the weights were saved with (the padding rows are dropped). The weights
are loaded at TP = the number of processes, PP 1, and written as safetensors shards by the same code as
train.py's `--save-hf` (`megarl.stages.report.save_hf`). The output loads in `transformers` as it is.

A LoRA checkpoint holds the adapters only: the base weights are read from the HF checkpoint (which must be the one
the adapters were trained on: `megarl.mcore.checkpoint` checks its fingerprint), and `--to hf` writes the merged
weights W + (alpha / rank) B A, `--to peft` the adapters as `--save-peft` does. `--from-peft` reads a PEFT LoRA
adapter directory (`adapter_config.json`, `adapter_model.safetensors`) on its base (the directory's
`base_model_name_or_path`, or `--hf-checkpoint`) and writes a megarl adapters checkpoint of step 0, with no training
state, that `train.py --lora-checkpoint` starts a run from.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from megarl.config import SAVED_CONFIG
from megarl.errors import ConfigError
from megarl.preflight import read_shape, resolve_load


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megarl-convert-checkpoint", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", help="a run's checkpoint directory, or one step's iter_N directory")
    source.add_argument("--from-peft", default="", help="a PEFT LoRA adapter directory to convert into a megarl "
                        "adapters checkpoint at --out (for train.py --lora-checkpoint)")
    p.add_argument("--ckpt-step", type=int, default=-1, help="the step to convert (default: the latest)")
    p.add_argument("--out", required=True, help="the directory to write (must not exist)")
    p.add_argument("--to", choices=("hf", "peft"), default="hf", help="with --load: an HF checkpoint (with LoRA: the "
                   "merged weights), or the LoRA adapters as a PEFT adapter directory")
    p.add_argument("--hf-checkpoint", default="", help="take config.json, the tokenizer and (LoRA) the base weights "
                   "from this HF directory (default: the run's --hf-checkpoint, from the checkpoint's config.json; "
                   "with --from-peft: the adapter directory's base_model_name_or_path)")
    args = p.parse_args(argv)
    if args.from_peft and args.to != "hf":
        p.error("--to applies to --load (--from-peft always writes a megarl checkpoint)")
    return args


def plan(args: argparse.Namespace) -> tuple[Path, str, dict]:
    """(the iter_N directory, the HF source directory, the checkpoint's saved config); ConfigError when any is
    missing, before any process group or model exists."""
    if Path(args.out).exists():
        raise ConfigError(f"--out {args.out} already exists; choose a new directory")
    if args.from_peft:
        return Path(args.from_peft), *_peft_plan(args)
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
    if args.to == "peft" and not saved["config"]["model"].get("lora_rank"):
        raise ConfigError(f"--to peft: {path} was saved without --lora-rank, so it holds no adapters; use --to hf")
    return path, source, saved


def _peft_plan(args: argparse.Namespace) -> tuple[str, dict]:
    """(the base's HF directory, the run settings the adapters need) from a PEFT adapter directory."""
    from megarl.config import build_config, saved_config
    from megarl.mcore.lora import TARGETS

    where = Path(args.from_peft)
    if not (where / "adapter_model.safetensors").is_file() or not (where / "adapter_config.json").is_file():
        raise ConfigError(f"--from-peft {where}: no adapter_config.json and adapter_model.safetensors there (a PEFT "
                          "adapter directory, as save_pretrained writes it)")
    c = json.loads((where / "adapter_config.json").read_text())
    targets = c.get("target_modules")
    unsupported = {"peft_type": (c.get("peft_type"), "LORA"), "use_rslora": (c.get("use_rslora", False), False),
                   "use_dora": (c.get("use_dora", False), False), "bias": (c.get("bias", "none"), "none"),
                   "fan_in_fan_out": (c.get("fan_in_fan_out", False), False)}
    for key, (value, wanted) in unsupported.items():
        if value != wanted:
            raise ConfigError(f"--from-peft {where}: adapter_config.json has {key} {value!r}; megarl's LoRA takes "
                              f"{wanted!r}")
    if not isinstance(targets, list) or not targets or set(targets) - set(TARGETS):
        raise ConfigError(f"--from-peft {where}: target_modules {targets!r}; megarl adapts a list among "
                          f"{', '.join(TARGETS)}")
    if c.get("rank_pattern") or c.get("alpha_pattern"):
        raise ConfigError(f"--from-peft {where}: a rank_pattern or alpha_pattern (one rank for every layer here)")
    source = args.hf_checkpoint or c.get("base_model_name_or_path") or ""
    if not source:
        raise ConfigError(f"--from-peft {where}: adapter_config.json names no base_model_name_or_path; give the "
                          "base with --hf-checkpoint")
    read_shape("--hf-checkpoint", source)
    cfg = build_config({"hf_checkpoint": source, "lora_rank": c["r"], "lora_alpha": float(c["lora_alpha"]),
                        "lora_dropout": float(c.get("lora_dropout", 0.0)), "lora_target_modules": ",".join(targets)})
    return source, saved_config(cfg, command=sys.argv, world_size=1, converted_from_peft=str(where.resolve()))


def convert(path: Path, source: str, saved: dict, out: str, to: str = "hf", from_peft: bool = False) -> None:
    """Collective over the processes (TP = their number): load the weights, write the HF or PEFT directory, or
    (`from_peft`: `path` is a PEFT adapter directory) the megarl adapters checkpoint."""
    from transformers import AutoTokenizer

    from megarl.mcore import checkpoint, parallel
    from megarl.stages.report import save_hf

    tp = int(os.environ.get("WORLD_SIZE", "1"))
    padded = padded_rows(path, source, saved, tp)
    info = parallel.init_distributed(tp=tp, pp=1, timeout_s=1800)
    try:
        policy = build_policy(source, saved, tp, padded)
        if from_peft:
            _load_peft(policy, path)
            checkpoint.save_lora_adapters(out, policy, {**saved, "padded_vocab_size": padded})
            return
        checkpoint.load_weights(path, policy)
        if to == "peft":
            policy.save_peft(source, out)
        else:
            save_hf(policy, AutoTokenizer.from_pretrained(source), source, out, info)
    finally:
        parallel.destroy()


def padded_rows(path: Path, source: str, saved: dict, tp: int) -> int:
    """The vocabulary rows the checkpoint's weights were saved with; ConfigError when `tp` cannot split them."""
    from megarl.model_shape import ModelShape
    from megarl.preflight import padded_vocab_size

    padded = saved.get("padded_vocab_size") or padded_vocab_size(ModelShape.from_pretrained(source).vocab_size, 1, tp)
    if padded % tp:
        raise ConfigError(f"{path} holds a vocabulary padded to {padded} rows, which {tp} processes (TP) cannot "
                          "split evenly; run with a number of processes that divides it")
    return padded


def build_policy(source: str, saved: dict, tp: int, padded: int):
    """The run's model at TP `tp`, PP 1, in the run's precision and LoRA layout, without the checkpoint's weights
    (`megarl.mcore.checkpoint.load_weights` loads them); with LoRA the frozen base is loaded from `source`, since a
    LoRA checkpoint holds the adapters only. The process groups must exist (`parallel.init_distributed`)."""
    from megarl.config import ModelConfig
    from megarl.mcore import lora
    from megarl.mcore.actor import MegatronPolicy
    from megarl.model_shape import ModelShape

    m = saved["config"]["model"]
    # The layer spec this machine has (TE and local checkpoints share their names); the run's precision.
    opts = lora.LoRAOptions.from_config(ModelConfig(**{k: v for k, v in m.items() if k.startswith("lora_")
                                                       and k != "lora_checkpoint"}))
    policy = MegatronPolicy(ModelShape.from_pretrained(source), tp=tp, pp=1, trainable=opts.rank > 0, bf16=m["bf16"],
                            padded_vocab_size=padded, lora=opts)
    if opts.rank:
        policy.load_hf(source)
    return policy


def _load_peft(policy, where: Path) -> None:
    """The adapter tensors of a PEFT directory into `policy`'s adapters: every one there, and nothing else."""
    from safetensors.torch import load_file

    from megarl.mcore import lora

    tensors = load_file(str(where / "adapter_model.safetensors"))
    expected = set(lora.peft_tensors(policy.model))
    if extra := sorted(tensors.keys() - expected):
        raise ConfigError(f"--from-peft {where}: tensors megarl's adapters have no place for, e.g. {extra[0]}")
    try:
        lora.load_peft_tensors(policy.model, tensors)
    except KeyError as e:
        raise ConfigError(f"--from-peft {where}: {e.args[0]}") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        path, source, saved = plan(args)
        convert(path, source, saved, args.out, to=args.to, from_peft=bool(args.from_peft))
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"convert_checkpoint: error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        what = ("a megarl adapters checkpoint (train.py --lora-checkpoint)" if args.from_peft else
                "a PEFT adapter directory" if args.to == "peft" else "an HF checkpoint")
        print(f"convert_checkpoint: wrote {args.out}, {what}, from {path} (base and tokenizer: {source})")
    return 0


if __name__ == "__main__":  # dist_checkpointing spawns helpers: keep the guard
    sys.exit(main())

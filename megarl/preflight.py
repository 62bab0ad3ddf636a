"""What the flags and the checkpoints on disk say before any process group, model or data exists.

Standard library only. train.py runs `check_run` on every rank before any work
(`megarl.stages.setup.check_before_start` adds what needs the machine: a GPU, Transformer Engine), and the Slurm and
nemo-run launchers run it on the batch host before they start anything (`launch/render.py check`). So a run that
cannot work stops at once, with every problem listed in one message naming the flag and the config field, and exit
status 2, which the launchers never requeue. What it checks:
- the layout: TP x PP x CP and expert-TP x EP x PP divide the world size, and DP the prompts;
- the actor's `config.json`: an architecture megarl trains (`ModelShape`), heads, KV heads and the MLP divisible
  by TP, layers by PP, experts by EP and their width by expert-TP (EP > 1 only for a mixture of experts),
  safetensors present; the reference's architecture equal to the actor's;
- lengths: --max-prompt-len + --max-response-len within the model's `max_position_embeddings`;
- `--load` / `--ckpt-step`: which checkpoint resumes (none yet: a fresh start), and that its padded vocabulary is
  the one this run builds.
A vocabulary that TP does not divide is padded as Megatron pads it (`padded_vocab_size`), never refused.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from megarl.checkpoint_layout import LATEST, resolve_load
from megarl.checkpoint_layout import complete_steps, iter_name  # noqa: F401 - importable here, their home before
from megarl.config import SAVED_CONFIG, Config
from megarl.errors import ConfigError
from megarl.model_shape import ModelShape


class LaunchError(ValueError):
    """A launch that cannot work as asked (launch/render.py, launch/nemo_run_launcher.py); the message says why."""


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    world_size: int
    cp: int = 1  # context parallel: CP ranks share one DP rank's samples


def parallel_layout(cfg: Config, world_size: int) -> Layout:
    """TP x PP x CP x DP = world size, and the prompts split evenly over DP; else ConfigError naming the flags."""
    m = cfg.model
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    if world_size % (tp * pp * cp):
        raise ConfigError(f"the world size {world_size} (processes, GPUs) is not divisible by "
                          f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} x "
                          f"--context-parallel-size {cp}; use a multiple of their product")
    ep, etp = m.expert_model_parallel_size, m.expert_tensor_parallel_size or tp
    if world_size % (etp * ep * pp):
        raise ConfigError(f"the world size {world_size} is not divisible by --expert-tensor-parallel-size {etp} x "
                          f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp} (the experts' "
                          "grid spans the same ranks as the rest of the model's); use a multiple of their product")
    dp = world_size // (tp * pp * cp)
    if cfg.data.rollout_batch_size % dp:
        raise ConfigError(f"--rollout-batch-size {cfg.data.rollout_batch_size} is not divisible by the data-parallel "
                          f"size {dp} ({world_size} processes / TP {tp} / PP {pp} / CP {cp})")
    return Layout(tp, pp, dp, world_size, cp)


def padded_vocab_size(vocab_size: int, multiple: int, tp: int) -> int:
    """Megatron's padding (`--make-vocab-size-divisible-by`): the embedding and output layer get rows up to the
    next multiple of `multiple` x TP, so that every TP rank holds as many. The extra rows are no token: the actor
    masks their logits and an HF export drops them."""
    step = multiple * tp
    return math.ceil(vocab_size / step) * step


def prompt_limit(cfg: Config, shape: ModelShape) -> int:
    """The longest prompt, in tokens, the run takes: --max-prompt-len, or what the model's positions leave
    after --max-response-len."""
    return cfg.data.max_prompt_len or shape.max_position_embeddings - cfg.rollout.max_response_len


def read_shape(flag: str, path: str) -> ModelShape:
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ConfigError(f"{flag} {path}: not an HF checkpoint directory (no config.json)")
    try:
        return ModelShape.from_hf_config(json.loads(config.read_text()), source=str(config))
    except (ValueError, KeyError, TypeError) as e:  # KeyError: a required field is absent
        what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        raise ConfigError(f"{flag} {path}: {what}") from None


def model_problems(cfg: Config, shape: ModelShape, where: str) -> list[str]:
    """What stops `shape` from training with these flags (an empty list: nothing)."""
    m, r = cfg.model, cfg.rollout
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    problems = []
    for count, field in ((shape.num_attention_heads, "num_attention_heads"),
                         (shape.num_kv_heads, "num_key_value_heads"), (shape.ffn_hidden_size, "intermediate_size")):
        if count % tp:
            fits = max(t for t in range(1, tp) if shape.num_attention_heads % t == 0 and shape.num_kv_heads % t == 0
                       and shape.ffn_hidden_size % t == 0)
            problems.append(f"{where}: {field} = {count} is not divisible by --tensor-model-parallel-size {tp} "
                            f"(the largest TP below {tp} that divides this model: {fits})")
    if shape.num_layers % pp:
        problems.append(f"{where}: num_hidden_layers = {shape.num_layers} is not divisible by "
                        f"--pipeline-model-parallel-size {pp}")
    problems += _expert_problems(m, shape, where, cfg.algorithm.routing_replay)
    context = shape.max_position_embeddings
    if r.max_response_len >= context:
        problems.append(f"{where}: --max-response-len {r.max_response_len} leaves no room for a prompt in the "
                        f"model's {context} positions (max_position_embeddings); lower it")
    elif cfg.data.max_prompt_len + r.max_response_len > context:
        problems.append(f"{where}: --max-prompt-len {cfg.data.max_prompt_len} + --max-response-len "
                        f"{r.max_response_len} = {cfg.data.max_prompt_len + r.max_response_len} tokens exceed the "
                        f"model's {context} positions (max_position_embeddings); lower one of them")
    return problems


def _expert_families() -> str:
    """The registered families with experts (`megarl.models`), for messages."""
    from megarl.models import FAMILIES

    return ", ".join(n for n in FAMILIES.names() if FAMILIES.get(n).moe)


def _expert_problems(m, shape: ModelShape, where: str, routing_replay: bool = False) -> list[str]:
    ep, etp = m.expert_model_parallel_size, m.expert_tensor_parallel_size
    if not shape.is_moe:
        problems = []
        if ep > 1 or etp > 1:
            problems.append(f"{where}: --expert-model-parallel-size {ep} / --expert-tensor-parallel-size {etp}: a "
                            f"{shape.family} model has no experts (the families with experts: "
                            f"{_expert_families()}); leave them at 1 and 0")
        if routing_replay:
            problems.append(f"{where}: --routing-replay: a {shape.family} model has no routers to replay")
        return problems
    problems = []
    if shape.num_experts % ep:
        fits = max(e for e in range(1, ep) if shape.num_experts % e == 0)
        problems.append(f"{where}: num_experts = {shape.num_experts} is not divisible by --expert-model-parallel-size "
                        f"{ep} (the largest EP below {ep} that divides it: {fits})")
    if m.tensor_model_parallel_size > 1 and not m.sequence_parallel:
        problems.append(f"{where}: a mixture-of-experts model trains at --tensor-model-parallel-size "
                        f"{m.tensor_model_parallel_size} only with --sequence-parallel (Megatron's MoE layer needs "
                        "the tokens split over TP ranks)")
    etp = etp or m.tensor_model_parallel_size
    if shape.moe_ffn_hidden_size % etp:
        problems.append(f"{where}: moe_intermediate_size = {shape.moe_ffn_hidden_size} is not divisible by "
                        f"--expert-tensor-parallel-size {etp} (0 = the TP size)")
    return problems


def check_model(cfg: Config, required: bool = True, problems: list[str] | None = None) -> ModelShape | None:
    """The actor's architecture from `--hf-checkpoint`'s config.json, after every check above; ConfigError lists
    every problem, `problems` found before (the layout's) first. With `required` False (the batch host, which may
    not see the checkpoint's file system) an unreadable checkpoint is None."""
    m = cfg.model
    problems = list(problems or [])
    if not m.hf_checkpoint:
        raise ConfigError("\n  ".join([*problems, "--hf-checkpoint is required"]))
    shape = None
    if required or (Path(m.hf_checkpoint) / "config.json").is_file():
        shape = read_shape("--hf-checkpoint", m.hf_checkpoint)
        problems += model_problems(cfg, shape, f"--hf-checkpoint {m.hf_checkpoint}")
        if not any(Path(m.hf_checkpoint).glob("*.safetensors")):
            problems.append(f"--hf-checkpoint {m.hf_checkpoint}: no *.safetensors weight files there")
    if shape is not None and m.ref_checkpoint and m.ref_checkpoint != m.hf_checkpoint:
        if read_shape("--ref-checkpoint", m.ref_checkpoint) != shape:
            problems.append(f"--ref-checkpoint {m.ref_checkpoint}: its architecture differs from --hf-checkpoint's "
                            "(the reference is built with the actor's shape; use a checkpoint of the same model)")
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError("\n  ".join([f"the run cannot start as configured ({len(problems)} problems):", *problems]))
    return shape


def check_resume(cfg: Config, shape: ModelShape | None) -> Path | None:
    """The checkpoint this run resumes from (None: a fresh start), with the vocabulary padding it was saved with
    equal to the one this run builds (dist_checkpointing cannot load other shapes)."""
    c, m = cfg.checkpoint, cfg.model
    if c.save:  # a run that cannot save must not train for hours first
        probe = Path(c.save) / f".megarl-write-test-{os.getpid()}"
        try:
            Path(c.save).mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"megarl")
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"--save {c.save}: cannot write there ({e.filename or probe}: {e.strerror or e})") \
                from None
    path = resolve_load(c.load, c.ckpt_step) if c.load else None
    if path is None and c.load and c.save and Path(c.save).resolve() != Path(c.load).resolve() \
            and resolve_load(c.save) is not None:
        # A mistyped --load would start afresh and save over the run that --save holds.
        raise ConfigError(f"--load {c.load} holds no checkpoint, but --save {c.save} does "
                          f"({(Path(c.save) / LATEST).read_text().strip()}): resume with --load {c.save}, or give "
                          "this run a --save of its own")
    saved = path / SAVED_CONFIG if path is not None else None
    if shape is None or saved is None or not saved.is_file():
        return path
    before = json.loads(saved.read_text()).get("padded_vocab_size")
    now = padded_vocab_size(shape.vocab_size, m.make_vocab_size_divisible_by, m.tensor_model_parallel_size)
    if before is not None and before != now:
        tp = m.tensor_model_parallel_size
        fix = (f"; --make-vocab-size-divisible-by {before // tp} keeps the saved {before} rows at TP {tp}"
               if before % tp == 0 else "")
        raise ConfigError(f"--load {c.load}: {path.name} holds a vocabulary padded to {before} rows; this run "
                          f"(TP {tp}, --make-vocab-size-divisible-by {m.make_vocab_size_divisible_by}) pads "
                          f"{shape.vocab_size} to {now}{fix}")
    return path


def check_run(cfg: Config, world_size: int, required: bool = True) -> tuple[Layout, ModelShape | None, Path | None]:
    """Everything above, in order: the layout, the model (None: not readable here and not `required`), the
    checkpoint to resume from (None: a fresh start)."""
    try:
        layout, problems = parallel_layout(cfg, world_size), []
    except ConfigError as e:
        layout, problems = None, [str(e)]
    shape = check_model(cfg, required=required, problems=problems)  # raises when there are problems
    return layout, shape, check_resume(cfg, shape)

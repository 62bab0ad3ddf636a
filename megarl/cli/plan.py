"""Size a megarl run before launching it: per-GPU memory by component, what will not fit, step time split into
rollout / training / weight sync, and whether to run colocated or disaggregated, with the reason.

    megarl-plan recipes/r1_math.sh --gpus 8                       # a recipe on one 8-GPU node
    megarl-plan recipes/models/llama-3.1-70b.sh --nodes 8 -- --rollout-batch-size 64 --kl-coef 0.001
    megarl-plan --model /models/Qwen2.5-7B/config.json --gpus 8 -- --tensor-model-parallel-size 4

The first argument is a recipe or a model shape file (recipes/models/<m>.sh, itself a small recipe); megarl
flags after `--` override it, exactly as on train.py's command line. The architecture comes from --model (an HF
config.json, its directory, or a shape file), else the MODEL_SHAPE a shape file defines, else the config.json of
the recipe's --hf-checkpoint. Formulas and assumptions: megarl/planner.py's docstring.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from megarl.arguments import parse_args
from megarl.errors import ConfigError
from megarl.model_shape import ModelShape
from megarl.planner import (GIB, GPUS, Cluster, Plan, RunSettings, active_params, expert_bytes_per_gpu,
                         kv_bytes_per_token, lora_params, lora_stage_params, num_params, plan, recommend,
                         reward_model_params)
from megarl.preflight import model_problems, prompt_limit

_SHAPE_DUMP = ('source "$1" >/dev/null; '
               'for k in "${!MODEL_SHAPE[@]}"; do printf "%s\\0%s\\0" "$k" "${MODEL_SHAPE[$k]}"; done')
_TEACHER_DUMP = _SHAPE_DUMP.replace("MODEL_SHAPE", "TEACHER_SHAPE")


def _value(text: str):
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def shape_from_bash(path: str | Path, dump: str = _SHAPE_DUMP) -> ModelShape | None:
    """The MODEL_SHAPE associative array (HF config.json keys) a recipe or shape file defines, if any (with
    `_TEACHER_DUMP`: its TEACHER_SHAPE, the distillation teacher's)."""
    proc = subprocess.run(["bash", "-c", dump, "plan", str(Path(path).resolve())], capture_output=True,
                          text=True, timeout=30)
    if proc.returncode:
        raise ConfigError(f"{path}: bash failed: {proc.stderr.strip()[-400:]}")
    words = proc.stdout.split("\0")[:-1]
    if not words:
        return None
    return ModelShape.from_hf_config({k: _value(v) for k, v in zip(words[::2], words[1::2])}, source=str(path))


def load_shape(model: str | None, recipe: str | None, hf_checkpoint: str) -> ModelShape:
    for candidate in (model, recipe):
        if not candidate:
            continue
        p = Path(candidate)
        if p.suffix == ".sh":
            shape = shape_from_bash(p)
            if shape:
                return shape
        elif p.is_dir():
            return ModelShape.from_pretrained(p)
        elif p.suffix == ".json":
            return ModelShape.from_hf_config(json.loads(p.read_text()), source=str(p))
    if hf_checkpoint and (Path(hf_checkpoint) / "config.json").is_file():
        return ModelShape.from_pretrained(hf_checkpoint)
    raise ConfigError(f"no model shape: give --model (config.json, an HF directory or recipes/models/<m>.sh), or a "
                      f"recipe whose model file defines MODEL_SHAPE, or a --hf-checkpoint with config.json "
                      f"(got {hf_checkpoint or 'none'})")


def _gb(x: float) -> str:
    return f"{x / GIB:7.1f}"


def format_plan(p: Plan, title: str, gpus_per_node: int = 8) -> str:
    r = p.run
    lines = [f"== {title}"]
    for m in p.memory:
        names = list(dict.fromkeys(k for ph in m.phases for k in ph.components))
        head = f"  {m.pool} ({m.gpus}), GiB per GPU"
        lines.append(f"{head:<48}" + "".join(f"{ph.name:>28}" for ph in m.phases))
        for k in names:
            lines.append(f"    {k:<44}" + "".join(f"{_gb(ph.components.get(k, 0.0)):>28}" for ph in m.phases))
        lines.append(f"    {'total':<44}" + "".join(f"{_gb(ph.total):>28}" for ph in m.phases)
                     + f"   of {m.capacity / GIB:.1f}: {'fits' if m.fits else 'DOES NOT FIT'}")
        lines.append(f"    peak: {m.peak_phase.name}, {m.peak / GIB:.1f} GiB per GPU")
        for k, v in m.host.items():
            lines.append(f"    host memory of the pushing rank: {k} {v / GIB:.1f} GiB (--async-staleness: the "
                         "weights a sync queued, until the engine has loaded them; none on the GPUs)")
        if m.kv_pool:
            lines.append(f"    KV cache for the whole batch at once: {m.kv_needed / GIB:.1f} GiB per GPU, pool "
                         f"{m.kv_pool / GIB:.1f} GiB -> {p.time.waves} decoding wave(s)")
        lines += [f"    ! {msg}" for msg in m.problems]
    t = p.time
    lines.append(f"  step time ~{t.total:.0f} s: rollout {t.rollout:.0f} s, training {t.training:.0f} s, "
                 f"weight sync {t.weight_sync:.1f} s")
    if r.mode == "disaggregated":
        lines.append(f"  synchronous ~{t.synchronous:.0f} s a step; asynchronous (--async-staleness >= 1: rollout "
                     f"beside training) ~{t.asynchronous:.0f} s{' (this run)' if t.overlapped else ''}")
        lines.append(f"  split: {r.rollout_gpus} rollout GPUs (engine TP {r.engine_tp}), the rest train")
        nodes, rem = divmod(r.rollout_gpus, gpus_per_node)
        if not rem and p.memory[0].gpus:
            lines.append(f"  launch: ROLLOUT_NODES={nodes} SGLANG_TP={r.engine_tp} sbatch --nodes "
                         f"{(r.rollout_gpus + p.memory[0].gpus) // gpus_per_node} "
                         "launch/slurm/disaggregated.sbatch <recipe>")
    return "\n".join(lines)


def _layout_that_divides(run: RunSettings, shape: ModelShape, gpus: int) -> RunSettings:
    """`run`, or, when its TP x PP x CP does not divide the GPUs, the same run at the largest lower TP that does
    (and divides the model's heads), said on stdout: a layout that cannot start is no memory verdict."""
    unit = run.pp * run.cp
    if gpus % (run.tp * unit) == 0:
        return run
    lower = [t for t in range(run.tp - 1, 0, -1) if gpus % (t * unit) == 0 and shape.num_attention_heads % t == 0
             and shape.num_kv_heads % t == 0]
    if not lower:
        print(f"! TP {run.tp} x PP {run.pp} x CP {run.cp} needs a multiple of {run.tp * unit} GPUs, not {gpus}, and no "
              "lower TP divides them: change --pipeline-model-parallel-size or the GPU count")
        return run
    tp = lower[0]
    off = " --no-sequence-parallel" if tp == 1 and run.sequence_parallel else ""
    print(f"! TP {run.tp} x PP {run.pp} x CP {run.cp} needs a multiple of {run.tp * unit} GPUs, not {gpus}: planned "
          f"at --tensor-model-parallel-size {tp}{off} instead (pass it after --, or use more GPUs)")
    return replace(run, tp=tp, sequence_parallel=run.sequence_parallel and tp > 1)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(prog="megarl-plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", nargs="?", help="recipes/<r>.sh or recipes/models/<m>.sh; megarl flags go after --")
    ap.add_argument("--model", help="HF config.json, HF checkpoint directory, or recipes/models/<m>.sh")
    ap.add_argument("--gpus", type=int, help="GPUs in the job (default: --nodes x --gpus-per-node)")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    ap.add_argument("--internode-gbps", type=float, default=3200.0, help="network into one node, Gbit/s")
    ap.add_argument("--mode", choices=("auto", "colocated", "disaggregated"), default="auto",
                    help="auto: plan both and recommend one")
    ap.add_argument("--rollout-gpus", type=int, default=0, help="disaggregated: GPUs for SGLang (0 = best split)")
    ap.add_argument("--engine-tp", type=int, default=0, help="SGLang TP (default --sglang-tp-size, else the actor's)")
    ap.add_argument("--prompt-len", type=int, default=256, help="mean prompt tokens")
    ap.add_argument("--mean-response-frac", type=float, default=0.6, help="mean response length / --max-response-len")
    ap.add_argument("--mfu", type=float, default=0.35, help="training model-FLOPs utilisation")
    args = ap.parse_args(own)
    try:
        cfg = parse_args([args.recipe, *flags] if args.recipe else flags, check_registries=False)
        shape = load_shape(args.model, args.recipe, cfg.model.hf_checkpoint)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    gpus = args.gpus or args.nodes * args.gpus_per_node
    cluster = Cluster(GPUS[args.gpu], gpus, min(args.gpus_per_node, gpus), args.internode_gbps)
    run = RunSettings.from_config(cfg, prompt_len=args.prompt_len, mean_response_frac=args.mean_response_frac,
                                  mfu=args.mfu)
    if args.engine_tp:
        run = replace(run, engine_tp=args.engine_tp)
    teacher = cfg.model.teacher
    if teacher and not run.teacher_params and not teacher.startswith(("http://", "https://")):
        t_shape = shape_from_bash(args.recipe, _TEACHER_DUMP) if args.recipe else None
        if t_shape is None:
            print(f"plan: --teacher {teacher}: no config.json there and no TEACHER_SHAPE in the recipe",
                  file=sys.stderr)
            return 2
        run = replace(run, teacher_params=float(num_params(t_shape)))
    if run.teacher_params:
        print(f"teacher: {run.teacher_params / 1e9:.2f}B parameters, frozen, sharded like the actor")
    print(f"model: {shape.family}, {num_params(shape) / 1e9:.2f}B parameters ({2 * num_params(shape) / GIB:.1f} GiB "
          f"in bf16), {shape.num_layers} layers, {shape.max_position_embeddings} positions, KV cache "
          f"{kv_bytes_per_token(shape) / 1024:.0f} KiB/token")
    if shape.is_moe:
        print(f"experts: {shape.num_experts} per sparse layer in {len(shape.moe_layers)} layers, top-"
              f"{shape.moe_top_k}: {active_params(shape) / 1e9:.2f}B parameters active per token; EP {run.ep} x "
              f"expert-TP {run.etp or run.tp}: {expert_bytes_per_gpu(shape, run) / GIB:.1f} GiB of bf16 expert weights "
              "per GPU")
    refused = model_problems(cfg, shape, "train.py would stop")
    run = _layout_that_divides(run, shape, gpus)
    if run.lora_rank:
        trained = lora_params(shape, run.lora_rank, run.lora_targets)
        print(f"LoRA: rank {run.lora_rank} on {','.join(run.lora_targets)}: {trained:,} trainable parameters "
              f"({100 * trained / num_params(shape):.2f} % of the model; {lora_stage_params(shape, run):,.0f} per "
              "GPU), which alone take gradients and optimizer state; the reference is the actor with its adapters "
              "off (no second model)")
    print(f"cluster: {gpus} x {cluster.gpu.name}; TP {run.tp} x PP {run.pp}; {run.rollout_batch_size} prompts x "
          f"{run.n_samples_per_prompt} samples, prompt ~{run.prompt_len} (at most "
          f"{max(0, prompt_limit(cfg, shape))}) + response <= {run.max_response_len} tokens, micro-batch "
          f"{run.micro_batch_size}")
    for problem in refused:
        print(f"! {problem}")
    reward_model = cfg.components["reward_model.hf_rm"].reward_model
    if reward_model:
        rm = ModelShape.from_hf_config(json.loads((Path(reward_model) / "config.json").read_text()),
                                       source=reward_model)
        servers = max(1, cluster.gpus_per_node // (run.tp * run.pp * run.cp))
        params = reward_model_params(rm)
        print(f"reward model (--reward-model): {params:,} parameters, {4 * params / GIB:.2f} GiB in fp32 per reward "
              f"server, loaded once by each; {servers} per node (one per model replica's leader) = "
              f"{servers * 4 * params / GIB:.2f} GiB of host memory, none on the GPUs")
    if args.mode == "auto":
        choice, why, colo, dis = recommend(shape, run, cluster)
        print(format_plan(colo, "colocated"))
        if dis is not colo:
            print(format_plan(dis, "disaggregated (best split)", cluster.gpus_per_node))
        print(f"recommendation: {choice}: {why}")
        return 0 if choice != "neither" and not refused else 1
    p = plan(shape, replace(run, mode=args.mode, rollout_gpus=args.rollout_gpus), cluster)
    print(format_plan(p, args.mode, cluster.gpus_per_node))
    return 0 if p.fits and not refused else 1


if __name__ == "__main__":
    sys.exit(main())

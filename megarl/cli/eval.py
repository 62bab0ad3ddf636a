"""`megarl-eval`: pass@k, maj@k and greedy accuracy of a checkpoint on a data file, by source and overall, with
bootstrap confidence intervals over prompts.

    megarl-eval --checkpoint checkpoints/run                      # the run's latest step, on the run's --eval-data
    megarl-eval --checkpoint .cache/starter --data .cache/starter/heldout.jsonl --eval-samples-per-prompt 8 --k 1,8
    megarl-eval recipes/tiny_cpu_code.sh --checkpoint hf/exported --data humaneval --k 1,10 \\
        --eval-samples-per-prompt 10 --max-response-len 512 --rollout-backend sglang --out runs/eval/humaneval

`--checkpoint` is an HF directory (config.json and safetensors: a starter, `--save-hf`'s or
`megarl-convert-checkpoint`'s output) or a megarl checkpoint (a run's `--save` directory, its latest step or
`--ckpt-step N`, or one `iter_N`): its weights are loaded into the run's Megatron model and synced into the engine
as the trainer syncs them. A megarl checkpoint brings its run's settings (its `config.json` is the recipe, so the
same engine, temperature, lengths, reward and held-out data); a recipe or saved config given first, and any
trainer flag after it, override them. `--data` is a jsonl or parquet file of megarl rows (prompt, answer, verifier,
source) or a dataset by name (`eval_datasets.py`: humaneval, arithmetic, code_functions, math_forms); by
default the recipe's `--eval-data`. Each row is judged by its own verifier (any the registry holds, plugins' too),
`--verifier SPEC` judges every row by SPEC instead.

The samples are drawn exactly as the trainer's evaluation draws them (`megarl.evaluation.generate`): every prompt
in one batch, `--eval-samples-per-prompt` N samples each at `--rollout-temperature` with seed `--seed` + 17, and
one greedy sample each, so pass@1 here equals the trainer's held-out `sampled` accuracy of the same weights, and
`greedy` its greedy one (a run on one DP rank; with several, rank r draws its share of the prompts with seed + 17
+ r). pass@k is Chen et al.'s unbiased estimator, maj@k a vote over the verifier's extracted
answers (`megarl.evaluation.metrics`); each figure comes with a percentile bootstrap interval over prompts
(`--bootstrap` draws, `--confidence`, seeded by `--bootstrap-seed`).

Writes `--out`: `eval.json` (every figure, overall and by source, with the settings), `eval.md` (the table, also
printed), `prompts.jsonl` (each prompt's verdicts and answers) and, for a dataset given by name, `data.jsonl` (its
rows). An `--out` that already holds an `eval.json` is refused, so no result is overwritten.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from megarl.config import SAVED_CONFIG, Config
from megarl.errors import ConfigError

PROG = "megarl-eval"


def _own_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], add_help=False,
                                usage=f"{PROG} [recipe.sh | config.json] --checkpoint DIR [--data FILE | NAME] "
                                "[--k K,...] [options] [trainer flags]",
                                epilog="Any trainer flag (megarl/train.py --help) may follow: --rollout-backend, "
                                "--rollout-temperature, --max-response-len, --seed, --eval-samples-per-prompt, "
                                "--eval-max-prompts, --apply-chat-template, --reward-workers, a verifier's options...")
    p.add_argument("--checkpoint", required=True, help="an HF checkpoint directory, or a megarl checkpoint (a run's "
                   "--save directory or one iter_N)")
    p.add_argument("--ckpt-step", type=int, default=-1, help="with a run's checkpoint directory: the step to "
                   "evaluate (default: the latest)")
    p.add_argument("--data", default="", help="a jsonl / parquet file of megarl rows, or a dataset by name "
                   "(humaneval, arithmetic, code_functions, math_forms); default: the recipe's --eval-data")
    p.add_argument("--k", default="", help="comma-separated k of pass@k (and maj@k for k > 1), each at most "
                   "--eval-samples-per-prompt (default: 1 and --eval-samples-per-prompt)")
    p.add_argument("--verifier", default="", help="judge every row by this verifier or reward spec instead of the "
                   "row's own `verifier` field")
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy pass (one sample a prompt at "
                   "temperature 0)")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples of the prompts for the "
                   "confidence intervals (0: none)")
    p.add_argument("--confidence", type=float, default=0.95, help="the intervals' coverage, in (0, 1)")
    p.add_argument("--bootstrap-seed", type=int, default=0, help="seed of the bootstrap's draws")
    p.add_argument("--out", default="", help="directory to write (default: runs/eval/<checkpoint name>); must not "
                   "hold an eval.json yet")
    return p


@dataclass
class Plan:
    """What the command will do, settled before any model is built."""

    cfg: Config
    checkpoint: Path  # the HF directory, or the iter_N directory
    megatron: dict | None  # a megarl checkpoint's saved config; None for an HF directory
    step: int | None  # a megarl checkpoint's step
    data: str  # the data file ("" until a named dataset is written)
    dataset: str  # the dataset's name when --data named one, else ""
    ks: list[int]
    metrics: list[str]
    greedy: bool
    out: Path
    bootstrap: dict  # resamples, seed, confidence
    verifier: str  # --verifier: every row judged by it ("" = each row's own)


def plan(argv: list[str]) -> Plan:
    """The command line settled into a `Plan`; ConfigError naming the flag for anything wrong."""
    from megarl.arguments import parse_args
    from megarl.checkpoint_layout import resolve_load
    from megarl.cli.eval_datasets import DATASETS
    from megarl.evaluation.metrics import check_ks

    recipe = [argv[0]] if argv and not argv[0].startswith("-") else []
    own, rest = _own_parser().parse_known_args(argv[len(recipe):])
    where = Path(own.checkpoint)
    if not where.exists():
        raise ConfigError(f"--checkpoint {where}: no such directory")
    iter_dir = resolve_load(str(where), own.ckpt_step)
    saved = None
    if iter_dir is not None:
        if not (iter_dir / SAVED_CONFIG).is_file():
            raise ConfigError(f"--checkpoint {iter_dir}: no {SAVED_CONFIG} (a checkpoint saved before megarl recorded "
                              "its config); export it with train.py --load it --num-steps <its step> --save-hf DIR")
        saved = json.loads((iter_dir / SAVED_CONFIG).read_text())
        # the run's own HF directory (config.json, tokenizer) unless the command line names another
        base = [*(recipe or [str(iter_dir / SAVED_CONFIG)]),
                "--hf-checkpoint", saved["config"]["model"]["hf_checkpoint"]]
        cfg = parse_args([*base, *rest, "--async-staleness", "0"])
        checkpoint = iter_dir
    elif _is_hf(where):
        cfg = parse_args([*recipe, *rest, "--hf-checkpoint", str(where), "--async-staleness", "0"])
        checkpoint = where
    else:
        raise ConfigError(f"--checkpoint {where}: neither a megarl checkpoint (an iter_N directory, or a --save "
                          "directory with a 'latest' file) nor an HF checkpoint directory (config.json and "
                          "*.safetensors)")
    n = cfg.logging.eval_samples_per_prompt
    try:
        ks = sorted({int(k) for k in own.k.split(",") if k.strip()}) if own.k else sorted({1, n})
        check_ks(ks, n, what="--k")
    except ValueError as e:
        raise ConfigError(f"--k {own.k}: {e} (--eval-samples-per-prompt {n})" if own.k else str(e)) from None
    if own.verifier:
        from megarl.reward.compose import spec_error

        if error := spec_error(own.verifier):
            raise ConfigError(f"--verifier {own.verifier}: {error}")
    if not 0 < own.confidence < 1:
        raise ConfigError(f"--confidence {own.confidence}: must be in (0, 1), e.g. 0.95")
    if own.bootstrap < 0:
        raise ConfigError(f"--bootstrap {own.bootstrap}: the number of resamples, >= 0 (0: no intervals)")
    data = own.data or cfg.data.eval_data
    if not data:
        raise ConfigError("--data is required (a jsonl / parquet file, or a dataset: "
                          f"{', '.join(DATASETS)}): the recipe names no --eval-data")
    dataset = "" if Path(data).is_file() or data not in DATASETS else data
    if not dataset and not Path(data).is_file():
        raise ConfigError(f"--data {data}: no such file, and no dataset of that name (datasets: {', '.join(DATASETS)})")
    out = Path(own.out) if own.out else Path("runs/eval") / (where.resolve().name or "checkpoint")
    if (out / "eval.json").exists():
        raise ConfigError(f"--out {out} already holds an eval.json; choose a new directory (nothing was overwritten)")
    metrics = [f"pass@{k}" for k in ks] + [f"maj@{k}" for k in ks if k > 1]
    step = int(iter_dir.name.split("_")[-1]) if iter_dir is not None else None
    return Plan(cfg, checkpoint, saved, step, "" if dataset else data, dataset, ks, metrics, not own.no_greedy, out,
                {"resamples": own.bootstrap, "seed": own.bootstrap_seed, "confidence": own.confidence}, own.verifier)


def _is_hf(path: Path) -> bool:
    config = path / "config.json"
    if not config.is_file():
        return False
    try:
        return "model_type" in json.loads(config.read_text())
    except json.JSONDecodeError:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        _own_parser().print_help()
        print("\n" + __doc__.split("\n\n", 1)[1])
        return 0
    try:
        p = plan(argv)
        result = evaluate(p)
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(result["table"])
    print(f"{PROG}: wrote {p.out / 'eval.json'}, {p.out / 'eval.md'} and {p.out / 'prompts.jsonl'}")
    return 0


def evaluate(p: Plan) -> dict:
    """Load the model into the engine, sample and judge every prompt, write the results; returns eval.json's
    content with the table under "table"."""
    import torch

    from megarl.cli.eval_datasets import write_dataset

    cfg = p.cfg
    torch.set_num_threads(cfg.training.threads_per_rank)
    p.out.mkdir(parents=True, exist_ok=True)
    data = p.data or str(write_dataset(p.dataset, p.out / "data.jsonl"))
    model = _load_model(p)
    try:
        t0 = time.perf_counter()
        sampled, greedy, too_long = _sample(cfg, model, data, p.greedy, p.verifier)
        seconds = time.perf_counter() - t0
    finally:
        model.close()
    return _write(p, data, sampled, greedy, too_long, seconds)


@dataclass
class _Model:
    """The engine with the checkpoint's weights, and what must be closed after."""

    engine: object
    tokenizer: object
    hf_dir: str
    policy: object | None = None

    def close(self) -> None:
        self.engine.shutdown()
        if self.policy is not None:
            from megarl.mcore import parallel

            parallel.destroy()


def _load_model(p: Plan) -> _Model:
    from transformers import AutoTokenizer

    from megarl.rollout.backends import BACKENDS, build_engine
    from megarl.rollout.base import as_engine

    cfg = p.cfg
    ok, why = BACKENDS.get(cfg.rollout.rollout_backend).available(cfg)
    if not ok:
        raise ConfigError(why)
    hf_dir = cfg.model.hf_checkpoint
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    if p.megatron is None:  # an HF directory: its tensors straight into the engine
        from megarl.rollout.builtin import hf_tensors

        try:
            engine = as_engine(build_engine(cfg, None))
        except ValueError as e:  # a backend that generates with a Megatron model (`megatron`)
            raise ConfigError(f"--rollout-backend {cfg.rollout.rollout_backend}: {e}; give it a megarl checkpoint, "
                              "or use another backend for an HF directory") from None
        engine.update_weights(hf_tensors(p.checkpoint), version=0)
        return _Model(engine, tokenizer, hf_dir)
    return _load_megatron(p, tokenizer, build_engine, as_engine)


def _load_megatron(p: Plan, tokenizer, build_engine, as_engine) -> _Model:
    """A megarl checkpoint: the run's model at TP 1 in this process, its weights loaded, then synced into the engine
    as the trainer syncs them (`WeightSync`, the same export)."""
    from megarl.cli.convert_checkpoint import build_policy, padded_rows
    from megarl.mcore import checkpoint, parallel
    from megarl.stages.colocation import WeightSync, enter_rollout

    cfg = p.cfg
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ConfigError(f"{PROG} runs as one process (the model at TP 1); run it without torchrun")
    if "MASTER_PORT" not in os.environ:  # one process: any free port, so that two evaluations may run side by side
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(s.getsockname()[1])
    padded = padded_rows(p.checkpoint, cfg.model.hf_checkpoint, p.megatron, 1)
    info = parallel.init_distributed(tp=1, pp=1, timeout_s=cfg.training.distributed_timeout_seconds,
                                     seed=cfg.training.seed)
    try:
        policy = build_policy(cfg.model.hf_checkpoint, p.megatron, 1, padded)
        checkpoint.load_weights(p.checkpoint, policy)
        engine = as_engine(build_engine(cfg, policy))
        sync = WeightSync(policy, engine, cfg.rollout, info, timeout_s=cfg.training.distributed_timeout_seconds)
        sync(version=p.step or 0)
        enter_rollout(policy, engine, cfg.training, sync)
    except BaseException:
        parallel.destroy()
        raise
    return _Model(engine, tokenizer, cfg.model.hf_checkpoint, policy)


def _sample(cfg: Config, model: _Model, data: str, greedy: bool, verifier: str):
    """(sampled results, greedy results or None, prompts left out as too long), drawn as the trainer's
    evaluation draws them."""
    from megarl.evaluation.generate import EVAL_SEED_OFFSET, sample_and_score
    from megarl.preflight import prompt_limit, read_shape
    from megarl.registry import load_plugins
    from megarl.reward import build_reward, reward_options
    from megarl.rollout import build_rollout
    from megarl.stages.collect import sampling_params
    from megarl.trainer.build import load_prompt_file

    limit = prompt_limit(cfg, read_shape("--hf-checkpoint", model.hf_dir))
    prompts, too_long = load_prompt_file(cfg, data, "--data", model.tokenizer, limit, print)
    if verifier:  # --verifier: every row judged by it
        prompts = [replace(r, verifier=verifier) for r in prompts]
    if cfg.logging.eval_max_prompts:
        prompts = prompts[: cfg.logging.eval_max_prompts]
    try:
        plugins = load_plugins(cfg.plugins.plugins)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    reward = build_reward(cfg.reward, reward_options(cfg), plugins)
    rollout_fn = build_rollout(cfg)
    seed = cfg.training.seed + EVAL_SEED_OFFSET
    n = cfg.logging.eval_samples_per_prompt
    print(f"{PROG}: {len(prompts)} prompts, {n} samples each{' and greedy' if greedy else ''} "
          f"({cfg.rollout.rollout_backend} engine, temperature {cfg.rollout.rollout_temperature:g}, "
          f"up to {cfg.rollout.max_response_len} tokens)", flush=True)
    try:
        sampled = sample_and_score(rollout_fn, model.engine, prompts, sampling_params(
            cfg.rollout, model.tokenizer, seed=seed, n=n), reward, model.tokenizer)
        best = (sample_and_score(rollout_fn, model.engine, prompts, sampling_params(
            cfg.rollout, model.tokenizer, seed=seed, n=1, greedy=True), reward, model.tokenizer) if greedy else None)
    finally:
        rollout_fn.close()
    return (prompts, sampled), best, too_long


def _write(p: Plan, data: str, sampled, greedy, too_long: int, seconds: float) -> dict:
    from megarl.evaluation.metrics import by_subset

    prompts, results = sampled
    cfg = p.cfg
    boot = p.bootstrap
    figures = by_subset(results, p.metrics, **boot)
    if greedy is not None:
        greedy_figures = by_subset(greedy, ["pass@1"], **boot)
        figures["overall"]["greedy"] = greedy_figures["overall"]["pass@1"]
        for name, row in greedy_figures["by_source"].items():
            figures["by_source"][name]["greedy"] = row["pass@1"]
    columns = [*p.metrics, *(["greedy"] if greedy is not None else [])]
    result = {
        "checkpoint": str(p.checkpoint), "format": "megarl" if p.megatron is not None else "hf", "step": p.step,
        "data": p.dataset or data, "samples_per_prompt": cfg.logging.eval_samples_per_prompt, "ks": p.ks,
        "metrics": columns, "prompts_too_long": too_long, "seed": cfg.training.seed,
        "sampling": {"temperature": cfg.rollout.rollout_temperature, "top_p": cfg.rollout.rollout_top_p,
                     "top_k": cfg.rollout.rollout_top_k, "max_response_len": cfg.rollout.max_response_len,
                     "rollout_backend": cfg.rollout.rollout_backend, "rollout_function": cfg.rollout.rollout_function},
        "verifier": p.verifier or "each row's own", "bootstrap": boot,
        "seconds": round(seconds, 2), **figures}
    table = markdown_table(result)
    p.out.mkdir(parents=True, exist_ok=True)
    with (p.out / "prompts.jsonl").open("w", encoding="utf-8") as f:
        for i, (record, r) in enumerate(zip(prompts, results)):
            row = {"source": r.subset, "row": record.source, "prompt": record.prompt, "correct": list(r.correct),
                   "answers": list(r.answers)}
            if greedy is not None:
                row["greedy_correct"] = greedy[i].correct[0]
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (p.out / "eval.md").write_text(table + "\n")
    (p.out / "eval.json").write_text(json.dumps(result, indent=1) + "\n")  # last: its presence means "done"
    return {**result, "table": table}


def markdown_table(result: dict) -> str:
    """A row per source and one overall: each figure as a percentage with its interval."""
    columns = result["metrics"]
    boot = result["bootstrap"]
    ci = f", [{100 * boot['confidence']:g} % interval]" if boot["resamples"] else ""
    lines = [f"{result['checkpoint']} on {result['data']}: {result['samples_per_prompt']} samples a prompt, "
             f"temperature {result['sampling']['temperature']:g}{ci}", "",
             "| source | prompts | " + " | ".join(columns) + " |", "|---|---:|" + "---:|" * len(columns)]
    rows = [*result["by_source"].items(), ("**overall**", result["overall"])]
    if len(result["by_source"]) == 1:
        rows = rows[-1:]
    for name, figures in rows:
        cells = [_cell(figures[c]) for c in columns]
        lines.append(f"| {name} | {figures['prompts']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(figure: dict) -> str:
    value = f"{100 * figure['value']:.1f} %"
    return value if figure["ci"] is None else f"{value} [{100 * figure['ci'][0]:.1f}, {100 * figure['ci'][1]:.1f}]"


if __name__ == "__main__":  # dist_checkpointing spawns helpers: keep the guard
    from megarl.procs import exiting

    sys.exit(exiting(main()))

"""Rollout throughput, side by side in one run: megarl's built-in engine, SGLang on CPU, vLLM on CPU and
`transformers`' `generate`, on the same model, the same prompt token ids and the same number of new tokens.

    python tools/bench/rollout.py                                  # 16 prompts x 64 new tokens, every engine
    python tools/bench/rollout.py --prompts 32 --n 4 --engines builtin,vllm
    python tools/bench/rollout.py --smoke --engines builtin,transformers    # seconds; what tests/unit runs

Model: `--model` (default the demo's starter, .cache/starter, which `make demo` builds); without it a random Qwen2
of the starter's shape (2 layers, hidden 256, 4 heads of 64, 2 KV heads) with the demo's tokenizer, made here (no
model hub). `--smoke`: a random Qwen2 of hidden 64 (2 heads of 32: vLLM's CPU attention takes no head size below
32), 2 prompts, 4 new tokens. The model runs as its checkpoint says, in float32, from a staged copy whose
`max_position_embeddings` is raised where prompt + new tokens need more (the starter's is 64); the weights are not
touched. Prompts: `--prompts` of the demo's arithmetic problems (`12+7=`), seeded, as token ids of the model's
tokenizer, each sampled `--n` times.

Each engine runs in a process of its own, one after the other (tools/bench/rollout_worker.py): the built-in engine
and `transformers` with this python, SGLang and vLLM with their environment's python, each through megarl's own
adapter (`SGLangEngine.launch(device="cpu", colocated=False)`, `VLLMEngine.launch`), all on `--threads` threads.
An engine reports its start-up (import and construction; SGLang's and vLLM's include their processes and warm-up),
then after one untimed warm-up call of the whole batch, one timed call at temperature 1 (top-p 1, no top-k) and one
greedy. No stop token: every row generates `--max-new-tokens` (SGLang's requests get `ignore_eos`, as its adapter's
tests do: SGLang otherwise stops at the checkpoint's EOS on its own). Tokens per second = tokens generated / wall
seconds of the call; the ratios are against the built-in engine's. `transformers` returns no log-probs; the three
engines do, as rollouts need. One run, no repeats: figures move with the machine's load.

SGLang's environment: $MEGARL_SGLANG_ENV, else .cache/sglang-env, else CI's ~/.cache/megarl/sglang-env (`make
sglang-env`), run with the stand-ins of tests/sglang_cpu/standins first on PYTHONPATH and SGLANG_USE_CPU_ENGINE=1
(a call to a stand-in voids its row); vLLM's: $MEGARL_VLLM_ENV, else .cache/vllm-env, else ~/.cache/megarl/vllm-env
(`make vllm-env`). An engine whose environment is absent, or that fails, is a row with the reason.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().with_name("rollout_worker.py")
STANDINS = REPO / "tests" / "sglang_cpu" / "standins"
ENGINES = ("builtin", "transformers", "sglang", "vllm")
MODES = ("sampled", "greedy")


def env_python(engine: str) -> tuple[Path | None, str]:
    """(the python of `engine`'s environment, "") or (None, why there is none): an environment counts once its
    build wrote its stamp, last (tools/{sglang,vllm}_cpu/build_env.sh)."""
    if engine in ("builtin", "transformers"):
        return Path(sys.executable), ""
    given = os.environ.get(f"MEGARL_{engine.upper()}_ENV")
    name = f"{engine}-env"
    dirs = [Path(given)] if given else [REPO / ".cache" / name, Path.home() / ".cache" / "megarl" / name]
    for d in dirs:
        if (d / ".megarl-stamp").exists():
            return d / "bin" / "python", ""
    return None, f"no {engine} environment at {' or '.join(map(str, dirs))} (`make {engine}-env` builds it)"


def worker_env(engine: str, python: Path, threads: int, standin_log: Path) -> dict:
    """This checkout's megarl first on PYTHONPATH, `threads` OpenMP threads, no hub look-ups; for SGLang the
    stand-ins before it and its CPU engine (as tests/sglang_cpu/conftest.py), for vLLM unbound threads (as
    tests/vllm_cpu/conftest.py)."""
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env["PYTHONPATH"] = os.pathsep.join(([str(STANDINS)] if engine == "sglang" else []) + [str(REPO)])
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if engine == "sglang":
        env.update(SGLANG_USE_CPU_ENGINE="1", MEGARL_SGLANG_STANDIN_LOG=str(standin_log))
    if engine == "vllm":
        env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return env


def make_random_qwen2(out: Path, smoke: bool, positions: int) -> None:
    """A random Qwen2 with the demo's tokenizer: the starter's shape, or (`smoke`) hidden 64, 2 heads of 32."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from megarl.tasks.arithmetic import build_tokenizer

    tok = build_tokenizer(out)
    shape = (dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1) if smoke
             else dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2))
    config = Qwen2Config(vocab_size=math.ceil(len(tok) / 16) * 16, num_hidden_layers=2, tie_word_embeddings=False,
                         max_position_embeddings=positions, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).float().eval().save_pretrained(out)


def stage(model: Path, out: Path, positions: int) -> str:
    """`model` seen from `out`: its files linked, config.json copied with `max_position_embeddings` raised to
    `positions` where lower. Says what it changed."""
    out.mkdir()
    for f in model.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((model / "config.json").read_text())
    had = config.get("max_position_embeddings", positions)
    config["max_position_embeddings"] = max(had, positions)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return f"positions raised {had} -> {positions} for the bench" if had < positions else ""


def make_prompts(model: Path, count: int, seed: int) -> list[list[int]]:
    """`count` of the demo's arithmetic problems, seeded, as the model's token ids."""
    from transformers import AutoTokenizer

    from megarl.tasks.arithmetic import all_problems

    tok = AutoTokenizer.from_pretrained(model)
    problems = random.Random(seed).sample(all_problems(), count)
    return [tok(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]


def run_engine(engine: str, job_path: Path, tmp: Path, timeout_s: float) -> dict:
    """One engine's row: the worker's result, or {"skipped": why}."""
    python, why = env_python(engine)
    if python is None:
        return {"skipped": why}
    job = json.loads(job_path.read_text())
    out, log, standins = tmp / f"{engine}.json", tmp / f"{engine}.log", tmp / f"{engine}-standins.log"
    start = time.perf_counter()
    try:
        with open(log, "w") as f:
            proc = subprocess.run([str(python), "-u", str(WORKER), engine, str(job_path), str(out)], stdout=f,
                                  stderr=subprocess.STDOUT, env=worker_env(engine, python, job["threads"], standins),
                                  cwd=REPO, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"skipped": f"timed out after {timeout_s:.0f} s; log {log}"}
    if proc.returncode != 0 or not out.exists():
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] or ["no output"]
        return {"skipped": f"failed ({proc.returncode}): {tail[0][-200:]}; log {log}"}
    if standins.exists() and standins.read_text().strip():
        return {"skipped": f"a stand-in for a GPU-only import was called: {standins.read_text().strip()[:200]}"}
    result = json.loads(out.read_text())
    result["process_s"] = time.perf_counter() - start
    return result


def table(rows: dict[str, dict], requested: int) -> list[str]:
    """The printed table: one line per engine, tokens/s per mode and its ratio to the built-in engine's."""
    def rate(row: dict, mode: str) -> float:
        m = row["modes"][mode]
        return sum(m["tokens"]) / m["seconds"]

    base = rows.get("builtin", {})
    lines = [f"{'engine':<13}{'start-up s':>11}{'tokens':>10}{'T=1 tok/s':>11}{'vs builtin':>11}"
             f"{'greedy tok/s':>14}{'vs builtin':>11}"]
    for name, row in rows.items():
        if "skipped" in row:
            lines.append(f"{name:<13}skipped: {row['skipped']}")
            continue
        tokens = {sum(row["modes"][m]["tokens"]) for m in MODES}
        cells = [f"{name:<13}{row['startup_s']:>11.2f}{'/'.join(map(str, sorted(tokens))):>10}"]
        for mode, width in zip(MODES, (11, 14)):
            ratio = f"{rate(row, mode) / rate(base, mode):.2f}x" if "modes" in base else "-"
            cells.append(f"{rate(row, mode):>{width}.0f}{ratio:>11}")
        lines.append("".join(cells) + ("" if tokens == {requested} else f"  (requested {requested})"))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="HF checkpoint dir (default .cache/starter, else a random Qwen2)")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"which of {','.join(ENGINES)}, in this order")
    p.add_argument("--prompts", type=int, default=16, help="distinct prompts")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens every row generates (no stop token)")
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads of every engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="seconds an engine may take, start-up included")
    p.add_argument("--smoke", action="store_true", help="a tiny random model, 2 prompts, 4 new tokens")
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    if unknown := set(engines) - set(ENGINES):
        p.error(f"--engines: unknown {sorted(unknown)}; choose from {','.join(ENGINES)}")
    if args.smoke:
        args.prompts, args.max_new_tokens = 2, 4
    starter = REPO / ".cache" / "starter"
    if args.model is not None and not (args.model / "config.json").is_file():
        print(f"rollout bench: no checkpoint at {args.model}", file=sys.stderr)
        return 2

    # The staged model, the job and each engine's log; kept when an engine failed, so its log can be read.
    tmp = Path(tempfile.mkdtemp(prefix="megarl-rollout-bench-"))
    source = args.model or (starter if not args.smoke and (starter / "config.json").is_file() else None)
    what = str(source)
    if source is None:
        source, what = tmp / "random", f"a random Qwen2{' (smoke)' if args.smoke else ' of the starter shape'}"
        make_random_qwen2(source, args.smoke, positions=64)
    prompts = make_prompts(source, args.prompts, args.seed)
    max_len = max(map(len, prompts)) + args.max_new_tokens + 8  # the longest row, and a margin for the engines
    change = stage(source, tmp / "model", max_len)
    what += f", {change}" if change else ""
    job = {"model": str(tmp / "model"), "prompts": prompts, "n": args.n, "max_new_tokens": args.max_new_tokens,
           "max_len": max_len, "seed": args.seed, "threads": args.threads}
    job_path = tmp / "job.json"
    job_path.write_text(json.dumps(job))
    requested = len(prompts) * args.n * args.max_new_tokens
    short, long = min(map(len, prompts)), max(map(len, prompts))
    print(f"model: {what}; {len(prompts)} prompts of {short if short == long else f'{short}-{long}'} tokens x "
          f"{args.n} sample{'s' if args.n > 1 else ''}, {args.max_new_tokens} new tokens each ({requested} in all), "
          f"float32, {args.threads} thread{'s' if args.threads > 1 else ''}; one engine at a time", flush=True)
    rows = {}
    for engine in engines:
        rows[engine] = run_engine(engine, job_path, tmp, args.timeout)
        row = rows[engine]
        done = row["skipped"] if "skipped" in row else f"done in {row['process_s']:.0f} s"
        print(f"  {engine}: {done}", file=sys.stderr, flush=True)
    print("\n".join(table(rows, requested)))
    if any("log " in row.get("skipped", "") for row in rows.values()):
        print(f"logs kept in {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps({"model": what, "requested_tokens": requested, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Smoke runs of the shipped recipes: each `recipes/*.sh`, and each model file through `RECIPE_MODEL`, trains 2 steps
on one CPU process, with a tiny random model of the recipe's own family and a few rows of its own data format.

    python tests/recipe_smoke.py --out DIR [RECIPE[:MODEL] ...]       # every run of RUNS when none is named

The one way a smoke run departs from the recipe (docs/guide.md, "Recipe smoke runs"):
- environment variables point the recipe's own path variables at what this file makes: `MODEL_DIR` (the GPU model
  files), `STARTER_DIR` / `MOE_STARTER_DIR` / `DEEPSEEK_STARTER_DIR` / `TOOL_STARTER_DIR` / `REWARD_MODEL_DIR` /
  `MATH_STARTER_DIR` / `CODE_STARTER_DIR` / `RG_STARTER_DIR` (the CPU demos), `DATA_DIR`;
- `OVERRIDES`, given on the command line after the recipe (where flags override a recipe), change the device,
  the backend and the sizes only: CPU layout (TP = PP = EP = 1, local layers, fp32), the built-in engine, 2 steps
  of 2 prompts with 8-token responses, and where the run writes.
The recipe's verifier, reward, sandbox, algorithm and optimizer settings are never overridden
(tests/e2e/test_recipes.py checks the list), so a recipe that names a missing flag, a data key its rows lack or an
unregistered verifier fails its smoke run as it would fail on the cluster.

A GPU model file's tiny model is made from the file's own `MODEL_SHAPE` (`tiny_config`): the same architecture
and the shape properties that change the code path (tied embeddings, the GQA ratio, Qwen3's head_dim against the
hidden size, the experts' routing, RoPE theta), at sizes that build in a blink. The CPU demos get their starters'
own architectures from the tools that build them, randomly initialised (no pre-training). The data are the rows
`megarl-prepare-data` writes from a few rows in the upstream datasets' layouts (the conversion the recipes' headers
name), or the demos' own task rows.

All the runs share one process (`megarl.train.main` one after the other, the process groups torn down in between):
torch and Megatron are imported once, which is most of a run's cost on a tiny model.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import string
import subprocess
import sys
import time
import traceback
from pathlib import Path

from helpers import free_port, randomize_qwen3_norms_and_router  # tests/ (this script's folder, or conftest's path)

REPO = Path(__file__).resolve().parents[1]

# Every shipped recipe, and every GPU model file through the math recipe (r1_code runs with its default model). The
# demos' model files, tiny_qwen2.sh, tiny_qwen3_moe.sh and tiny_deepseek_v3.sh, run in the demos that source them
# (tiny_cpu.sh, tiny_cpu_moe.sh, tiny_cpu_deepseek_v3.sh): the starters' 64 positions cannot hold r1_math's prompts.
RUNS = ("r1_math", "r1_code", "tiny_cpu", "tiny_cpu_moe", "tiny_cpu_deepseek_v3", "tiny_cpu_ppo", "tiny_cpu_ppo_rm",
        "tiny_cpu_tool", "tiny_cpu_math", "tiny_cpu_code", "tiny_cpu_rg", "tiny_cpu_lora", "r1_math_lora",
        "r1_math_distill",
        *(f"r1_math:{m}" for m in ("qwen2.5-7b", "qwen2.5-math-7b", "llama-3.1-8b", "llama-3.1-70b", "qwen3-8b",
                                   "qwen3-30b-a3b", "moonlight-16b-a3b")))
# the recipes' `RECIPE_MODEL` defaults
DEFAULT_MODEL = {"r1_math": "qwen2.5-math-1.5b", "r1_code": "qwen2.5-7b", "r1_math_lora": "qwen2.5-math-7b",
                 "r1_math_distill": "qwen2.5-math-1.5b"}
# a distillation recipe's teacher (`TEACHER_DIR`): the tiny model of this model file, on the same tokenizer
TEACHER_MODEL = {"r1_math_distill": "qwen2.5-math-7b"}


def overrides(out: Path) -> list[str]:
    """The flags a smoke run adds after the recipe: device, backend and sizes, and where the run writes. Nothing
    here names a verifier, a reward, a sandbox, an algorithm or an optimizer setting."""
    return [
        # device and backend: one CPU process
        "--rollout-backend", "builtin", "--transformer-impl", "local", "--no-bf16", "--no-sequence-parallel",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "0",
        # sizes
        "--num-steps", "2", "--rollout-batch-size", "2", "--max-response-len", "8",
        # where the run writes
        "--output-dir", str(out), "--save", str(out / "checkpoints"),
    ]


# ------------------------------------------------------------------------------------------------ tiny models

def model_shape(model_file: str) -> dict[str, str]:
    """A GPU model file's `MODEL_SHAPE` (HF config.json keys), as bash reads it."""
    path = REPO / "recipes" / "models" / f"{model_file}.sh"
    dump = 'source "$1" >&2; for k in "${!MODEL_SHAPE[@]}"; do printf "%s=%s\\0" "$k" "${MODEL_SHAPE[$k]}"; done'
    proc = subprocess.run(["bash", "-c", dump, "shape", str(path)], capture_output=True, text=True, check=True,
                          env={**os.environ, "REPO_ROOT": str(REPO)})
    return dict(item.split("=", 1) for item in proc.stdout.split("\0") if item)


def tiny_config(shape: dict[str, str], vocab: int) -> tuple[str, dict]:
    """(family, config.json fields) of a 2-layer model of `shape`'s architecture: the same model_type, tied or
    untied embeddings, GQA ratio (query heads per KV head), attention width against the hidden size (Qwen3 sets
    head_dim apart from hidden / heads), MoE routing (top-k renormalised or not, sparse step), RoPE theta and norm
    epsilon; 8-wide heads, 2 KV heads, 8 experts of which 2 a token. Llama model files are Llama-3.1, whose
    checkpoints carry "llama3" RoPE scaling in their config.json (not in MODEL_SHAPE): the tiny one does too."""
    family = shape["model_type"]
    heads, kv = int(shape["num_attention_heads"]), int(shape["num_key_value_heads"])
    hidden = int(shape["hidden_size"])
    head_dim = int(shape.get("head_dim", hidden // heads))
    tiny_heads, tiny_head_dim = 2 * (heads // kv), 8
    cfg: dict = dict(
        vocab_size=vocab, num_hidden_layers=2, num_attention_heads=tiny_heads, num_key_value_heads=2,
        hidden_size=tiny_heads * tiny_head_dim * hidden // (heads * head_dim), intermediate_size=128,
        max_position_embeddings=min(int(shape["max_position_embeddings"]), 4096),
        tie_word_embeddings=shape.get("tie_word_embeddings", "false") == "true")
    if "head_dim" in shape:
        cfg["head_dim"] = tiny_head_dim
    for key, kind in (("rope_theta", float), ("rms_norm_eps", float), ("decoder_sparse_step", int)):
        if key in shape:
            cfg[key] = kind(shape[key])
    if family == "qwen3_moe":
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   norm_topk_prob=shape.get("norm_topk_prob", "false") == "true")
    if family == "deepseek_v3":  # MLA with 8-wide parts, the model file's router and dense-first layout
        cfg.update(num_key_value_heads=tiny_heads, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                   v_head_dim=8, q_lora_rank=16 if "q_lora_rank" in shape else None, n_routed_experts=8,
                   num_experts_per_tok=2, moe_intermediate_size=32,
                   **{k: int(shape[k]) for k in ("n_shared_experts", "first_k_dense_replace") if k in shape},
                   n_group=1, topk_group=1, routed_scaling_factor=float(shape.get("routed_scaling_factor", 1.0)),
                   norm_topk_prob=shape.get("norm_topk_prob", "true") == "true")
    if family == "llama":
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return family, cfg


def _save(model, tokenizer, out: Path) -> Path:
    model.float().save_pretrained(out)
    tokenizer.save_pretrained(str(out))
    return out


def make_gpu_model(model_file: str, out: Path) -> Path:
    """The tiny random model of a GPU model file's family, with a character tokenizer of printable ASCII (so the
    math and code prompts reach the model whole)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.tasks.arithmetic import build_tokenizer

    chars = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")
    tokenizer = build_tokenizer(None, chars=chars)
    family, fields = tiny_config(model_shape(model_file), vocab=128)
    rope = fields.pop("rope_scaling", None)
    config = AutoConfig.for_model(family, **fields, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    if rope is not None:
        config.rope_parameters = {**rope, "rope_theta": fields["rope_theta"]}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if family in ("qwen3", "qwen3_moe", "deepseek_v3"):
        randomize_qwen3_norms_and_router(model)
    return _save(model, tokenizer, out)


def _tool(name: str):
    """A script of tools/ as a module (tools/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_starter(out: Path, family: str = "qwen2", tool: bool = False) -> Path:
    """A CPU demo's starter as its tool builds it, randomly initialised, with a few of its task's rows."""
    import torch

    from megarl.tasks import arithmetic, multiplication
    from megarl.tasks.arithmetic import build_tokenizer, write_jsonl

    torch.manual_seed(0)
    if tool:
        tokenizer = build_tokenizer(None, chars=multiplication.CHARS)
        model, (train, held) = _tool("make_tool_starter_model").build_model(tokenizer), multiplication.split_problems()
    else:
        tokenizer = build_tokenizer(None)
        model, (train, held) = _tool("make_starter_model").build_model(tokenizer, family), arithmetic.split_problems()
    _save(model, tokenizer, out)
    write_jsonl(out / "train.jsonl", train[:4])
    write_jsonl(out / "heldout.jsonl", held[:2])
    return out


def make_math_starter(out: Path) -> Path:
    """The math demo's starter as `tools/make_math_starter_model.py` builds it, randomly initialised, with a few
    rows of each of its three files."""
    import torch

    from megarl.tasks.arithmetic import build_tokenizer
    from megarl.tasks.math_forms import CHARS, split_problems

    torch.manual_seed(0)
    tool = _tool("make_math_starter_model")
    tokenizer = build_tokenizer(None, chars=CHARS)
    _save(tool.build_model(tokenizer), tokenizer, out)
    train, held = split_problems()
    tool.write_rows(out / "train.jsonl", train[:4], "math")
    tool.write_rows(out / "train_exact.jsonl", train[:4], "exact_string")
    tool.write_rows(out / "heldout.jsonl", held[:2], "math")
    return out


def make_rg_starter(out: Path) -> Path:
    """The reasoning-gym demo's starter as `tools/make_rg_starter_model.py` builds it, randomly initialised, with a
    few rows of its task written as the tool writes them (needs the rg extra)."""
    import torch

    from megarl.tasks import reasoning_gym as rg_task
    from megarl.tasks.arithmetic import build_tokenizer

    torch.manual_seed(0)
    tool = _tool("make_rg_starter_model")
    tokenizer = build_tokenizer(None, chars=tool.CHARS)
    model = _tool("make_starter_model").build_model(tokenizer, mlp_width=tool.MLP_WIDTH, positions=tool.POSITIONS,
                                                    hidden=tool.HIDDEN)
    _save(model, tokenizer, out)
    for name, seed, size in (("train.jsonl", tool.TRAIN_SEED, 4), ("heldout.jsonl", tool.HELDOUT_SEED, 2)):
        rg_task.write(tool.TASK, out / name, size=size, seed=seed, config=tool.CONFIG, template=tool.TEMPLATE)
    return out


def make_code_starter(out: Path) -> Path:
    """The code demo's starter as `tools/make_code_starter_model.py` builds it, randomly initialised, with a few
    of its task's rows."""
    import torch

    from megarl.tasks import code_functions
    from megarl.tasks.arithmetic import build_tokenizer

    torch.manual_seed(0)
    tool = _tool("make_code_starter_model")
    tokenizer = build_tokenizer(None, chars=code_functions.CHARS)
    model = _tool("make_starter_model").build_model(tokenizer, mlp_width=tool.MLP_WIDTH, positions=tool.POSITIONS,
                                                    hidden=tool.HIDDEN)
    _save(model, tokenizer, out)
    train, held = code_functions.split_problems()
    code_functions.write_jsonl(out / "train.jsonl", train[:4])
    code_functions.write_jsonl(out / "heldout.jsonl", held[:2])
    return out


# ------------------------------------------------------------------------------------------------ data

def _convert(layout: str, rows: list[dict], dst: Path) -> None:
    """`megarl-prepare-data <layout>` over `rows` given in the upstream dataset's layout."""
    from megarl.cli.prepare_data import convert

    src = dst.with_suffix(".raw.jsonl")
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts = convert(layout, src, dst)
    assert counts["written"] == len(rows), (layout, counts)


def make_math_data(data: Path) -> Path:
    """r1_math's files: DAPO-Math-17k rows (a chat prompt, reward_model.ground_truth) and AIME rows."""
    data.mkdir(parents=True, exist_ok=True)
    ask = "Solve the following math problem step by step. The last line of your response should be of the form " \
          "Answer: $Answer where $Answer is the answer to the problem.\n\n{}\n\nRemember to put your answer on its " \
          "own line after \"Answer:\"."
    problems = [("What is $3 + 4 \\times 2$?", "11"), ("Find $x$ if $2x = 10$.", "5"),
                ("How many primes are less than 10?", "4"), ("Compute $\\frac{1}{2} + \\frac{1}{4}$.", "\\frac{3}{4}")]
    _convert("dapo-math", [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": ask.format(q)}],
                            "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"}}
                           for q, a in problems], data / "train.jsonl")
    _convert("math", [{"problem": "Find the remainder when $2^{10}$ is divided by 7.", "answer": "2"},
                      {"problem": "What is $\\sqrt{49}$?", "solution": "It is $\\boxed{7}$."}], data / "aime24.jsonl")
    return data


def make_code_data(data: Path) -> Path:
    """r1_code's files: code_contests rows (stdin/stdout tests) and HumanEval rows (function tests)."""
    data.mkdir(parents=True, exist_ok=True)
    contests = [("Read two integers and print their sum.", ["1 2\n", "5 7\n"], ["3\n", "12\n"]),
                ("Read a line and print it reversed.", ["abc\n"], ["cba\n"]),
                ("Read n and print n squared.", ["3\n", "10\n"], ["9\n", "100\n"]),
                ("Print the number of words in the input line.", ["a b c\n"], ["3\n"])]
    _convert("code-contests", [{"name": f"p{i}", "description": d, "public_tests": {"input": x, "output": y},
                                "private_tests": {"input": [], "output": []}}
                               for i, (d, x, y) in enumerate(contests)], data / "train.jsonl")
    _convert("humaneval", [
        {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n", "entry_point": "add",
         "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n"},
        {"task_id": "HumanEval/1", "prompt": "def double(x):\n    \"\"\"Return 2 * x.\"\"\"\n",
         "entry_point": "double", "test": "def check(candidate):\n    assert candidate(4) == 8\n"}],
        data / "humaneval.jsonl")
    return data


# ------------------------------------------------------------------------------------------------ one run

_MADE: dict[tuple, Path] = {}  # what this process made already: models and data are only read by the runs


def _made(key: tuple, shared: Path, make) -> Path:
    if key not in _MADE:
        _MADE[key] = make(shared / "-".join(map(str, key)))
    return _MADE[key]


def make_reward_model(out: Path) -> Path:
    """The demo's reward model (a Qwen2 sequence classifier on the task's tokenizer), random, with the score
    statistics megarl-train-reward-model stores for --reward-model-normalize (mean 0, std 1: no change)."""
    from helpers import make_tiny_reward_model  # tests/, this script's directory, is first on sys.path

    make_tiny_reward_model(out, seed=0)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "reward_mean": 0.0, "reward_std": 1.0}))
    return out


def prepare(run: str, shared: Path) -> tuple[Path, dict[str, str]]:
    """(the recipe, the environment that points it at test-made files) for `RECIPE[:MODEL]`, where RECIPE is a
    shipped recipe's name or a recipe file (a copy of one, named as it is); what it makes goes under `shared`."""
    recipe, _, model = run.partition(":")
    path = Path(recipe) if recipe.endswith(".sh") else REPO / "recipes" / f"{recipe}.sh"
    name = path.stem
    env: dict[str, str] = {}
    if name in DEFAULT_MODEL:
        model = model or DEFAULT_MODEL[name]
        hf = _made(("model", model), shared, lambda out: make_gpu_model(model, out))
        data = _made(("data", name), shared, make_math_data if name.startswith("r1_math") else make_code_data)
        env.update(RECIPE_MODEL=model, MODEL_DIR=str(hf), DATA_DIR=str(data))
        if name in TEACHER_MODEL:
            teacher = TEACHER_MODEL[name]
            env["TEACHER_DIR"] = str(_made(("model", teacher), shared, lambda out: make_gpu_model(teacher, out)))
    elif name == "tiny_cpu_tool":
        env["TOOL_STARTER_DIR"] = str(_made(("starter", "tool"), shared, lambda out: make_starter(out, tool=True)))
    elif name == "tiny_cpu_code":
        env["CODE_STARTER_DIR"] = str(_made(("starter", "code"), shared, make_code_starter))
    elif name == "tiny_cpu_math":
        env["MATH_STARTER_DIR"] = str(_made(("starter", "math"), shared, make_math_starter))
    elif name == "tiny_cpu_rg":
        env["RG_STARTER_DIR"] = str(_made(("starter", "rg"), shared, make_rg_starter))
    elif name == "tiny_cpu_moe":
        moe = _made(("starter", "qwen3_moe"), shared, lambda out: make_starter(out, "qwen3_moe"))
        env["MOE_STARTER_DIR"] = str(moe)
    elif name == "tiny_cpu_deepseek_v3":
        starter = _made(("starter", "deepseek_v3"), shared, lambda out: make_starter(out, "deepseek_v3"))
        env["DEEPSEEK_STARTER_DIR"] = str(starter)
    else:
        env["STARTER_DIR"] = str(_made(("starter", "qwen2"), shared, make_starter))
        if name == "tiny_cpu_ppo_rm":
            env["REWARD_MODEL_DIR"] = str(_made(("reward_model",), shared, make_reward_model))
    return path, env


def smoke(run: str, root: Path, shared: Path) -> dict:
    """One smoke run in this process, writing under `root`: {"run", "out" (`root`), "rc", "stderr" (its tail),
    "seconds", "recipe_config" (the recipe's own settings, read with the same environment; None if it does not
    parse)}."""
    from megarl import train
    from megarl.arguments import parse_args
    from megarl.errors import ConfigError
    from megarl.mcore import parallel

    t0 = time.perf_counter()
    recipe, env = prepare(run, shared)
    saved = {k: os.environ.get(k) for k in (*env, "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    err = io.StringIO()
    try:
        try:
            recipe_config = parse_args([str(recipe)], check_registries=False).to_dict()
        except ConfigError:
            recipe_config = None
        with contextlib.redirect_stderr(err):
            rc = train.main([str(recipe), *overrides(root)])
    except BaseException:  # noqa: BLE001 - a failed run is a result to report, not the end of the others
        rc, err = 1, io.StringIO(err.getvalue() + traceback.format_exc())
    finally:
        parallel.destroy()  # a run that stopped after the process groups started leaves them behind
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return {"run": run, "out": str(root), "rc": rc, "stderr": err.getvalue()[-4000:],
            "seconds": round(time.perf_counter() - t0, 2), "recipe_config": recipe_config}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="a directory for the runs; results.jsonl lists them")
    ap.add_argument("runs", nargs="*", help="RECIPE[:MODEL]: a shipped recipe's name or a recipe file (default: "
                    "every run of RUNS)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    with open(args.out / "results.jsonl", "w") as results:
        for i, run in enumerate(args.runs or RUNS):
            result = smoke(run, args.out / f"{i:02d}-{Path(run.split(':')[0]).stem}", args.out / "shared")
            results.write(json.dumps(result) + "\n")
            results.flush()
            failed += result["rc"] != 0
            print(f"{run}: rc {result['rc']} in {result['seconds']} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

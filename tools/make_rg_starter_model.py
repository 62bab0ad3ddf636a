"""Build the starter of the reasoning-gym demo: the 2-layer Qwen2 of `tools/make_starter_model.py`, trained
supervised on a reasoning-gym task's train split to answer in reasoning-gym's `<answer>...</answer>` format.

    python tools/make_rg_starter_model.py --out DIR [--steps 800] [--noise-p 0.5] [--seed 0]
        [--task chain_sum --config JSON --train-size 3000 --heldout-size 1000]

DIR receives an HF checkpoint (config.json, model.safetensors, a character tokenizer of the rows' characters) and
two row files written by `megarl-prepare-data reasoning-gym` (`megarl.tasks.reasoning_gym`): `train.jsonl`
(seed 1) and `heldout.jsonl` (seed 100,000, every question that is also in train.jsonl left out), for the
`reasoning_gym` verifier. Written to a hidden sibling first and renamed at the end.

The task is reasoning-gym's `chain_sum`, as its own generator writes it ("State the final answer to the following
arithmetic problem: 7 - 2 + 9 ="), here with 2-3 one-digit terms: 4,200 distinct questions, answers -18..27,
rows of ~95 characters. A tiny character-level model learns it on 2 cores in minutes; most of reasoning-gym's
other tasks (puzzles, long lists, words) need a model that can read.

What the model sees: `prompt + "<answer>A</answer>" + EOS`, the loss on the answer and EOS only. In a share
`--noise-p` of rows, drawn afresh every time, A is a near miss (the answer plus or minus 1 to 3) instead of the
right answer, as in the other starters: the starter learns the format and is right only part of the time, which
leaves GRPO something to learn. Bound by the step count (the arithmetic starter's warm-up and cosine schedule
over exactly `--steps`), so every machine builds the same model; the held-out accuracy before and after GRPO is
the trainer's own evaluation (`make demo-rg`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import time
from pathlib import Path

import torch

from megarl.tasks import reasoning_gym as rg_task
from megarl.tasks.arithmetic import TOKENIZER_CHARS, build_tokenizer

_spec = importlib.util.spec_from_file_location("make_starter_model", Path(__file__).with_name("make_starter_model.py"))
_starter = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_starter)
write_atomically = _starter.write_atomically

STEPS = 800
BATCH = 64
NOISE_P = 0.5
TASK = "chain_sum"
CONFIG = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}
# The prompt is the question alone: the answer format is learnt from the rows (the CLI's default template adds a
# line asking for <answer> tags, 60 more characters a row, which a model that cannot read does not need)
TEMPLATE = "{question}"
# reasoning-gym makes item i of seed S from S + i: the held-out seed starts past the train split's items
TRAIN_SEED, HELDOUT_SEED = 1, 100_000
CHARS = TOKENIZER_CHARS + "<>"  # "/" is among them
POSITIONS = 128
MAX_NEW_TOKENS = 24  # "<answer>-18</answer>" is 20 characters, then EOS
HIDDEN, MLP_WIDTH = 128, 512  # the math and code starters' width: ~0.5M parameters


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def response(answer: str, rng: random.Random, noise_p: float) -> str:
    """`<answer>A</answer>`: the right answer, or with probability `noise_p` a near miss (integers off by 1-3)."""
    if rng.random() < noise_p:
        answer = str(int(answer) + rng.choice([-3, -2, -1, 1, 2, 3]))
    return f"<answer>{answer}</answer>"


def make_batch(rows, tokenizer, rng: random.Random, noise_p: float) -> dict[str, torch.Tensor]:
    """`prompt + response + EOS`, right-padded; labels -100 on the prompt and the padding. No attention mask: under
    causal attention right padding never reaches a real token (as the code starter)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids, labels = [], []
    for row in rows:
        prompt = encode(tokenizer, row["prompt"])
        answer = encode(tokenizer, response(row["answer"]["answer"], rng, noise_p)) + [eos]
        ids.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(map(len, ids))
    return {"input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in ids]),
            "labels": torch.tensor([r + [-100] * (width - len(r)) for r in labels])}


def check_rows(rows) -> int:
    """The longest prompt + answer + EOS in tokens; every character must be in the tokenizer's alphabet."""
    longest = 0
    for row in rows:
        text = row["prompt"] + response(row["answer"]["answer"], random.Random(0), 0.0)
        missing = set(text) - set(CHARS)
        if missing:
            raise ValueError(f"row {row['id']} has characters outside the tokenizer's: {sorted(missing)}")
        longest = max(longest, len(row["prompt"]) + MAX_NEW_TOKENS)
    return longest


def read_rows(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="checkpoint directory to create")
    p.add_argument("--steps", type=int, default=STEPS, help="training steps: the learning-rate schedule's length")
    p.add_argument("--noise-p", type=float, default=NOISE_P, help="share of training rows with a near-miss answer")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights, the batches and the near misses")
    p.add_argument("--train-size", type=int, default=3000, help="items of the train split (seed 1)")
    p.add_argument("--heldout-size", type=int, default=1000,
                   help="items drawn for the held-out split (seed 100,000), before the train split's are left out")
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it already exists")
    args = p.parse_args(argv)
    if not 0 <= args.noise_p <= 1:
        p.error(f"--noise-p must be in [0, 1], got {args.noise_p}")

    def build(tmp: Path) -> None:
        torch.manual_seed(args.seed)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # one thread, as the other starters
        train_path, heldout_path = tmp / "train.jsonl", tmp / "heldout.jsonl"
        rg_task.write(TASK, train_path, size=args.train_size, seed=TRAIN_SEED, config=CONFIG, template=TEMPLATE)
        counts = rg_task.write(TASK, heldout_path, size=args.heldout_size, seed=HELDOUT_SEED, config=CONFIG,
                               template=TEMPLATE, exclude_from=train_path)
        train, heldout = read_rows(train_path), read_rows(heldout_path)
        longest = check_rows(train + heldout)
        if longest > POSITIONS:
            raise ValueError(f"a prompt plus {MAX_NEW_TOKENS} new tokens is {longest} tokens: raise POSITIONS")
        tokenizer = build_tokenizer(tmp, chars=CHARS)
        model = _starter.build_model(tokenizer, mlp_width=MLP_WIDTH, positions=POSITIONS, hidden=HIDDEN)
        left_out = sum(n for reason, n in counts.items() if reason.startswith("skipped"))
        print(f"parameters: {_starter.count_parameters(model):,}; {TASK} {json.dumps(CONFIG)}: {len(train)} train "
              f"rows (seed {TRAIN_SEED}), {len(heldout)} held out (seed {HELDOUT_SEED}; {left_out} of "
              f"{args.heldout_size} left out, their questions being in the train split); near misses in "
              f"{args.noise_p:.0%} of rows", flush=True)
        start = time.perf_counter()

        def next_loss(rng: random.Random) -> torch.Tensor:
            return model(**make_batch(rng.sample(train, BATCH), tokenizer, rng, args.noise_p), use_cache=False).loss

        _starter.pretrain_steps(model, next_loss, args.steps, args.seed)
        seconds = time.perf_counter() - start
        print(f"trained {args.steps} steps in {seconds:.1f} s ({seconds / max(args.steps, 1):.3f} s/step)", flush=True)
        model.save_pretrained(str(tmp), safe_serialization=True)

    write_atomically(args.out, args.overwrite, build, "make_rg_starter_model")


if __name__ == "__main__":
    main()

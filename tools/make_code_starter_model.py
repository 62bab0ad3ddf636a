"""Build the starter of the code demo: the 2-layer Qwen2 of `tools/make_starter_model.py`, pre-trained to write the
one-line Python functions of `megarl.tasks.code_functions` from their specs in words, a share of them wrong.

    python tools/make_code_starter_model.py --out DIR [--steps 1500] [--wrong-p 0.5] [--seed 0]

DIR receives an HF checkpoint (config.json, model.safetensors, the task's character tokenizer), `train.jsonl`
(every problem not held out) and `heldout.jsonl` (the 200 held-out problems, never trained on): rows whose
verifier is `code` and whose answer is the problem's tests. Written to a hidden sibling first and renamed at the
end, so an interrupted build leaves nothing behind.

What the model sees: `prompt + program + EOS`, the loss on the program and EOS only (the prompt is given at test
time). With probability `--wrong-p`, drawn afresh for every row, the program is the task's `wrong_solution` (a
neighbouring primitive or a constant one off) instead of the canonical one. As with the arithmetic starter's near
misses, the model learns the format and which fragments a phrase calls for, but not to be reliably right: it
often writes a plausible program that fails the tests, which leaves headroom for GRPO. Bound by the step count,
like the other starters, so every machine builds the same model.

The build ends with the starter's held-out pass@1, greedy and sampled (temperature 1, 4 per problem), judged by
the `code` verifier in the local sandbox, as the trainer's evaluation is. Measured (docs/results.md, "The code
demo"): 600 steps give greedy 37 %, sampled ~10 %, in ~0.5 s of CPU a step (21 min on 2 heavily loaded cores).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import time
from pathlib import Path

import torch

from megarl.tasks import code_functions
from megarl.tasks.arithmetic import build_tokenizer

# The arithmetic starter's model, pre-training loop and atomic write, from its script by path: tools/ is a folder of
# scripts, not a package (see tools/make_tool_starter_model.py).
_spec = importlib.util.spec_from_file_location("make_starter_model", Path(__file__).with_name("make_starter_model.py"))
_starter = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_starter)
write_atomically = _starter.write_atomically

STEPS = 600
BATCH = 32
WRONG_P = 0.5  # share of rows whose program is a wrong one
# The longest prompt is 140 characters, the longest program 96 (+ EOS); a response may ramble up to MAX_NEW_TOKENS.
POSITIONS = 256
MAX_NEW_TOKENS = 112
# Half the arithmetic starter's width and MLP (~0.5M parameters): a row here is ~10 times as long, and a step of the
# 2M-parameter model took 3 s of CPU at batch 64, too slow for a build of a few minutes or for RL on 2 cores.
HIDDEN, MLP_WIDTH = 128, 512


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def make_batch(problems, tokenizer, rng: random.Random, wrong_p: float) -> dict[str, torch.Tensor]:
    """`prompt + program + EOS`, right-padded, no BOS; labels mask the prompt and padding with -100. Each program is
    the canonical solution, or with probability `wrong_p` a wrong one. No attention mask: under causal attention
    right padding never reaches a real token, and without a mask SDPA takes its causal kernel (faster on CPU)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows, label_rows = [], []
    for p in problems:
        program = code_functions.wrong_solution(p, rng) if rng.random() < wrong_p else p.solution
        prompt_ids, program_ids = encode(tokenizer, p.prompt), encode(tokenizer, program) + [eos]
        rows.append(prompt_ids + program_ids)
        label_rows.append([-100] * len(prompt_ids) + program_ids)
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in label_rows])
    return {"input_ids": input_ids, "labels": labels}


def pretrain(model, tokenizer, train, steps: int, seed: int, wrong_p: float, minutes: float = 0.0) -> None:
    """Causal-LM pre-training for exactly `steps` steps (`make_starter_model.pretrain_steps`)."""
    def next_loss(rng: random.Random) -> torch.Tensor:
        return model(**make_batch(rng.sample(train, BATCH), tokenizer, rng, wrong_p), use_cache=False).loss

    _starter.pretrain_steps(model, next_loss, steps, seed, minutes)


def evaluate(model_dir: Path, problems, samples: int, temperature: float, seed: int = 0,
             verifier=None) -> tuple[float, list[str]]:
    """pass@1 over `samples` programs per problem (temperature 0 = greedy), judged by the `code` verifier in the
    local sandbox; returns it and the programs. Generation is the trainer's own engine (`BuiltinEngine`), so a
    program here is what the trainer's evaluation would sample."""
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.verifiers.code import CodeVerifier

    tokenizer = _load_tokenizer(model_dir)
    engine = BuiltinEngine.from_pretrained(model_dir, tokenizer=tokenizer)
    params = SamplingParams(n=samples, temperature=temperature, max_new_tokens=MAX_NEW_TOKENS,
                            stop_token_ids=(tokenizer.eos_token_id,), seed=seed)
    groups = engine.generate([encode(tokenizer, p.prompt) for p in problems], params)
    programs, golds = [], []
    for p, group in zip(problems, groups):
        for c in group:
            programs.append(tokenizer.decode(c.token_ids, skip_special_tokens=True))
            golds.append(p.answer)
    verifier = verifier or CodeVerifier(backend="local", workers=2)
    results = verifier.verify_many(list(zip(programs, golds)))
    return sum(r.score == 1.0 for r in results) / len(results), programs


def _load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="checkpoint directory to create")
    p.add_argument("--steps", type=int, default=STEPS, help="pre-training steps: the learning-rate schedule's length")
    p.add_argument("--wrong-p", type=float, default=WRONG_P, help="share of training rows whose program is wrong")
    p.add_argument("--seed", type=int, default=0, help="seed for the initial weights and the rows drawn")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the held-out split")
    p.add_argument("--minutes", type=float, default=0.0, help="a deadline (0 = none); never shortens the schedule")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out pass@1 at the end")
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it already exists")
    args = p.parse_args(argv)
    if not 0 <= args.wrong_p <= 1:
        p.error(f"--wrong-p must be in [0, 1], got {args.wrong_p}")

    def build(tmp: Path) -> None:
        torch.manual_seed(args.seed)
        # One thread unless told otherwise, as the tool starter: on shared cores OpenMP's barriers cost more than a
        # second thread gains at this size
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        train, heldout = code_functions.split_problems(seed=args.split_seed)
        tokenizer = build_tokenizer(tmp, chars=code_functions.CHARS)
        longest = max(len(encode(tokenizer, x.prompt)) for x in train + heldout) + MAX_NEW_TOKENS
        if longest > POSITIONS:
            raise ValueError(f"a prompt plus {MAX_NEW_TOKENS} new tokens is {longest} tokens, past the model's "
                             f"{POSITIONS} positions")
        model = _starter.build_model(tokenizer, mlp_width=MLP_WIDTH, positions=POSITIONS, hidden=HIDDEN)
        print(f"parameters: {_starter.count_parameters(model):,}; {len(train)} train problems, {len(heldout)} held "
              f"out; wrong programs: {args.wrong_p:.0%} of rows", flush=True)
        start = time.perf_counter()
        pretrain(model, tokenizer, train, args.steps, args.seed, args.wrong_p, args.minutes)
        seconds = time.perf_counter() - start
        print(f"pre-trained {args.steps} steps in {seconds:.1f} s ({seconds / max(args.steps, 1):.3f} s/step)",
              flush=True)
        model.save_pretrained(str(tmp), safe_serialization=True)
        code_functions.write_jsonl(tmp / "train.jsonl", train)
        code_functions.write_jsonl(tmp / "heldout.jsonl", heldout)
        if not args.no_eval:
            print(f"evaluating on the {len(heldout)} held-out problems (greedy, then 4 samples each)", flush=True)
            greedy, _ = evaluate(tmp, heldout, samples=1, temperature=0.0)
            sampled, _ = evaluate(tmp, heldout, samples=4, temperature=1.0, seed=args.seed)
            print(f"held-out pass@1 greedy {greedy:.2%}, sampled {sampled:.2%} (T=1, 4 per problem)", flush=True)

    write_atomically(args.out, args.overwrite, build, "make_code_starter_model")


if __name__ == "__main__":
    main()

"""Build the starter of the math demo: the 2-layer Qwen2 of `tools/make_starter_model.py`, pre-trained on the
math-forms task (`megarl.tasks.math_forms`): a line of working, then the answer boxed, in many right spellings.

    python tools/make_math_starter_model.py --out DIR [--steps 600] [--noise-p 0.5] [--seed 0]

DIR receives an HF checkpoint (config.json, model.safetensors, the character tokenizer of the task's `CHARS`),
and three row files: `train.jsonl` (verifier `math`), `train_exact.jsonl` (the same rows for the `exact_string`
control) and `heldout.jsonl` (200 problems never trained on, verifier `math`: both demo runs are judged by it).
Every row's answer is the task's `label`: the canonical answer and the not-answers (copies of the question), so
the `math` verifier does not reward a copied question. Written to a hidden sibling first and renamed at the end.

What the model sees: `prompt + solution + EOS`, the loss on the solution and EOS only. The solution's working is
always the task's; its box holds, in a share `1 - --noise-p` of rows, a right answer spelled in one of its forms
drawn uniformly (the canonical one among them: `7/12`, `14/24`, `\\frac{7}{12}`, `0.5833`...), and in the share
`--noise-p` a plausible mistake (`wrong_forms`), drawn afresh every time. So the starter knows the format and is
right in roughly that share, and it spells right answers in many ways: the `math` reward credits every spelling,
the exact-string control only the canonical one. Bound by the step count (the arithmetic starter's warm-up and
cosine schedule over exactly `--steps`), so every machine builds the same model.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import time
from pathlib import Path

import torch

from megarl.tasks.arithmetic import build_tokenizer
from megarl.tasks.math_forms import CHARS, forms, label, rows, solution, split_problems, wrong_forms

# The arithmetic starter's pre-training loop and atomic write, from its script by path (tools/ is a folder of scripts).
_spec = importlib.util.spec_from_file_location("make_starter_model", Path(__file__).with_name("make_starter_model.py"))
_starter = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_starter)
write_atomically = _starter.write_atomically

STEPS = 600
BATCH = 32
HIDDEN, MLP_WIDTH = 128, 512  # half the arithmetic starter's width: rows are ~8x longer, and 2 cores are few
NOISE_P = 0.5
POSITIONS = 128  # the longest prompt + solution + EOS is 103 tokens (checked at build time)
MAX_NEW_TOKENS = 80  # the longest solution is 71 characters, then EOS
VOCAB_MULTIPLE = 16


def build_model(tokenizer):
    """The arithmetic starter's depth and heads (2 layers, 4 heads, 2 KV heads) at half its width (~0.5M
    parameters): a row here is ~8x longer than an arithmetic one, and measured on 2 shared cores a step of the
    full-width model on 64 rows took ~7 s; with room for prompt + solution."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    vocab = len(tokenizer)
    config = Qwen2Config(
        vocab_size=math.ceil(vocab / VOCAB_MULTIPLE) * VOCAB_MULTIPLE, tokenizer_vocab_size=vocab, hidden_size=HIDDEN,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=MLP_WIDTH,
        max_position_embeddings=POSITIONS, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype="float32")
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def response(problem, rng: random.Random, noise_p: float = NOISE_P) -> str:
    """A training solution: with probability `noise_p` a plausible mistake, else a right spelling, uniformly."""
    if rng.random() < noise_p:
        return rng.choice(wrong_forms(problem))
    return rng.choice([solution(problem), *forms(problem)])


def make_batch(problems, tokenizer, rng: random.Random, noise_p: float = NOISE_P) -> dict[str, torch.Tensor]:
    """`prompt + response + EOS`, right-padded; labels -100 on the prompt and the padding."""
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    ids, labels = [], []
    for p in problems:
        prompt, answer = enc(p.prompt), enc(response(p, rng, noise_p)) + [tokenizer.eos_token_id]
        ids.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width, pad = max(map(len, ids)), tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in ids])
    label_ids = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    return {"input_ids": input_ids, "attention_mask": (input_ids != pad).long(), "labels": label_ids}


def longest_row(problems, tokenizer) -> int:
    """Tokens in the longest prompt + any response (right or wrong) + EOS: what the positions must cover."""
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    return max(len(enc(p.prompt)) + max(len(enc(r)) for r in [solution(p), *forms(p), *wrong_forms(p)]) + 1
               for p in problems)


def pretrain(model, tokenizer, train, steps: int, seed: int, noise_p: float, minutes: float = 0.0) -> None:
    """Causal-LM pre-training for exactly `steps` steps (`make_starter_model.pretrain_steps`)."""
    def next_loss(rng: random.Random) -> torch.Tensor:
        return model(**make_batch(rng.sample(train, BATCH), tokenizer, rng, noise_p), use_cache=False).loss

    _starter.pretrain_steps(model, next_loss, steps, seed, minutes)


@torch.no_grad()
def evaluate(model, tokenizer, problems, samples: int, greedy: bool, seed: int = 0) -> dict[str, float]:
    """Held-out accuracy judged by the `math` verifier on the rows' labels, with the exact-string control's
    verdict and the share of answers that copy the question (right in value, but a not-answer)."""
    from megarl.verifiers import VERIFIERS

    math_v, exact_v = VERIFIERS.build("math"), VERIFIERS.build("exact_string")
    torch.manual_seed(seed)
    model.eval()
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    by_length: dict[int, list] = {}
    for p in problems:
        by_length.setdefault(len(enc(p.prompt)), []).append(p)
    counts = {"math": 0, "exact_string": 0, "copies": 0, "total": 0}
    for group in by_length.values():
        prompts = torch.tensor([enc(p.prompt) for p in group])
        out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=not greedy,
                             temperature=None if greedy else 1.0, top_k=None, top_p=None,
                             num_return_sequences=1 if greedy else samples, max_new_tokens=MAX_NEW_TOKENS,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        n = 1 if greedy else samples
        for i, row in enumerate(out[:, prompts.shape[1]:].tolist()):
            p = group[i // n]
            text = tokenizer.decode(row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row)
            right = math_v.verify(text, label(p)).outcome == "correct"
            counts["math"] += right
            counts["exact_string"] += exact_v.verify(text, p.answer).outcome == "correct"
            counts["copies"] += not right and math_v.verify(text, p.answer).outcome == "correct"
            counts["total"] += 1
    math_v.close()
    total = counts.pop("total")
    return {k: v / total for k, v in counts.items()}


def write_rows(path: Path, problems, verifier: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows(problems, verifier):
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="checkpoint directory to create")
    p.add_argument("--steps", type=int, default=STEPS, help="pre-training steps: the learning-rate schedule's length")
    p.add_argument("--noise-p", type=float, default=NOISE_P, help="share of training rows whose box holds a mistake")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights, the spellings and the mistakes")
    p.add_argument("--minutes", type=float, default=0.0, help="a deadline (0 = none); never shortens the schedule")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation at the end")
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it already exists")
    args = p.parse_args(argv)
    if not 0 <= args.noise_p <= 1:
        p.error(f"--noise-p must be in [0, 1], got {args.noise_p}")

    def build(tmp: Path) -> None:
        torch.manual_seed(args.seed)
        # One thread unless told otherwise, as the tool starter: on shared cores a second thread mostly waits
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        train, heldout = split_problems()
        tokenizer = build_tokenizer(tmp, chars=CHARS)
        longest = longest_row(train + heldout, tokenizer)
        if longest > POSITIONS:
            raise ValueError(f"the longest row has {longest} tokens: raise POSITIONS ({POSITIONS})")
        model = build_model(tokenizer)
        print(f"parameters: {sum(x.numel() for x in model.parameters()):,}; {len(train)} train problems, "
              f"{len(heldout)} held out; longest row {longest} of {POSITIONS} positions; mistakes in "
              f"{args.noise_p:.0%} of rows", flush=True)
        start = time.perf_counter()
        pretrain(model, tokenizer, train, args.steps, args.seed, args.noise_p, args.minutes)
        seconds = time.perf_counter() - start
        print(f"pre-trained {args.steps} steps in {seconds:.1f} s ({seconds / max(args.steps, 1):.3f} s/step)",
              flush=True)
        model.save_pretrained(str(tmp), safe_serialization=True)
        write_rows(tmp / "train.jsonl", train, "math")
        write_rows(tmp / "train_exact.jsonl", train, "exact_string")
        write_rows(tmp / "heldout.jsonl", heldout, "math")
        if not args.no_eval:
            print(f"evaluating on the {len(heldout)} held-out problems (greedy, then 4 samples each)", flush=True)
            for name, result in (("greedy", evaluate(model, tokenizer, heldout, 1, greedy=True)),
                                 ("sampled (T=1, 4 per prompt)",
                                  evaluate(model, tokenizer, heldout, 4, greedy=False, seed=args.seed))):
                print(f"held-out {name}: math {result['math']:.1%}, exact string {result['exact_string']:.1%}, "
                      f"copies of the question {result['copies']:.1%}", flush=True)

    write_atomically(args.out, args.overwrite, build, "make_math_starter_model")


if __name__ == "__main__":
    main()

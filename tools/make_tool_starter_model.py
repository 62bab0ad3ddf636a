"""Build the starter of the tool-use demo: the 2-layer Qwen2 of `tools/make_starter_model.py`, pre-trained on
`a*b=` multiplication (`megarl.tasks.multiplication`), mostly answering in its head and, in a small share of the
rows, by calling the python tool.

    python tools/make_tool_starter_model.py --out DIR [--steps 1500] [--tool-share 0.2] [--seed 0]

DIR receives an HF checkpoint (config.json, model.safetensors, the tokenizer with the backtick), `train.jsonl` and
`heldout.jsonl` (200 problems never trained on). Written to a hidden sibling first and renamed at the end.

What the model sees: a row is `prompt + answer + EOS` (a share `1 - --tool-share`: the true product, which the
model cannot compute, so it learns only the answer's format and rough size) or a tool-use demonstration (the
share `--tool-share`: the call, the tool's output, the product copied from it). The loss covers what the model
would write, never the prompt or the tool's output, as RL's loss mask does. So the starter calls the tool for
about that share of prompts and is then right when it copies well; GRPO can raise the share. Bound by the step
count, like the arithmetic starter.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import random
import time
from pathlib import Path

import torch

from megarl.tasks.arithmetic import build_tokenizer, write_jsonl
from megarl.tasks.multiplication import CHARS, split_problems, tool_call, tool_output

# The arithmetic starter's schedule and atomic write, from its script by path: tools/ is a folder of scripts, not a
# package, so an import that works when this file runs as a script would fail when a test imports it, or the reverse.
_spec = importlib.util.spec_from_file_location("make_starter_model", Path(__file__).with_name("make_starter_model.py"))
_starter = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_starter)
write_atomically = _starter.write_atomically

STEPS = 1500
BATCH = 64
TOOL_SHARE = 0.2
POSITIONS = 128  # prompt + call + output + answer: ~56 tokens
VOCAB_MULTIPLE = 16


def build_model(tokenizer):
    from transformers import AutoModelForCausalLM, Qwen2Config

    vocab = len(tokenizer)
    config = Qwen2Config(
        vocab_size=math.ceil(vocab / VOCAB_MULTIPLE) * VOCAB_MULTIPLE, tokenizer_vocab_size=vocab, hidden_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024,
        max_position_embeddings=POSITIONS, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype="float32")
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def row(problem, tokenizer, use_tool: bool) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 where there is no loss: the prompt, the tool's output)."""
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = enc(problem.prompt)
    if not use_tool:
        answer = enc(problem.answer) + [tokenizer.eos_token_id]
        return prompt + answer, [-100] * len(prompt) + answer
    call, output = enc(tool_call(problem)), enc(tool_output(problem.answer))
    answer = enc(problem.answer) + [tokenizer.eos_token_id]
    return prompt + call + output + answer, [-100] * len(prompt) + call + [-100] * len(output) + answer


def make_batches(problems, tokenizer, rng: random.Random, tool_share: float) -> list[dict[str, torch.Tensor]]:
    """The rows as two right-padded batches, direct answers and demonstrations: each padded to its own width
    (a demonstration is four times as long as a direct answer; one batch would be mostly padding)."""
    use = [rng.random() < tool_share for _ in problems]
    out = []
    for kind in (False, True):
        rows = [row(p, tokenizer, kind) for p, u in zip(problems, use) if u == kind]
        if not rows:
            continue
        width, pad = max(len(ids) for ids, _ in rows), tokenizer.pad_token_id
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
        out.append({"input_ids": input_ids, "attention_mask": (input_ids != pad).long(), "labels": labels})
    return out


def batch_loss(model, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Mean cross-entropy over every labelled token of all the batches together."""
    total, count = 0.0, 0
    for b in batches:
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
        labels = b["labels"][:, 1:]
        total = total + torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(),
                                                          ignore_index=-100, reduction="sum")
        count += int((labels != -100).sum())
    return total / count


def pretrain(model, tokenizer, train, steps: int, seed: int, tool_share: float, minutes: float = 0.0) -> None:
    """Pre-training for exactly `steps` steps (`make_starter_model.pretrain_steps`) on the batch loss above."""
    def next_loss(rng: random.Random) -> torch.Tensor:
        return batch_loss(model, make_batches(rng.sample(train, BATCH), tokenizer, rng, tool_share))

    _starter.pretrain_steps(model, next_loss, steps, seed, minutes)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--tool-share", type=float, default=TOOL_SHARE, help="share of rows that are tool demonstrations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=0.0, help="a deadline (0 = none); never shortens the schedule")
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    if not 0 <= args.tool_share <= 1:
        p.error(f"--tool-share must be in [0, 1], got {args.tool_share}")

    def build(tmp: Path) -> None:
        torch.manual_seed(args.seed)
        # One thread unless told otherwise: at this size a second one gains little on an idle machine, and on a
        # shared one OpenMP's barriers made steps several times slower (measured: 4.8 s against ~1 s a step)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        train, heldout = split_problems()
        tokenizer = build_tokenizer(tmp, chars=CHARS)
        model = build_model(tokenizer)
        print(f"parameters: {sum(x.numel() for x in model.parameters()):,}; {len(train)} train problems, "
              f"{len(heldout)} held out; tool demonstrations: {args.tool_share:.0%} of rows", flush=True)
        start = time.perf_counter()
        pretrain(model, tokenizer, train, args.steps, args.seed, args.tool_share, args.minutes)
        print(f"pre-trained {args.steps} steps in {time.perf_counter() - start:.1f} s", flush=True)
        model.save_pretrained(str(tmp), safe_serialization=True)
        write_jsonl(tmp / "train.jsonl", train)
        write_jsonl(tmp / "heldout.jsonl", heldout)

    write_atomically(args.out, args.overwrite, build, "make_tool_starter_model")


if __name__ == "__main__":
    main()

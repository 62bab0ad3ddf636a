"""Rollout throughput: the built-in engine against `transformers` `generate`, same model, prompts and sampling.

Both sample at temperature 1, top_p 1, no top-k, `--n` completions per prompt in one batch (HF via
`num_return_sequences`), up to `--max-new-tokens`, stopping at EOS. Throughput counts the tokens actually generated
(up to and including EOS) over wall seconds, after a warm-up, best of `--repeats`.

    python tools/bench/rollout.py                      # a tiny random Qwen2 made on the fly
    python tools/bench/rollout.py --model DIR --device cuda --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Callable

import torch
import transformers

from megarl.rollout.base import SamplingParams
from megarl.rollout.builtin import BuiltinEngine

EOS = 0  # of the tiny random model


def make_tiny_qwen2(path: str) -> None:
    """The default benchmark model: 2 layers, hidden 256, 4 heads / 2 kv heads, MLP 1024, vocab 64."""
    config = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=EOS,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def make_prompts(count: int, max_len: int, vocab: int, eos: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of lengths in [max_len // 2, max_len], never containing EOS."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, max_len // 2), max_len + 1, (count,), generator=gen).tolist()
    prompts = []
    for length in lengths:
        ids = torch.randint(0, vocab, (length,), generator=gen)
        prompts.append(torch.where(ids == eos, (ids + 1) % vocab, ids).tolist())
    return prompts


def run_builtin(engine: BuiltinEngine, prompts: list[list[int]], args, eos: int, seed: int) -> int:
    params = SamplingParams(
        n=args.n, temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=(eos,), seed=seed
    )
    return sum(len(c.token_ids) for group in engine.generate(prompts, params) for c in group)


def run_hf(model, prompts: list[list[int]], args, eos: int, seed: int) -> int:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), eos, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # HF decoder-only models want left padding too
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            num_return_sequences=args.n,
            max_new_tokens=args.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos,
        )[:, width:]
    # Rows that ended are padded with EOS after their EOS: count up to and including the first one.
    is_eos = out == eos
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, out.shape[1])
    return int(first.sum())


def race(runners: dict[str, Callable[[int], int]], repeats: int, sync: Callable[[], None]) -> dict[str, float]:
    """Best tokens/s of each runner over `repeats` rounds after one warm-up round (one-time costs). Runners
    alternate within a round, so load from other processes on the machine hits them alike."""
    for run in runners.values():
        run(-1)
    best = dict.fromkeys(runners, 0.0)
    for rep in range(repeats):
        for name, run in runners.items():
            sync()
            start = time.perf_counter()
            tokens = run(rep)
            sync()
            best[name] = max(best[name], tokens / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF checkpoint dir; default: a tiny random Qwen2 made in a temp dir")
    parser.add_argument("--prompts", type=int, default=64, help="distinct prompts per batch")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt lengths are drawn from [len/2, len]")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or tmp
        if args.model is None:
            make_tiny_qwen2(tmp)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
        engine = BuiltinEngine.from_pretrained(path, device=args.device, dtype=torch.float32)
    eos = model.generation_config.eos_token_id
    eos = (eos[0] if isinstance(eos, list) else eos) if eos is not None else EOS
    prompts = make_prompts(args.prompts, args.prompt_len, model.config.vocab_size, eos)
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)

    best = race(
        {
            "builtin": lambda seed: run_builtin(engine, prompts, args, eos, seed),
            "transformers": lambda seed: run_hf(model, prompts, args, eos, seed),
        },
        args.repeats,
        sync,
    )
    ours, theirs = best["builtin"], best["transformers"]
    print(
        f"{args.prompts} prompts x {args.n} samples, prompt len <= {args.prompt_len}, "
        f"max_new_tokens {args.max_new_tokens}, {args.threads} threads, {args.device}"
    )
    print(f"builtin {ours:.0f} tok/s | transformers {theirs:.0f} tok/s | ratio {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()

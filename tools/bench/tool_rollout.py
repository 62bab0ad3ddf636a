"""What a tool call costs a rollout, side by side in one run: a turn with a tool call against plain generation of
the same number of tokens, and the sandbox's batch tool-call throughput.

    python tools/bench/tool_rollout.py [--model DIR] [--prompts 8] [--n 8] [--first 20] [--second 6]
                                       [--workers 1,2] [--repeats 3] [--json out.json]

With the built-in engine (one torch thread) over `--model` (default: the tool demo's starter, .cache/tool-starter;
without it a random model of the same shape made here) and a batch of `--prompts` x `--n` rows:
- plain: one `generate` of first + output + second new tokens per row (no stop: every row runs to the end);
- with a tool call: `generate` of `--first` tokens, the batch's calls through the `python` tool (a cell whose
  output is the product of two numbers), the output's tokens appended, then `generate` of `--second` tokens from
  prompt + everything so far (the re-prefill);
- the difference per turn, split into the tool's sandbox round trip and the generation's extra (re-prefill);
- batch tool-call throughput: the batch's calls through the sandbox with each `--workers` count (calls per second,
  and the latency of one call alone).
Medians over `--repeats`. Times move with the machine's load; the bench reports CPU seconds of this process too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from megarl.rollout import SamplingParams
from megarl.rollout.builtin import BuiltinEngine
from megarl.tasks.multiplication import CHARS, tool_output
from megarl.tool_calls import ToolCall, ToolSettings, build_tool

REPO = Path(__file__).resolve().parents[2]


def median_time(fn, repeats: int) -> tuple[float, float, object]:
    """Median wall and CPU seconds of `fn()` over `repeats` runs, and its last result."""
    walls, cpus, out = [], [], None
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus), out


def load(model_dir: Path | None):
    from megarl.tasks.arithmetic import build_tokenizer

    if model_dir is not None and (model_dir / "config.json").exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        return BuiltinEngine.from_pretrained(model_dir, tokenizer=tok), tok, str(model_dir)
    from transformers import AutoModelForCausalLM, Qwen2Config

    tok = build_tokenizer(chars=CHARS)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, num_hidden_layers=2, tie_word_embeddings=False, hidden_size=256,
                      intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    path = Path(tempfile.mkdtemp()) / "m"
    AutoModelForCausalLM.from_config(cfg).float().eval().save_pretrained(path)
    return BuiltinEngine.from_pretrained(path, tokenizer=tok), tok, "random, the demo starter's shape"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / ".cache/tool-starter")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--first", type=int, default=20, help="tokens of the turn that ends in the call")
    ap.add_argument("--second", type=int, default=6, help="tokens of the turn after the output")
    ap.add_argument("--workers", default="1,2", help="sandbox worker counts for the throughput rows")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine, tok, what = load(args.model)
    prompts = [tok.encode(f"{100 + 37 * i}*{10 + 7 * i}=", add_special_tokens=False) for i in range(args.prompts)]
    rows = args.prompts * args.n
    output_ids = tok.encode(tool_output("56088"), add_special_tokens=False)
    total = args.first + len(output_ids) + args.second
    calls = [ToolCall("python", {"code": "123*456"})] * rows
    tool = build_tool("python", ToolSettings(workers=max(int(w) for w in args.workers.split(","))))
    tool.run_many(calls[:2])  # start the sandbox outside the timings

    def plain():
        return engine.generate(prompts, SamplingParams(n=args.n, max_new_tokens=total, seed=1))

    def with_tool():
        t0 = time.perf_counter()
        first = engine.generate(prompts, SamplingParams(n=args.n, max_new_tokens=args.first, seed=1))
        t1 = time.perf_counter()
        outputs = tool.run_many(calls)
        t2 = time.perf_counter()
        assert all(o.text == "56088" for o in outputs), outputs[:2]
        seqs = [list(p) + c.token_ids + output_ids for p, group in zip(prompts, first) for c in group]
        engine.generate(seqs, SamplingParams(n=1, max_new_tokens=args.second, seed=2))
        return {"first_s": t1 - t0, "tool_s": t2 - t1, "second_s": time.perf_counter() - t2}

    plain_wall, plain_cpu, _ = median_time(plain, args.repeats)
    parts = [with_tool() for _ in range(args.repeats)]
    tool_wall = statistics.median(sum(p.values()) for p in parts)
    split = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    tool.close()

    throughput = []
    for w in (int(x) for x in args.workers.split(",")):
        box = build_tool("python", ToolSettings(workers=w))
        box.run_many(calls[:w])  # warm
        wall, _, _ = median_time(lambda box=box: box.run_many(calls), args.repeats)
        one, _, _ = median_time(lambda box=box: box.run_many(calls[:1]), args.repeats)
        throughput.append({"workers": w, "calls": rows, "calls_per_s": round(rows / wall, 1),
                           "one_call_ms": round(1000 * one, 1)})
        box.close()

    report = {
        "model": what, "rows": rows, "tokens_per_row": total, "output_tokens": len(output_ids),
        "plain_generation_s": round(plain_wall, 3), "plain_generation_cpu_s": round(plain_cpu, 3),
        "with_tool_call_s": round(tool_wall, 3), **{k: round(v, 3) for k, v in split.items()},
        "overhead_per_turn_s": round(tool_wall - plain_wall, 3),
        "overhead_generation_s": round(split["first_s"] + split["second_s"] - plain_wall, 3),
        "throughput": throughput,
    }
    print(f"model: {what}; {rows} rows, {total} tokens each ({len(output_ids)} of them tool output)")
    print(f"{'':<34}{'seconds':>9}")
    print(f"{'plain generation':<34}{plain_wall:9.3f}")
    print(f"{'with a tool call':<34}{tool_wall:9.3f}  (first turn {split['first_s']:.3f}, tool {split['tool_s']:.3f},"
          f" re-prefill + second turn {split['second_s']:.3f})")
    print(f"{'overhead of the tool-call turn':<34}{tool_wall - plain_wall:9.3f}  (sandbox {split['tool_s']:.3f}, "
          f"generation {report['overhead_generation_s']:+.3f})")
    for t in throughput:
        print(f"batch of {t['calls']} calls, {t['workers']} sandbox worker(s): {t['calls_per_s']} calls/s "
              f"(one call alone: {t['one_call_ms']} ms)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

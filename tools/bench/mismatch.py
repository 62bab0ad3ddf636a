"""What the rollout engine's precision costs, measured over the whole next-token distribution: on the demo model,
a bf16 built-in engine against the fp32 Megatron actor, and an fp32 engine against the same actor, side by side.

    python tools/bench/mismatch.py                          # the demo starter (`make demo` builds .cache/starter)
    python tools/bench/mismatch.py --starter DIR --prompts 16 --max-new-tokens 48

Each engine samples completions of `--prompts` training prompts as the demo's rollouts are drawn (temperature 1,
stopped at the tokenizer's EOS, at most `--max-new-tokens`, the demo's `--max-response-len` 8); the actor (TP 1,
one process) computes its vocabulary-wide distributions at every sampled position
(`MegatronPolicy.next_token_distributions`), and the engine its own at the same positions
(`megarl.stages.mismatch`, the code behind `--mismatch-check-interval`). Reported per engine: the
full-distribution KL(engine || actor) and KL(actor || engine), total variation, top-1 agreement, and the
sampled-token gap |log p_engine - log p_actor| that the per-step metrics log (`rollout_actor_logp_absdiff_mean`).
Each engine samples its own completions (same seed, same prompts), so the two rows of figures are over the same
prompts but not always the same positions; the first line says what ran (model, prompts, lengths), each engine's
line how many rows and positions it compared.

The last line reads `mismatch bf16 engine vs fp32 actor: full KL X, sampled-token |dlogp| Y; fp32 vs fp32: full
KL Z` (`--json FILE` writes every figure).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(engine, actor, prompts: list[list[int]], max_new_tokens: int, seed: int,
            stop_token_ids: tuple[int, ...] = ()) -> dict[str, float]:
    """Sample from `engine`, then both sides' distributions at the sampled positions; the sampled-token gap too.
    `mismatch_rows`: the prompts whose completion has a token (an empty one has no position to compare)."""
    from megarl.rollout import SamplingParams
    from megarl.stages.algorithm import pack
    from megarl.samples import Sample, SampleStatus
    from megarl.stages.mismatch import actor_side, engine_side

    groups = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, n=1,
                                                     seed=seed, stop_token_ids=stop_token_ids))
    samples = [Sample(group=i, prompt_index=i, prompt_ids=list(p), response_ids=list(c.token_ids),
                      loss_mask=[1] * len(c.token_ids), rollout_logprobs=list(c.logprobs), weight_version=0,
                      status=SampleStatus.COMPLETED)
               for i, (p, (c,)) in enumerate(zip(prompts, groups)) if c.token_ids]
    packed = pack(samples, pad_id=0)
    side = actor_side(actor, packed, rows=len(samples), gather=False)
    metrics = engine_side(engine, side, topk=0)
    actor_sampled = torch.cat([a.gather(1, torch.tensor(s[1:])[c, None]).squeeze(1)
                               for a, s, c in zip(side.actor_logp, side.sequences, side.columns)])
    engine_sampled = torch.cat([packed.rollout_logp[b][packed.loss_mask[b].bool()] for b in range(len(samples))])
    metrics["sampled_abs_dlogp"] = float((actor_sampled.double() - engine_sampled.double()).abs().mean())
    metrics["mismatch_rows"] = float(len(samples))
    return metrics


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--starter", default=str(REPO / ".cache" / "starter"), help="HF checkpoint of the demo model")
    p.add_argument("--prompts", type=int, default=64, help="training prompts sampled (one completion each)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="the demo's --max-response-len")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write every figure here")
    args = p.parse_args()
    starter = Path(args.starter)
    if not (starter / "config.json").is_file():
        print(f"mismatch: no demo starter at {starter}: `make demo` builds it, or pass --starter DIR", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    from transformers import AutoTokenizer

    from megarl.mcore import parallel
    from megarl.mcore.actor import MegatronPolicy
    from megarl.model_shape import ModelShape
    from megarl.rollout.builtin import BuiltinEngine

    parallel.init_distributed(tp=1, pp=1, seed=args.seed)
    try:
        actor = MegatronPolicy(ModelShape.from_pretrained(starter), tp=1, pp=1, trainable=False)
        actor.load_hf(starter)
        tok = AutoTokenizer.from_pretrained(starter)
        lines = (starter / "train.jsonl").read_text().splitlines()[: args.prompts]
        prompts = [tok(json.loads(line)["prompt"])["input_ids"] for line in lines]
        shape = actor.shape
        print(f"model {starter} ({shape.family}, {shape.num_layers} layers, hidden {shape.hidden_size}, vocab "
              f"{shape.vocab_size}); {len(prompts)} prompts of train.jsonl, one completion each at temperature 1, "
              f"up to {args.max_new_tokens} new tokens or EOS, seed {args.seed}; actor fp32, TP 1, one process")
        out = {}
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            engine = BuiltinEngine.from_pretrained(starter, dtype=dtype)
            out[name] = measure(engine, actor, prompts, args.max_new_tokens, args.seed, (tok.eos_token_id,))
            m = out[name]
            print(f"{name} engine vs fp32 actor: KL(engine||actor) {m['mismatch_kl_fwd']:.3e}  KL(actor||engine) "
                  f"{m['mismatch_kl_rev']:.3e}  TV {m['mismatch_tv']:.3e}  top-1 {m['mismatch_top1']:.4f}  "
                  f"sampled |dlogp| {m['sampled_abs_dlogp']:.3e}  ({m['mismatch_rows']:.0f} rows, "
                  f"{m['mismatch_positions']:.0f} positions)")
    finally:
        parallel.destroy()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    b, f = out["bf16"], out["fp32"]
    print(f"mismatch bf16 engine vs fp32 actor: full KL {b['mismatch_kl_fwd']:.3e}, sampled-token |dlogp| "
          f"{b['sampled_abs_dlogp']:.3e}; fp32 vs fp32: full KL {f['mismatch_kl_fwd']:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

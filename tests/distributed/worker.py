"""Scenarios run under torchrun by tests/distributed; each rank writes its results to OUT/<scenario>-rank<r>.pt."""

from __future__ import annotations

import argparse
import os
import sys

import torch


def _setup(args):
    from megarl.mcore import parallel

    torch.set_num_threads(1)
    return parallel.init_distributed(tp=args.tp, pp=args.pp, timeout_s=120, seed=args.seed)


def _fixed_tokens(vocab: int, rows: int = 4, seq: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (rows, seq), generator=g)


def scenario_forward(args, info):
    """Full logits (gathered over TP), log-probs, and the exported HF weights."""
    from megatron.core import tensor_parallel

    from megarl.mcore import cpu_compat
    from megarl.mcore.actor import MegatronPolicy
    from megarl.mcore.model import ModelShape

    shape = ModelShape.from_pretrained(args.hf)
    policy = MegatronPolicy(shape, tp=args.tp, pp=args.pp, trainable=False)
    policy.load_hf(args.hf)
    tokens = _fixed_tokens(shape.vocab_size)
    out = {"logprobs": policy.logprobs(tokens, micro_batch_size=2, temperature=0.7)}
    if info.pp_size == 1:
        with cpu_compat.megatron_scope(), torch.no_grad():
            logits = policy.model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
            out["logits"] = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    out["exported"] = dict(policy.export_hf())
    return out


SCENARIOS = {"forward": scenario_forward}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    info = _setup(args)
    result = SCENARIOS[args.scenario](args, info)
    torch.save({"info": info, **result}, os.path.join(args.out, f"{args.scenario}-rank{info.rank}.pt"))
    from megarl.mcore import parallel

    parallel.destroy()


if __name__ == "__main__":
    sys.exit(main())

"""Context-parallel parity on GPUs (run under torchrun by tests/gpu/test_context_parallel_gpu.py): the same tiny
model and batch at CP = 1 and CP = 2 with the Transformer Engine spec in bf16, writing the actor's log-probs, one GRPO
update's loss / grad norm / entropy and the updated weights to OUT/cp<CP>-rank<r>.pt."""

from __future__ import annotations

import argparse
import os
import sys

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cp", type=int, default=1)
    args = p.parse_args()
    from megarl.stages.update import make_loss_fn
    from megarl.config import build_config
    from megarl.mcore import parallel
    from megarl.mcore.actor import MegatronPolicy, OptimConfig
    from megarl.model_shape import ModelShape

    info = parallel.init_distributed(tp=1, pp=1, timeout_s=300, seed=0, cp=args.cp)
    shape = ModelShape.from_pretrained(args.hf)
    # bf16: TE's context-parallel attention runs in its flash / fused backends only, which take no fp32.
    actor = MegatronPolicy(shape, tp=1, pp=1, trainable=True, optim=OptimConfig(lr=1e-3, adam_eps=1e-4),
                           use_transformer_engine=True, cp=args.cp, bf16=True)
    actor.load_hf(args.hf)
    g = torch.Generator().manual_seed(99)
    rows, seq = 8, 13  # 13: not a multiple of 2 x CP, so the padding path runs
    tokens = torch.randint(0, shape.vocab_size, (rows, seq), generator=g)
    mask = torch.zeros(rows, seq - 1)
    for b in range(rows):
        mask[b, 2 + b % 4 : seq - 1 - b % 3] = 1.0
    batch = {"tokens": tokens, "loss_mask": mask, "rollout_logp": torch.zeros(rows, seq - 1),
             "advantages": torch.randn(rows, generator=g)}
    out = {"logprobs": actor.logprobs(tokens.cuda(), micro_batch_size=4, temperature=0.7).cpu()}
    update = actor.train_step(batch, make_loss_fn(build_config({}).algorithm, 64), micro_batch_size=4, temperature=1.0)
    out.update(loss=update["loss_num"] / update["loss_den"], grad_norm=update["grad_norm"],
               entropy=update["entropy_sum"] / update["tokens"],
               exported={k: v.cpu() for k, v in actor.export_hf()})
    torch.save(out, os.path.join(args.out, f"cp{args.cp}-rank{info.rank}.pt"))
    parallel.destroy()


if __name__ == "__main__":
    sys.exit(main())

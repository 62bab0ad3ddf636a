"""Run under torchrun by tests/distributed/test_critic.py: fit the PPO critic to fixed returns on a fixed batch.

Each rank writes OUT/critic-<layout>-rank<r>.pt with its per-step value losses (global, reduced over ranks) and,
on the last pipeline stage, its final values for its share of the batch.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist


def fixed_batch(vocab: int, rows: int = 8, seq: int = 12) -> dict[str, torch.Tensor]:
    """Right-padded rows with response masks of different lengths and returns that depend on the row."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (rows, seq), generator=g)
    mask = torch.zeros(rows, seq - 1)
    for b in range(rows):
        mask[b, 2 + b % 3 : seq - 1 - b % 4] = 1.0
    returns = torch.where(torch.arange(rows) % 2 == 0, 1.0, -0.5).unsqueeze(1) * mask
    return {"tokens": tokens, "loss_mask": mask, "returns": returns}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layout", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()

    from megarl.mcore import parallel
    from megarl.mcore.actor import OptimConfig
    from megarl.mcore.critic import MegatronCritic
    from megarl.metrics import reduce_over_ranks
    from megarl.model_shape import ModelShape
    from megarl.stages.critic_update import value_loss_fn

    torch.set_num_threads(1)
    info = parallel.init_distributed(tp=args.tp, pp=args.pp, timeout_s=120, seed=1234)
    shape = ModelShape.from_pretrained(args.hf)
    critic = MegatronCritic(shape, tp=args.tp, pp=args.pp, optim=OptimConfig(lr=args.lr))
    critic.load_hf(args.hf)

    full = fixed_batch(shape.vocab_size)
    rows = full["tokens"].shape[0] // info.dp_size
    batch = {k: v[info.dp_rank * rows : (info.dp_rank + 1) * rows] for k, v in full.items()}
    initial = critic.values(batch["tokens"], micro_batch_size=2)
    losses = []
    for _ in range(args.steps):
        old = critic.values(batch["tokens"], micro_batch_size=2)
        old = torch.zeros_like(batch["loss_mask"]) if old is None else old
        out = critic.train_step({**batch, "old_values": old}, value_loss_fn(clip=0.2), micro_batch_size=2)
        last = info.is_last_stage and info.tp_rank == 0
        mine = {k: out.get(k, 0.0) for k in ("value_loss_num", "value_tokens")} if last else {}
        g = reduce_over_ranks(mine, ["value_loss_num", "value_tokens"])
        losses.append(g["value_loss_num"] / g["value_tokens"])
    final = critic.values(batch["tokens"], micro_batch_size=2)
    result = {"losses": losses, "initial": initial, "final": final, "dp_rank": info.dp_rank, "rows": rows}
    torch.save(result, os.path.join(args.out, f"critic-{args.layout}-rank{dist.get_rank()}.pt"))
    parallel.destroy()


if __name__ == "__main__":
    sys.exit(main())

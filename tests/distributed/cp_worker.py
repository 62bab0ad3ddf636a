"""Context parallelism over gloo, run under torchrun by tests/distributed/test_cp_groups_gloo.py: the process
groups (TP x CP x PP replicas, DP over the rest), the whole-sequence gather and its gradient, the samples' broadcast
to a replica's CP ranks, and the clear error a CPU-only (local-spec) model gives for CP > 1. Each rank writes
OUT/cp-rank<r>.json."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cp", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    from megarl.mcore import context_parallel, parallel
    from megarl.mcore.actor import MegatronPolicy
    from megarl.model_shape import ModelShape

    info = parallel.init_distributed(tp=1, pp=1, timeout_s=120, seed=0, cp=args.cp)
    out = {"rank": info.rank, "cp_rank": info.cp_rank, "cp_size": info.cp_size, "dp_rank": info.dp_rank,
           "dp_size": info.dp_size, "is_mp_leader": info.is_mp_leader, "replica_size": info.replica_size,
           "replica_ranks": dist.get_process_group_ranks(parallel.mp_group()),
           "cp_ranks": dist.get_process_group_ranks(parallel.cp_group())}

    # The gather: whole sequences on every CP rank, bit for bit; the gradient of this rank's positions only.
    g = torch.Generator().manual_seed(7 + info.dp_rank)  # each DP rank its own batch
    full = torch.randn(3, 4 * args.cp, 5, generator=g)
    weight = torch.randn(3, 4 * args.cp, 5, generator=g)
    local = context_parallel.split_for_cp_rank(full, info.cp_rank, info.cp_size).requires_grad_()
    whole = context_parallel.gather_from_cp_ranks(local, parallel.cp_group())
    (whole * weight).sum().backward()
    out["gather_exact"] = torch.equal(whole.detach(), full)
    out["grad_exact"] = torch.equal(local.grad, context_parallel.split_for_cp_rank(weight, info.cp_rank, info.cp_size))

    # The replica's leader hands its samples to the replica's other ranks (its CP partners here).
    out["broadcast"] = parallel.broadcast_in_mp_group({"from": info.rank} if info.is_mp_leader else None)

    shape = ModelShape.from_hf_config(dict(model_type="qwen2", num_hidden_layers=2, hidden_size=64,
                                           num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                           vocab_size=64, max_position_embeddings=64, rms_norm_eps=1e-6,
                                           rope_theta=10000.0, tie_word_embeddings=False))
    try:
        MegatronPolicy(shape, tp=1, pp=1, trainable=False, cp=args.cp, use_transformer_engine=None)
        out["policy_error"] = None
    except ValueError as e:
        out["policy_error"] = str(e)
    with open(os.path.join(args.out, f"cp-rank{info.rank}.json"), "w") as fh:
        json.dump(out, fh)
    parallel.destroy()


if __name__ == "__main__":
    sys.exit(main())

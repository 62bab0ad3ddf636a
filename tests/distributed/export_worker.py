"""`report.save_hf` (megarl/stages) under torchrun (tests/distributed/test_export_hf.py): load an HF checkpoint into
the actor at the given TP x PP and export it again, streamed into small safetensors shards."""

from __future__ import annotations

import argparse
import sys

import torch


class _NoTokenizer:
    def save_pretrained(self, path):
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--shard-bytes", type=int, default=0)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (a mixture-of-experts model)")
    args = p.parse_args()
    torch.set_num_threads(1)
    from megarl.stages import report
    from megarl.mcore import parallel
    from megarl.mcore.actor import MegatronPolicy
    from megarl.mcore.model import MoEOptions
    from megarl.model_shape import ModelShape

    info = parallel.init_distributed(tp=args.tp, pp=args.pp, timeout_s=120, seed=0, ep=args.ep)
    shape = ModelShape.from_pretrained(args.hf)
    actor = MegatronPolicy(shape, tp=args.tp, pp=args.pp, trainable=False, moe=MoEOptions(ep=args.ep))
    actor.load_hf(args.hf)
    report.save_hf(actor, _NoTokenizer(), args.hf, args.out, info, shard_bytes=args.shard_bytes)
    parallel.destroy()


if __name__ == "__main__":
    sys.exit(main())

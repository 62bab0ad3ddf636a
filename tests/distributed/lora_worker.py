"""tests/distributed/test_lora_tp.py's torchrun worker: `lora_checks.megatron_side` at TP 2, without and with
sequence parallelism; rank 0 saves both results for the test to hold against `peft`. The test puts tests/ on its
PYTHONPATH (for tests/lora_checks.py)."""

from __future__ import annotations

import argparse
import sys

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    args = p.parse_args()
    torch.set_num_threads(1)
    from megarl.mcore import parallel

    info = parallel.init_distributed(tp=args.tp, timeout_s=120, seed=0)
    from lora_checks import megatron_side

    results = {sp: megatron_side(args.hf, tp=args.tp, targets=tuple(args.targets.split(",")), sequence_parallel=sp)
               for sp in (False, True)}
    if info.rank == 0:
        torch.save(results, args.out)
    parallel.destroy()


if __name__ == "__main__":
    sys.exit(main())

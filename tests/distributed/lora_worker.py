"""tests/distributed/test_lora_tp.py's torchrun worker: `lora_checks.megatron_side` in each of `--layouts` (TP 2
without and with sequence parallelism, PP 2), one after another on new process groups over the same two processes;
rank 0 saves the results for the test to hold against `peft`. The test puts tests/ on its PYTHONPATH (for
tests/lora_checks.py)."""

from __future__ import annotations

import argparse
import sys

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layouts", default="2,1,0;2,1,1;1,2,0", help="tp,pp,sequence_parallel;...")
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    args = p.parse_args()
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from megarl.mcore import parallel

    info = parallel.init_distributed(timeout_s=120, seed=0)
    from lora_checks import megatron_side

    results = {}
    for layout in args.layouts.split(";"):
        tp, pp, sp = (int(x) for x in layout.split(","))
        parallel_state.destroy_model_parallel()
        parallel.init_distributed(tp=tp, pp=pp, timeout_s=120, seed=0)
        results[layout] = megatron_side(args.hf, tp=tp, pp=pp, targets=tuple(args.targets.split(",")),
                                        sequence_parallel=bool(sp))
    if info.rank == 0:
        torch.save(results, args.out)
    parallel.destroy()


if __name__ == "__main__":
    sys.exit(main())

"""tests/distributed/test_lora_tp.py's torchrun worker: `lora_checks.megatron_side` in each of `--layouts` (Qwen2 at
TP 2 without and with sequence parallelism and at PP 2, Qwen3-MoE with expert adapters at EP 2; on four processes
TP 2 x PP 2, Qwen3-MoE also at EP 2), one after another on new process groups over the same processes; rank 0
saves the results for the test to hold against `peft`. The test puts tests/ on its PYTHONPATH (for
tests/lora_checks.py)."""

from __future__ import annotations

import argparse
import sys

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True, help="qwen2=DIR,moe=DIR: the models the layouts name")
    p.add_argument("--out", required=True)
    p.add_argument("--layouts", default="qwen2:2,1,1,0;qwen2:2,1,1,1;qwen2:1,2,1,0;moe:1,1,2,0",
                   help="model:tp,pp,ep,sequence_parallel;...")
    args = p.parse_args()
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from megarl.mcore import parallel

    info = parallel.init_distributed(timeout_s=120, seed=0)
    from lora_checks import ALL, MOE, megatron_side

    models = dict(kv.split("=", 1) for kv in args.hf.split(","))
    results = {}
    for layout in args.layouts.split(";"):
        model, split = layout.split(":")
        tp, pp, ep, sp = (int(x) for x in split.split(","))
        parallel_state.destroy_model_parallel()
        etp = 1 if model == "moe" else 0  # expert adapters need expert-TP 1 (at TP 2 too)
        parallel.init_distributed(tp=tp, pp=pp, ep=ep, etp=etp, timeout_s=120, seed=0)
        results[layout] = megatron_side(models[model], tp=tp, pp=pp, ep=ep, etp=etp,
                                        targets=MOE if model == "moe" else ALL, sequence_parallel=bool(sp))
    if info.rank == 0:
        torch.save(results, args.out)
    parallel.destroy()


if __name__ == "__main__":
    sys.exit(main())

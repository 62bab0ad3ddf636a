"""bf16 on CPU, in one process (run under torchrun by tests/e2e/test_bf16_cpu.py): writes OUT/bf16.pt with

- `logp`: {"fp32", "bf16"}: the frozen reference's log-probs of fixed tokens in each precision;
- `param_dtypes`, `main_dtypes`, `main_grad_dtypes`: the bf16 actor's model params, its optimizer's main params,
  and its gradient buffers' dtypes;
- `losses`: {"fp32", "bf16"}: the mean next-token NLL of a fixed batch before each of `STEPS` updates;
- `sync`: the bf16 engine's log-probs against the bf16 actor's after a weight sync
  (`megarl.stages.colocation.verify_sync` metrics).
"""

from __future__ import annotations

import sys

import torch

STEPS = 8


def nll(logp: torch.Tensor, mb: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The actor's loss interface: (sum, count, metrics) of the next-token NLL over real rows."""
    rows = mb["_real_rows"]
    loss = -logp[:rows].sum()
    return loss, torch.tensor(logp[:rows].numel()), {"nll_sum": loss.detach(), "tokens": float(logp[:rows].numel())}


def main(hf: str, out: str) -> None:
    from megarl.mcore import parallel
    from megarl.mcore.actor import MegatronPolicy, OptimConfig
    from megarl.model_shape import ModelShape
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.rollout import weight_sync
    from megarl.stages.colocation import verify_sync

    torch.set_num_threads(1)
    parallel.init_distributed(tp=1, pp=1, timeout_s=120, seed=0)
    shape = ModelShape.from_pretrained(hf)
    tokens = torch.randint(0, shape.vocab_size, (8, 24), generator=torch.Generator().manual_seed(1))
    result: dict = {"logp": {}, "losses": {}}
    for precision in ("fp32", "bf16"):
        bf16 = precision == "bf16"
        reference = MegatronPolicy(shape, tp=1, pp=1, trainable=False, bf16=bf16, use_transformer_engine=False)
        reference.load_hf(hf)
        result["logp"][precision] = reference.logprobs(tokens, micro_batch_size=4)
        actor = MegatronPolicy(shape, tp=1, pp=1, trainable=True, bf16=bf16, use_transformer_engine=False,
                               optim=OptimConfig(lr=3e-3))
        actor.load_hf(hf)
        losses = []
        for _ in range(STEPS):
            m = actor.train_step({"tokens": tokens}, nll, micro_batch_size=4)
            losses.append(m["nll_sum"] / m["tokens"])
        result["losses"][precision] = losses
    result["param_dtypes"] = sorted({str(p.dtype) for p in actor.model.parameters()})
    inner = actor.optimizer.chained_optimizers[0]
    result["main_dtypes"] = sorted({str(p.dtype) for g in inner.fp32_from_float16_groups for p in g})
    result["main_grad_dtypes"] = sorted({str(p.main_grad.dtype) for p in actor.model.parameters()})
    engine = BuiltinEngine(_config(hf), dtype=torch.bfloat16)
    weight_sync.push(engine, actor.export_hf(), version=1)
    result["sync"] = verify_sync(actor, engine, version=1, tolerance=0.05)
    torch.save(result, f"{out}/bf16.pt")
    parallel.destroy()


def _config(hf: str) -> dict:
    import json
    from pathlib import Path

    return json.loads((Path(hf) / "config.json").read_text())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

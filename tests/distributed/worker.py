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


def parallel_device() -> torch.device:
    from megarl.mcore.parallel import device

    return device()


def _fixed_tokens(vocab: int, rows: int = 4, seq: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (rows, seq), generator=g)


def scenario_forward(args, info):
    """Full logits (gathered over TP), log-probs, and the exported HF weights."""
    from megatron.core import tensor_parallel

    from megarl.mcore import cpu_compat
    from megarl.mcore.actor import MegatronPolicy
    from megarl.model_shape import ModelShape

    shape = ModelShape.from_pretrained(args.hf)
    policy = MegatronPolicy(shape, tp=args.tp, pp=args.pp, trainable=False)
    policy.load_hf(args.hf)
    tokens = _fixed_tokens(shape.vocab_size).to(parallel_device())
    logprobs = policy.logprobs(tokens, micro_batch_size=2, temperature=0.7)
    out = {"logprobs": None if logprobs is None else logprobs.cpu()}
    if info.pp_size == 1:
        with cpu_compat.megatron_scope(), torch.no_grad():
            logits = policy.model(tokens, torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens), None)
            out["logits"] = tensor_parallel.gather_from_tensor_model_parallel_region(logits).cpu()
    out["exported"] = dict(policy.export_hf())
    return out


def _synthetic_batch(vocab: int, rows: int = 8, seq: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    tokens = torch.randint(0, vocab, (rows, seq), generator=g)
    mask = torch.zeros(rows, seq - 1)
    for b in range(rows):
        start = 2 + b % 4
        mask[b, start : seq - 1 - b % 3] = 1.0
    return {"tokens": tokens, "loss_mask": mask, "rollout_logp": torch.zeros(rows, seq - 1),
            "advantages": torch.randn(rows, generator=g)}


def _trained_actor(args, info, steps: int = 1):
    """An actor loaded from HF and moved by `steps` GRPO updates on this DP rank's slice of a fixed batch."""
    from megarl import steps as train_steps
    from megarl.config import build_config
    from megarl.mcore.actor import MegatronPolicy, OptimConfig
    from megarl.model_shape import ModelShape

    shape = ModelShape.from_pretrained(args.hf)
    # A large Adam eps: gradients that are zero in exact arithmetic (the key bias, by softmax shift invariance)
    # come out as float noise, and Adam's m / sqrt(v) would blow that noise up into a full-size update.
    actor = MegatronPolicy(shape, tp=args.tp, pp=args.pp, trainable=True, optim=OptimConfig(lr=1e-2, adam_eps=1e-4))
    actor.load_hf(args.hf)
    batch = _synthetic_batch(shape.vocab_size)
    per = batch["tokens"].shape[0] // info.dp_size
    mine = {k: v[info.dp_rank * per : (info.dp_rank + 1) * per] for k, v in batch.items()}
    cfg = build_config({})
    losses = []
    for _ in range(steps):
        out = actor.train_step(mine, train_steps.make_loss_fn(cfg), micro_batch_size=2, temperature=1.0)
        losses.append(out.get("loss_num", 0.0))
    return actor, shape, losses


def scenario_dp_step(args, info):
    """Weights after two updates on a fixed global batch, however it is split over DP ranks."""
    actor, _, losses = _trained_actor(args, info, steps=2)
    return {"exported": dict(actor.export_hf()), "losses": losses}


def scenario_sync(args, info):
    """After an update and a weight sync, the built-in engine's log-probs equal the actor's."""
    from megarl import steps as train_steps

    actor, shape, _ = _trained_actor(args, info)
    engine = train_steps.build_engine(args.hf, "cpu") if info.is_mp_leader else None
    train_steps.sync_weights(actor, engine, version=1)
    tokens = _fixed_tokens(shape.vocab_size).to(parallel_device())
    out = {"actor_logprobs": actor.logprobs(tokens, micro_batch_size=2, temperature=0.7)}
    if engine is not None:
        out["engine_logprobs"] = torch.tensor(engine.score(tokens.tolist(), [1] * tokens.shape[0], temperature=0.7))
        out["engine_version"] = engine.weight_version
    return out


def scenario_ckpt_save(args, info):
    from megarl.mcore import checkpoint

    actor, shape, _ = _trained_actor(args, info)
    checkpoint.save(args.ckpt, 1, actor, {"sampler": {"epoch": 0, "position": 0}})
    return {"logprobs": actor.logprobs(_fixed_tokens(shape.vocab_size), micro_batch_size=2)}


def scenario_ckpt_load(args, info):
    from megarl.mcore import checkpoint
    from megarl.mcore.actor import MegatronPolicy
    from megarl.model_shape import ModelShape

    shape = ModelShape.from_pretrained(args.hf)
    actor = MegatronPolicy(shape, tp=args.tp, pp=args.pp, trainable=True)
    state = checkpoint.load(checkpoint.find_latest(args.ckpt), actor)
    return {"logprobs": actor.logprobs(_fixed_tokens(shape.vocab_size), micro_batch_size=2), "step": state["step"]}


SCENARIOS = {"forward": scenario_forward, "dp_step": scenario_dp_step, "sync": scenario_sync,
             "ckpt_save": scenario_ckpt_save, "ckpt_load": scenario_ckpt_load}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", default="")
    args = p.parse_args()
    info = _setup(args)
    result = SCENARIOS[args.scenario](args, info)
    torch.save({"info": info, **result}, os.path.join(args.out, f"{args.scenario}-rank{info.rank}.pt"))
    from megarl.mcore import parallel

    parallel.destroy()


if __name__ == "__main__":
    sys.exit(main())

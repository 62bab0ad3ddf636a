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
    # A micro-batch size above the batch's 4 rows: one micro-batch of 4 rows, not 16 with 12 padded ones.
    rows_seen = []
    hook = policy.model.register_forward_pre_hook(lambda module, args: rows_seen.append(args[0].shape[0]))
    wide = policy.logprobs(tokens, micro_batch_size=16, temperature=0.7)
    hook.remove()
    out.update(wide_logprobs=None if wide is None else wide.cpu(), wide_rows_seen=rows_seen)
    if info.pp_size == 1:
        with cpu_compat.megatron_scope(), torch.no_grad():
            logits = policy.model(tokens, torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens), None)
            out["logits"] = tensor_parallel.gather_from_tensor_model_parallel_region(logits).cpu()
    out["exported"] = dict(policy.export_hf())
    return out


def _synthetic_batch(vocab: int, rows: int = 8, seq: int = 12, seed: int = 99) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq), generator=g)
    mask = torch.zeros(rows, seq - 1)
    for b in range(rows):
        start = 2 + b % 4
        mask[b, start : seq - 1 - b % 3] = 1.0
    return {"tokens": tokens, "loss_mask": mask, "rollout_logp": torch.zeros(rows, seq - 1),
            "advantages": torch.randn(rows, generator=g)}


def _trained_actor(args, info, steps: int = 1):
    """An actor loaded from HF and moved by `steps` GRPO updates on this DP rank's slice of a fixed batch."""
    from megarl.stages.update import make_loss_fn
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
        loss_fn = make_loss_fn(cfg.algorithm, cfg.rollout.max_response_len)
        out = actor.train_step(mine, loss_fn, micro_batch_size=2, temperature=1.0)
        losses.append(out.get("loss_num", 0.0))
    return actor, shape, losses


def scenario_dp_step(args, info):
    """Weights after two updates on a fixed global batch, however it is split over DP ranks."""
    actor, _, losses = _trained_actor(args, info, steps=2)
    return {"exported": dict(actor.export_hf()), "losses": losses}


def _layouts(args) -> list[dict]:
    """`--layouts "m,tp,pp,ep,etp,dispatcher,sp;..."`: model index into `--hf a,b`, then the split of each run."""
    out = []
    for spec in args.layouts.split(";"):
        m, tp, pp, ep, etp, dispatcher, sp = spec.split(",")
        out.append(dict(name=spec, hf=args.hf.split(",")[int(m)], tp=int(tp), pp=int(pp), ep=int(ep), etp=int(etp),
                        dispatcher=dispatcher, sp=bool(int(sp))))
    return out


def _relayout(layout: dict):
    """New model-parallel groups over the same processes (one torchrun serves many layouts)."""
    from megatron.core import parallel_state

    from megarl.mcore import parallel
    from megarl.mcore.model import MoEOptions

    parallel_state.destroy_model_parallel()
    info = parallel.init_distributed(tp=layout["tp"], pp=layout["pp"], timeout_s=120, ep=layout["ep"],
                                     etp=layout["etp"])
    return info, MoEOptions(ep=layout["ep"], etp=layout["etp"], dispatcher=layout["dispatcher"])


def scenario_layouts(args, info):
    """Per layout: full logits (PP = 1), log-probs and the exported HF weights (on the leader, rank 0)."""
    from megatron.core import tensor_parallel

    from megarl.mcore import cpu_compat
    from megarl.mcore.actor import MegatronPolicy
    from megarl.model_shape import ModelShape

    out = {}
    for layout in _layouts(args):
        info, moe = _relayout(layout)
        shape = ModelShape.from_pretrained(layout["hf"])
        policy = MegatronPolicy(shape, tp=info.tp_size, pp=info.pp_size, trainable=False, moe=moe)
        policy.load_hf(layout["hf"])
        tokens = _fixed_tokens(shape.vocab_size)
        logprobs = policy.logprobs(tokens, micro_batch_size=2, temperature=0.7)
        r = {"logprobs": logprobs, "exported": dict(policy.export_hf())}
        if info.pp_size == 1:
            with cpu_compat.megatron_scope(), torch.no_grad():
                logits = policy.model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
                r["logits"] = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        out[layout["name"]] = r
    return out


def scenario_train_layouts(args, info):
    """Per layout, one GRPO update of the same HF weights on the same global batch: loss, gradient norm, updated
    weights. The first layout also syncs the built-in engine and scores the probe tokens with both, and with
    `--ckpt` saves a checkpoint, which every later layout loads first (its log-probs then, and the weights after
    a second update on another batch, which the first layout also makes after saving: Adam's state matters)."""
    from megarl.arguments import components
    from megarl.config import build_config
    from megarl.mcore import checkpoint
    from megarl.mcore.actor import MegatronPolicy, OptimConfig
    from megarl.model_shape import ModelShape
    from megarl.rollout.backends import build_engine
    from megarl.stages.colocation import WeightSync
    from megarl.stages.update import make_loss_fn

    out = {}

    def second_update(actor, info, shape):
        batch = _synthetic_batch(shape.vocab_size, seed=7)
        per = batch["tokens"].shape[0] // info.dp_size
        mine = {k: v[info.dp_rank * per : (info.dp_rank + 1) * per] for k, v in batch.items()}
        actor.train_step(mine, make_loss_fn(build_config({}).algorithm, 64), micro_batch_size=2)
        return {k: v.clone() for k, v in actor.export_hf()}  # unsharded tensors alias the weights

    for index, layout in enumerate(_layouts(args)):
        info, moe = _relayout(layout)
        shape = ModelShape.from_pretrained(layout["hf"])
        def build(shape=shape, info=info, moe=moe, layout=layout):
            return MegatronPolicy(shape, tp=info.tp_size, pp=info.pp_size, trainable=True, moe=moe,
                                  sequence_parallel=layout["sp"], optim=OptimConfig(lr=1e-2, adam_eps=1e-4))

        tokens = _fixed_tokens(shape.vocab_size)
        r = {}
        if index > 0 and args.ckpt:
            resumed = build()
            r["step"] = checkpoint.load(checkpoint.find_latest(args.ckpt), resumed)["step"]
            r["resumed_logprobs"] = resumed.logprobs(tokens, micro_batch_size=2)
            r["resumed_update"] = second_update(resumed, info, shape)
            del resumed
        actor = build()
        actor.load_hf(layout["hf"])
        batch = _synthetic_batch(shape.vocab_size)
        per = batch["tokens"].shape[0] // info.dp_size
        mine = {k: v[info.dp_rank * per : (info.dp_rank + 1) * per] for k, v in batch.items()}
        stats = actor.train_step(mine, make_loss_fn(build_config({}).algorithm, 64), micro_batch_size=2)
        sums = torch.tensor([stats.get("loss_num", 0.0), stats.get("loss_den", 0.0)], dtype=torch.float64)
        torch.distributed.all_reduce(sums)  # each TP rank of the last stage reports its replica's sums
        r.update(loss=float(sums[0] / sums[1]), grad_norm=stats["grad_norm"],
                 exported={k: v.clone() for k, v in actor.export_hf()})  # unsharded tensors alias the weights
        if index == 0:
            if args.ckpt:
                checkpoint.save(args.ckpt, 1, actor, {"sampler": {"epoch": 0, "position": 0}})
                r["saved_logprobs"] = actor.logprobs(tokens, micro_batch_size=2)
            cfg = build_config({"hf_checkpoint": layout["hf"], "rollout_device": "cpu"}, components())
            engine = build_engine(cfg) if info.is_mp_leader else None
            WeightSync(actor, engine, cfg.rollout, info)(version=1)
            r["actor_logprobs"] = actor.logprobs(tokens, micro_batch_size=2, temperature=0.7)
            if engine is not None:
                r["engine_logprobs"] = torch.tensor(engine.score(tokens.tolist(), [1] * len(tokens), temperature=0.7))
            if args.ckpt:
                r["continued_update"] = second_update(actor, info, shape)
        out[layout["name"]] = r
    return out


def scenario_routing_replay(args, info):
    """The built-in engine in fp32, then in bf16, samples from a Qwen3-MoE; an fp32 actor computes the log-probs of
    those samples in its first update, with its own routing and with the engine's replayed: per engine dtype and
    setting, the step's routing metrics and the mean |actor - engine| log-prob over the sampled tokens."""
    from megarl.config import build_config
    from megarl.mcore.actor import MegatronPolicy, OptimConfig
    from megarl.model_shape import ModelShape
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.stages.algorithm import pack
    from megarl.stages.update import make_loss_fn
    from megarl.samples import Sample, SampleStatus

    shape = ModelShape.from_pretrained(args.hf)
    # Prompts of different lengths: left padding in the engine, right padding in the actor's rows.
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, shape.vocab_size, (4 + i % 3,), generator=g).tolist() for i in range(8)]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        engine = BuiltinEngine.from_pretrained(args.hf, dtype=dtype)
        groups = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=3,
                                                         stop_token_ids=(7,)))
        samples = [Sample(group=g, prompt_index=g, prompt_ids=prompts[g], response_ids=c.token_ids,
                          loss_mask=[1] * len(c.token_ids), rollout_logprobs=c.logprobs, weight_version=0,
                          status=SampleStatus.TRUNCATED, routed_experts=c.routed_experts)
                   for g, group in enumerate(groups) for c in group]
        packed = pack(samples, pad_id=0)
        batch = {"tokens": packed.tokens, "loss_mask": packed.loss_mask, "rollout_logp": packed.rollout_logp,
                 "lengths": packed.lengths, "advantages": torch.zeros(len(samples)), "routing": packed.routing}
        name = str(dtype).removeprefix("torch.")
        out[name] = {"routing": packed.routing, "lengths": packed.lengths}
        for replay in (False, True):
            actor = MegatronPolicy(shape, tp=1, pp=1, trainable=True, routing_replay=replay, optim=OptimConfig(lr=1e-6))
            actor.load_hf(args.hf)
            stats = actor.train_step(batch, make_loss_fn(build_config({}).algorithm, 64), micro_batch_size=8)
            out[name]["replay" if replay else "own"] = stats
    return out


def scenario_sync(args, info):
    """After an update and a weight sync, the built-in engine's log-probs equal the actor's."""
    from megarl.arguments import components
    from megarl.config import build_config
    from megarl.rollout.backends import build_engine
    from megarl.stages.colocation import WeightSync

    actor, shape, _ = _trained_actor(args, info)
    cfg = build_config({"hf_checkpoint": args.hf, "rollout_device": "cpu"}, components())
    engine = build_engine(cfg) if info.is_mp_leader else None
    WeightSync(actor, engine, cfg.rollout, info)(version=1)
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


def scenario_dynbatch(args, info):
    """One update with fixed micro-batches and one with a token budget, from the same weights; log-probs both ways."""
    from megarl.stages.update import make_loss_fn
    from megarl.config import build_config
    from megarl.mcore.actor import MegatronPolicy, OptimConfig
    from megarl.model_shape import ModelShape

    shape = ModelShape.from_pretrained(args.hf)
    batch = _synthetic_batch(shape.vocab_size)
    seq = batch["tokens"].shape[1]
    batch["lengths"] = torch.tensor([seq - b % 3 for b in range(batch["tokens"].shape[0])])
    out = {}
    for name, budget in (("fixed", 0), ("budget", 30)):
        actor = MegatronPolicy(shape, tp=args.tp, pp=args.pp, trainable=True, optim=OptimConfig(lr=1e-2, adam_eps=1e-4))
        actor.load_hf(args.hf)
        logp = actor.logprobs(batch["tokens"], micro_batch_size=2, lengths=batch["lengths"],
                              max_tokens_per_micro_batch=budget)
        inside = torch.arange(seq - 1)[None, :] < (batch["lengths"][:, None] - 1)
        out[f"logprobs_{name}"] = torch.where(inside, logp, torch.zeros_like(logp))  # past a row's end: not defined
        stats = actor.train_step(batch, make_loss_fn(build_config({}).algorithm, 64), micro_batch_size=2,
                                 max_tokens_per_micro_batch=budget)
        out[f"loss_{name}"] = stats["loss_num"] / stats["loss_den"]
        out[f"exported_{name}"] = dict(actor.export_hf())
    return out


def scenario_entropy(args, info):
    """Vocab-parallel entropy against the entropy of the full (TP-gathered) distribution."""
    from megatron.core import tensor_parallel

    from megarl.mcore import cpu_compat
    from megarl.mcore.actor import MegatronPolicy, token_entropy
    from megarl.model_shape import ModelShape

    shape = ModelShape.from_pretrained(args.hf)
    policy = MegatronPolicy(shape, tp=args.tp, pp=args.pp, trainable=False)
    policy.load_hf(args.hf)
    tokens = _fixed_tokens(shape.vocab_size).to(parallel_device())
    with cpu_compat.megatron_scope(), torch.no_grad():
        logits = policy.model(tokens, torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens), None)
        entropy = token_entropy(logits, 0.7)
        full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    reference = torch.distributions.Categorical(logits=full[:, :-1].float() / 0.7).entropy()
    return {"entropy": entropy.cpu(), "reference": reference.cpu()}


def scenario_trl_parity(args, info):
    """One batch through megarl's loss (Megatron actor, TP=1) and through TRL's `GRPOTrainer.compute_loss` on the
    same HF weights: loss values and HF-named gradients, for each TRL loss type and its megarl aggregation."""
    import tempfile

    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from megarl.stages.update import make_loss_fn
    from megarl.config import build_config
    from megarl.mcore.actor import MegatronPolicy
    from megarl.model_shape import ModelShape
    from megarl.tasks.arithmetic import build_tokenizer

    shape = ModelShape.from_pretrained(args.hf)
    g = torch.Generator().manual_seed(7)
    rows, plen, clen, temperature = 6, 4, 5, 0.7
    prompt_ids = torch.randint(2, 79, (rows, plen), generator=g)
    completion_ids = torch.randint(2, 79, (rows, clen), generator=g)
    completion_mask = torch.ones(rows, clen)
    for b, n in enumerate([5, 3, 1, 4, 5, 2]):
        completion_mask[b, n:] = 0
        completion_ids[b, n:] = 1  # padding
    advantages = torch.randn(rows, generator=g)
    hf = AutoModelForCausalLM.from_pretrained(args.hf).float()
    tokens = torch.cat([prompt_ids, completion_ids], dim=1)
    with torch.no_grad():
        logits = hf(tokens).logits[:, plen - 1 : -1] / temperature
    current = torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None])[..., 0]
    old = current + 0.3 * torch.randn(rows, clen, generator=g)  # ratios away from 1: clipping is exercised
    ref = current + 0.5 * torch.randn(rows, clen, generator=g)

    def padded(x):  # completion-aligned [rows, clen] -> megarl's [rows, plen + clen - 1]
        out = torch.zeros(rows, plen + clen - 1)
        out[:, plen - 1 :] = x
        return out

    batch = {"tokens": tokens, "loss_mask": padded(completion_mask), "old_logp": padded(old), "ref_logp": padded(ref),
             "rollout_logp": padded(old), "advantages": advantages}
    results = {}
    for trl_type, ours in (("grpo", "seq-mean-token-mean"), ("dapo", "token-mean"),
                           ("dr_grpo", "seq-mean-token-sum-norm")):
        cfg = build_config({"kl_coef": 0.04, "kl_estimator": "k3", "eps_clip": 0.2, "eps_clip_high": 0.28,
                            "loss_aggregation": ours, "rollout_temperature": temperature, "max_response_len": clen})
        actor = MegatronPolicy(shape, tp=1, pp=1, trainable=True)
        actor.load_hf(args.hf)
        actor.model.train()
        actor.model.zero_grad_buffer()
        outputs = actor._run(batch, make_loss_fn(cfg.algorithm, cfg.rollout.max_response_len), 4, temperature,
                             forward_only=False)  # 2 micro-batches
        loss = sum(float(o["loss_num"]) for o in outputs) / sum(float(o["loss_den"]) for o in outputs)
        params = list(actor.model.parameters())
        saved = [p.data for p in params]
        for p in params:  # export the gradients through the same HF name/reshape table as the weights
            p.data = p.main_grad.to(p.dtype)
        ours_grads = dict(actor.export_hf())
        for p, d in zip(params, saved):
            p.data = d

        with tempfile.TemporaryDirectory() as tmp:
            tcfg = GRPOConfig(output_dir=tmp, per_device_train_batch_size=rows, num_generations=2,
                              max_completion_length=clen, temperature=temperature, beta=0.04, loss_type=trl_type,
                              epsilon=0.2, epsilon_high=0.28, use_bias_correction_kl=False, bf16=False,
                              gradient_checkpointing=False, use_cpu=True, report_to="none")
            model = AutoModelForCausalLM.from_pretrained(args.hf).float()
            trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                  args=tcfg, train_dataset=Dataset.from_list([{"prompt": "1+1="}] * rows),
                                  processing_class=build_tokenizer())
            trainer.model.train()
            trainer.current_gradient_accumulation_steps = 1
            inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
                      "completion_ids": completion_ids, "completion_mask": completion_mask.long(),
                      "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
                      "num_items_in_batch": completion_mask.sum()}
            trl_loss = trainer.compute_loss(trainer.model, inputs)
            trl_loss.backward()
            trl_grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
        results[trl_type] = {"loss": loss, "trl_loss": float(trl_loss), "grads": ours_grads, "trl_grads": trl_grads}
    return results


def scenario_padded_vocab(args, info):
    """A vocabulary TP does not divide, padded as Megatron pads it: log-probs and entropy, the HF export before and
    after an update, and a checkpoint of the updated actor (with the config.json train.py writes beside it)."""
    from megatron.core import tensor_parallel

    from megarl.config import build_config, saved_config
    from megarl.mcore import checkpoint, cpu_compat
    from megarl.mcore.actor import MegatronPolicy, OptimConfig, token_entropy
    from megarl.model_shape import ModelShape
    from megarl.preflight import padded_vocab_size
    from megarl.stages.update import make_loss_fn

    shape = ModelShape.from_pretrained(args.hf)
    padded = padded_vocab_size(shape.vocab_size, 4, args.tp)
    actor = MegatronPolicy(shape, tp=args.tp, pp=1, trainable=True, optim=OptimConfig(lr=1e-2, adam_eps=1e-4),
                           padded_vocab_size=padded)
    actor.load_hf(args.hf)
    tokens = _fixed_tokens(shape.vocab_size).to(parallel_device())
    out = {"rows": padded, "logprobs": actor.logprobs(tokens, micro_batch_size=2, temperature=0.7),
           "exported": {k: v.clone() for k, v in actor.export_hf()}}  # unsharded tensors alias the weights
    with cpu_compat.megatron_scope(), torch.no_grad():
        logits = actor.model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
        out["entropy"] = token_entropy(logits, 0.7, shape.vocab_size)
        out["local_rows"] = logits.shape[-1]
        out["padding_logits"] = tensor_parallel.gather_from_tensor_model_parallel_region(logits)[..., shape.vocab_size:]
    cfg = build_config({"hf_checkpoint": args.hf, "tensor_model_parallel_size": args.tp,
                        "make_vocab_size_divisible_by": 4})
    actor.train_step(_synthetic_batch(shape.vocab_size), make_loss_fn(cfg.algorithm, 64), micro_batch_size=2)
    checkpoint.save(args.ckpt, 1, actor, {"sampler": {"epoch": 0, "position": 0}},
                    config=saved_config(cfg, padded_vocab_size=padded))
    out["logprobs_after"] = actor.logprobs(tokens, micro_batch_size=2, temperature=0.7)
    out["exported_after"] = dict(actor.export_hf())
    return out


def scenario_recompute(args, info):
    """One update per --recompute-granularity from the same weights: the loss, the updated weights, and how many
    times the first layer and its core attention ran (recomputation runs them again in the backward pass)."""
    from megarl.config import build_config
    from megarl.mcore.actor import MegatronPolicy, OptimConfig
    from megarl.mcore.convert import unwrap
    from megarl.model_shape import ModelShape
    from megarl.stages.update import make_loss_fn

    shape = ModelShape.from_pretrained(args.hf)
    out = {}
    for granularity in ("none", "selective", "full"):
        actor = MegatronPolicy(shape, tp=args.tp, pp=1, trainable=True, recompute_granularity=granularity,
                               optim=OptimConfig(lr=1e-2, adam_eps=1e-4))
        actor.load_hf(args.hf)
        layer = unwrap(actor.model).decoder.layers[0]
        calls = {"layer": 0, "core_attention": 0}
        layer.register_forward_hook(lambda *a, calls=calls: calls.__setitem__("layer", calls["layer"] + 1))
        layer.self_attention.core_attention.register_forward_hook(
            lambda *a, calls=calls: calls.__setitem__("core_attention", calls["core_attention"] + 1))
        stats = actor.train_step(_synthetic_batch(shape.vocab_size), make_loss_fn(build_config({}).algorithm, 64),
                                 micro_batch_size=4)
        out[granularity] = {"loss": stats["loss_num"] / stats["loss_den"], "calls": calls,
                            "exported": dict(actor.export_hf())}
    return out


def scenario_mismatch(args, info):
    """--mismatch-check-interval's two sides: the actor's vocabulary-wide distributions at the sampled positions
    (gathered over TP), then, on the leader, the built-in engine's (fp32 and bf16) against them, and `transformers`'
    fp32 distributions against the actor's, by the same metric."""
    from transformers import AutoModelForCausalLM

    from megarl.mcore.actor import MegatronPolicy
    from megarl.model_shape import ModelShape
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.samples import PackedSamples
    from megarl.rollout.base import EngineCapabilities
    from megarl.stages.mismatch import ActorSide, actor_side, engine_side

    shape = ModelShape.from_pretrained(args.hf)
    policy = MegatronPolicy(shape, tp=args.tp, pp=args.pp, trainable=False)
    policy.load_hf(args.hf)
    tokens = _fixed_tokens(shape.vocab_size, rows=3, seq=10)
    lengths = torch.tensor([10, 7, 9])
    mask = torch.zeros(3, 9)
    mask[0, 3:9], mask[1, 2:6], mask[2, 4:8] = 1, 1, 1  # the sampled positions; row 2 is past --rows 2
    packed = PackedSamples(tokens, mask, torch.zeros(3, 9), lengths)
    side = actor_side(policy, packed, rows=2, gather=True)
    if info.rank != 0:
        return {}
    hf = AutoModelForCausalLM.from_pretrained(args.hf).float().eval()
    with torch.no_grad():
        ref = [torch.log_softmax(hf(torch.tensor([s])).logits[0, :-1].float(), -1) for s in side.sequences]

    class Transformers(EngineCapabilities):  # the reference as an engine: its distributions at the same positions
        scores_distributions = True

        def score_distributions(self, sequences, prompt_lens, temperature):
            return ref

    return {"columns": side.columns, "rows": len(side.sequences),
            "fp32": engine_side(BuiltinEngine.from_pretrained(args.hf), side, topk=5),
            "bf16": engine_side(BuiltinEngine.from_pretrained(args.hf, dtype=torch.bfloat16), side, topk=5),
            "hf": engine_side(Transformers(), side, topk=5),
            "hf_vs_hf": engine_side(Transformers(), ActorSide(side.sequences, side.columns,
                                                              [r[c] for r, c in zip(ref, side.columns)]), topk=5)}


def scenario_teacher(args, info):
    """On-policy distillation's teacher (`--teacher args.hf`, a wider model than the student `args.ckpt`), built as
    the trainer builds it, and its log-probs of a fixed batch at temperature 0.7."""
    from types import SimpleNamespace

    from megarl.model_shape import ModelShape
    from megarl.trainer.build import build_teacher

    cfg = SimpleNamespace(model=SimpleNamespace(teacher=args.hf, hf_checkpoint=args.ckpt,
                                                make_vocab_size_divisible_by=1),
                          training=SimpleNamespace(distributed_timeout_seconds=60),
                          algorithm=SimpleNamespace(distill_topk=5))
    teacher = build_teacher(cfg, info, dict(tp=args.tp, pp=args.pp), lambda *a: None)[""]
    tokens = _fixed_tokens(ModelShape.from_pretrained(args.hf).vocab_size).to(parallel_device())
    logprobs = teacher.logprobs(tokens, micro_batch_size=2, temperature=0.7)
    top = teacher.topk_logprobs(tokens, 5, micro_batch_size=3, temperature=0.7)  # 2 micro-batches, one padded
    return {"logprobs": None if logprobs is None else logprobs.cpu(),
            "topk_ids": None if top is None else top[0].cpu(), "topk_logp": None if top is None else top[1].cpu()}


def scenario_topk_loss(args, info):
    """--distill-topk's loss term on this TP rank's shard of fixed full logits (`tests/distill_topk_checks.py`):
    the loss, this shard's gradient, the per-token KL; and the chunked head's top-K log-probs against the full one's."""
    from megatron.core import parallel_state

    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "distill_topk_checks.py")
    spec = importlib.util.spec_from_file_location("distill_topk_checks", path)  # tests/, imported by file
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)
    case, chunked_vs_full, wired_loss = checks.case, checks.chunked_vs_full, checks.wired_loss

    c = case(seed=0)
    width = c["logits"].shape[-1] // args.tp
    rank = parallel_state.get_tensor_model_parallel_rank()
    shard = c["logits"][..., rank * width: (rank + 1) * width].float().contiguous().requires_grad_(True)
    loss, metrics = wired_loss(shard, c)
    loss.backward()
    return {"loss": loss.item(), "grad": shard.grad.clone(),
            "kl": float(metrics["distill_topk_kl_sum"] / metrics["distill_topk_tokens"]),
            "chunked": chunked_vs_full(args.tp, rank, parallel_state.get_tensor_model_parallel_group())}


SCENARIOS = {"mismatch": scenario_mismatch, "padded_vocab": scenario_padded_vocab, "recompute": scenario_recompute,
              "forward": scenario_forward, "dp_step": scenario_dp_step, "sync": scenario_sync,
             "ckpt_save": scenario_ckpt_save, "ckpt_load": scenario_ckpt_load, "dynbatch": scenario_dynbatch,
             "entropy": scenario_entropy, "trl_parity": scenario_trl_parity, "layouts": scenario_layouts,
             "train_layouts": scenario_train_layouts, "routing_replay": scenario_routing_replay,
             "teacher": scenario_teacher, "topk_loss": scenario_topk_loss}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenarios", help=f"one or more of {sorted(SCENARIOS)}, comma-separated: run in this order, in one "
                   "process group, each from the random state the first one started with")
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", default="")
    p.add_argument("--layouts", default="", help="m,tp,pp,ep,etp,dispatcher,sp;... (scenarios layouts, train_layouts)")
    args = p.parse_args()
    names = args.scenarios.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; choose from {sorted(SCENARIOS)}")
    info = _setup(args)
    from megarl.mcore import parallel

    # Each scenario starts where a process of its own would: the same torch and model-parallel RNG states (the
    # scenarios build their models from the checkpoint, so nothing else carries over but megatron's caches).
    start = _random_state()
    for name in names:
        _restore_random_state(start)
        result = SCENARIOS[name](args, info)
        torch.save({"info": info, **result}, os.path.join(args.out, f"{name}-rank{info.rank}.pt"))
    parallel.destroy()


def _random_state():
    from megatron.core import tensor_parallel

    return torch.random.get_rng_state(), tensor_parallel.get_cuda_rng_tracker().get_states()


def _restore_random_state(state) -> None:
    from megatron.core import tensor_parallel

    torch.random.set_rng_state(state[0])
    tensor_parallel.get_cuda_rng_tracker().set_states(state[1])


if __name__ == "__main__":
    sys.exit(main())

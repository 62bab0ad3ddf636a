"""LoRA on the Megatron actor against `peft` on the `transformers` model, for tests/unit/test_lora.py (TP 1, in
process) and tests/distributed/test_lora_tp.py (TP 2 under torchrun, tests/distributed/lora_worker.py).

`megatron_side`: the actor with adapters whose values come from `adapter_values` (B non-zero), its logits on
`batch()`'s tokens, the gradients of A and B of a weighted sum of next-token log-probs, and what one optimizer step
changes, everything whole (TP shards gathered) and named as PEFT names them. `peft_side`: the same from `peft`.
`check_against_peft` holds one to the other."""

from __future__ import annotations

import torch

RANK, ALPHA = 4, 8.0
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Qwen3-MoE: a subset of attention (the fused qkv layer adapts q and v and leaves k alone) and the experts, which
# PEFT adapts through target_parameters (transformers' fused expert parameters), one A and B per expert.
MOE = ("q_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj")


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [2, 10] and per-token loss weights [2, 9]."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (2, 10), generator=g), torch.randn(2, 9, generator=g)


def adapter_values(names_and_shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Whole adapter tensors, by PEFT name: A and B both random (a fresh B is zero and would test nothing)."""
    g = torch.Generator().manual_seed(11)
    return {n: torch.randn(s, generator=g) * 0.2 for n, s in sorted(names_and_shapes.items())}


def _over_stages(local):
    """Every pipeline stage's `local` on every rank: dicts merged, lists of (global) names joined over all ranks
    (pipeline stages and expert-parallel ranks hold different ones), else the one that is not None (log-probs and
    logits live on the last stage only)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if isinstance(local, list):
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, local)
        return sorted({x for names in ranks for x in names})
    stages = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, local, group=ps.get_pipeline_model_parallel_group())
    if isinstance(local, dict):
        return {k: v for stage in stages for k, v in stage.items()}
    found = [x for x in stages if x is not None]
    assert len(found) == 1, f"{len(found)} pipeline stages returned a result"
    return found[0]


def megatron_side(hf: str, *, tp: int, targets: tuple[str, ...], pp: int = 1, ep: int = 1, etp: int = 0,
                  sequence_parallel: bool = False, peft_dir: str = "") -> dict:
    """Run inside initialised process groups (`parallel.init_distributed(tp=tp, pp=pp, ep=ep, etp=etp)`); every
    rank gets the whole result (pipeline stages' parts gathered), but `merged` on the model-parallel leader only.
    `peft_dir`: also save the trained adapters there (`--save-peft`) and return the logits after the update. With
    data-parallel ranks (EP 2 on two processes is DP 2) every rank runs the same batch: the gradients are those of
    one."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from megarl.mcore import convert, lora
    from megarl.mcore.actor import AdaptersOff, MegatronPolicy
    from megarl.mcore.model import MoEOptions
    from megarl.model_shape import ModelShape

    shape = ModelShape.from_pretrained(hf)
    opts = lora.LoRAOptions(rank=RANK, alpha=ALPHA, targets=targets, seed=5)
    moe = MoEOptions(ep=ep, etp=etp, dispatcher="alltoall") if shape.is_moe else None
    actor = MegatronPolicy(shape, tp=tp, pp=pp, trainable=True, lora=opts, sequence_parallel=sequence_parallel,
                           moe=moe)
    actor.load_hf(hf)
    fresh = _over_stages({n: tuple(t.shape) for n, t in lora.peft_tensors(actor.model).items()})
    values = adapter_values(fresh)
    lora.load_peft_tensors(actor.model, values)
    tokens, weights = batch(shape.vocab_size)

    def logits_of(model_logits, _tokens, _t):  # the whole logits, through the pipeline schedule
        return gather_from_tensor_model_parallel_region(model_logits)

    def forward_logits():
        return _over_stages(actor._forward_only(tokens, micro_batch_size=2, head=logits_of))

    logits = forward_logits()
    with lora.adapters_disabled(actor.model):
        base_logits = forward_logits()

    def loss_fn(logp, mb):
        return -(logp * mb["weights"]).sum(), torch.tensor(1), {}

    # Forward and backward through Megatron's schedule, which also finishes the gradients (the TP all-reduce of
    # replicated adapters that saw only their sequence chunk).
    actor.model.train()
    actor.model.zero_grad_buffer()
    actor._run({"tokens": tokens, "weights": weights}, loss_fn, 2, 1.0, forward_only=False)
    grads = _over_stages(lora.peft_tensors(actor.model, grads=True))
    module = convert.unwrap(actor.model)
    names = convert.global_param_names(module)
    trainable = _over_stages([names[n] for n, p in module.named_parameters() if p.requires_grad])

    kw = dict(micro_batch_size=2)
    reference = AdaptersOff(actor)
    ref_before = _over_stages(reference.logprobs(tokens, **kw))
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    actor.train_step({"tokens": tokens, "weights": weights}, loss_fn, micro_batch_size=2)
    changed = _over_stages([names[n] for n, p in module.named_parameters() if not torch.equal(p, before[n])])
    ref_after = _over_stages(reference.logprobs(tokens, **kw))
    base = MegatronPolicy(shape, tp=tp, pp=pp, trainable=False, sequence_parallel=sequence_parallel, moe=moe)
    base.load_hf(hf)
    merged = dict(actor.export_hf())
    logits_after = None
    if peft_dir:
        actor.save_peft(hf, peft_dir)
        logits_after = forward_logits()
    return dict(values=values, logits=logits, base_logits=base_logits, grads=grads, trainable=trainable,
                changed=changed, ref_before=ref_before, ref_after=ref_after,
                base_logp=_over_stages(base.logprobs(tokens, **kw)),
                adapters_after=_over_stages(lora.peft_tensors(actor.model)), merged=merged, logits_after=logits_after)


def peft_side(hf, values: dict, targets, trained: dict) -> dict:
    """PEFT's logits and gradients for `batch()` with the adapters `values`, and its merged weights with
    the adapters `trained` (the actor's after its update)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf).float().eval()
    from megarl.mcore.lora import EXPERT_TARGETS, peft_target_parameters

    # Experts: transformers' fused expert parameters, through PEFT's `target_parameters`.
    pm = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                          target_modules=[t for t in targets if t not in EXPERT_TARGETS],
                                          target_parameters=peft_target_parameters(targets)))
    result = set_peft_model_state_dict(pm, values)
    assert result.unexpected_keys == []
    tokens, weights = batch(model.config.vocab_size)
    logits = pm(tokens).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    (-(logp * weights).sum()).backward()
    grads = {}
    for name, p in pm.named_parameters():
        if p.requires_grad:
            grads[name.replace(".default.", ".")] = p.grad.clone()
    with torch.no_grad():
        with pm.disable_adapter():
            base_logits = pm(tokens).logits
        assert set_peft_model_state_dict(pm, trained).unexpected_keys == []
        merged = {n: t.clone() for n, t in pm.merge_and_unload().state_dict().items()}
    return dict(logits=logits.detach(), base_logits=base_logits, grads=grads, merged=merged)


def per_expert(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert parameters (`mlp.experts.gate_up_proj` [E, 2F, H], `mlp.experts.down_proj`
    [E, H, F]) as the per-expert tensors of an HF checkpoint (`mlp.experts.e.{gate,up,down}_proj.weight`)."""
    out = {}
    for name, t in hf.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate
                out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            for e, w in enumerate(t):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = w
        else:
            out[name] = t
    return out


def check_against_peft(meg: dict, ref: dict) -> None:
    # The adapters change the output (B is not zero), and match PEFT's.
    assert (meg["logits"] - meg["base_logits"]).abs().max() > 1e-2
    assert torch.allclose(meg["logits"], ref["logits"], atol=1e-5, rtol=0)
    assert torch.allclose(meg["base_logits"], ref["base_logits"], atol=1e-5, rtol=0)
    assert set(meg["grads"]) == set(ref["grads"]) == set(meg["values"])
    for name, g in ref["grads"].items():
        assert g.abs().max() > 0, name
        # fp32 sums in another order: within 1e-5 of the gradient's scale (its largest entry, at least 1)
        assert (meg["grads"][name] - g).abs().max() <= 1e-5 * max(1.0, g.abs().max().item()), name
    # Only adapters train, and the step changed every one of them; the base is bitwise untouched.
    assert meg["trainable"] == meg["changed"] and all(".lora." in n for n in meg["changed"])
    # (a PEFT expert tensor holds every expert's A, or B, fused: Megatron has one parameter per expert)
    per_peft_tensor = [t.shape[0 if ".lora_A." in n else 1] // RANK if ".mlp.experts." in n else 1
                       for n, t in meg["values"].items()]
    assert len(meg["changed"]) == sum(per_peft_tensor)
    # One model as actor and reference: adapters off is the base model, bitwise, before and after the update.
    assert torch.equal(meg["ref_before"], meg["base_logp"]) and torch.equal(meg["ref_after"], meg["base_logp"])
    # Weight sync / --save-hf: W + (alpha / rank) B A, equal to PEFT's merge_and_unload() of the same adapters.
    # (transformers 5 holds a mixture-of-experts layer's experts fused in memory, per expert on disk and in the
    # export: PEFT's are split per expert here)
    merged_ref = per_expert(ref["merged"])
    common = set(meg["merged"]) & set(merged_ref)
    assert set(merged_ref) == common
    for name in common:
        t = meg["merged"][name]
        assert torch.allclose(t, merged_ref[name], atol=1e-6, rtol=0), name

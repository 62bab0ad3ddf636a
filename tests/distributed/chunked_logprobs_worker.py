"""Chunked log-probs and entropy (`megarl.mcore.chunked_logprobs`) against today's head: logits = hidden @ W.T,
then `actor.label_logprobs` and `actor.position_entropy`, at this process's TP size (in-process at TP 1 from
tests/distributed/test_chunked_logprobs.py, under torchrun at TP 2). Run under torchrun, each rank writes
OUT/chunked-rank<r>.json with the largest differences of each case; the policy case compares a tiny
MegatronPolicy's log-probs and one training step with --logprob-chunk-tokens against today's path; then the same
two processes regroup as CP 2 and compare the actor's head on CP-split hidden states (`compare_cp`)."""

from __future__ import annotations

import argparse
import json
import os

import torch

PADDED, REAL, HIDDEN = 40, 37, 16  # a vocabulary of 37 padded to 40 rows: TP 2's second shard holds the padding


def _reference(hidden, weight, labels, temperature, vocab_size, with_entropy):
    from megarl.mcore.actor import label_logprobs, position_entropy

    logits = hidden @ weight.t()
    logp = label_logprobs(logits, labels, temperature, vocab_size)
    return logp, position_entropy(logits, temperature, vocab_size) if with_entropy else None


def compare_cases(group) -> dict[str, float]:
    """Largest |chunked - today's| / max(1, max |today's|) of each value and gradient (hidden: this rank's part;
    weight: this rank's shard) in each case: temperature != 1, vocabulary padding, a chunk that does not divide the
    tokens, the [b, s] form context parallelism uses (labels alongside), log-probs alone, and a loss of both
    log-probs and entropy."""
    import torch.distributed as dist

    from megarl.mcore.chunked_logprobs import chunked_logprobs

    tp = dist.get_world_size(group)
    rank = dist.get_rank(group)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 13, HIDDEN, generator=g, dtype=torch.float64).float()
    full_weight = torch.randn(PADDED, HIDDEN, generator=g) * 0.5
    labels = torch.randint(0, REAL, (3, 13), generator=g)
    a, b = torch.randn(3, 13, generator=g), torch.randn(3, 13, generator=g)
    shard = full_weight.chunk(tp)[rank].contiguous()
    out = {}
    for name, temperature, vocab, chunk, with_entropy in [("temperature_padding_entropy", 0.7, REAL, 5, True),
                                                          ("logprobs_only_no_padding", 1.3, 0, 4, False),
                                                          ("one_chunk_temperature_0", 0.0, REAL, 64, True)]:
        results = []
        for fn in ("ref", "chunked"):
            h = hidden.clone().requires_grad_()
            w = shard.clone().requires_grad_()
            if fn == "ref":
                logp, ent = _reference(h, w, labels, temperature, vocab, with_entropy)
            else:
                logp, ent = chunked_logprobs(h, w, labels, temperature=temperature, chunk_tokens=chunk,
                                             vocab_size=vocab, with_entropy=with_entropy, group=group)
            loss = (logp * a).sum() + ((ent * b).sum() if with_entropy else 0.0)
            loss.backward()
            results.append([logp.detach(), ent.detach() if with_entropy else torch.zeros(()), h.grad, w.grad])
        for part, ref, got in zip(("logp", "entropy", "grad_hidden", "grad_weight"), *results):
            out[f"{name}_{part}"] = (ref - got).abs().max().item() / max(1.0, ref.abs().max().item())
        out[name + "_grad_weight_norm"] = results[0][3].norm().item()  # not all zero: the case means something
    return out


def compare_cp(group) -> dict[str, float]:
    """Context parallelism 2 (TP 1), as the actor sees it: `MegatronPolicy._run` splits every padded sequence into
    2 x CP chunks, gives this rank chunks (r, 2 CP - 1 - r) of the tokens, positions and next-token labels, and hands
    the model's output on those positions to `MegatronPolicy._head` with `whole` (the CP gather, cut to S - 1).
    Here the actor's own `_head` runs both paths on this rank's split of the same hidden states (the full path on
    the logits the output layer makes from them), with temperature 0.7 and a vocabulary of 37 padded to 40, on a
    loss of log-probs and entropy. The model itself is not built: `MegatronPolicy.__init__` refuses CP > 1 without
    Transformer Engine (megarl/mcore/base_model.py:150), since Megatron's local attention asserts CP 1
    (megatron/core/transformer/dot_product_attention.py:57); the head needs no attention.

    Largest |chunked - full| / max(1, max |full|) of the whole log-probs and entropy, this rank's hidden-state
    gradient and output-weight gradient; and both paths against today's head at CP 1 on the whole sequences (log-probs,
    entropy, this rank's part of the hidden-state gradient, the weight gradient summed over CP ranks as Megatron's
    gradient reduction over DP x CP sums it)."""
    import torch.distributed as dist

    from megarl.mcore import context_parallel
    from megarl.mcore.actor import ActorLoss, MegatronPolicy

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(11)
    rows, width, temperature = 2, 15, 0.7
    padded = context_parallel.padded_width(width, cp)  # 16: four chunks of 4 positions
    tokens = torch.nn.functional.pad(torch.randint(0, REAL, (rows, width), generator=g), (0, padded - width))
    labels = torch.nn.functional.pad(tokens[:, 1:], (0, 1))  # as MegatronPolicy._run makes them
    hidden = torch.randn(rows, padded, HIDDEN, generator=g, dtype=torch.float64).float()  # the model's output
    weight = torch.randn(PADDED, HIDDEN, generator=g) * 0.5
    a, b = torch.randn(rows, width - 1, generator=g), torch.randn(rows, width - 1, generator=g)
    mb = {"tokens": tokens[:, :width]}

    def loss(logp, inputs):
        return (logp * a).sum() + (inputs["entropy"] * b).sum(), torch.tensor(logp.numel()), {}

    loss_fn = ActorLoss(loss, needs_entropy=True)

    def whole(x):
        return context_parallel.gather_from_cp_ranks(x, group)[:, : width - 1]

    results = {}
    for name, chunk in (("full", 0), ("chunked", 5)):  # 5 does not divide this rank's 2 x 8 positions
        policy = MegatronPolicy.__new__(MegatronPolicy)  # the head's state only (see the docstring)
        policy.logprob_chunk_tokens, policy.padded_vocab_size = chunk, PADDED
        policy.shape = argparse.Namespace(vocab_size=REAL)
        policy.config = argparse.Namespace(context_parallel_size=cp)
        h = context_parallel.split_for_cp_rank(hidden, rank, cp).clone().requires_grad_()
        w = weight.clone().requires_grad_()
        policy._output_weight = lambda w=w: w
        output = h @ w.t() if chunk == 0 else h  # the output layer's logits, or (--logprob-chunk-tokens) its input
        logp, inputs = policy._head(output, mb, context_parallel.split_for_cp_rank(labels, rank, cp), temperature,
                                    loss_fn, whole)
        loss_fn(logp, inputs)[0].backward()
        results[name] = [logp.detach(), inputs["entropy"].detach(), h.grad, w.grad]

    h = hidden[:, : width - 1].clone().requires_grad_()  # today's head at CP 1 on the whole sequences
    w = weight.clone().requires_grad_()
    logp, ent = _reference(h, w, tokens[:, 1:width], temperature, REAL, True)
    ((logp * a).sum() + (ent * b).sum()).backward()
    grad_hidden = torch.nn.functional.pad(h.grad, (0, 0, 0, padded - width + 1))
    cp1 = [logp.detach(), ent.detach(), context_parallel.split_for_cp_rank(grad_hidden, rank, cp), w.grad]

    def rel(ref, got):
        return (ref - got).abs().max().item() / max(1.0, ref.abs().max().item())

    out = {}
    parts = ("logp", "entropy", "grad_hidden", "grad_weight")
    for part, full, chunked, ref in zip(parts, results["full"], results["chunked"], cp1):
        out[f"cp2_{part}"] = rel(full, chunked)
        if part == "grad_weight":  # each rank's covers its own positions: summed over CP, the whole gradient
            full, chunked = full.clone(), chunked.clone()
            dist.all_reduce(full, group=group)
            dist.all_reduce(chunked, group=group)
        out[f"cp2_full_vs_cp1_{part}"] = rel(ref, full)
        out[f"cp2_chunked_vs_cp1_{part}"] = rel(ref, chunked)
    out["cp2_grad_weight_norm"] = cp1[3].norm().item()
    return out


def compare_policy(tp: int) -> dict[str, float]:
    """A tiny MegatronPolicy (vocabulary 37 padded to 40), with tied and with separate output weights, built twice
    with the same weights: log-probs, and one training step on a loss of log-probs and entropy, with
    --logprob-chunk-tokens 0 (today's path) against 7."""
    from megarl.mcore import convert
    from megarl.mcore.actor import ActorLoss, MegatronPolicy
    from megarl.mcore.base_model import OptimConfig
    from megarl.model_shape import ModelShape

    tokens = torch.randint(0, REAL, (4, 11), generator=torch.Generator().manual_seed(5))

    def loss(logp, mb):
        ent = mb["entropy"]
        return (logp * 0.3 - ent * 0.1).sum(), torch.tensor(logp.numel()), {"entropy": ent.detach().sum()}

    loss_fn = ActorLoss(loss, needs_entropy=True)
    out = {}
    for tied in (True, False):
        shape = ModelShape(family="qwen2", num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                           head_dim=8, ffn_hidden_size=64, vocab_size=REAL, max_position_embeddings=64,
                           rope_theta=10000.0, norm_eps=1e-6, tie_word_embeddings=tied, qkv_bias=True)
        results, weights = [], None
        for chunk in (0, 7):
            actor = MegatronPolicy(shape, tp=tp, pp=1, trainable=True, optim=OptimConfig(lr=1e-2),
                                   padded_vocab_size=PADDED, logprob_chunk_tokens=chunk)
            module = convert.unwrap(actor.model)
            if weights is None:
                weights = {k: v.detach().clone() for k, v in module.named_parameters()}
            else:
                with torch.no_grad():
                    for k, v in module.named_parameters():
                        v.copy_(weights[k])
            before = actor.logprobs(tokens, micro_batch_size=2, temperature=0.8)
            metrics = actor.train_step({"tokens": tokens}, loss_fn, micro_batch_size=2, temperature=0.8)
            after = actor.logprobs(tokens, micro_batch_size=2, temperature=0.8)
            results.append((before, after, metrics))
        (b0, a0, m0), (b1, a1, m1) = results
        tag = "tied" if tied else "untied"
        out.update({f"policy_{tag}_logprobs": (b0 - b1).abs().max().item(),
                    f"policy_{tag}_after_step": (a0 - a1).abs().max().item(),
                    f"policy_{tag}_grad_norm": abs(m0["grad_norm"] - m1["grad_norm"]) / m0["grad_norm"],
                    f"policy_{tag}_entropy": abs(m0["entropy"] - m1["entropy"]) / m0["entropy"],
                    f"policy_{tag}_step_moved": (a0 - b0).abs().max().item()})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from megarl.mcore import parallel

    tp = int(os.environ["WORLD_SIZE"])
    info = parallel.init_distributed(tp=tp, pp=1, timeout_s=120, seed=0)
    out = compare_cases(parallel_state.get_tensor_model_parallel_group())
    out.update(compare_policy(tp))
    # The same two processes as CP 2 at TP 1 (one torchrun for both layouts).
    parallel_state.destroy_model_parallel()
    parallel.init_distributed(tp=1, pp=1, cp=2, timeout_s=120, seed=0)
    out.update(compare_cp(parallel.cp_group()))
    with open(os.path.join(args.out, f"chunked-rank{info.rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()

"""The Megatron policy: per-token log-probs of the next token and the update step, at any TP x PP x CP x DP.

`MegatronPolicy` is a `MegatronModel` (`megarl.mcore.base_model`: build, optimizer, forward schedule, offload,
checkpoint state) whose head is the language-model output layer: `logp[b, t] = log p(tokens[b, t + 1] |
tokens[b, :t + 1])`, shape `[B, S - 1]`, computed from vocab-parallel logits (divided by the sampling
temperature) without gathering the vocabulary. The actor trains; the reference is the same class, frozen.
Its loss may also ask for the per-token entropy (`loss_fn.needs_entropy`), computed from the same logits.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.mcore import convert, lora
from megarl.mcore.base_model import LossFn, MegatronModel, OptimConfig
from megarl.mcore.chunked_logprobs import chunked_topk_logprobs

__all__ = ["ActorLoss", "AdaptersOff", "LossFn", "MegatronPolicy", "OptimConfig", "label_logprobs",
           "mask_vocab_padding", "position_entropy", "token_entropy", "token_logprobs", "topk_label_logprobs",
           "vocab_parallel_topk"]


@dataclass(frozen=True)
class ActorLoss:
    """A `LossFn` for `MegatronPolicy.train_step` with what it asks of the forward declared: `needs_entropy`, the
    per-token entropy in the micro-batch it is given (`mb["entropy"]`); `entropy_grad`, that entropy differentiated
    (an entropy bonus) rather than detached (reported only); `needs_topk`, the student's log-probs at the teacher's
    top-K ids. A plain `LossFn` asks for none (`ActorLoss.of`)."""

    fn: LossFn
    needs_entropy: bool = False
    entropy_grad: bool = True
    needs_topk: bool = False  # the student's log-probs at the teacher's top-K ids, `mb["topk_logp"]` [b, S - 1, K]
    # (differentiated), from `mb["teacher_topk_ids"]` [b, S - 1, K]: on-policy distillation's top-K KL

    def __call__(self, logp: torch.Tensor, mb: dict):
        return self.fn(logp, mb)

    @staticmethod
    def of(loss_fn: LossFn) -> ActorLoss:
        return loss_fn if isinstance(loss_fn, ActorLoss) else ActorLoss(loss_fn)


def mask_vocab_padding(x: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`x` [..., v/tp], this TP rank's shard of a padded vocabulary (`megarl.preflight.padded_vocab_size`), with
    the padding rows' entries at the dtype's lowest value, so they take no probability, no entropy and no
    gradient; in place (pass a fresh tensor). `vocab_size` 0: nothing is masked."""
    from megatron.core import parallel_state

    local = x.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local
    if vocab_size and start + local > vocab_size:
        x[..., max(0, vocab_size - start):] = torch.finfo(x.dtype).min
    return x


def _scaled(logits: torch.Tensor, temperature: float, vocab_size: int) -> torch.Tensor:
    # A fresh float tensor: vocab_parallel_cross_entropy overwrites its input, and masking writes into it.
    return mask_vocab_padding(logits.float() / (temperature if temperature > 0 else 1.0), vocab_size)


def label_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float, vocab_size: int = 0) -> torch.Tensor:
    """log p(labels[b, t]) at every position from vocab-parallel logits [b, s, v/tp]: [b, s] (differentiable).
    Context parallelism needs this form: a rank's positions are not contiguous, so the labels come split alongside.
    `vocab_size`: the real vocabulary of a padded one (0 = no padding)."""
    from megatron.core import tensor_parallel

    return -tensor_parallel.vocab_parallel_cross_entropy(_scaled(logits, temperature, vocab_size), labels.contiguous())


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, vocab_size: int = 0) -> torch.Tensor:
    """log p(tokens[:, 1:]) from vocab-parallel logits [b, s, v/tp] (differentiable)."""
    return label_logprobs(logits[:, :-1], tokens[:, 1:], temperature, vocab_size)


def token_entropy(logits: torch.Tensor, temperature: float, vocab_size: int = 0) -> torch.Tensor:
    """Entropy of the next-token distribution at each position but the last, [b, s - 1] (see `position_entropy`)."""
    return position_entropy(logits[:, :-1], temperature, vocab_size)


def position_entropy(logits: torch.Tensor, temperature: float, vocab_size: int = 0) -> torch.Tensor:
    """Entropy of the next-token distribution at every position, [b, s], from vocab-parallel logits [b, s, v/tp]
    without gathering the vocabulary (differentiable).

    With x the temperature-scaled logits and m their max: H = log sum_j e^(x_j - m) + m - sum_j p_j x_j. The two
    sums over the vocabulary run over this rank's shard and are all-reduced over tensor-parallel ranks (an
    autograd-aware reduction: each rank's shard gets its own gradient)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    x = _scaled(logits, temperature, vocab_size)
    m = x.detach().max(dim=-1, keepdim=True).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    e = torch.exp(x - m)
    z = reduce_from_tensor_model_parallel_region(e.sum(dim=-1))
    ex = reduce_from_tensor_model_parallel_region((e * x).sum(dim=-1))
    return torch.log(z) + m.squeeze(-1) - ex / z


def _vocab_parallel_lse(x: torch.Tensor) -> torch.Tensor:
    """log sum_j e^(x_j) over the whole vocabulary from this rank's shard x [..., v/tp]: the max and the sum of
    exponentials all-reduced over the TP group (the sum by an autograd-aware reduction, as `position_entropy`)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    m = x.detach().max(dim=-1, keepdim=True).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    return torch.log(reduce_from_tensor_model_parallel_region(torch.exp(x - m).sum(dim=-1))) + m.squeeze(-1)


def topk_label_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float,
                        vocab_size: int = 0) -> torch.Tensor:
    """log p(ids[b, t, j]) at every position from vocab-parallel logits [b, s, v/tp] and token ids [b, s, K] (the
    teacher's top-K), [b, s, K], differentiable, without gathering the vocabulary: each id's logit comes from the
    rank whose shard holds it (0 elsewhere, summed over TP ranks), minus the vocab-parallel logsumexp."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    x = _scaled(logits, temperature, vocab_size)
    local = x.shape[-1]
    local_ids = ids.long() - parallel_state.get_tensor_model_parallel_rank() * local
    inside = (local_ids >= 0) & (local_ids < local)
    at = x.gather(-1, local_ids.clamp(0, local - 1))
    at = reduce_from_tensor_model_parallel_region(torch.where(inside, at, torch.zeros_like(at)))
    return at - _vocab_parallel_lse(x).unsqueeze(-1)


@torch.no_grad()
def vocab_parallel_topk(logits: torch.Tensor, k: int, temperature: float,
                        vocab_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The K most likely next tokens at every position from vocab-parallel logits [b, s, v/tp]: (ids [b, s, K]
    long, log-probs [b, s, K] float32), largest first, the same on every TP rank. Each rank's own top-K (global ids)
    is gathered over the TP group and the top-K of those taken: K * TP candidates a position, never the vocabulary.
    Padding rows of a padded vocabulary are never chosen."""
    from megatron.core import parallel_state

    x = _scaled(logits, temperature, vocab_size)
    lse = _vocab_parallel_lse(x)
    values, ids = x.topk(min(k, x.shape[-1]), dim=-1)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        ids = ids + parallel_state.get_tensor_model_parallel_rank() * x.shape[-1]
        group = parallel_state.get_tensor_model_parallel_group()
        all_values = [torch.empty_like(values) for _ in range(tp)]
        all_ids = [torch.empty_like(ids) for _ in range(tp)]
        dist.all_gather(all_values, values.contiguous(), group=group)
        dist.all_gather(all_ids, ids.contiguous(), group=group)
        values, pick = torch.cat(all_values, dim=-1).topk(k, dim=-1)
        ids = torch.cat(all_ids, dim=-1).gather(-1, pick)
    return ids, values - lse.unsqueeze(-1)


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward, gradient all-reduced over the TP group backward: Megatron's
    `copy_to_tensor_model_parallel_region`, which all-reduces a contiguous copy and returns the original when the
    gradient is not contiguous (as GPTModel's final transpose makes it here)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


@contextmanager
def _hidden_states_out(gpt):
    """GPTModel's output layer hands its input through: the model returns its last hidden states [b, s, h] for
    `chunked_logprobs` to multiply by the output weight, without changing GPTModel. What `ColumnParallelLinear` does
    to its input stays: with sequence parallelism the hidden states are gathered over TP ranks (reduce-scattered
    back in the backward pass); without, their gradient is all-reduced over TP ranks (each rank's covers its
    vocabulary shard)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    layer = getattr(gpt, "output_layer", None)
    if layer is None:  # not the last pipeline stage
        yield
        return

    def hand_through(hidden_states, weight=None, runtime_gather_output=None):
        if layer.sequence_parallel:
            return gather_from_sequence_parallel_region(hidden_states, group=layer.tp_group), None
        return _SumGradOverTP.apply(hidden_states, layer.tp_group), None

    layer.forward = hand_through
    try:
        yield
    finally:
        del layer.forward


class MegatronPolicy(MegatronModel):
    """A GPTModel shard with its language-model head (actor when trainable, reference when frozen).

    `logprob_chunk_tokens` N > 0 (`--logprob-chunk-tokens`): the model outputs its last hidden states instead of
    logits while log-probs are computed, and the head multiplies them by the output weight N tokens at a time, forward
    and backward (`megarl.mcore.chunked_logprobs`), so no [tokens, v/tp] tensor exists; 0: today's full logits."""

    def __init__(self, shape, *, logprob_chunk_tokens: int = 0, **kwargs):
        if logprob_chunk_tokens < 0:
            raise ValueError(f"--logprob-chunk-tokens must be >= 0 (0 = the full logits), got {logprob_chunk_tokens}")
        self.logprob_chunk_tokens = logprob_chunk_tokens
        super().__init__(shape, **kwargs)

    def _output_scope(self):
        return _hidden_states_out(convert.unwrap(self.model)) if self.logprob_chunk_tokens else nullcontext()

    def _output_weight(self) -> torch.Tensor:
        """This stage's output-weight shard [v/tp, h]: the embedding's when the two are tied and this stage holds it
        (what GPTModel passes its output layer)."""
        gpt = convert.unwrap(self.model)
        if gpt.share_embeddings_and_output_weights:
            return gpt.shared_embedding_or_output_weight()
        return gpt.output_layer.weight

    def _head(self, output, mb, labels, temperature, loss_fn, whole):
        """With `logprob_chunk_tokens`, `output` is the hidden states [b, s, h]: log-probs and, when the loss asks
        for them, the entropy (differentiated only when the loss says `entropy_grad`) and the log-probs at the
        teacher's top-K ids in one chunked pass."""
        if not self.logprob_chunk_tokens:
            return super()._head(output, mb, labels, temperature, loss_fn, whole)
        from megatron.core import parallel_state

        if labels is None:  # without CP: positions 0..S-2 predict tokens 1..S-1
            output, labels = output[:, :-1], mb["tokens"][:, 1:]
        entropy = loss_fn is not None and ActorLoss.of(loss_fn).needs_entropy
        topk_ids = mb["teacher_topk_ids"] if loss_fn is not None and ActorLoss.of(loss_fn).needs_topk else None
        if topk_ids is not None and self.config.context_parallel_size > 1:  # refused by the config (--distill-topk)
            raise ValueError("--distill-topk needs --context-parallel-size 1")
        logp, ent, topk = chunked_topk_logprobs(output, self._output_weight(), labels, topk_ids,
                                                temperature=temperature, chunk_tokens=self.logprob_chunk_tokens,
                                                vocab_size=self._vocab_mask, with_entropy=entropy,
                                                group=parallel_state.get_tensor_model_parallel_group())
        if topk is not None:
            mb = {**mb, "topk_logp": topk}
        if not entropy:
            return whole(logp), mb
        if not (torch.is_grad_enabled() and ActorLoss.of(loss_fn).entropy_grad):
            ent = ent.detach()
        return whole(logp), {**mb, "entropy": whole(ent)}

    @property
    def _vocab_mask(self) -> int:
        """The real vocabulary when the output layer has padding rows to mask, else 0."""
        return self.shape.vocab_size if self.padded_vocab_size != self.shape.vocab_size else 0

    def _per_token(self, output: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        return token_logprobs(output, tokens, temperature, self._vocab_mask)

    def _per_position(self, output: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
        return label_logprobs(output, labels, temperature, self._vocab_mask)

    def _loss_inputs(self, output: torch.Tensor, mb: dict, loss_fn: LossFn, temperature: float, whole) -> dict:
        """Adds the per-token entropy [b, S - 1] when the loss asks for it (differentiated only when the loss
        says `entropy_grad`), and the student's log-probs at the teacher's top-K ids when it asks for those."""
        loss = ActorLoss.of(loss_fn)
        if loss.needs_entropy:
            with torch.set_grad_enabled(torch.is_grad_enabled() and loss.entropy_grad):
                if self.config.context_parallel_size > 1:
                    entropy = whole(position_entropy(output, temperature, self._vocab_mask))
                else:
                    entropy = token_entropy(output, temperature, self._vocab_mask)
            mb = {**mb, "entropy": entropy}
        if loss.needs_topk:
            if self.config.context_parallel_size > 1:  # refused by the config (`--distill-topk`)
                raise ValueError("--distill-topk needs --context-parallel-size 1")
            topk = topk_label_logprobs(output[:, :-1], mb["teacher_topk_ids"], temperature, self._vocab_mask)
            mb = {**mb, "topk_logp": topk}
        return mb

    def topk_logprobs(self, tokens: torch.Tensor, k: int, *, micro_batch_size: int, temperature: float = 1.0,
                      **_) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The K most likely next tokens at every position but the last (`vocab_parallel_topk`): (ids
        [B, S - 1, K] long, log-probs [B, S - 1, K] float32) on the last pipeline stage, None on the others;
        fixed micro-batches, context parallelism 1 (a teacher for `--distill-topk`)."""
        vocab = self._vocab_mask

        def head(output: torch.Tensor, _tokens: torch.Tensor, t: float) -> torch.Tensor:
            ids, logp = vocab_parallel_topk(output[:, :-1], k, t, vocab)
            return torch.cat([logp.double(), ids.double()], dim=-1)  # one tensor a micro-batch; ids exact in fp64

        out = self._forward_only(tokens, micro_batch_size=micro_batch_size, temperature=temperature, head=head)
        if out is None:
            return None
        return out[..., k:].long(), out[..., :k].float()

    def next_token_distributions(self, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor | None:
        """The whole next-token distribution at every position but the last, as log-probs [B, S - 1, vocab]
        (float32; the padding rows of a padded vocabulary cut off), on the last pipeline stage, None on the others.
        The vocab-parallel logits are gathered over TP ranks: meant for a few rows (`megarl.rollout.mismatch`),
        one micro-batch of them; context parallelism 1."""
        from megatron.core import tensor_parallel

        vocab = self.shape.vocab_size

        def head(output: torch.Tensor, _tokens: torch.Tensor, t: float) -> torch.Tensor:
            full = tensor_parallel.gather_from_tensor_model_parallel_region(output[:, :-1])[..., :vocab]
            return torch.log_softmax(_scaled(full, t, 0), dim=-1)  # (cut to the real vocabulary: no mask)

        return self._forward_only(tokens, micro_batch_size=tokens.shape[0], temperature=temperature, head=head)

    def export_hf(self) -> list[tuple[str, torch.Tensor]]:
        """Full HF-named weights on the model-parallel leader, [] elsewhere."""
        return convert.export_hf_weights(self.model, self.shape)

    def iter_hf(self, every_tp_rank: bool = False, merge_adapters: bool = True):
        """`export_hf` one tensor at a time; every model-parallel rank must exhaust it (it runs collectives).
        `every_tp_rank`: every TP rank of the first stage gets the full tensors, not only the leader.
        `merge_adapters` False: the frozen base weights, without the LoRA adapters merged in."""
        return convert.iter_hf_weights(self.model, self.shape, every_tp_rank, merge_adapters)

    def peft_adapters(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The LoRA adapters, whole, on the CPU and named as PEFT names them, with their `adapter_config.json`
        dict, on every model-parallel rank, which all call it (`--lora-weight-sync adapter`)."""
        if self.lora is None:
            raise ValueError("--lora-weight-sync adapter: the actor has no LoRA adapters (--lora-rank 0)")
        return lora.all_peft_tensors(self.model), lora.peft_config(self.lora, base="")

    def save_peft(self, base: str, out_dir: str) -> None:
        """The LoRA adapters as a PEFT adapter directory (`lora.save_peft`); every rank calls it."""
        if self.lora is None:
            raise ValueError(f"--save-peft {out_dir}: the actor has no LoRA adapters (--lora-rank 0)")
        lora.save_peft(self.model, self.lora, base, out_dir)

    def logprobs(self, tokens: torch.Tensor, *, micro_batch_size: int, temperature: float = 1.0,
                 lengths: torch.Tensor | None = None, max_tokens_per_micro_batch: int = 0,
                 routing: torch.Tensor | None = None) -> torch.Tensor | None:
        """Per-token log-probs [B, S - 1] on the last pipeline stage, None on the others; `routing`: the engine's
        experts per token [B, S, sparse layers, k], replayed when the actor was built with `routing_replay`."""
        return self._forward_only(tokens, micro_batch_size=micro_batch_size, temperature=temperature,
                                  lengths=lengths, max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                                  routing=routing)


class AdaptersOff:
    """The reference policy of a LoRA actor: the actor's own forward with its adapters off (`lora.adapters_disabled`),
    the frozen base weights, so there is no second model in memory. Its log-probs are bitwise those of a model
    without adapters, before and after any update (only adapters train)."""

    def __init__(self, actor: MegatronPolicy):
        if actor.lora is None:
            raise ValueError("AdaptersOff needs an actor built with LoRA adapters (--lora-rank > 0)")
        self.actor = actor

    def logprobs(self, tokens: torch.Tensor, **kw) -> torch.Tensor | None:
        """`MegatronPolicy.logprobs` of the base model."""
        with lora.adapters_disabled(self.actor.model):
            return self.actor.logprobs(tokens, **kw)

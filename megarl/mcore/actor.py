"""The Megatron policy: per-token log-probs of the next token and the update step, at any TP x PP x CP x DP.

`MegatronPolicy` is a `MegatronModel` (`megarl.mcore.base_model`: build, optimizer, forward schedule, offload,
checkpoint state) whose head is the language-model output layer: `logp[b, t] = log p(tokens[b, t + 1] |
tokens[b, :t + 1])`, shape `[B, S - 1]`, computed from vocab-parallel logits (divided by the sampling
temperature) without gathering the vocabulary. The actor trains; the reference is the same class, frozen.
Its loss may also ask for the per-token entropy (`loss_fn.needs_entropy`), computed from the same logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.mcore import convert
from megarl.mcore.base_model import LossFn, MegatronModel, OptimConfig

__all__ = ["LossFn", "MegatronPolicy", "OptimConfig", "label_logprobs", "mask_vocab_padding", "position_entropy",
           "token_entropy", "token_logprobs"]


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


class MegatronPolicy(MegatronModel):
    """A GPTModel shard with its language-model head (actor when trainable, reference when frozen)."""

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
        says `entropy_grad`)."""
        if not getattr(loss_fn, "needs_entropy", False):
            return mb
        with torch.set_grad_enabled(torch.is_grad_enabled() and getattr(loss_fn, "entropy_grad", True)):
            if self.config.context_parallel_size > 1:
                return {**mb, "entropy": whole(position_entropy(output, temperature, self._vocab_mask))}
            return {**mb, "entropy": token_entropy(output, temperature, self._vocab_mask)}

    def next_token_distributions(self, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor | None:
        """The whole next-token distribution at every position but the last, as log-probs [B, S - 1, vocab]
        (float32; the padding rows of a padded vocabulary cut off), on the last pipeline stage, None on the others.
        The vocab-parallel logits are gathered over TP ranks: meant for a few rows (`megarl.rollout.mismatch`),
        one micro-batch of them; context parallelism 1."""
        from megatron.core import tensor_parallel

        vocab = self.shape.vocab_size

        def head(output: torch.Tensor, _tokens: torch.Tensor, t: float) -> torch.Tensor:
            full = tensor_parallel.gather_from_tensor_model_parallel_region(output[:, :-1])[..., :vocab]
            return torch.log_softmax(full.float() / (t if t > 0 else 1.0), dim=-1)

        return self._forward_only(tokens, micro_batch_size=tokens.shape[0], temperature=temperature, head=head)

    def export_hf(self) -> list[tuple[str, torch.Tensor]]:
        """Full HF-named weights on the model-parallel leader, [] elsewhere."""
        return convert.export_hf_weights(self.model, self.shape)

    def iter_hf(self):
        """`export_hf` one tensor at a time; every model-parallel rank must exhaust it (it runs collectives)."""
        return convert.iter_hf_weights(self.model, self.shape)

    def logprobs(self, tokens: torch.Tensor, *, micro_batch_size: int, temperature: float = 1.0,
                 lengths: torch.Tensor | None = None, max_tokens_per_micro_batch: int = 0,
                 routing: torch.Tensor | None = None) -> torch.Tensor | None:
        """Per-token log-probs [B, S - 1] on the last pipeline stage, None on the others; `routing`: the engine's
        experts per token [B, S, sparse layers, k], replayed when the actor was built with `routing_replay`."""
        return self._forward_only(tokens, micro_batch_size=micro_batch_size, temperature=temperature,
                                  lengths=lengths, max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                                  routing=routing)

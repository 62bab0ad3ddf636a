"""Context parallelism (CP): how a batch of whole sequences is split over the CP ranks and put back together.

Megatron's attention with CP (Transformer Engine's) expects each rank to hold two of `2 * CP` equal chunks of
every sequence: rank r holds chunks r and 2 * CP - 1 - r, concatenated. With causal attention a late chunk costs
more than an early one, and this pairing gives every rank the same work (Megatron's `get_batch_on_this_cp_rank`
does the same split; a unit test checks that the two agree).

megarl splits the model's inputs (tokens, position ids, next-token labels) with `split_for_cp_rank`, runs the
model on this rank's positions, and gathers the per-token results (log-probs, entropies) back into whole
sequences with `gather_from_cp_ranks`, so losses and metrics never see a split sequence.

Gradients: every CP rank computes the loss of the whole (gathered) sequences, and the gather's backward hands each
rank the gradient of its own positions only, without communication. Megatron then sums parameter gradients and
token counts over DP x CP ranks (`calculate_per_token_loss`): the caller scales its loss by CP so that the summed
gradient over the summed count is the plain per-token mean (see `MegatronPolicy._run`).

What this does not do: Megatron's local (non-TE) attention has no CP, so CP > 1 runs only with the Transformer
Engine layer spec on GPUs; on CPU these functions are tested on their own (tests/unit/test_context_parallel.py,
and the gather over gloo in tests/distributed/test_cp_groups_gloo.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two of the `2 * cp_size` sequence chunks that rank `cp_rank` holds, in the order it holds them."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"CP rank {cp_rank} is not in [0, {cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def padded_width(width: int, cp_size: int, multiple: int = 1) -> int:
    """The smallest width >= `width` that splits into `2 * cp_size` equal chunks, each a multiple of `multiple`
    (sequence parallelism shards each rank's part over TP ranks too). Pad on the right: causal attention keeps the
    real positions unchanged."""
    unit = (2 * cp_size if cp_size > 1 else 1) * multiple
    return -(-width // unit) * unit


def split_for_cp_rank(t: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1) -> torch.Tensor:
    """This rank's part of `t` along `seq_dim`: chunks `chunk_ids(cp_rank, cp_size)` concatenated.
    `t.shape[seq_dim]` must be a multiple of `2 * cp_size` (see `padded_width`)."""
    if cp_size == 1:
        return t
    width = t.shape[seq_dim]
    if width % (2 * cp_size):
        raise ValueError(f"a sequence of {width} positions does not split into 2 x CP = {2 * cp_size} equal chunks")
    chunks = t.chunk(2 * cp_size, dim=seq_dim)
    first, second = chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=seq_dim)


def merge_cp_parts(parts: list[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """Whole sequences from every rank's part (`parts[r]` as `split_for_cp_rank(t, r, len(parts))` gave it)."""
    cp_size = len(parts)
    if cp_size == 1:
        return parts[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for r, part in enumerate(parts):
        a, b = part.chunk(2, dim=seq_dim)
        first, second = chunk_ids(r, cp_size)
        chunks[first], chunks[second] = a, b
    return torch.cat(chunks, dim=seq_dim)


class _GatherFromCPRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, group, seq_dim: int) -> torch.Tensor:
        ctx.rank, ctx.size, ctx.seq_dim = dist.get_rank(group), dist.get_world_size(group), seq_dim
        parts = [torch.empty_like(local) for _ in range(ctx.size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return merge_cp_parts(parts, seq_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Every CP rank computed the same loss from the whole sequences; each keeps the gradient of its own positions.
        return split_for_cp_rank(grad, ctx.rank, ctx.size, ctx.seq_dim).contiguous(), None, None


def gather_from_cp_ranks(local: torch.Tensor, group, seq_dim: int = 1) -> torch.Tensor:
    """All-gather every CP rank's part over `group` and undo the chunk order: whole sequences on every rank.
    Differentiable; the backward returns the gradient of this rank's positions (see the module docstring)."""
    if group is None or dist.get_world_size(group) == 1:
        return local
    return _GatherFromCPRanks.apply(local, group, seq_dim)

"""Context parallelism's split and reassembly (megarl/mcore/context_parallel.py): pure tensor functions, checked
against the formula and against Megatron's own `get_batch_on_this_cp_rank`."""

from __future__ import annotations

import pytest
import torch

from megarl.mcore import context_parallel as cp


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_chunk_ids_follow_the_load_balanced_formula(size):
    owned = []
    for r in range(size):
        assert cp.chunk_ids(r, size) == (r, 2 * size - 1 - r)
        owned += cp.chunk_ids(r, size)
    assert sorted(owned) == list(range(2 * size))  # every chunk on exactly one rank
    with pytest.raises(ValueError):
        cp.chunk_ids(size, size)


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("seq_dim", [1, 2])
def test_split_then_merge_is_exact(size, seq_dim):
    t = torch.randn(3, 8 * size, 8 * size, 5)
    parts = [cp.split_for_cp_rank(t, r, size, seq_dim) for r in range(size)]
    assert all(p.shape[seq_dim] == t.shape[seq_dim] // size for p in parts)
    assert torch.equal(cp.merge_cp_parts(parts, seq_dim), t)


def test_split_holds_the_positions_the_formula_names():
    positions = torch.arange(16).unsqueeze(0)  # 2 x CP = 8 chunks of 2 positions at CP = 4
    assert cp.split_for_cp_rank(positions, 0, 4).tolist() == [[0, 1, 14, 15]]
    assert cp.split_for_cp_rank(positions, 1, 4).tolist() == [[2, 3, 12, 13]]
    assert cp.split_for_cp_rank(positions, 3, 4).tolist() == [[6, 7, 8, 9]]


def test_split_rejects_a_width_that_does_not_divide():
    with pytest.raises(ValueError, match="2 x CP = 4"):
        cp.split_for_cp_rank(torch.zeros(1, 6), 0, 2)


def test_padded_width():
    assert cp.padded_width(13, 1) == 13
    assert cp.padded_width(13, 2) == 16
    assert cp.padded_width(16, 2) == 16
    assert cp.padded_width(13, 2, multiple=2) == 16  # sequence parallel at TP 2 too: 2 x CP x TP
    assert cp.padded_width(17, 2, multiple=2) == 24
    assert cp.padded_width(13, 1, multiple=4) == 16


class _FakeGroup:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


@pytest.mark.parametrize("size", [2, 3])
def test_split_matches_megatrons_get_batch_on_this_cp_rank(size, monkeypatch):
    from megatron.core.utils import get_batch_on_this_cp_rank

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # it asks the group only then
    tokens = torch.randint(0, 100, (2, 12 * size))
    labels = torch.roll(tokens, -1, dims=1)
    positions = torch.arange(12 * size).expand(2, -1)
    for r in range(size):
        theirs = get_batch_on_this_cp_rank({"tokens": tokens.clone(), "labels": labels.clone(),
                                            "position_ids": positions.clone()}, cp_group=_FakeGroup(r, size))
        assert torch.equal(theirs["tokens"], cp.split_for_cp_rank(tokens, r, size))
        assert torch.equal(theirs["labels"], cp.split_for_cp_rank(labels, r, size))
        assert torch.equal(theirs["position_ids"], cp.split_for_cp_rank(positions, r, size))


def test_gather_without_a_group_is_the_identity():
    t = torch.randn(2, 4)
    assert cp.gather_from_cp_ranks(t, None) is t


def test_config_and_launch_count_cp():
    from launch.render import LaunchError, check_parallel
    from megarl.arguments import parse_args
    from megarl.config import ConfigError

    with pytest.raises(ConfigError, match="--context-parallel-size must be >= 1"):
        parse_args(["--context-parallel-size", "0"])
    with pytest.raises(ConfigError, match="--context-parallel-size > 1 needs Transformer Engine"):
        parse_args(["--context-parallel-size", "2", "--transformer-impl", "local"])
    cfg = parse_args(["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--rollout-batch-size", "4"])
    layout = check_parallel(cfg, 16)
    assert (layout.tp, layout.cp, layout.dp) == (2, 2, 4)
    with pytest.raises(LaunchError, match="--context-parallel-size 2"):
        check_parallel(cfg, 10)


def test_train_preflight_refuses_cp_without_transformer_engine():
    from megarl.arguments import parse_args
    from megarl.config import ConfigError
    from megarl.mcore.parallel import transformer_engine_available
    from megarl.stages.setup import check_before_start

    if transformer_engine_available():
        pytest.skip("Transformer Engine is importable here")
    with pytest.raises(ConfigError, match="--context-parallel-size 2 needs Transformer Engine"):
        check_before_start(parse_args(["--context-parallel-size", "2"]))


def test_planner_counts_cp_in_dp_and_splits_activations():
    from dataclasses import replace

    from megarl import planner as P
    from megarl.arguments import parse_args
    from megarl.model_shape import ModelShape

    s = ModelShape.from_hf_config(dict(model_type="qwen2", num_hidden_layers=28, hidden_size=3584,
                                       num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                                       vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-6,
                                       rope_theta=1e6, tie_word_embeddings=False))
    c = P.Cluster(P.GPUS["h100"], 8)
    base = P.RunSettings(tp=2, micro_batch_size=1, distributed_optimizer=True)
    train = lambda r: P.memory_plan(s, r, c)[0].phases[0].components
    one, two = train(base), train(replace(base, cp=2))
    # the layers' activations halve with the tokens; the log-prob head is the measured model at half the tokens
    # (its weight-sized part does not shrink)
    tokens = base.micro_batch_size * P._sequence_len(base)
    head = lambda n: P.logprob_head_bytes(n, s.vocab_size, s.hidden_size, tp=2)
    layers = one["activations + logits"] - head(tokens)
    assert two["activations + logits"] == pytest.approx(layers / 2 + head(tokens / 2))
    assert two["activations + logits"] < 0.55 * one["activations + logits"]
    # the distributed optimizer shards over DP x CP (Megatron's dp-cp group): 8 / TP 2 either way
    assert two["optimizer (fp32 main + Adam)"] == pytest.approx(one["optimizer (fp32 main + Adam)"])
    assert any("CP 3" in p for p in P.memory_plan(s, replace(base, cp=3), c)[0].problems)
    assert P.RunSettings.from_config(parse_args(["--context-parallel-size", "2"])).cp == 2

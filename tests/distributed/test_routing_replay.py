"""Rollout routing replay (`--routing-replay`, `megarl/mcore/routing.py`) on a tiny random Qwen3-MoE (3 sparse
layers, 8 experts, top-2): the built-in engine records each token's experts while it samples, and the fp32 actor
either routes by itself (the experts are only compared) or replays them.

- engine in fp32: the actor's own top-k equals the engine's on every token (the recorded experts line up with the
  actor's rows: left-padded prompts in the engine, right-padded rows in the actor, stop tokens), and the log-probs
  agree within 1e-5;
- engine in bf16: rounding flips some tokens' experts; replay brings the disagreement to 0 and lowers the mean
  |actor - engine| log-prob difference on the sampled tokens.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_hf_model, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("routing_replay")
    hf = make_tiny_hf_model(root / "moe", "qwen3_moe", seed=7, layers=3, num_experts=8, num_experts_per_tok=2)
    torchrun(1, "tests/distributed/worker.py", "routing_replay", "--hf", hf, "--out", root, timeout=400)
    return torch.load(root / "routing_replay-rank0.pt", weights_only=False)


def _frac(stats, key):
    return stats[key] / stats["router_tokens"]


def _absdiff(stats):
    return stats["mismatch_abs_sum"] / stats["tokens"]


def test_recorded_experts_line_up_with_the_actor(results):
    fp32 = results["float32"]
    routing, lengths = fp32["routing"], fp32["lengths"]
    assert routing.shape[2:] == (3, 2)
    for row, length in zip(routing, lengths.tolist()):
        assert (row[: length - 1] >= 0).all() and (row[length - 1 :] == -1).all()  # every token the engine ran
    own = fp32["own"]
    assert own["router_tokens"] == 3 * (lengths - 1).sum().item()
    assert _frac(own, "routing_disagree_sum") == 0.0
    assert own["mismatch_abs_max"] < 1e-5


def test_replay_removes_the_bf16_engines_routing_disagreement(results):
    own, replay = results["bfloat16"]["own"], results["bfloat16"]["replay"]
    assert _frac(own, "routing_disagree_sum") > 0, "no expert flipped: the comparison would be vacuous"
    assert _frac(replay, "routing_disagree_sum") == 0.0
    assert _frac(replay, "routing_replayed_sum") == _frac(own, "routing_disagree_sum")
    assert _absdiff(replay) < _absdiff(own)
    # The router's entropy and the load imbalance are measured either way (ln 8 bounds the entropy).
    assert 0 < own["router_entropy_sum"] / own["router_tokens"] < torch.log(torch.tensor(8.0))
    assert own["router_imbalance_sum"] / own["router_layers"] >= 1.0

"""`--rollout-backend megatron` on CPU: what runs without a GPU (the mapping of sampling params onto Megatron's,
finished requests to completions, the identity weight sync, the clear errors). The engine itself needs CUDA and
flash-attn: tools/gpu_check.py's `dynamic` part (tests/gpu/test_colocated_path.py)."""

from __future__ import annotations

import pytest
import torch

from megarl.arguments import parse_args
from megarl.config import ConfigError
from megarl.rollout import weight_sync
from megarl.rollout.base import Completion, SamplingParams
from megarl.mcore.inference_engine import (
    MegatronEngine,
    group,
    megatron_engine_available,
    megatron_sampling,
    needs_rescoring,
    to_completion,
)


def test_sampling_params_map_onto_megatrons():
    from megatron.core.inference.sampling_params import SamplingParams as MegatronSampling

    sampled = megatron_sampling(SamplingParams(n=4, temperature=0.7, top_p=0.9, max_new_tokens=12,
                                               stop_token_ids=(5, 9)))
    assert sampled == dict(temperature=0.7, top_k=0, top_p=0.9, return_log_probs=True, skip_prompt_log_probs=True,
                           num_tokens_to_generate=12, termination_id=5)
    greedy = megatron_sampling(SamplingParams(temperature=0.0, top_k=50))
    assert (greedy["top_k"], greedy["top_p"], greedy["termination_id"]) == (1, 0.0, -1)
    assert megatron_sampling(SamplingParams(top_k=20))["top_k"] == 20
    MegatronSampling(**sampled)  # Megatron's own class takes every key
    with pytest.raises(ValueError, match="top-k or top-p, not both"):
        megatron_sampling(SamplingParams(top_k=20, top_p=0.9))


def test_completion_is_cut_after_the_first_stop_token():
    params = SamplingParams(stop_token_ids=(5, 9))
    c = to_completion([3, 9, 4, 5], [-1.0, -2.0, -3.0, -4.0], params, version=7, completion=Completion)
    assert (c.token_ids, c.logprobs, c.finish_reason, c.weight_version) == ([3, 9], [-1.0, -2.0], "stop", 7)
    c = to_completion([3, 4], [-1.0, -2.0], params, version=0, completion=Completion)
    assert (c.token_ids, c.finish_reason) == ([3, 4], "length")
    with pytest.raises(RuntimeError, match="2 tokens but 1 log-probs"):
        to_completion([3, 4], [-1.0], params, version=0, completion=Completion)
    assert [len(g) for g in group([c] * 6, 3)] == [3, 3]


def test_rescoring_only_where_megatrons_raw_logit_log_probs_differ():
    assert not needs_rescoring(SamplingParams(temperature=1.0))
    assert not needs_rescoring(SamplingParams(temperature=0.0))
    assert needs_rescoring(SamplingParams(temperature=0.7))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_unavailable_on_cpu_with_a_reason():
    ok, why = megatron_engine_available()
    assert not ok and "CUDA" in why
    with pytest.raises(RuntimeError, match="--rollout-backend megatron: .*CUDA"):
        MegatronEngine(torch.nn.Linear(2, 2), None, completion=Completion, max_sequence_length=8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_what_the_megatron_backend_needs_is_named_before_any_work():
    from megarl.stages.setup import check_before_start

    assert parse_args(["--rollout-backend", "megatron"]).rollout.rollout_backend == "megatron"
    with pytest.raises(ConfigError, match="--rollout-backend megatron: .*CUDA.*use --rollout-backend builtin"):
        check_before_start(parse_args(["--rollout-backend", "megatron"]))  # the machine, before any process group
    with pytest.raises(ConfigError, match="needs --tensor-model-parallel-size 1"):  # the flags, when parsed
        parse_args(["--rollout-backend", "megatron", "--tensor-model-parallel-size", "2"])
    with pytest.raises(ConfigError, match="--offload-params"):
        parse_args(["--rollout-backend", "megatron", "--offload-params"])
    with pytest.raises(ConfigError, match="needs --expert-model-parallel-size 1"):
        parse_args(["--rollout-backend", "megatron", "--expert-model-parallel-size", "2"])


class _SharingEngine:
    dtype = None  # the protocol's: weights (were they sent) as the actor holds them
    shares_actor_weights = True
    weight_version = 0

    def update_weights(self, named, version=None):
        assert list(named) == []
        self.weight_version = version


class _NoExportActor:
    def export_hf(self):
        raise AssertionError("an engine that shares the actor's weights needs no export")


def test_sync_of_a_weight_sharing_engine_moves_nothing():
    from megarl.mcore.parallel import ParallelInfo
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.stages.colocation import WeightSync

    engine = _SharingEngine()
    one_rank = ParallelInfo(rank=0, world_size=1, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1)
    metrics = WeightSync(_NoExportActor(), engine, parse_args(["--rollout-backend", "megatron"]).rollout,
                         one_rank)(version=3)
    assert engine.weight_version == 3
    assert (metrics["weight_version"], metrics["sync_bytes"], metrics["sync_buckets"]) == (3, 0, 0)
    with pytest.raises(weight_sync.WeightSyncError, match="holds weights of its own"):
        weight_sync.stamp(BuiltinEngine.__new__(BuiltinEngine), 1)

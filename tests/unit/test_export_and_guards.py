"""Small pieces around the GPU path: HF export in shards, the checkpoint's refusal to save an offloaded policy,
and the disaggregated SGLang client sized by --sglang-tp-size."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from megarl.mcore import checkpoint


def _named(sizes):
    return [(f"w{i}", torch.full((n,), float(i))) for i, n in enumerate(sizes)]


def test_one_shard_is_model_safetensors(tmp_path):
    files = checkpoint.write_hf_shards(iter(_named([4, 4])), tmp_path)
    assert [f.name for f in files] == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert torch.equal(load_file(str(files[0]))["w1"], torch.full((4,), 1.0))


def test_shards_respect_the_bound_and_the_index_names_every_tensor(tmp_path):
    named = _named([10, 10, 10, 100, 5])  # float32: 40, 40, 40, 400, 20 bytes
    files = checkpoint.write_hf_shards(iter(named), tmp_path, max_shard_bytes=100)
    assert [f.name for f in files] == [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    # w3 alone exceeds the bound: a shard of its own
    assert [sorted(load_file(str(f))) for f in files] == [["w0", "w1"], ["w2"], ["w3"], ["w4"]]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 540
    assert set(index["weight_map"]) == {"w0", "w1", "w2", "w3", "w4"}
    for name, t in named:
        assert torch.equal(load_file(str(tmp_path / index["weight_map"][name]))[name], t)
    assert not list(tmp_path.glob("*.tmp"))


def test_save_refuses_an_offloaded_policy(tmp_path):
    policy = SimpleNamespace(_offloader=SimpleNamespace(offloaded_bytes=4096))
    with pytest.raises(RuntimeError, match="4096 bytes of the policy are offloaded"):
        checkpoint.save(tmp_path, 1, policy, {})
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_disaggregated_servers_take_the_tp_size_flag(monkeypatch):
    import torch.distributed as dist

    from megarl.arguments import parse_args
    from megarl.rollout.backends import build_engine

    from megarl.mcore import parallel

    monkeypatch.setattr(dist, "get_rank", lambda: 1)  # not the pushing rank: no weight-update group
    # one data-parallel rank (no process group here): no barrier among DP leaders, which needs the default store
    monkeypatch.setattr(parallel, "parallel_info", lambda: parallel.ParallelInfo(
        rank=1, world_size=2, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1))
    cfg = parse_args(["--rollout-backend", "sglang", "--rollout-servers", "a:1,b:2", "--sglang-tp-size", "2"])
    servers = build_engine(cfg)
    assert servers.tp_sizes == [2, 2] and not servers.push
    cfg = parse_args(["--rollout-backend", "sglang", "--rollout-servers", "a:1"])
    assert build_engine(cfg).tp_sizes is None  # asked from each server at connect()

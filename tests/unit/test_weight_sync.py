"""Weight sync: bucket packing is exact, a sync moves exactly the model's parameter bytes once, the HF name table
round-trips through buckets, versions are stamped, the probe check catches a wrong engine, and offload restores
every byte."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_hf_model
from safetensors.torch import load_file

from megarl.model_shape import ModelShape
from megarl.rollout.builtin import BuiltinEngine
from megarl.rollout.weight_sync import (WeightSyncError, check_probe, model_parameter_count, pack_buckets,
                                        probe_sequence, push)


def _mixed_tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 5, generator=g)),
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),  # odd element count in a 2-byte dtype
        ("c", torch.randn(2, 2, generator=g).to(torch.bfloat16)),
        ("d", torch.randn(4, 4, generator=g)),
        ("scalar", torch.tensor(3.5)),
        ("empty", torch.empty(0, 4)),
        ("ids", torch.arange(6, dtype=torch.int64).view(2, 3)),
        ("t", torch.randn(6, 4, generator=g).t()),  # not contiguous
    ]


@pytest.mark.parametrize("bucket_bytes", [1, 40, 100, 1 << 20])
def test_buckets_round_trip_exactly_and_respect_the_bound(bucket_bytes):
    named = _mixed_tensors()
    buckets = list(pack_buckets(named, bucket_bytes))
    out = dict(pair for b in buckets for pair in b.tensors())
    assert sorted(out) == sorted(n for n, _ in named)
    for name, want in named:
        got = out[name]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    for b in buckets:
        assert len({s.dtype for s in b.slots}) == 1, "one dtype per bucket: offsets need no padding"
        assert b.nbytes <= bucket_bytes or len(b.slots) == 1, "only a single oversized tensor exceeds the bound"
        assert b.flat.dtype == torch.uint8 and b.nbytes == sum(s.end - s.start for s in b.slots)
    assert sum(b.nbytes for b in buckets) == sum(t.numel() * t.element_size() for _, t in named)


def test_alternating_dtypes_share_buckets_and_cast_to_the_engine_dtype():
    named = [(f"w{i}", torch.randn(4)) if i % 2 else (f"w{i}", torch.randn(4).to(torch.bfloat16)) for i in range(8)]
    assert len(list(pack_buckets(named, 1 << 20))) == 2, "one pending bucket per dtype, not one per dtype change"
    (bucket,) = pack_buckets(named, 1 << 20, dtype=torch.bfloat16)
    assert bucket.nbytes == 8 * 4 * 2
    for (name, want), (_, got) in zip(named, bucket.tensors()):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16)), name
    ids = list(pack_buckets([("ids", torch.arange(3))], 1 << 20, dtype=torch.bfloat16))[0].tensors()[0][1]
    assert ids.dtype == torch.int64, "only floating tensors are cast"


def test_unpacked_tensors_are_views_of_the_bucket():
    (bucket,) = pack_buckets([("x", torch.ones(4)), ("y", torch.zeros(3))], 1 << 20)
    x = bucket.tensors()[0][1]
    assert x.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()


@pytest.mark.parametrize("family,tie", [("qwen2", False), ("llama", True)])
def test_model_parameter_count_matches_transformers(family, tie, tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf_model(tmp_path, family, tie=tie)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model_parameter_count(ModelShape.from_pretrained(path)) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family,tie", [("qwen2", False), ("llama", True)])
def test_a_sync_moves_exactly_the_parameter_bytes_and_reproduces_the_engine(family, tie, tmp_path):
    path = make_tiny_hf_model(tmp_path, family, tie=tie, seed=3)
    weights = load_file(str(path / "model.safetensors"))
    if tie:
        weights.pop("lm_head.weight", None)  # tied: one tensor, sent once
    shape = ModelShape.from_pretrained(path)
    reference = BuiltinEngine.from_pretrained(path)
    engine = BuiltinEngine.from_pretrained(path)
    for t in engine._params.values():  # scramble, so the sync has to deliver everything
        t.normal_()
    stats = push(engine, list(weights.items()), version=7, bucket_bytes=64 << 10)
    assert stats.bytes == model_parameter_count(shape) * 4, "bytes moved = parameter bytes (fp32), no duplicates"
    assert stats.tensors == len(weights) and stats.buckets > 1 and stats.version == 7
    assert engine.weight_version == 7
    seq = probe_sequence(shape.vocab_size)
    assert engine.score([seq], [1]) == reference.score([seq], [1])
    assert stats.metrics()["sync_bytes"] == stats.bytes


def test_a_name_sent_twice_is_refused(tmp_path):
    path = make_tiny_hf_model(tmp_path, "qwen2")
    engine = BuiltinEngine.from_pretrained(path)
    w = engine._params["model.norm.weight"].clone()
    with pytest.raises(WeightSyncError, match="sent twice"):
        push(engine, [("model.norm.weight", w), ("model.norm.weight", w)], version=1)


def test_hf_megatron_name_table_round_trips_through_buckets(tmp_path):
    """HF -> Megatron fused tensors (the actor's layout) -> HF names -> buckets -> tensors equal the checkpoint."""
    from megarl.mcore import convert

    path = make_tiny_hf_model(tmp_path, "qwen2")
    shape = ModelShape.from_pretrained(path)
    hf = load_file(str(path / "model.safetensors"))
    named = []
    for rule in convert.rules_for(shape):
        for layer in range(shape.num_layers) if "{i}" in rule.mcore else [None]:
            mcore = convert.hf_to_mcore_tensor(rule, [hf[n] for n in convert.hf_names(rule, layer)], shape)
            named += convert.mcore_to_hf(rule.mcore.format(i=layer), mcore, shape)
    got = {n: t for b in pack_buckets(named, 10_000) for n, t in b.tensors()}
    assert got.keys() == hf.keys()
    assert all(torch.equal(got[k], hf[k]) for k in hf)


def test_probe_check():
    a = torch.tensor([-1.0, -2.0, -3.0])
    assert check_probe(a, a.clone(), 1e-6)["sync_probe_absdiff_max"] == 0.0
    with pytest.raises(WeightSyncError, match="differ from the actor"):
        check_probe(a, a + 0.5, 0.05)
    with pytest.raises(WeightSyncError):
        check_probe(a, torch.full((3,), float("nan")), 0.05)


def test_offload_frees_and_restores_every_byte_through_views():
    """Parameters as views into one flat buffer (Megatron DDP's layout), main_grad views, Adam state."""
    from megarl.mcore.offload import Offloader

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    grads = torch.zeros_like(flat)
    offset = 0
    for p in model.parameters():
        n = p.numel()
        flat[offset : offset + n].copy_(p.data.view(-1))
        p.data = flat[offset : offset + n].view_as(p)
        p.main_grad = grads[offset : offset + n].view_as(p)
        offset += n
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]

    off = Offloader(model, opt)
    freed = off.offload(params=True, grads=True, optimizer=True)
    assert flat.untyped_storage().nbytes() == 0 and grads.untyped_storage().nbytes() == 0
    assert freed == off.offloaded_bytes > flat.numel() * 4
    assert off.onload() == freed
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(s[k], opt.state[p][k]) for s, p in zip(state, model.parameters()) for k in s)
    assert flat.untyped_storage().data_ptr() == next(model.parameters()).untyped_storage().data_ptr()
    opt.step()  # the optimizer still works on the restored storages


def test_offload_of_the_optimizer_alone_keeps_the_weights():
    from megarl.mcore.offload import Offloader

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    Offloader(model, opt).offload(params=False, grads=False, optimizer=True)
    assert model.weight.untyped_storage().nbytes() > 0, "fp32 Adam's params are the model's: kept with params=False"
    assert opt.state[model.weight]["exp_avg"].untyped_storage().nbytes() == 0

"""HF <-> Megatron weight table (`megarl/mcore/convert.py`) and `ModelShape.from_hf_config`: pure functions only.

The layouts are checked on examples small enough to write out by hand: every row carries a label (its first
column), so "which HF row lands where" reads directly off the expected label lists. The there-and-back test
against `transformers`' own model lives in tests/distributed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megarl.mcore.convert import (
    _qkv_to_hf,
    _qkv_to_mcore,
    hf_to_mcore_tensor,
    mcore_to_hf,
    mcore_to_hf_tensors,
    rules_for,
    shard_for_tp,
)
from megarl.model_shape import ModelShape

HIDDEN = 3  # input columns of the toy projections; column 0 holds the row label


def shape(**kw) -> ModelShape:
    # 4 query heads in 2 KV groups, head_dim 2: q has 8 rows, k and v have 4 each.
    base = dict(family="qwen2", num_layers=2, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
                ffn_hidden_size=4, vocab_size=16, max_position_embeddings=32, rope_theta=10000.0, norm_eps=1e-6,
                tie_word_embeddings=False, qkv_bias=True)
    return ModelShape(**{**base, **kw})


def labelled(labels: list[int], cols: int = HIDDEN) -> torch.Tensor:
    """Rows [label, label + 0.1, label + 0.2, ...]: distinct everywhere, label readable from column 0."""
    lab = torch.tensor(labels, dtype=torch.float32)[:, None]
    return lab + 0.1 * torch.arange(cols, dtype=torch.float32)[None, :]


Q = list(range(100, 108))  # q rows 0..7: heads 0,1 belong to KV group 0, heads 2,3 to group 1
K = list(range(200, 204))  # k rows 0..3: KV head 0 = rows 0,1; KV head 1 = rows 2,3
V = list(range(300, 304))

# Megatron's linear_qkv, grouped by KV head: [q heads of g ; k_g ; v_g] for g = 0, 1.
MCORE_QKV = [100, 101, 102, 103, 200, 201, 300, 301,  # group 0: q heads 0,1 | k head 0 | v head 0
             104, 105, 106, 107, 202, 203, 302, 303]  # group 1: q heads 2,3 | k head 1 | v head 1


class FakeParam:
    """What shard_for_tp reads from a Megatron parameter: its TP attributes."""

    def __init__(self, partition_dim: int | None):
        if partition_dim is not None:
            self.tensor_model_parallel = True
            self.partition_dim = partition_dim


# ------------------------------------------------------------------------------------------------ qkv


def test_qkv_weight_megatron_layout():
    qkv = _qkv_to_mcore(labelled(Q), labelled(K), labelled(V), shape())
    assert qkv.shape == (16, HIDDEN)
    assert torch.equal(qkv, labelled(MCORE_QKV))


def test_qkv_bias_megatron_layout():
    qkv = _qkv_to_mcore(torch.tensor(Q, dtype=torch.float32), torch.tensor(K, dtype=torch.float32),
                        torch.tensor(V, dtype=torch.float32), shape())
    assert qkv.tolist() == MCORE_QKV


def test_qkv_to_hf_inverts_the_layout():
    q, k, v = _qkv_to_hf(labelled(MCORE_QKV), shape())
    assert torch.equal(q, labelled(Q)) and torch.equal(k, labelled(K)) and torch.equal(v, labelled(V))
    assert all(t.is_contiguous() for t in (q, k, v))


@pytest.mark.parametrize("heads, groups, d", [(4, 2, 2), (4, 4, 3), (6, 1, 2), (8, 2, 4)])
def test_qkv_round_trip(heads, groups, d):
    s = shape(num_attention_heads=heads, num_kv_heads=groups, head_dim=d)
    g = torch.Generator().manual_seed(heads * 10 + groups)
    q, k, v = (torch.randn(n * d, 5, generator=g) for n in (heads, groups, groups))
    back = _qkv_to_hf(_qkv_to_mcore(q, k, v, s), s)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_mha_layout_interleaves_per_head():
    # With as many KV heads as query heads each group is [q_h ; k_h ; v_h].
    s = shape(num_attention_heads=2, num_kv_heads=2, head_dim=1)
    qkv = _qkv_to_mcore(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), torch.tensor([5.0, 6.0]), s)
    assert qkv.tolist() == [1.0, 3.0, 5.0, 2.0, 4.0, 6.0]


def test_qkv_through_the_rule_helpers():
    rule = next(r for r in rules_for(shape()) if r.mcore.endswith("linear_qkv.weight"))
    assert rule.kind == "qkv"
    fused = hf_to_mcore_tensor(rule, [labelled(Q), labelled(K), labelled(V)], shape())
    assert torch.equal(fused, labelled(MCORE_QKV))
    q, k, v = mcore_to_hf_tensors(rule, fused, shape())
    assert torch.equal(q, labelled(Q)) and torch.equal(k, labelled(K)) and torch.equal(v, labelled(V))


# ------------------------------------------------------------------------------------------------ gate/up

GATE = [10, 11, 12, 13]  # ffn_hidden_size 4
UP = [20, 21, 22, 23]


def fc1_rule():
    return next(r for r in rules_for(shape()) if r.mcore.endswith("mlp.linear_fc1.weight"))


def test_gate_up_fuses_gate_then_up():
    rule = fc1_rule()
    assert rule.kind == "gate_up"
    fused = hf_to_mcore_tensor(rule, [labelled(GATE), labelled(UP)], shape())
    assert torch.equal(fused, labelled(GATE + UP))
    gate, up = mcore_to_hf_tensors(rule, fused, shape())
    assert torch.equal(gate, labelled(GATE)) and torch.equal(up, labelled(UP))


def test_copy_rules_pass_tensors_through():
    rule = next(r for r in rules_for(shape()) if r.mcore.endswith("linear_fc2.weight"))
    t = labelled([1, 2])
    assert hf_to_mcore_tensor(rule, [t], shape()) is t
    assert mcore_to_hf_tensors(rule, t, shape()) == [t]


# ------------------------------------------------------------------------------------------------ TP sharding


def test_shard_gate_up_gives_each_rank_its_gate_and_up_halves():
    rule = fc1_rule()
    fused = labelled(GATE + UP)
    param = FakeParam(partition_dim=0)  # fc1 is column-parallel: output rows are split
    assert torch.equal(shard_for_tp(rule, fused, param, 0, 2), labelled([10, 11, 20, 21]))
    assert torch.equal(shard_for_tp(rule, fused, param, 1, 2), labelled([12, 13, 22, 23]))
    assert torch.equal(shard_for_tp(rule, fused, param, 3, 4), labelled([13, 23]))


def test_shard_qkv_gives_each_rank_whole_kv_groups():
    rule = next(r for r in rules_for(shape()) if r.mcore.endswith("linear_qkv.weight"))
    fused = labelled(MCORE_QKV)
    param = FakeParam(partition_dim=0)
    # Because the fused layout is grouped by KV head, a plain row chunk is one KV group with its q heads.
    assert torch.equal(shard_for_tp(rule, fused, param, 0, 2), labelled([100, 101, 102, 103, 200, 201, 300, 301]))
    assert torch.equal(shard_for_tp(rule, fused, param, 1, 2), labelled([104, 105, 106, 107, 202, 203, 302, 303]))


def test_shard_row_parallel_splits_columns():
    rule = next(r for r in rules_for(shape()) if r.mcore.endswith("linear_proj.weight"))
    full = torch.arange(12, dtype=torch.float32).view(3, 4)
    param = FakeParam(partition_dim=1)
    assert shard_for_tp(rule, full, param, 1, 2).tolist() == [[2.0, 3.0], [6.0, 7.0], [10.0, 11.0]]


def test_shard_leaves_replicated_params_and_tp1_alone():
    rule = next(r for r in rules_for(shape()) if r.mcore.endswith("input_layernorm.weight"))
    full = torch.arange(4.0)
    assert shard_for_tp(rule, full, FakeParam(None), 1, 2) is full
    assert shard_for_tp(fc1_rule(), full, FakeParam(0), 0, 1) is full


# ------------------------------------------------------------------------------------------------ names


def names(pairs):
    return [n for n, _ in pairs]


def test_mcore_to_hf_names_with_layer_index():
    s = shape(num_layers=16)
    assert names(mcore_to_hf("decoder.layers.3.self_attention.linear_qkv.weight", labelled(MCORE_QKV), s)) == [
        "model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.v_proj.weight"]
    assert names(mcore_to_hf("decoder.layers.12.mlp.linear_fc1.weight", labelled(GATE + UP), s)) == [
        "model.layers.12.mlp.gate_proj.weight", "model.layers.12.mlp.up_proj.weight"]
    single = {
        "decoder.layers.0.self_attention.linear_proj.weight": "model.layers.0.self_attn.o_proj.weight",
        "decoder.layers.7.input_layernorm.weight": "model.layers.7.input_layernorm.weight",
        "decoder.layers.7.pre_mlp_layernorm.weight": "model.layers.7.post_attention_layernorm.weight",
        "decoder.layers.15.mlp.linear_fc2.weight": "model.layers.15.mlp.down_proj.weight",
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    }
    for mcore, hf in single.items():
        t = torch.ones(2)
        out = mcore_to_hf(mcore, t, s)
        assert names(out) == [hf] and out[0][1] is t


def test_mcore_to_hf_qkv_bias_for_qwen2():
    out = mcore_to_hf("decoder.layers.1.self_attention.linear_qkv.bias", torch.tensor(MCORE_QKV, dtype=torch.float32),
                      shape())
    assert names(out) == ["model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.k_proj.bias",
                          "model.layers.1.self_attn.v_proj.bias"]
    assert [t.tolist() for _, t in out] == [Q, K, V]


@pytest.mark.parametrize("name", [
    "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",  # TE naming: canonicalised before lookup
    "decoder.layers.x.mlp.linear_fc1.weight",
    "decoder.layers.0.mlp.linear_fc1.weight.extra",
    "prefix.embedding.word_embeddings.weight",
])
def test_unknown_megatron_name_raises_keyerror_naming_it(name):
    with pytest.raises(KeyError, match=name.replace(".", r"\.")):
        mcore_to_hf(name, torch.zeros(1), shape())


def test_tied_embeddings_drop_output_layer():
    tied = shape(tie_word_embeddings=True)
    assert "output_layer.weight" not in [r.mcore for r in rules_for(tied)]
    assert "output_layer.weight" in [r.mcore for r in rules_for(shape())]
    with pytest.raises(KeyError, match="output_layer.weight"):
        mcore_to_hf("output_layer.weight", torch.zeros(1), tied)


def test_llama_without_attention_bias_has_no_qkv_bias_rule():
    llama = shape(family="llama", qkv_bias=False)
    mcore_names = [r.mcore for r in rules_for(llama)]
    assert "decoder.layers.{i}.self_attention.linear_qkv.bias" not in mcore_names
    assert "decoder.layers.{i}.self_attention.linear_qkv.weight" in mcore_names
    with pytest.raises(KeyError, match="linear_qkv.bias"):
        mcore_to_hf("decoder.layers.0.self_attention.linear_qkv.bias", torch.zeros(16), llama)
    with_bias = [r.mcore for r in rules_for(shape(family="llama", qkv_bias=True))]
    assert "decoder.layers.{i}.self_attention.linear_qkv.bias" in with_bias


def test_full_rule_table_for_untied_qwen2():
    assert [r.mcore for r in rules_for(shape())] == [
        "embedding.word_embeddings.weight",
        "decoder.final_layernorm.weight",
        "output_layer.weight",
        "decoder.layers.{i}.input_layernorm.weight",
        "decoder.layers.{i}.self_attention.linear_qkv.weight",
        "decoder.layers.{i}.self_attention.linear_qkv.bias",
        "decoder.layers.{i}.self_attention.linear_proj.weight",
        "decoder.layers.{i}.pre_mlp_layernorm.weight",
        "decoder.layers.{i}.mlp.linear_fc1.weight",
        "decoder.layers.{i}.mlp.linear_fc2.weight",
    ]


def test_unknown_family_has_no_rules():
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, qwen2"):
        rules_for(shape(family="gpt2"))


# ------------------------------------------------------------------------------------------------ ModelShape


def hf_config(**kw) -> dict:
    base = dict(model_type="qwen2", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=96, max_position_embeddings=64, rms_norm_eps=1e-5,
                tie_word_embeddings=True)
    return {**base, **kw}


def test_shape_from_hf_config_fields():
    s = ModelShape.from_hf_config(hf_config(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}))
    assert dataclasses.asdict(s) == dict(
        family="qwen2", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
        ffn_hidden_size=128, vocab_size=96, max_position_embeddings=64, rope_theta=1000000.0, norm_eps=1e-5,
        tie_word_embeddings=True, qkv_bias=True, rope_scaling_factor=0.0, qk_norm=False, num_experts=0,
        moe_top_k=0, moe_ffn_hidden_size=0, moe_norm_topk_prob=True, moe_layers=(), moe_score_function="softmax",
        moe_expert_bias=False, moe_num_groups=0, moe_group_topk=0, moe_routed_scaling_factor=1.0,
        moe_shared_ffn_hidden_size=0, q_lora_rank=0, kv_lora_rank=0, qk_nope_head_dim=0, v_head_dim=0,
        yarn_factor=0.0, yarn_original_max_position_embeddings=0, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
        yarn_mscale=1.0, yarn_mscale_all_dim=0.0)


def test_shape_is_frozen():
    s = shape()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_layers = 3


def test_rope_theta_from_transformers5_rope_parameters():
    cfg = hf_config(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    assert ModelShape.from_hf_config(cfg).rope_theta == 1000000.0


def test_rope_theta_from_transformers4_top_level():
    cfg = hf_config(rope_theta=500000.0, rope_scaling=None)
    assert ModelShape.from_hf_config(cfg).rope_theta == 500000.0


def test_rope_theta_default_when_absent():
    assert ModelShape.from_hf_config(hf_config()).rope_theta == 10000.0


def test_shape_from_installed_transformers_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, rope_theta=123456.0)
    s = ModelShape.from_hf_config(cfg.to_dict())
    assert (s.family, s.rope_theta, s.num_kv_heads, s.head_dim, s.qkv_bias) == ("llama", 123456.0, 2, 16, False)


def test_llama_defaults_and_attention_bias():
    base = hf_config(model_type="llama", head_dim=32, num_key_value_heads=None, tie_word_embeddings=False)
    s = ModelShape.from_hf_config(base)
    assert (s.head_dim, s.num_kv_heads, s.qkv_bias, s.tie_word_embeddings) == (32, 4, False, False)
    # Llama's attention_bias also puts a bias on o_proj, which the Megatron layer table does not carry.
    with pytest.raises(ValueError, match="attention_bias=true"):
        ModelShape.from_hf_config({**base, "attention_bias": True})


def test_unsupported_model_type_is_named():
    with pytest.raises(ValueError,
                       match=r"cfg.json: model_type 'mistral' is not supported; supported: deepseek_v3, llama, qwen2"):
        ModelShape.from_hf_config(hf_config(model_type="mistral"), source="cfg.json")


@pytest.mark.parametrize("rope", [
    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
    {"rope_scaling": {"type": "yarn", "factor": 4.0}},  # transformers 4.x spelling
])
def test_unsupported_rope_type_is_named(rope):
    with pytest.raises(ValueError, match=r"rope type 'yarn' is not supported"):
        ModelShape.from_hf_config(hf_config(**rope))


def test_llama3_rope_scaling_from_transformers4_rope_scaling():
    cfg = hf_config(model_type="llama", rope_theta=500000.0,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    s = ModelShape.from_hf_config(cfg)
    assert s.rope_theta == 500000.0 and s.rope_scaling_factor == 8.0


# ------------------------------------------------------------------------------------------------ Qwen3, Qwen3-MoE


def moe_config(**kw) -> dict:
    """A Qwen3-MoE config.json as transformers 5 writes it (`num_local_experts`, not `num_experts`)."""
    base = dict(model_type="qwen3_moe", num_hidden_layers=4, head_dim=24, num_local_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    return hf_config(**{**base, **kw})


def test_qwen3_shape_has_qk_norm_and_explicit_head_dim():
    s = ModelShape.from_hf_config(hf_config(model_type="qwen3", head_dim=24))
    assert (s.family, s.head_dim, s.qk_norm, s.qkv_bias, s.is_moe) == ("qwen3", 24, True, False, False)
    with pytest.raises(ValueError, match="attention_bias=true .* not supported for qwen3"):
        ModelShape.from_hf_config(hf_config(model_type="qwen3", attention_bias=True))


def test_qwen3_moe_layers_follow_transformers_rule():
    """transformers: layer i is sparse unless in mlp_only_layers or (i + 1) % decoder_sparse_step != 0."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeSparseMoeBlock

    for extra in ({}, {"mlp_only_layers": [0, 2]}, {"decoder_sparse_step": 2},
                  {"decoder_sparse_step": 2, "mlp_only_layers": [3]}):
        cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in moe_config(**extra).items()
                                             if k not in ("model_type", "num_local_experts")}, num_experts=8)
        sparse = tuple(i for i in range(4) if isinstance(Qwen3MoeDecoderLayer(cfg, i).mlp, Qwen3MoeSparseMoeBlock))
        s = ModelShape.from_hf_config(cfg.to_dict())
        assert s.moe_layers == sparse, extra
        assert (s.num_experts, s.moe_top_k, s.moe_ffn_hidden_size, s.moe_norm_topk_prob) == (8, 2, 32, True)


@pytest.mark.parametrize("bad, message", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be within 1..num_experts=8"),
    ({"num_local_experts": 0}, "qwen3_moe with num_experts=0"),
    ({"shared_expert_intermediate_size": 64}, "shared experts are not supported"),
    ({"mlp_only_layers": [7]}, r"mlp_only_layers=\[7\] names layers outside 0..3"),
])
def test_qwen3_moe_unsupported_variants_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        ModelShape.from_hf_config(moe_config(**bad), source="cfg.json")


def test_qwen3_moe_parameter_counts():
    """Total vs active parameters by hand: 4 layers, 8 experts of width 32 (top-2), hidden 64, 4 x 24 query and
    2 x 24 key/value dims, vocabulary 96 tied."""
    s = ModelShape.from_hf_config(moe_config(mlp_only_layers=[1]))
    attention = 64 * (96 + 2 * 48) + 96 * 64 + 2 * 24
    expert = 3 * 64 * 32
    dense_mlp = 3 * 64 * 128
    norms = 2 * 64
    total = 96 * 64 + 64 + 4 * (attention + norms) + dense_mlp + 3 * (8 * 64 + 8 * expert)
    active = 96 * 64 + 64 + 4 * (attention + norms) + dense_mlp + 3 * (8 * 64 + 2 * expert)
    assert (s.param_count(), s.param_count(active=True)) == (total, active)


def test_qwen3_moe_names_round_trip_with_global_expert_index():
    s = ModelShape.from_hf_config(moe_config())
    w = torch.arange(2 * 32 * 64, dtype=torch.float32).reshape(64, 64)
    names = [n for n, _ in mcore_to_hf("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight", w, s)]
    assert names == ["model.layers.3.mlp.experts.5.gate_proj.weight", "model.layers.3.mlp.experts.5.up_proj.weight"]
    router = mcore_to_hf("decoder.layers.0.mlp.router.weight", w[:8], s)
    assert [n for n, _ in router] == ["model.layers.0.mlp.gate.weight"]
    assert [n for n, _ in mcore_to_hf("decoder.layers.2.self_attention.q_layernorm.weight", w[0, :24], s)] == [
        "model.layers.2.self_attn.q_norm.weight"]


def test_expert_names_of_both_specs_map_to_global_expert_indices(monkeypatch):
    """The local spec's `mlp.experts.local_experts.<j>.linear_fc*` and Transformer Engine's
    `mlp.experts.linear_fc*.weight<j>` on EP rank 1 of 2 with 8 experts: local expert j is global expert 4 + j, and
    layer indices are global too."""
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps

    from megarl.mcore.convert import global_param_names

    monkeypatch.setattr(ps, "get_expert_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(ps, "get_expert_model_parallel_world_size", lambda: 2)

    def layer(number: int, te: bool) -> torch.nn.Module:
        m = torch.nn.Module()
        m.layer_number = number
        m.mlp = torch.nn.Module()
        m.mlp.experts = torch.nn.Module()
        if te:
            m.mlp.experts.linear_fc1 = torch.nn.Module()
            m.mlp.experts.linear_fc1.register_parameter("weight1", torch.nn.Parameter(torch.zeros(1)))
        else:
            expert = torch.nn.Module()
            expert.linear_fc2 = torch.nn.Linear(1, 1, bias=False)
            m.mlp.experts.local_experts = torch.nn.ModuleList([torch.nn.Module(), expert])
        return m

    model = torch.nn.Module()
    model.config = SimpleNamespace(num_moe_experts=8)
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([layer(3, te=True), layer(4, te=False)])  # a PP stage from layer 2
    assert global_param_names(model) == {
        "decoder.layers.0.mlp.experts.linear_fc1.weight1":
            "decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight",
        "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight":
            "decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.weight",
    }
    s = ModelShape.from_hf_config(moe_config())
    names = [n for n, _ in mcore_to_hf("decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight",
                                       torch.zeros(64, 64), s)]
    assert names == ["model.layers.2.mlp.experts.5.gate_proj.weight", "model.layers.2.mlp.experts.5.up_proj.weight"]

"""Model families registered in one place (`megarl.models`): each built-in family's weight table names exactly the
tensors of transformers' own model of that family, and a plugin's family is known to shapes and the weight table
without editing megarl."""

from __future__ import annotations

import pytest

from megarl.mcore.convert import FAMILY_RULES, hf_names, rules_for
from megarl.model_shape import SUPPORTED_FAMILIES, ModelShape
from megarl.models import FAMILIES, ModelFamily, get_family, register_family
from megarl.models.weights import DECODER_RULES
from tests.helpers import make_tiny_hf_model


def _hf_names_from_table(shape: ModelShape) -> set[str]:
    """Every HF tensor name the weight table says a checkpoint of `shape` holds."""
    names = set()
    for rule in rules_for(shape):
        if "{i}" not in rule.mcore:
            names.update(hf_names(rule, None))
            continue
        expert_rule = any(f".mlp.{part}." in rule.mcore for part in ("experts", "router", "shared_experts"))
        for layer in range(shape.num_layers):
            if shape.is_moe_layer(layer) != expert_rule and (expert_rule or ".mlp." in rule.mcore):
                continue  # a dense layer has no router or experts; a sparse one no dense MLP
            experts = range(shape.num_experts) if "{e}" in rule.mcore else [None]
            for e in experts:
                names.update(hf_names(rule, layer, e))
    return names


@pytest.mark.parametrize("family,tie,extra", [("llama", True, {}), ("qwen2", False, {}), ("qwen3", False, {}),
                                              ("qwen3_moe", False, {"mlp_only_layers": [1]}),
                                              ("deepseek_v3", False, {"layers": 3}),
                                              ("deepseek_v3", True, {"q_lora_rank": None})])
def test_each_builtin_family_table_names_transformers_tensors(tmp_path, family, tie, extra):
    from safetensors import safe_open

    path = make_tiny_hf_model(tmp_path / family, family, tie=tie, **extra)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        on_disk = set(f.keys())
    shape = ModelShape.from_pretrained(path)
    assert _hf_names_from_table(shape) == on_disk


def test_builtin_families_are_registered_with_their_old_names():
    assert set(SUPPORTED_FAMILIES) <= set(FAMILIES.names())
    assert [r.mcore for r in FAMILY_RULES["qwen3_moe"]] == [r.mcore for r in get_family("qwen3_moe").weight_rules]
    assert (get_family("qwen2").qkv_bias, get_family("qwen3").qk_norm, get_family("qwen3_moe").moe) == (True,) * 3
    with pytest.raises(ValueError, match="unknown model family 'gpt9'; valid names: deepseek_v3, llama, qwen2"):
        get_family("gpt9")


@pytest.fixture
def plugin_family():
    """A family registered the way a plugin module does it, removed afterwards (the registry is process-wide)."""
    family = register_family(ModelFamily(name="plugin_llama", weight_rules=DECODER_RULES, qk_norm=False,
                                         hf_config_class="LlamaConfig"))
    yield family
    FAMILIES._items.pop(family.name)


def test_a_plugin_family_is_known_to_shapes_and_the_weight_table(plugin_family):
    cfg = {"model_type": "plugin_llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 96, "tie_word_embeddings": True}
    shape = ModelShape.from_hf_config(cfg)
    llama = ModelShape.from_hf_config({**cfg, "model_type": "llama"})
    assert shape == ModelShape(**{**llama.__dict__, "family": "plugin_llama"})
    assert rules_for(shape) == rules_for(llama)
    assert "plugin_llama" in FAMILY_RULES
    with pytest.raises(ValueError, match="already registered"):
        register_family(plugin_family)
    with pytest.raises(ValueError, match="model_type 'gpt9' is not supported; supported: .*plugin_llama"):
        ModelShape.from_hf_config({**cfg, "model_type": "gpt9"})


def test_register_family_refuses_what_is_not_a_family():
    with pytest.raises(TypeError, match="takes a megarl.models.ModelFamily"):
        register_family({"name": "x"})


def test_the_registry_imports_no_torch():
    """Shapes are read on hosts without torch (`megarl-plan`, the launch scripts' checks)."""
    import subprocess
    import sys

    code = ("import sys, megarl.models as m, megarl.model_shape; m.FAMILIES.names(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_deepseek_v3_shape_counts_transformers_parameters(tmp_path):
    """MLA, the dense first layer, routed and shared experts: the planner's count is transformers' own."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf_model(tmp_path / "ds", "deepseek_v3", layers=3)
    shape = ModelShape.from_pretrained(path)
    assert (shape.is_mla, shape.moe_layers, shape.moe_num_groups, shape.moe_shared_ffn_hidden_size) == \
        (True, (1, 2), 2, 32)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert shape.param_count() == sum(p.numel() for p in model.parameters())


def test_deepseek_v3_refuses_what_megatron_computes_differently():
    base = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 96, "q_lora_rank": 32, "kv_lora_rank": 16,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 4, "topk_group": 1}
    assert ModelShape.from_hf_config(base).moe_group_topk == 1
    with pytest.raises(ValueError, match="top-2 per group"):
        ModelShape.from_hf_config({**base, "num_experts_per_tok": 4, "topk_group": 1})
    with pytest.raises(ValueError, match="rope_interleave=false"):
        ModelShape.from_hf_config({**base, "rope_interleave": False})
    with pytest.raises(ValueError, match="mscale_all_dim but no mscale"):
        ModelShape.from_hf_config({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                               "original_max_position_embeddings": 16,
                                                               "mscale_all_dim": 1.0}})

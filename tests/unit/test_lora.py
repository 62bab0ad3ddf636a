"""LoRA on the Megatron actor against `peft` on the `transformers` model (the independent reference): the same
adapter values (A and B random), copied by name; logits within 1e-5, gradients of A and B within 1e-5; one
optimizer step changes the adapters only; the reference (the actor with adapters off) is bitwise the base model
before and after; the merged export equals PEFT's `merge_and_unload()`. TP 1 here, in process; TP 2 (with and
without sequence parallelism) in tests/distributed/test_lora_tp.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import make_tiny_hf_model
from lora_checks import ALL, MOE, batch, check_against_peft, megatron_side, peft_side

from megarl.config import ModelConfig, parse_config
from megarl.errors import ConfigError

needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="peft (the dev extra) is the independent reference for LoRA")

@needs_peft
@pytest.mark.slow
def test_megatron_lora_matches_peft_at_tp1_qwen2(tiny_qwen2, process_group, tmp_path):
    meg = megatron_side(str(tiny_qwen2), tp=1, targets=ALL, peft_dir=str(tmp_path / "adapter"))
    check_against_peft(meg, peft_side(tiny_qwen2, meg["values"], ALL, meg["adapters_after"]))
    _check_peft_dir(tiny_qwen2, tmp_path / "adapter", meg)


@needs_peft
@pytest.mark.slow
def test_megatron_lora_matches_peft_at_tp1_qwen3_moe_attention_and_experts(tmp_path, process_group):
    hf = make_tiny_hf_model(tmp_path / "qwen3_moe", "qwen3_moe", layers=2, mlp_only_layers=[1])
    targets = MOE  # q, v, o (not k: a part of the fused qkv layer) and the experts
    meg = megatron_side(str(hf), tp=1, targets=targets, peft_dir=str(tmp_path / "adapter"))
    assert not any("k_proj" in n for n in meg["values"])
    assert sum(".mlp.experts." in n for n in meg["values"]) == 4  # layer 0's experts: gate_up and down, A and B
    check_against_peft(meg, peft_side(hf, meg["values"], targets, meg["adapters_after"]))
    assert sum(".mlp.experts." in n for n in meg["merged"]) == 12  # 4 experts' gate, up and down, merged
    _check_peft_dir(hf, tmp_path / "adapter", meg)


def _check_peft_dir(hf, adapter, meg):
    """--save-peft: the directory loads in peft on the HF base and gives the trained actor's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf).float(), adapter).eval()
    tokens, _ = batch(loaded.config.vocab_size)
    with torch.no_grad():
        got = loaded(tokens).logits
    assert (meg["logits_after"] - meg["logits"]).abs().max() > 1e-4  # the update moved them
    assert torch.allclose(got, meg["logits_after"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("flags,match", [
    (dict(lora_rank=-1), "--lora-rank"),
    (dict(lora_rank=4, lora_dropout=1.0), "--lora-dropout"),
    (dict(lora_rank=4, lora_target_modules="q_proj,qkv"), "'qkv' is not a projection"),
    (dict(lora_rank=4, lora_target_modules=" , "), "empty"),
    (dict(lora_rank=4, ref_checkpoint="/x"), "drop --ref-checkpoint"),
    (dict(lora_rank=4, lora_target_modules="q_proj,experts", tensor_model_parallel_size=2),
     "needs --expert-tensor-parallel-size 1"),
])
def test_lora_flags_are_checked(flags, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**flags)


def test_save_peft_needs_adapters():
    with pytest.raises(ConfigError, match="--save-peft /x needs --lora-rank > 0"):
        parse_config(["--save-peft", "/x"])
    assert parse_config(["--save-peft", "/x", "--lora-rank", "8"]).checkpoint.save_peft == "/x"


def test_lora_targets_read_attention_as_the_four_projections():
    assert ModelConfig(lora_target_modules="attention").lora_targets == ALL[:4]
    assert ModelConfig(lora_target_modules="q_proj, v_proj").lora_targets == ("q_proj", "v_proj")
    assert ModelConfig(lora_target_modules="attention,experts").lora_targets == ALL[:4] + (
        "experts.gate_up_proj", "experts.down_proj")
    # expert-TP 1 with TP 2: expert adapters allowed
    assert ModelConfig(lora_rank=4, lora_target_modules="experts.down_proj", tensor_model_parallel_size=2,
                       expert_tensor_parallel_size=1).lora_targets == ("experts.down_proj",)

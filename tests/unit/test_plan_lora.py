"""The planner's LoRA accounting (`megarl.planner`): the adapters' parameters against a hand count on a small shape and
against the trainable parameters of a Megatron model built with LoRA; their gradients and Adam states; no
gradient or optimizer state for the frozen base, and no reference model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megarl.model_shape import ModelShape
from megarl.planner import RunSettings, _train_phase, lora_params, lora_stage_params, num_params, stage_params

# hidden 8, 4 query heads and 2 KV heads of 2: q = 8 and kv = 4 rows; MLP width 12.
SMALL = ModelShape(family="qwen2", num_layers=2, hidden_size=8, num_attention_heads=4, num_kv_heads=2, head_dim=2,
                   ffn_hidden_size=12, vocab_size=16, max_position_embeddings=32, rope_theta=10000.0, norm_eps=1e-6,
                   tie_word_embeddings=False, qkv_bias=True)
SUBSET = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")


def test_lora_params_by_hand():
    # rank 2, A [2, in] + B [out, 2] per projection: q 2 (8 + 8), k and v 2 (8 + 4), o 2 (8 + 8), gate and up
    # 2 (8 + 12), down 2 (12 + 8) = 32 + 24 + 24 + 32 + 40 + 40 + 40 = 232 a layer, two layers.
    assert lora_params(SMALL, 2) == 464
    assert lora_params(SMALL, 2, SUBSET) == 2 * (32 + 24 + 32 + 40 + 40)
    # TP 2 splits B of column-parallel layers by rows and A of row-parallel ones by columns; the other is whole:
    # q 2 x 8 + 4 x 2, k and v 2 x 8 + 2 x 2, o 2 x 4 + 8 x 2, gate and up 2 x 8 + 6 x 2, down 2 x 6 + 8 x 2.
    per_layer_tp2 = 24 + 20 + 20 + 24 + 28 + 28 + 28
    assert lora_stage_params(SMALL, RunSettings(tp=2, lora_rank=2)) == 2 * per_layer_tp2
    assert lora_stage_params(SMALL, RunSettings(tp=2, pp=2, lora_rank=2)) == per_layer_tp2  # one layer a stage
    assert lora_stage_params(SMALL, RunSettings(tp=2)) == 0  # no LoRA


def test_lora_memory_has_adapter_state_only_and_no_reference():
    full = RunSettings(tp=2, kl=True, distributed_optimizer=True)
    lora = replace(full, lora_rank=2)
    dp = 2
    base, adapters = stage_params(SMALL, 2, 1), 2 * 172  # per GPU, as above
    f, lo = _train_phase(SMALL, full, dp), _train_phase(SMALL, lora, dp)
    assert f["reference model"] == 2 * base and lo["reference model"] == 0  # the actor with adapters off
    assert lo["actor weights"] == 2 * (base + adapters)  # bf16 base and adapters
    assert lo["gradients (fp32)"] == 4 * adapters and f["gradients (fp32)"] == 4 * base
    assert lo["optimizer (fp32 main + Adam)"] == 12 * adapters / dp  # fp32 main, m and v, over DP
    assert lo["activations + logits"] == f["activations + logits"]


@pytest.mark.parametrize("targets", [RunSettings().lora_targets, SUBSET], ids=["all", "subset"])
def test_planned_lora_params_are_the_built_models_trainable_ones(tiny_qwen2, process_group, targets):
    from megarl.mcore.actor import MegatronPolicy
    from megarl.mcore.lora import LoRAOptions

    shape = ModelShape.from_pretrained(tiny_qwen2)
    actor = MegatronPolicy(shape, tp=1, pp=1, trainable=True, lora=LoRAOptions(rank=4, targets=targets))
    params = list(actor.model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    assert trainable == lora_params(shape, 4, targets) > 0
    assert sum(p.numel() for p in params if not p.requires_grad) == num_params(shape)  # the frozen base
    in_optimizer = sum(p.numel() for g in actor.optimizer.param_groups for p in g["params"])
    assert in_optimizer == trainable  # Adam's states are the adapters' only


def test_planned_expert_adapters_are_the_built_moe_models_trainable_ones(tmp_path, process_group):
    """Qwen3-MoE with its experts adapted (layer 0 sparse, layer 1 dense): an A and a B per expert over the fused
    gate/up and over down, as `megarl.mcore.lora` attaches them."""
    from megarl.mcore.actor import MegatronPolicy
    from megarl.mcore.lora import LoRAOptions
    from helpers import make_tiny_hf_model

    targets = ("q_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj")
    shape = ModelShape.from_pretrained(make_tiny_hf_model(tmp_path / "moe", "qwen3_moe", layers=2,
                                                          mlp_only_layers=[1]))
    actor = MegatronPolicy(shape, tp=1, pp=1, trainable=True, lora=LoRAOptions(rank=4, targets=targets))
    trainable = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
    experts = shape.num_experts * 4 * (2 * shape.hidden_size + 3 * shape.moe_ffn_hidden_size)  # by hand, layer 0
    assert trainable == lora_params(shape, 4, targets) == lora_params(shape, 4, targets[:3]) + experts
    assert lora_stage_params(shape, RunSettings(ep=2, lora_rank=4, lora_targets=targets)) == \
        lora_params(shape, 4, targets[:3]) + experts / 2  # EP 2: half the experts on a GPU

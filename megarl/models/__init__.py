"""Model families: what megarl knows about one Hugging Face `model_type`, registered in one place.

A family (`ModelFamily`) says how its `config.json` reads into a `megarl.model_shape.ModelShape` (q/k/v biases,
per-head q/k norms, a mixture of experts), its HF <-> Megatron weight table (`megarl.models.weights.Rule`s, used by
`megarl.mcore.convert` for loading, TP/PP/EP sharding and export) and the transformers classes of its tiny test
model. The built-in families live in `megarl/models/<family>/`; each registers itself on import, and the registry
imports them on the first lookup, so `FAMILIES.get("qwen3")` or `"qwen3" in FAMILIES` is all another part needs.

A plugin adds a family without editing megarl (a module passed with `--plugins`, or imported first):

    from megarl.models import ModelFamily, register_family
    from megarl.models.weights import DECODER_RULES
    register_family(ModelFamily(name="my_llama", weight_rules=DECODER_RULES, hf_config_class="LlamaConfig"))

Pure Python (no torch): the rollout engines and `megarl-plan` read shapes on hosts that may have no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from megarl.models.weights import Rule
from megarl.registry import Registry


@dataclass(frozen=True)
class ModelFamily:
    name: str  # HF `model_type`
    weight_rules: tuple[Rule, ...]  # the HF <-> Megatron table (`megarl.models.weights`)
    qkv_bias: bool = False  # q/k/v projections always have biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on queries and keys (Qwen3's `self_attn.q_norm` / `k_norm`)
    moe: bool = False  # a mixture of experts (`config.json`'s expert fields are read: `megarl.model_shape`)
    mla: bool = False  # multi-latent attention (DeepSeek-V2/V3): low-rank q, compressed KV, a decoupled RoPE part
    hf_config_class: str = ""  # transformers' config class, for the tiny test models (`tests/helpers.py`)
    hf_model_class: str = ""  # transformers' causal LM class, the reference the tests compare logits with
    # config.json fields of the tiny random test model beyond the shared ones (`tests/helpers.make_tiny_hf_model`:
    # 64 wide, 4 heads, 2 KV heads, 2 layers): what makes a tiny model exercise the family's own parts.
    tiny_config: Mapping[str, Any] = field(default_factory=dict)
    # config.json -> the family's own `ModelShape` fields (its attention, its router), called as
    # `read_config(cfg, num_layers, source)` in place of the generic experts reader; None: the generic reader.
    read_config: Callable[[dict, int, str], dict] | None = None


FAMILIES: Registry[ModelFamily] = Registry(
    "model family", builtins=("megarl.models.llama", "megarl.models.qwen2", "megarl.models.qwen3",
                              "megarl.models.qwen3_moe", "megarl.models.deepseek_v3"))


def register_family(family: ModelFamily) -> ModelFamily:
    """Make `family` known to every part of megarl (shapes, the planner, the weight table); a name registered twice
    is an error."""
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register_family takes a megarl.models.ModelFamily, got {family!r}")
    FAMILIES.add(family.name, family)
    return family


def get_family(name: str) -> ModelFamily:
    """The family registered for HF `model_type` `name`; an unknown one raises ValueError listing the known."""
    return FAMILIES.get(name)

"""megarl.mcore's rules on the model's flags (`megarl.config.ModelConfig`), in pure Python: what LoRA may adapt,
which MoE token dispatcher runs, which layer spec is built. `megarl.config` calls them while it checks a run's flags,
on hosts that may have no torch: this module imports nothing but megarl's errors (and `megarl.mcore`'s `__init__`
only sets warning filters).
"""

from __future__ import annotations

from megarl.errors import ConfigError

# The projections LoRA adapts, by their Hugging Face names (`megarl/mcore/lora.py` maps them onto Megatron's fused
# layers), and the shorthands `--lora-target-modules` takes.
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                    "experts.gate_up_proj", "experts.down_proj")
LORA_ALIASES = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
                "experts": ("experts.gate_up_proj", "experts.down_proj")}


def lora_targets(spec: str) -> tuple[str, ...]:
    """`--lora-target-modules` (comma-separated names or shorthands) as a tuple of HF projection names."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    return tuple(t for n in names for t in LORA_ALIASES.get(n, (n,)))


def check_lora(m) -> None:
    """The LoRA flags of a `ModelConfig` `m`, and their ties to its parallel layout and reference."""
    if m.lora_rank < 0 or m.lora_alpha < 0 or not 0 <= m.lora_dropout < 1:
        raise ConfigError(f"--lora-rank and --lora-alpha must be >= 0 and --lora-dropout in [0, 1), got "
                          f"{m.lora_rank}, {m.lora_alpha} and {m.lora_dropout}")
    if unknown := [n for n in m.lora_targets if n not in LORA_PROJECTIONS]:
        raise ConfigError(f"--lora-target-modules {unknown[0]!r} is not a projection; choose among "
                          f"{', '.join(LORA_PROJECTIONS)} (comma-separated), or attention, experts")
    if m.lora_rank and not m.lora_targets:
        raise ConfigError("--lora-target-modules is empty: name at least one projection, e.g. q_proj,v_proj")
    if m.lora_checkpoint and not m.lora_rank:
        raise ConfigError(f"--lora-checkpoint {m.lora_checkpoint} needs --lora-rank > 0 (the rank the "
                          "adapters were saved with)")
    etp = m.expert_tensor_parallel_size or m.tensor_model_parallel_size
    if m.lora_rank and etp > 1 and any(t.startswith("experts.") for t in m.lora_targets):
        raise ConfigError(f"--lora-target-modules {m.lora_target_modules} adapts experts, which needs "
                          f"--expert-tensor-parallel-size 1 (it is {etp}; 0 means the TP size): Megatron's "
                          "experts leave fc2's TP reduction to the token dispatcher (megarl/mcore/lora.py)")
    if m.lora_rank and m.ref_checkpoint:
        raise ConfigError(f"--ref-checkpoint {m.ref_checkpoint} with --lora-rank {m.lora_rank}: with LoRA "
                          "the reference is the actor with its adapters off (the --hf-checkpoint weights); drop "
                          "--ref-checkpoint")


def token_dispatcher(choice: str) -> str:
    """`--moe-token-dispatcher-type` resolved: auto = alltoall, on CPU as on GPU. Megatron's allgather dispatcher
    gathers equal shares from every EP rank (`all_gather_into_tensor`): RL micro-batches, each as wide as its own
    longest sample, differ across ranks, and gloo stops with "Received data size doesn't match"."""
    return "alltoall" if choice == "auto" else choice


def use_transformer_engine(choice: str) -> bool | None:
    """`--transformer-impl` as the Megatron layer-spec choice: None = Transformer Engine when importable."""
    return {"auto": None, "local": False, "transformer_engine": True}[choice]

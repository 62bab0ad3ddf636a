"""megarl: Megatron-native RL post-training with verifiable rewards (GRPO / RLVR)."""

__version__ = "0.1.0"

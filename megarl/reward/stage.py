"""Moved: the reward functions are `megarl.reward.functions`, the reward stage (`RewardMeter`) is
`megarl.stages.reward`. This module re-exports both for old imports and is removed in megarl 0.3. `RewardMeter` is
looked up on use, so that the reward package does not import the stages (which import it)."""

from megarl.reward.functions import (InProcessReward, PoolReward, RewardFn, RoutedReward, Scores, build_reward,
                                     reward_options)

__all__ = ["InProcessReward", "PoolReward", "RewardFn", "RoutedReward", "Scores", "build_reward", "reward_options"]


def __getattr__(name: str):
    if name == "RewardMeter":
        import importlib

        return importlib.import_module("megarl.stages.reward").RewardMeter
    raise AttributeError(f"module 'megarl.reward.stage' has no attribute {name!r}")

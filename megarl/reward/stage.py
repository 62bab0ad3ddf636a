"""Moved: the reward functions are `megarl.reward.functions`, the reward stage (`RewardMeter`) is
`megarl.stages.reward`. This module re-exports both for old imports and is removed in megarl 0.3."""

from megarl.reward.functions import (InProcessReward, PoolReward, RewardFn, RoutedReward, Scores, build_reward,
                                     reward_options)
from megarl.stages.reward import RewardMeter

__all__ = ["InProcessReward", "PoolReward", "RewardFn", "RewardMeter", "RoutedReward", "Scores", "build_reward",
           "reward_options"]

"""Rewards: everything between a finished trajectory and its score.

    functions.py  the reward function a rollout calls: in a worker pool or in process, routed to rule verifiers
                  and reward models; `build_reward`, `reward_options` (metered for the step's metrics by the
                  reward stage, `megarl.stages.reward`)
    pool.py       reward worker processes, each sample under a wall-clock limit
    compose.py    reward specs ("math > hf_rm", "0.7*math + 0.3*hf_rm") and how their parts combine
    models.py     reward models, batch sources that score in the trainer: `hf_rm` (served), `remote_rm` (HTTP)
    judge.py      `llm_judge`, a generative judge behind an OpenAI-compatible endpoint or a local checkpoint
    http.py       bounded POSTs with retries, for the remote sources
    hf_scorer.py  the HF sequence classifier itself (torch), loaded by the reward server `megarl-serve-rm`

The per-sample rules are `megarl.verifiers`. Nothing here imports torch but `hf_scorer.py`, which only the reward
server and the reward-model tool load.
"""

from megarl.reward.functions import (InProcessReward, PoolReward, RewardFn, RewardFunction, RoutedReward, Scores,
                                     StreamingReward, build_reward, reward_options)

__all__ = ["InProcessReward", "PoolReward", "RewardFn", "RewardFunction", "RoutedReward", "Scores", "StreamingReward",
           "build_reward", "reward_options"]


def __getattr__(name: str):
    """`megarl.reward.RewardMeter`, for old imports: it is `megarl.stages.reward.RewardMeter` (the reward stage);
    this name is removed in megarl 0.3. Looked up on use, so that this package does not import the stages."""
    if name == "RewardMeter":
        import importlib

        return importlib.import_module("megarl.stages.reward").RewardMeter
    raise AttributeError(f"module 'megarl.reward' has no attribute {name!r}")

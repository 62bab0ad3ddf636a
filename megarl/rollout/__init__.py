"""Rollout: engines (`base.RolloutEngine`, chosen by name in `backends`), the weight sync into them, and the
registered rollout functions that turn prompts into finished, scored trajectories (`functions`)."""

from megarl.rollout.base import Completion, RolloutEngine, SamplingParams
from megarl.rollout.functions import (RolloutFn, build_rollout, get_rollout, register_rollout, rollout_names,
                                     single_turn)
from megarl.rollout import tool_use  # noqa: E402,F401  (registers `tool_use`)

__all__ = ["Completion", "RolloutEngine", "RolloutFn", "SamplingParams", "build_rollout", "get_rollout",
           "register_rollout", "rollout_names", "single_turn"]

"""Rollout: engines (`base.RolloutEngine`, chosen by name in `backends`), the weight sync into them, and the
registered rollout functions that turn prompts into finished, scored trajectories (`functions`, `tool_use`)."""

from megarl.rollout.base import Completion, RolloutEngine, SamplingParams
from megarl.rollout.functions import ROLLOUTS, RolloutFn, build_rollout, register_rollout, single_turn

__all__ = ["Completion", "ROLLOUTS", "RolloutEngine", "RolloutFn", "SamplingParams", "build_rollout",
           "register_rollout", "single_turn"]

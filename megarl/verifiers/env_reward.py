"""The `env_reward` verifier: the reward an OpenEnv environment gave a trajectory, as the sample's reward.

`--rollout-function tool_use` with `--openenv` or `--openenv-url` runs an environment beside each trajectory and
hands a row whose verifier is `env_reward` the label `{"env_reward": <the sum of the step rewards>, "env_done":
<whether the environment ended the episode>, "row": <the row's own label>}` (`megarl.rollout.tool_use`). The score
is that sum; the outcome is `correct` when it is above 0, `incorrect` otherwise (accuracy then counts the
trajectories the environment rewarded). A label without `env_reward` (a row scored outside such a rollout:
`megarl-verify`, another rollout function) is a `parse_error` with reward 0. The response text is not read.
"""

from __future__ import annotations

import math
import time
from typing import Any

from megarl.verifiers.base import VerifyResult, register_verifier


@register_verifier("env_reward")
class EnvRewardVerifier:
    name = "env_reward"

    def verify(self, response: str, ground_truth: Any) -> VerifyResult:
        start = time.perf_counter()
        value = ground_truth.get("env_reward") if isinstance(ground_truth, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            result = VerifyResult(0.0, "parse_error", normalized="no environment reward: env_reward rows need "
                                  "--rollout-function tool_use with --openenv or --openenv-url")
        else:
            result = VerifyResult(float(value), "correct" if value > 0 else "incorrect", normalized=f"{value:g}")
        result.seconds = time.perf_counter() - start
        return result

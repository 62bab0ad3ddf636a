"""OpenEnv in `tool_use` without the openenv-core package (the test venv has none): megarl imports and runs
`tool_use` as before, asking for an environment names the extra to install, the options check their values, and
the `env_reward` verifier reads the reward the rollout puts in the label. The integration itself is tested against
the package in tests/openenv_cpu."""

from __future__ import annotations

import importlib.util

import pytest

from megarl.data import PromptRecord
from megarl.errors import ConfigError
from megarl.rollout.slots import ToolUseOptions
from megarl.rollout.tool_use import ToolUse, _Trajectory
from megarl.verifiers import VERIFIERS


def test_without_the_package_tool_use_builds_and_an_environment_names_the_extra():
    if importlib.util.find_spec("openenv") is not None:
        pytest.skip("openenv-core is installed here; this test is about a venv without it")
    ToolUse(ToolUseOptions(), None, tools={})  # no environment asked for: nothing of openenv imported
    with pytest.raises(ConfigError, match=r"--openenv / --openenv-url need the openenv-core package: pip install "
                                          r"'megarl\[openenv\]'"):
        ToolUse(ToolUseOptions(openenv="pkg.module:Env"), None, tools={})


@pytest.mark.parametrize("kwargs, message", [
    ({"openenv": "a:B", "openenv_url": "http://127.0.0.1:1"}, "give one"),
    ({"openenv": "pkg.module"}, "expected 'pkg.module:Class'"),
    ({"openenv": ":Env"}, "expected 'pkg.module:Class'"),
    ({"openenv_url": "127.0.0.1:8000"}, r"expected http://, https://, ws:// or wss://"),
    ({"openenv": "a:B", "openenv_timeout": 0}, "--openenv-timeout must be > 0"),
    ({"openenv": "a:B", "openenv_tool": "python"}, "--openenv-tool 'python' is also in --tools python"),
])
def test_openenv_options_refuse_bad_values(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ToolUseOptions(**kwargs)


def test_env_reward_reads_the_label_the_rollout_gives_it():
    v = VERIFIERS.build("env_reward")
    assert (v.verify("", {"env_reward": 1.0}).score, v.verify("", {"env_reward": 1.0}).outcome) == (1.0, "correct")
    assert (v.verify("", {"env_reward": 0.0}).score, v.verify("", {"env_reward": -0.5}).outcome) == (0.0, "incorrect")
    for label in ("12", None, {"target": 3}, {"env_reward": "1"}, {"env_reward": float("nan")}, {"env_reward": True}):
        r = v.verify("anything", label)
        assert (r.score, r.outcome) == (0.0, "parse_error") and "--openenv" in r.normalized


def test_only_env_reward_rows_get_the_environment_label():
    row = PromptRecord(0, "p", [1], {"target": 7}, "env_reward")
    t = _Trajectory(0, row, 8, env=True, env_reward=1.0, env_steps=2, env_done=True)
    assert t.scoring_record().label == {"env_reward": 1.0, "env_done": True, "row": {"target": 7}}
    assert t.sample().metadata["env_reward"] == 1.0 and t.sample().metadata["env_steps"] == 2.0
    other = _Trajectory(0, PromptRecord(0, "p", [1], "7", "arithmetic"), 8, env=True, env_reward=1.0)
    assert other.scoring_record() is other.record
    plain = _Trajectory(0, row, 8)
    assert plain.scoring_record() is row and "env_reward" not in plain.sample().metadata

"""megarl's OpenEnv integration (`--openenv`, `--openenv-url`) against openenv-core 0.3.0 itself, in the environment
tools/openenv/build_env.sh builds (openenv_cpu_env.py: built here when absent, then cached)."""

from pathlib import Path

import pytest
from helpers import wait_for_env_build

from openenv_cpu_env import ensure_env_python


@pytest.fixture(scope="session")
def openenv_python() -> Path:
    wait_for_env_build("openenv")  # not a second build beside .ci/run's
    return ensure_env_python()

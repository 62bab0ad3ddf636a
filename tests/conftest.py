import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # megarl from the checkout

from helpers import make_tiny_hf_model, build_test_starter  # noqa: E402


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen2"), "qwen2", tie=False)


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("llama"), "llama", tie=True, seed=1)


@pytest.fixture(scope="session")
def starter():
    """A briefly pre-trained starter model and its data, built by the real tool (`helpers.build_test_starter`)."""
    return build_test_starter()

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # megarl from the checkout

from helpers import REPO, env, make_tiny_hf_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen2"), "qwen2", tie=False)


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("llama"), "llama", tie=True, seed=1)


@pytest.fixture(scope="session")
def starter(tmp_path_factory):
    """A briefly pre-trained starter model and its data, built by the real tool (a few hundred steps)."""
    import subprocess

    out = tmp_path_factory.mktemp("starter") / "model"
    subprocess.run([sys.executable, str(REPO / "tools/make_starter_model.py"), "--out", str(out), "--max-steps", "300",
                    "--minutes", "10"], check=True, env=env(), cwd=REPO, timeout=600, capture_output=True)
    return out

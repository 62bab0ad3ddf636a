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
def starter():
    """A briefly pre-trained starter model and its data, built by the real tool (300 steps).

    Built once per checkout under `.cache/test-starter-<hash of the tool and the task>` and reused by later
    sessions: the build is deterministic (a fixed step count) and atomic (the tool renames a finished directory
    into place), so a cached copy is exactly what a fresh build would give. A change to the tool or the task
    changes the hash and triggers a rebuild."""
    import hashlib
    import subprocess

    sources = [REPO / "tools/make_starter_model.py", REPO / "megarl/tasks/arithmetic.py"]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]
    out = REPO / ".cache" / f"test-starter-{digest}"
    if not (out / "model.safetensors").exists():
        proc = subprocess.run([sys.executable, str(REPO / "tools/make_starter_model.py"), "--out", str(out),
                               "--max-steps", "300", "--minutes", "10", "--overwrite"],
                              env=env(), cwd=REPO, timeout=600, capture_output=True, text=True)
        if proc.returncode != 0 and not (out / "model.safetensors").exists():  # a concurrent session may have won
            raise AssertionError(f"building the test starter failed:\n{proc.stderr[-3000:]}")
    return out

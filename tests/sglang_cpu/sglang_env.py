"""What the SGLang CPU tests share, beside their conftest: where the environment and the stand-ins are, and the
variables every process in it gets. A module of its own so that test files import it by a name no other folder uses
(`from conftest import ...` gets whichever folder's conftest pytest loaded last)."""

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STANDINS = HERE / "standins"


def env_dir() -> Path:
    """Where `make sglang-env` builds the environment ($MEGARL_SGLANG_ENV, default .cache/sglang-env)."""
    return Path(os.environ.get("MEGARL_SGLANG_ENV") or REPO / ".cache" / "sglang-env")


def env_python() -> Path | None:
    """The environment's python, or None if it is not (completely) built: the build writes its stamp last."""
    d = env_dir()
    return d / "bin" / "python" if (d / ".megarl-stamp").exists() else None


def skip_reason() -> str:
    return (f"no SGLang CPU environment at {env_dir()}: `make sglang-env` builds it (3-9 minutes on 2 cores, 3.5 GB; "
            "tests/sglang_cpu/conftest.py)")


def sglang_env_vars(standin_log: Path, threads: int = 1) -> dict:
    """The environment of every process run in the SGLang environment: the stand-ins first on PYTHONPATH (their
    sitecustomize is read by SGLang's spawned processes too), then the checkout's megarl and these tests."""
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env["PYTHONPATH"] = os.pathsep.join([str(STANDINS), str(REPO), str(HERE)])
    env["PATH"] = f"{env_dir() / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.update(SGLANG_USE_CPU_ENGINE="1", MEGARL_SGLANG_STANDIN_LOG=str(standin_log), OMP_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")  # no hub look-ups
    return env

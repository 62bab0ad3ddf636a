"""What the OpenEnv tests share: where their environment is (openenv-core cannot join the test venv, setup.py says
why), building it once when it is absent, and the variables every process in it gets. A module of its own so that
test files import it by a name no other folder uses."""

import fcntl
import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BUILD_TIMEOUT_S = 1500  # ~3-6 minutes on 2 quiet cores; PyPI downloads on a cold cache


def env_dir() -> Path:
    """Where tools/openenv/build_env.sh builds it ($MEGARL_OPENENV_ENV, default .cache/openenv-env)."""
    return Path(os.environ.get("MEGARL_OPENENV_ENV") or REPO / ".cache" / "openenv-env")


def ensure_env_python() -> Path:
    """The environment's python, built first when absent or out of date (the script stops at once on an unchanged
    recipe); one build at a time (xdist workers, sessions sharing the checkout). An AssertionError with the
    build's log when it fails."""
    d = env_dir()
    d.parent.mkdir(parents=True, exist_ok=True)
    log = d.parent / "openenv-env-build.log"
    with open(d.parent / "openenv-env.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(log, "w") as out:
            proc = subprocess.run(["bash", str(REPO / "tools/openenv/build_env.sh")], cwd=REPO, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S,
                                  env={**os.environ, "MEGARL_OPENENV_ENV": str(d)})
    if proc.returncode != 0:
        raise AssertionError(f"building the OpenEnv test environment failed ({proc.returncode}):\n"
                             f"{log.read_text(errors='replace')[-4000:]}")
    return d / "bin" / "python"


def env_vars() -> dict:
    """The environment of every process run in it: the checkout's megarl, tests/ (helpers) and these tests first on
    PYTHONPATH, one OpenMP thread, no hub look-ups."""
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), str(HERE)])
    env["PATH"] = f"{env_dir() / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               PYTHONWARNINGS="ignore")
    return env

"""SGLang 0.5.23 imported for real (not read with `ast`), on this CPU torch, in a subprocess.

sglang pins torch==2.14.1 (CUDA on PyPI), so it is not installed in the test venv. Instead its wheel (fetched by
`sglang_upstream.fetch_wheel`) is unpacked into .cache/contract/sglang-0.5.23-site, and the few pure-Python or
small binary packages its import chain to `sglang.srt.server_args`, `sglang.srt.utils` and
`sglang.srt.weight_sync.tensor_bucket` needs and the venv lacks are installed with `pip install --no-deps --target`
into .cache/contract/sglang-0.5.23-deps (`DEPS`, pinned). Both are kept: a warm run only starts the subprocess.
`triton` is stood in for by an empty module (sglang_runtime_probe.py says why that keeps the checks honest).

`sglang.srt.entrypoints.engine` is not imported here: its chain reaches `sglang.srt.configs`' multimodal configs,
which import torchvision, whose PyPI build does not load under a CPU torch (`torchvision::nms does not exist`);
the Engine's method signatures stay read from its source (`sglang_upstream.engine_signatures`).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import sglang_upstream as upstream

SITE = upstream.CACHE / f"sglang-{upstream.SGLANG_VERSION}-site"
DEP_DIR = upstream.CACHE / f"sglang-{upstream.SGLANG_VERSION}-deps"
STUB = upstream.CACHE / "sglang-stub"
# What `import sglang.srt.server_args` / `sglang.srt.utils` needs beyond the dev venv (found one ImportError at a
# time; the versions are those current when this was written).
DEPS = ("orjson==3.13.0", "pybase64==1.5.1", "pyzmq==27.3.0", "ipython==9.18.1", "traitlets==5.16.1")
PROBE = Path(__file__).with_name("sglang_runtime_probe.py")
PROBE_TIMEOUT_S = 600
_STAMP = ".complete"


def _pip_command() -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--retries", "1", "--timeout", "20",
            "--target", str(DEP_DIR), *DEPS]


def prepare() -> None:
    """Unpack the wheel and install `DEPS` once (under the cache's lock); skips, naming the command, when the wheel
    cannot be fetched or the install fails (offline)."""
    wheel = upstream.fetch_wheel(f"sglang=={upstream.SGLANG_VERSION}", f"sglang-{upstream.SGLANG_VERSION}-*.whl")
    with open(upstream.CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (SITE / _STAMP).exists():
            with zipfile.ZipFile(wheel) as z:
                z.extractall(SITE)
            (SITE / _STAMP).touch()
        if not (DEP_DIR / _STAMP).exists():
            cmd = _pip_command()
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=upstream.DOWNLOAD_TIMEOUT_S)
                why = (done.stderr or done.stdout).strip().splitlines()[-1:] if done.returncode else None
            except subprocess.TimeoutExpired:
                why = [f"no answer in {upstream.DOWNLOAD_TIMEOUT_S} s"]
            if why is not None:
                pytest.skip(f"SGLang's import dependencies did not install (offline?): {' '.join(why)}; "
                            f"`{' '.join(cmd)}`")
            (DEP_DIR / _STAMP).touch()
        (STUB / "triton").mkdir(parents=True, exist_ok=True)
        (STUB / "triton" / "__init__.py").write_text(
            '"""Empty stand-in for triton, for tests/contracts/sglang_runtime_probe.py only (see there)."""\n')


def probe(*checks: str, env: dict | None = None) -> dict[str, str]:
    """Run `checks` (functions of sglang_runtime_probe.py, `name` or `name=arg`) in one subprocess; {name: "ok" or
    the traceback}. `env` is added to the subprocess's environment (a test's PYTHONPATH, to break megarl)."""
    prepare()
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join([str(upstream.ROOT), os.environ.get("PYTHONPATH", "")]),
                   **(env or {})}
    done = subprocess.run([sys.executable, str(PROBE), str(SITE), str(DEP_DIR), str(STUB), *checks],
                          capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=environment,
                          cwd=upstream.ROOT)
    marker = done.stdout.rfind("\n@@")
    if marker < 0:
        raise AssertionError(f"the SGLang probe exited {done.returncode} without a verdict:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout[marker + 3:])

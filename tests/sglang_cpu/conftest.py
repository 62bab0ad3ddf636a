"""megarl's SGLang adapter against SGLang 0.5.23 itself, on CPU, in the environment `make sglang-env` builds.

SGLang cannot live in the test venv (it pins a CUDA torch 2.14.1 and transformers 5.19.0), so these tests drive a
process of that environment: `Worker` runs `worker.py` there with one module of checks (`checks_*.py`, which keep
one engine for the whole test module) and each test asks it for one check. Without the environment the tests skip
and say how to build it.

The stand-ins SGLang needs to import on CPU (`standins/`: torchvision's operator schemas, a placeholder
`sgl_kernel`) record any call to them; `no_standin_called` fails the test after which one was called.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import wait_for_env_build

from sglang_env import HERE, REPO, env_python, sglang_env_vars, skip_reason


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    wait_for_env_build("sglang")
    python = env_python()
    if python is None:
        pytest.skip(skip_reason())
    return python


@pytest.fixture(scope="session")
def standin_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sglang-standins") / "calls.log"


@pytest.fixture(autouse=True)
def no_standin_called(standin_log):
    """Fails the test after which a stand-in was called (a path that needs a GPU-only kernel the tests assumed
    SGLang never calls on CPU)."""
    yield
    if standin_log.exists() and standin_log.read_text().strip():
        calls = standin_log.read_text()
        standin_log.unlink()
        pytest.fail(f"a stand-in for a GPU-only import was called (tests/sglang_cpu/standins):\n{calls}")


class Worker:
    """A process of the SGLang environment running `worker.py` over the checks module `module`."""

    def __init__(self, python: Path, module: str, log: Path, standin_log: Path, timeout_s: float = 300.0):
        self.log, self.timeout_s = log, timeout_s
        cmd_r, self._cmd_w = os.pipe()
        self._ans_r, ans_w = os.pipe()
        self._out = open(log, "w")
        self.proc = subprocess.Popen([str(python), "-u", str(HERE / "worker.py"), module, str(cmd_r), str(ans_w)],
                                     pass_fds=(cmd_r, ans_w), stdout=self._out, stderr=subprocess.STDOUT,
                                     env=sglang_env_vars(standin_log), cwd=REPO)
        os.close(cmd_r)
        os.close(ans_w)
        self._commands = os.fdopen(self._cmd_w, "w")
        self._answers = os.fdopen(self._ans_r, "r")

    def tail(self, n: int = 4000) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")[-n:]

    def call(self, name: str, timeout_s: float | None = None, **kwargs):
        """Run check `name` in the worker; its result, or a test failure with its traceback and the log's tail."""
        if self.proc.poll() is not None:
            pytest.fail(f"the SGLang worker exited ({self.proc.returncode}); its log:\n{self.tail()}")
        self._commands.write(json.dumps({"name": name, "kwargs": kwargs}) + "\n")
        self._commands.flush()
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self._answers, selectors.EVENT_READ)
            deadline = time.monotonic() + (timeout_s or self.timeout_s)
            while not sel.select(timeout=1.0):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    pytest.fail(f"check {name}: the SGLang worker "
                                f"{'exited' if self.proc.returncode is not None else 'timed out'}; its log:\n"
                                f"{self.tail()}")
        line = self._answers.readline()
        if not line:
            pytest.fail(f"check {name}: the SGLang worker closed its answers; its log:\n{self.tail()}")
        answer = json.loads(line)
        if not answer["ok"]:
            pytest.fail(f"check {name} failed in the SGLang environment:\n{answer['error']}\n-- log tail --\n"
                        f"{self.tail(2000)}", pytrace=False)
        return answer["result"]

    def close(self) -> None:
        try:
            self._commands.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()


@pytest.fixture(scope="module")
def worker_for(sglang_python, standin_log, tmp_path_factory):
    """`worker_for("checks_engine")`: one worker per test module over that checks module, closed at its end."""
    workers = []

    def start(module: str, timeout_s: float = 300.0) -> Worker:
        log = tmp_path_factory.mktemp("sglang-worker") / f"{module}.log"
        w = Worker(sglang_python, module, log, standin_log, timeout_s)
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.close()


def pytest_collection_modifyitems(config, items):
    """The tests here that need the environment (the `sglang_python` fixture) are marked `sglang_cpu` and `slow`
    (make test-fast leaves them out); the others are plain unit tests of the adapter's CPU rules."""
    for item in items:
        if HERE in Path(str(item.fspath)).parents and "sglang_python" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.sglang_cpu)
            item.add_marker(pytest.mark.slow)


sys.path.insert(0, str(HERE))

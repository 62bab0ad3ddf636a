"""`.ci/run` builds the engines' environments while the suite runs; the tests that need one wait for its build
(`helpers.wait_for_env_build`) and run last (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from helpers import ENV_FOLDERS, REPO, wait_for_env_build


def test_a_test_waits_for_the_build_under_way_then_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGARL_ENV_BUILDS", str(tmp_path))
    status = tmp_path / "sglang.status"
    status.write_text("building\n")
    threading.Timer(0.5, lambda: status.write_text("ready\n")).start()
    t0 = time.monotonic()
    wait_for_env_build("sglang")
    assert 0.4 < time.monotonic() - t0 < 10


def test_without_a_build_under_way_nothing_waits(tmp_path, monkeypatch):
    monkeypatch.delenv("MEGARL_ENV_BUILDS", raising=False)
    wait_for_env_build("sglang")  # outside CI
    monkeypatch.setenv("MEGARL_ENV_BUILDS", str(tmp_path))
    wait_for_env_build("vllm")  # no status: not built by .ci/run
    (tmp_path / "vllm.status").write_text("failed\n")
    wait_for_env_build("vllm")  # the caller skips, naming the missing environment


def test_a_build_that_does_not_end_fails_the_test_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGARL_ENV_BUILDS", str(tmp_path))
    (tmp_path / "openenv.status").write_text("building\n")
    with pytest.raises(AssertionError, match=r"the openenv environment's build has not ended in 0 s .*openenv.log"):
        wait_for_env_build("openenv", timeout_s=0.1)


def test_the_tests_that_need_an_environment_run_last():
    """Collected with an environment's folder named first, its tests still come after the others (the order xdist
    hands out the groups in); and `.ci/run` builds exactly these environments."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/verifiers_env", "tests/unit/test_env_build_wait.py"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert len(ids) == 9, proc.stdout + proc.stderr
    assert [i.startswith("tests/verifiers_env/") for i in ids] == [False] * 4 + [True] * 5, ids
    ci = (REPO / ".ci/run").read_text()
    assert all(f"[{name}]=tests/{folder}" in ci for name, folder in ENV_FOLDERS.items())
